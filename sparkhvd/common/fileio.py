"""Atomic local file writes: the one helper every writer of sparkhvd uses.

A reader (or a crash) sees the old file or the whole new one, never a partial file: data goes to
a temporary file in the same folder, is flushed and fsynced, then renamed over the target.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """A file to write; it replaces ``path`` only if the block finishes without error."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_copy(src: str, dst: str) -> None:
    """Copy the file ``src`` to ``dst`` atomically."""
    with open(src, "rb") as fin, atomic_open(dst) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
