"""Reading and writing through one small API: whole objects, atomic writes (a reader sees the
old object or the whole new one: locally a temp file and a rename, on Azure one committed
upload or a temporary blob for streamed writes), a local spill when an upload fails, and
:func:`preflight` (a small object written and deleted, so a bad account, key, container or
permission fails in seconds, before training)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import uuid
from typing import IO, Any, Iterator, Mapping, Optional

from sparkhvd.common.errors import StorageError
from sparkhvd.common.fileio import TEMP_PREFIX
from sparkhvd.storage.diagnosis import cause_of, diagnose, explained
from sparkhvd.storage.location import Location, as_location, public_url

__side__ = "shared"

log = logging.getLogger(__name__)


PREFLIGHT_TIMEOUT_S = 60.0


def read_bytes(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None) -> bytes:
    """The whole content of a file or blob."""
    loc = as_location(target, storage_options)
    with explained(loc, "read"):
        if loc.is_local:
            return loc.fs.cat_file(loc.path)
        return loc.fs.cat_file(loc.path, max_concurrency=TRANSFER_CONCURRENCY)


def read_range(target: "Location | str", offset: int, length: int,
               storage_options: Optional[Mapping[str, Any]] = None) -> bytes:
    """``length`` bytes of a file or blob from ``offset`` (fewer where it ends first): the part
    of a large checkpoint file a rank reads, without the rest."""
    loc = as_location(target, storage_options)
    with explained(loc, "read"):
        if loc.is_local:
            return loc.fs.cat_file(loc.path, start=offset, end=offset + length)
        return loc.fs.cat_file(loc.path, start=offset, end=offset + length,
                               max_concurrency=TRANSFER_CONCURRENCY)


def size(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None) -> int:
    """A file's or blob's size in bytes."""
    loc = as_location(target, storage_options)
    with explained(loc, "read"):
        return int(loc.fs.size(loc.path))


def exists(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None) -> bool:
    """Whether a file, blob or folder exists."""
    loc = as_location(target, storage_options)
    with explained(loc, "check"):
        return bool(loc.fs.exists(loc.path))


def listdir(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Names (not paths) of the entries directly below a folder."""
    loc = as_location(target, storage_options)
    with explained(loc, "list"):
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in loc.fs.ls(loc.path, detail=False))


def delete(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None, *,
           recursive: bool = False) -> None:
    """Remove a file/blob (or a whole folder with ``recursive=True``); missing is not an error."""
    loc = as_location(target, storage_options)
    with explained(loc, "delete"):
        if loc.fs.exists(loc.path):
            loc.fs.rm(loc.path, recursive=recursive)


def remove_torn(target: "Location | str", before: float,
                storage_options: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Delete the temporary objects (``.tmp-*``) under the folder ``target`` that writers
    killed mid-write left there, last modified before ``before`` (seconds since the epoch): a
    write still in flight is newer, and left alone. Returns their paths under ``target``."""
    loc = as_location(target, storage_options)
    with explained(loc, "list"):
        if not loc.fs.exists(loc.path):
            return []
        found = loc.fs.find(loc.path, detail=True)
    removed = []
    root = loc.path.rstrip("/") + "/"
    for path, info in sorted(found.items()):
        if not path.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
            continue
        modified = _modified(info)
        if modified is None or modified >= before:
            continue
        name = path[len(root):] if path.startswith(root) else path
        try:
            loc.fs.rm_file(path)
        except FileNotFoundError:  # gone meanwhile: what was asked
            pass
        except Exception as exc:  # noqa: BLE001 - one that stays is not worth the others
            log.warning("could not remove %s: %s",
                        public_url(f"{loc.url.rstrip('/')}/{name}"), cause_of(exc))
            continue
        removed.append(name)
    return removed


def _modified(info: Mapping[str, Any]) -> Optional[float]:
    """An fsspec entry's modification time in seconds since the epoch (local ``mtime``, Azure's
    ``last_modified``), None when it has none."""
    value = info.get("mtime", info.get("last_modified"))
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _tmp_sibling(loc: Location) -> Location:
    folder, _, name = loc.path.rpartition("/")
    tmp_name = f"{TEMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}"
    return Location(loc.url, loc.fs, f"{folder}/{tmp_name}" if folder else tmp_name,
                    loc.account, loc.container)


@contextlib.contextmanager
def open_atomic(target: "Location | str",
                storage_options: Optional[Mapping[str, Any]] = None) -> Iterator[IO[bytes]]:
    """A binary file to write; it replaces ``target`` only if the block finishes without error.

    Locally: :func:`sparkhvd.common.fileio.atomic_open` (temp file, fsync, rename). On Azure: a temp
    blob, its size verified, then moved into place. On error (or interrupt) the temp object is
    removed and the old content of ``target`` is untouched. Exceptions raised by the block
    propagate unchanged.
    """
    loc = as_location(target, storage_options)
    if loc.is_local:
        from sparkhvd.common.fileio import atomic_open

        with atomic_open(loc.path) as f:
            yield f
        return
    tmp = _tmp_sibling(loc)
    with explained(loc, "write"):
        f = loc.fs.open(tmp.path, "wb")
    writer = _CountingWriter(f, loc)
    try:
        yield writer  # type: ignore[misc]
        with explained(loc, "write"):
            f.close()
            size = loc.fs.size(tmp.path)
            if size != writer.count:
                raise OSError(f"size check failed after upload ({size} != {writer.count} bytes)")
            loc.fs.mv(tmp.path, loc.path)
    except BaseException:
        with contextlib.suppress(Exception):
            if not f.closed:
                f.close()
        with contextlib.suppress(Exception):
            if loc.fs.exists(tmp.path):
                loc.fs.rm(tmp.path)
        raise


class _CountingWriter:
    def __init__(self, f: IO[bytes], loc: Location) -> None:
        self._f = f
        self._loc = loc
        self.count = 0

    def write(self, data: bytes) -> int:
        with explained(self._loc, "write"):
            self._f.write(data)
        self.count += len(data)
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


#: Parallel block transfers for one blob (the Azure SDK's ``max_concurrency``).
TRANSFER_CONCURRENCY = 4


def write_bytes(target: "Location | str", data: bytes,
                storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Write ``data`` atomically.

    Locally through :func:`open_atomic`. On Azure in one upload straight to the final blob:
    the service commits a Put Blob / Put Block List atomically (readers see the old blob or the
    whole new one; a broken upload commits nothing), so no temporary blob and server-side copy
    are needed; the size is verified afterwards.
    """
    loc = as_location(target, storage_options)
    if loc.is_local:
        with open_atomic(loc) as f:
            f.write(data)
        return
    with explained(loc, "write"):
        loc.fs.pipe_file(loc.path, data, max_concurrency=TRANSFER_CONCURRENCY)
        size = loc.fs.size(loc.path)
        if size != len(data):
            raise OSError(f"size check failed after upload ({size} != {len(data)} bytes)")


