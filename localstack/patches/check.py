"""Checks sitecustomize.py's fix on the LocalStack installed here (run by deploy/test.sh with this
directory on PYTHONPATH): an upload whose body breaks off (its client was killed) leaves the key's
stored bytes as they were. Exit 1 if it does not."""

import io
import sys

try:
    from localstack.services.s3.models import S3Object
    from localstack.services.s3.storage.ephemeral import EphemeralS3ObjectStore, EphemeralS3StoredObject
except ImportError as e:  # another LocalStack layout: the patch does not apply to it
    print(f"localstack patch: not applicable to this LocalStack ({e})")
    sys.exit(0)


class BreaksOff(io.RawIOBase):
    """A request body whose client went away after a few bytes."""

    def __init__(self):
        self.sent = False

    def readable(self):
        return True

    def read(self, n=-1):
        if not self.sent:
            self.sent = True
            return b'{"owner":"b"'
        raise ValueError("I/O operation on closed file.")


if not getattr(EphemeralS3StoredObject, "_fleet_patched", False):
    sys.exit("localstack patch: sitecustomize.py was not loaded (PYTHONPATH?)")
store = EphemeralS3ObjectStore()
obj = S3Object(key="leases/j.json")
first = b'{"owner":"a","expires_ms":1795777088082,"epoch":1}'
with store.open("b", obj, mode="w") as w:
    w.write(io.BytesIO(first))
try:
    with store.open("b", obj, mode="w") as w:
        w.write(BreaksOff())
    sys.exit("localstack patch: an upload that broke off did not fail")
except ValueError:
    pass
with store.open("b", obj, mode="r") as r:
    kept = r.read()
if kept != first:
    sys.exit(f"localstack patch: an upload that broke off left {kept!r} where {first!r} was")
print("localstack patch: an upload that broke off leaves the stored object whole")
