"""Atomic local file writes: the one helper every writer of sparkhvd uses.

A reader (or a crash) sees the old file or the whole new one, never a partial file: data goes to
a temporary file in the same folder, is flushed and fsynced, then renamed over the target.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from typing import IO, Any, Iterator

__side__ = "common"


#: Errors of a disk or store that cannot take the write (full, over quota, read-only, failing).
_FULL_OR_FAILING = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


def explain_write_error(path: str, exc: OSError) -> OSError:
    """``exc`` (a full, read-only or failing disk) as an ``OSError`` that names the file being
    written and the free space there -- the raw ``[Errno 28] No space left on device`` names
    neither."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:,.1f} MiB free in {folder}"
    except OSError:
        free = f"free space in {folder} unknown"
    return OSError(exc.errno, f"{exc.strerror or exc} while writing {path} ({free}); nothing "
                              "partial was left under that name", path)


#: How an atomic write's temporary file begins: ``.tmp-<random>-<name>`` beside its target
#: (here and in :func:`sparkhvd.storage.open_atomic`; :func:`sparkhvd.storage.remove_torn`
#: deletes what a killed writer left).
TEMP_PREFIX = ".tmp-"


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb", **kwargs: Any) -> Iterator[IO[Any]]:
    """A file to write; it replaces ``path`` only if the block finishes without error. A full
    or failing disk is said with the path and the free space (:func:`explain_write_error`)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if exc.errno in _FULL_OR_FAILING:
            raise explain_write_error(path, exc) from exc
        raise
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