def write_file(target: "Location | str", local_path: str,
               storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Copy the local file ``local_path`` to ``target`` atomically, streamed (never whole in
    memory). On Azure one upload of blocks straight to the final blob, committed at once (as
    :func:`write_bytes`); the size is verified afterwards."""
    loc = as_location(target, storage_options)
    if loc.is_local:
        from sparkhvd.common.fileio import atomic_copy

        atomic_copy(local_path, loc.path)
        return
    expected = os.path.getsize(local_path)
    with explained(loc, "write"):
        loc.fs.put_file(local_path, loc.path, max_concurrency=TRANSFER_CONCURRENCY)
        size = loc.fs.size(loc.path)
        if size != expected:
            raise OSError(f"size check failed after upload ({size} != {expected} bytes)")


def write_or_spill(target: "Location | str", data: bytes, spill_dir: str,
                   storage_options: Optional[Mapping[str, Any]] = None) -> str:
    """Write ``data``; if that fails, keep it under ``spill_dir`` and raise a StorageError that
    says where. Returns the URL written."""
    loc = as_location(target, storage_options)
    try:
        write_bytes(loc, data)
        return loc.url
    except Exception as exc:  # noqa: BLE001 - whatever failed, the bytes must not be lost
        name = loc.path.rstrip("/").rsplit("/", 1)[-1] or "data.bin"
        os.makedirs(spill_dir, exist_ok=True)
        spilled = os.path.join(os.path.abspath(spill_dir), name)
        write_bytes(spilled, data)
        raise StorageError(f"Could not write {public_url(loc.url)}: {cause_of(exc)}. Nothing is "
                           f"lost: the {len(data)} bytes are kept at {spilled}.",
                           spilled_to=spilled) from None


def preflight(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None, *,
              timeout_s: float = PREFLIGHT_TIMEOUT_S) -> Location:
    """Write and delete a small object under ``target`` (a folder URL) before training.

    Raises:
        StorageError: naming the URL (without secrets) and the likely cause, within
            ``timeout_s`` seconds.
    """
    loc = as_location(target, storage_options)
    probe = loc.child(f".sparkhvd-preflight-{uuid.uuid4().hex[:12]}")

    def attempt() -> None:
        if loc.is_local:
            os.makedirs(loc.path, exist_ok=True)
        probe.fs.pipe_file(probe.path, b"sparkhvd preflight")
        probe.fs.rm(probe.path)

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparkhvd-preflight")
    try:
        pool.submit(attempt).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise StorageError(f"Storage pre-flight for {public_url(loc.url)} got no answer in "
                           f"{timeout_s:.0f} s: cannot reach the storage endpoint of account "
                           f"{loc.account!r}; check the account name, endpoint and network.") from None
    except Exception as exc:  # noqa: BLE001
        raise StorageError(f"Storage pre-flight failed for {public_url(loc.url)}: "
                           f"{diagnose(loc, exc)}. ({cause_of(exc)})") from None
    finally:
        pool.shutdown(wait=False)
    return loc
