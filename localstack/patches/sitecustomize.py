"""A fix loaded into the LocalStack this project runs (host mode: localstack/start.sh puts this directory
on PYTHONPATH; compose: deploy/images/localstack copies it into the image), before LocalStack starts.

LocalStack 2026.3.0's S3 (ephemeral storage) takes an object's read lock in GetObject and releases it
only when the response body is closed after it was sent. When a client dies while its GetObject is
being answered (a controller killed with SIGKILL, as the tests do on purpose), the request fails in the
gateway's handler chain ("I/O operation on closed file"), the response is dropped without being
closed, and the read lock is never released. The key's next write waits for it forever, and since
the lock prefers writers, so does every later read of that key: a job's lease could then never be
read again, and the job never finished. (Real S3 has no such locks.)

The fix: a stored object that still holds its lock when it is garbage-collected releases it. The
module is patched when LocalStack imports it (an import hook), so nothing is imported at startup.
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "localstack.services.s3.storage.ephemeral"


def _patch(module):
    cls = getattr(module, "EphemeralS3StoredObject", None)
    if cls is None or getattr(cls, "_fleet_patched", False):
        return
    init, close = cls.__init__, cls.close

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # The lock is held once the original constructor returned.
        self._fleet_holds_lock = True

    def close_(self):
        self._fleet_holds_lock = False
        return close(self)

    def __del__(self):
        if getattr(self, "_fleet_holds_lock", False):
            self._fleet_holds_lock = False
            try:
                close(self)
                # (stderr: LocalStack's log, whatever its logging configuration.)
                print("billing-fleet patch: released the lock of an S3 object whose response was never closed (its client went away)", file=sys.stderr, flush=True)
            except Exception:  # never raise from a finalizer
                pass

    cls.__init__, cls.close, cls.__del__ = __init__, close_, __del__
    cls._fleet_patched = True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())
