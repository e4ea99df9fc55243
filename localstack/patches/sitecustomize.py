"""A fix loaded into the LocalStack this project runs (host mode: localstack/start.sh puts this directory
on PYTHONPATH; compose: deploy/images/localstack copies it into the image), before LocalStack starts.

LocalStack 2026.3.0's S3 (ephemeral storage) keeps one file per key and overwrites it in place: a
PutObject truncates the key's file, then copies the request body into it. When the body cannot be read
to its end (its client was killed mid-request, as the tests kill controllers on purpose), the request
fails, the key keeps its old object (size, ETag), but the file holding its bytes is left truncated.
Every GetObject of the key then announces the old size and sends fewer bytes: the client waits for the
rest until it times out, again and again. A job whose lease a killed controller was writing could never
be taken again. (On real S3 a failed PutObject leaves the old object whole.)

The fix: the body is read to its end first (memory, spilling to disk past 16 MiB), and the key's file
is rewritten only from that complete copy, so a failed upload changes nothing. The module is patched
when LocalStack imports it (an import hook), so nothing is imported at startup.
"""

import importlib.abc
import importlib.util
import sys
import tempfile

_TARGET = "localstack.services.s3.storage.ephemeral"
_SPILL = 16 << 20
_CHUNK = 1 << 20


def _patch(module):
    cls = getattr(module, "EphemeralS3StoredObject", None)
    if cls is None or getattr(cls, "_fleet_patched", False):
        return
    write = cls.write

    def write_whole(self, stream):
        if stream is None:
            return write(self, stream)
        body = tempfile.SpooledTemporaryFile(max_size=_SPILL)
        try:
            # Raises, with the key's file untouched, if the body ends early.
            while data := stream.read(_CHUNK):
                body.write(data)
            body.seek(0)
            return write(self, body)
        finally:
            body.close()

    cls.write = write_whole
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
