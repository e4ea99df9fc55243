"""Checks sitecustomize.py's fix on the LocalStack installed here (run by deploy/test.sh with this
directory on PYTHONPATH): an S3 object's read lock, taken as GetObject takes it and dropped without
being closed (its client went away), no longer blocks the key's next write. Exit 1 if it does."""

import gc
import io
import sys
import threading

try:
    from localstack.services.s3.models import S3Object
    from localstack.services.s3.storage.ephemeral import EphemeralS3ObjectStore, EphemeralS3StoredObject
except ImportError as e:  # another LocalStack layout: the patch does not apply to it
    print(f"localstack patch: not applicable to this LocalStack ({e})")
    sys.exit(0)

if not getattr(EphemeralS3StoredObject, "_fleet_patched", False):
    sys.exit("localstack patch: sitecustomize.py was not loaded (PYTHONPATH?)")
store = EphemeralS3ObjectStore()
obj = S3Object(key="k")
with store.open("b", obj, mode="w") as w:
    w.write(io.BytesIO(b"first"))
read = store.open("b", obj, mode="r")  # GetObject's read lock ...
del read  # ... and its response dropped, never closed
gc.collect()
written = threading.Event()


def write():
    with store.open("b", obj, mode="w") as w:
        w.write(io.BytesIO(b"second"))
    written.set()


threading.Thread(target=write, daemon=True).start()
if not written.wait(5):
    sys.exit("localstack patch: a dropped GetObject's read lock still blocks the key's next write")
print("localstack patch: a dropped GetObject's read lock is released")
