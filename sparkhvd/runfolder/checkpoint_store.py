"""Where rank 0's checkpoints live: a folder of files with ``latest.json`` written last.

Shared by the Keras (:mod:`sparkhvd.keras.checkpoints`) and PyTorch
(:mod:`sparkhvd.torch.training`) helpers. A store is the run folder (``checkpoints/``, through
:mod:`sparkhvd.runfolder.rank_files`, so it works from any host without storage credentials), the
checkpoints of the run being resumed (read-only, through the same service), or a URL the user
gave. ``latest.json`` names the newest complete checkpoint, so a partial one is never read.
"""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import zlib
from typing import (
    IO,
    Any,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Optional,
    Sequence,
    TypeVar,
    Union,
)

from sparkhvd.common import owned_temp
from sparkhvd.runfolder.file_pieces import (
    FilePieces,
    Needs,
    Span,
    index_files,
    load_plan,
    merged,
)

__side__ = "rank"

T = TypeVar("T")

log = logging.getLogger(__name__)

LATEST = "latest.json"


def spool_file() -> tuple[int, str]:
    """A temporary file (``mkstemp``) to spool one checkpoint file in before its upload; named
    by this process, so that the spool of a rank killed mid-upload (as big as the checkpoint) is
    deleted by the next process that spools on the host (:mod:`sparkhvd.common.owned_temp`)."""
    return tempfile.mkstemp(prefix=owned_temp.prefix("spool"))


def spool_folder() -> str:
    """:func:`spool_file`, for a folder (``mkdtemp``): DCP's files before they are uploaded."""
    return tempfile.mkdtemp(prefix=owned_temp.prefix("dcp"))


class CheckpointStore:
    """A checkpoints folder: read, write, check, describe."""

    #: the record of the last checkpoint this process committed here (None: none yet)
    committed: Optional[dict] = None

    @property
    def on_this_host(self) -> bool:
        """Whether the folder is on this host's own disk (then it is its nearest copy)."""
        return False

    @property
    def key(self) -> str:
        """What names this folder for the host copies kept before their upload to it
        (:mod:`sparkhvd.runfolder.host_copy`): the same whether the run writes it or, after a
        relaunch, resumes from it."""
        return self.describe()

    def write(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def write_file(self, name: str, local_path: str) -> None:
        """Copy a local file in as ``name`` (streamed where the store can)."""
        with open(local_path, "rb") as f:
            self.write(name, f.read())

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        """A binary file that becomes ``name`` whole when the block ends without error (and
        never otherwise). Here: spooled to a local temporary file, then :meth:`write_file`;
        a store on this host writes in place."""
        fd, spool = spool_file()
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            self.write_file(name, spool)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(spool)

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``offset`` (fewer where it ends first). Here: read
        whole, then cut; the stores below read only the range."""
        return self.read(name)[offset:offset + length]

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def list(self) -> list[str]:
        """The names in the folder (empty where it cannot be listed)."""
        return []

    def delete(self, name: str) -> None:
        """Remove a file (best effort; a service-backed store keeps everything)."""

    def describe(self, name: str = "") -> str:
        raise NotImplementedError


class RunFolderStore(CheckpointStore):
    """``checkpoints/`` of this run (``root="run"``) or of the run resumed (``root="resume"``)."""

    def __init__(self, root: str = "run", prefix: str = "checkpoints",
                 label: Optional[str] = None) -> None:
        from sparkhvd.runfolder.rank_files import run_files

        self.files = run_files()
        self.root = root
        self.prefix = prefix if root == "run" else ""
        self.label = label

    @property
    def on_this_host(self) -> bool:
        return self.root == "run" and bool(self.files.local)

    def _path(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def write(self, name: str, data: bytes) -> None:
        self.files.write_bytes(self._path(name), data)

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        if not self.files.local:
            with super().open_write(name) as f:
                yield f
            return
        from sparkhvd.common.fileio import atomic_open

        with atomic_open(os.path.join(self.files.local, self._path(name))) as f:
            yield f

    def write_file(self, name: str, local_path: str) -> None:
        self.files.write_file(self._path(name), local_path)

    def read(self, name: str) -> bytes:
        return self.files.read_bytes(self._path(name), root=self.root)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        return self.files.read_bytes(self._path(name), root=self.root, span=(offset, length))

    def exists(self, name: str) -> bool:
        return self.files.exists(self._path(name), root=self.root)

    def list(self) -> list[str]:
        return self.files.listdir(self.prefix, root=self.root)

    def delete(self, name: str) -> None:
        if self.root == "run" and self.files.local:
            path = os.path.join(self.files.local, self._path(name))
            if os.path.exists(path):
                os.unlink(path)

    @property
    def key(self) -> str:
        from sparkhvd.common import protocol

        run_id = os.environ.get(protocol.RUN_ID_ENV, "")
        own = self.root == "run" or \
            (self.label or "").rstrip("/").endswith(f"/{run_id}/checkpoints")
        return f"run folder {run_id}" if own and run_id else self.describe()

    def describe(self, name: str = "") -> str:
        if self.label:
            return f"{self.label}/{name}".rstrip("/")
        return self.files.describe(self._path(name))


#: A ``.tmp-*`` file in a user's checkpoint folder is torn (its writer gone) when it is older
#: than the writing rank's process by this much (:meth:`UrlStore.remove_torn`).
TORN_MARGIN_S = 60.0


class UrlStore(CheckpointStore):
    """A folder URL the user gave (local path, ``file://``, ``abfss://``)."""

    def __init__(self, url: str, storage_options: Optional[dict] = None) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = storage_options

    @property
    def on_this_host(self) -> bool:
        from urllib.parse import urlparse

        return urlparse(self.url).scheme in ("", "file")

    def write(self, name: str, data: bytes) -> None:
        from sparkhvd import storage

        storage.write_bytes(f"{self.url}/{name}", data, self.storage_options)

    def write_file(self, name: str, local_path: str) -> None:
        from sparkhvd import storage

        storage.write_file(f"{self.url}/{name}", local_path, self.storage_options)

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        if not self.on_this_host:
            with super().open_write(name) as f:
                yield f
            return
        from sparkhvd import storage

        with storage.open_atomic(f"{self.url}/{name}", self.storage_options) as f:
            yield f

    def read(self, name: str) -> bytes:
        from sparkhvd import storage

        return storage.read_bytes(f"{self.url}/{name}", self.storage_options)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        from sparkhvd import storage

        return storage.read_range(f"{self.url}/{name}", offset, length, self.storage_options)

    def exists(self, name: str) -> bool:
        from sparkhvd import storage

        return storage.exists(f"{self.url}/{name}", self.storage_options)

    def list(self) -> list[str]:
        from sparkhvd import storage

        try:
            return storage.listdir(self.url, self.storage_options)
        except (FileNotFoundError, OSError):
            return []

    def delete(self, name: str) -> None:
        from sparkhvd import storage

        storage.delete(f"{self.url}/{name}", self.storage_options)

    def describe(self, name: str = "") -> str:
        from sparkhvd.storage import public_url

        return public_url(f"{self.url}/{name}".rstrip("/"))

    def remove_torn(self) -> Sequence[str]:
        """Delete the ``.tmp-*`` files a writer killed mid-write left in this folder (an
        earlier attempt or run): called by the writing rank as its checkpoints are set up.
        Only those older than this process by :data:`TORN_MARGIN_S` go: this attempt's writes
        all began after it started, and a folder's clock (a blob store's) may differ from the
        host's. A run folder's own are removed by the driver before each attempt."""
        import psutil

        from sparkhvd import storage

        before = psutil.Process().create_time() - TORN_MARGIN_S
        try:
            removed = storage.remove_torn(self.url, before, self.storage_options)
        except Exception as exc:  # noqa: BLE001 - a sweep never stops the training
            log.warning("could not look for torn temporary files in %s: %s",
                        self.describe(), exc)
            return []
        if removed:
            log.warning("removed %d torn temporary file(s) a killed writer left in %s: %s",
                        len(removed), self.describe(), ", ".join(removed[:5]))
        return removed


class _Discard(CheckpointStore):
    """Where a worker that only takes part in saving writes: nowhere."""

    def write(self, name: str, data: bytes) -> None:
        pass

    def describe(self, name: str = "") -> str:
        return "(not written by this rank)"


DISCARD = _Discard()


def url_store(url: str, storage_options: Optional[dict] = None) -> UrlStore:
    """A store for ``url``: its ``checkpoints/`` when ``url`` is a run folder."""
    store = UrlStore(url, storage_options)
    nested = UrlStore(f"{store.url}/checkpoints", storage_options)
    return nested if nested.exists(LATEST) else store


def latest(store: CheckpointStore) -> Optional[dict]:
    """The newest checkpoint's ``latest.json`` record, or None."""
    if not store.exists(LATEST):
        return None
    return json.loads(store.read(LATEST))


# -- writing a checkpoint so that it can be checked, and resuming from the newest good one ----
def digest(data: bytes) -> dict:
    """What a checkpoint records of each file: its size and SHA-256."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


#: Where a file's checked pieces begin when its items' offsets are not known
#: (:func:`digest_file`): every 16 MiB.
CHECK_BLOCK = 16 << 20


def digest_file(path: str, cuts: Optional[Iterable[int]] = None) -> dict:
    """:func:`digest` of the file at ``path``, read in pieces (a shard of several GB is never
    whole in memory); with ``cuts`` (the offsets where its items begin: DCP's), also the
    CRC-32 of each piece from one cut to the next (``pieces``: ``[[offset, crc32], ...]``), so
    that a rank that reads some items of the file from the folder checks those alone
    (:func:`read_file_checked`). CRC-32, as HDFS checks its blocks: it finds a torn or changed
    piece at 2.3x SHA-256's speed here (3.9 against 1.7 GB/s)."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        starts = sorted({0, *(int(c) for c in cuts if 0 < int(c) < end)}) if cuts is not None \
            else None
        pieces: list[list[int]] = []
        crc = 0
        while chunk := f.read(CHECK_BLOCK):
            sha.update(chunk)
            view, at = memoryview(chunk), 0
            while starts is not None and at < len(view):
                following = starts[len(pieces) + 1] if len(pieces) + 1 < len(starts) else end
                take = min(len(view) - at, following - (size + at))
                crc = zlib.crc32(view[at:at + take], crc)
                at += take
                if size + at == following and following < end:
                    pieces.append([starts[len(pieces)], crc])
                    crc = 0
            size += len(chunk)
    if starts is not None:
        pieces.append([starts[len(pieces)], crc])
    return {"size": size, "sha256": sha.hexdigest(),
            **({"pieces": pieces} if starts is not None else {})}


def check_cadence(every_steps: Any, every_seconds: Any, keep: Any) -> None:
    """The checkpoint helpers' cadence settings (torch and Keras), checked once: ValueError
    naming the one that is wrong."""
    for name, value in (("every_steps", every_steps), ("keep", keep)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive int or None; got {value!r}")
    if every_seconds is not None and not every_seconds > 0:
        raise ValueError(f"every_seconds must be a positive number or None; got "
                         f"{every_seconds!r}")


def checkpoint_name(epoch: int, step: int = 0) -> str:
    """A checkpoint's name: ``epoch-000N`` after N epochs, ``epoch-000N-step-000000K`` after
    step K of the epoch that follows them (a mid-epoch checkpoint). Names sort as progress."""
    return f"epoch-{epoch:04d}" + (f"-step-{step:07d}" if step else "")


def record_name(epoch: int, step: int = 0) -> str:
    """The record of a checkpoint (its files, sizes, checksums): its name + ``.json``."""
    return checkpoint_name(epoch, step) + ".json"


class DigestingWriter:
    """A binary writer that passes what is written on to ``f`` and keeps its size and SHA-256
    (what a checkpoint's record says of the file) as it goes: a checkpoint is serialised
    straight into its file, never held whole in memory. Writes to a real file release the GIL,
    so a checkpoint written on a background thread leaves the training thread running."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self._sha = hashlib.sha256()
        self.size = 0
        #: the write error the file raised (a serialiser may report it as its own error)
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._sha.update(view)
        self.size += view.nbytes
        try:
            self.f.write(view)
        except OSError as exc:
            self.error = exc
            raise
        return view.nbytes

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> dict:
        """As :func:`digest` of everything written."""
        return {"size": self.size, "sha256": self._sha.hexdigest()}


def write_checkpoint_streamed(store: CheckpointStore, epoch: int, name: str,
                              serialise: Callable[[IO[bytes]], None], info: dict,
                              step: int = 0) -> dict:
    """:func:`write_checkpoint` of one file that ``serialise(f)`` writes (``torch.save``)
    straight into the store's file; the record comes after the file is complete, as always.
    (A file serialised on this host first, then copied in: :func:`serialise_into` and
    :func:`upload_checkpoint`.)"""
    try:
        with store.open_write(name) as f:
            written = _serialised(f, serialise)
        return commit_checkpoint(store, epoch, {name: written}, info, step)
    except OSError as exc:
        raise not_written(store, epoch, exc) from exc


def serialise_into(path: str, serialise: Callable[[IO[bytes]], None]) -> dict:
    """``serialise(f)`` into the local file ``path``; what the record says of it."""
    with open(path, "wb") as f:
        return _serialised(f, serialise)


def upload_checkpoint(store: CheckpointStore, record: dict, local: Mapping[str, str]) -> dict:
    """Commit the checkpoint ``record`` (:func:`record_of`) whose files are on this host (name
    -> local path): the files copied in, then the record and ``latest.json``."""
    try:
        for name, path in local.items():
            store.write_file(name, path)
        return _commit(store, record)
    except OSError as exc:
        raise not_written(store, int(record["epoch"]), exc) from exc


def _serialised(f: IO[bytes], serialise: Callable[[IO[bytes]], None]) -> dict:
    """``serialise(f)``; what the record says of the file. A failed write is raised as the
    disk's own error (``torch.save`` turns it into a RuntimeError about positions)."""
    writer = DigestingWriter(f)
    try:
        serialise(writer)  # type: ignore[arg-type]
    except Exception:
        if writer.error is not None:
            raise writer.error from None
        raise
    return writer.digest()


def write_checkpoint(store: CheckpointStore, epoch: int, files: Mapping[str, bytes],
                     info: dict, step: int = 0, digests: Optional[Mapping[str, dict]] = None
                     ) -> dict:
    """Write a checkpoint: its files, then its record (each file's size and checksum:
    ``digests`` when already taken), then ``latest.json`` -- so a record never names a file
    that is not complete."""
    try:
        for name, data in files.items():
            store.write(name, data)
        return commit_checkpoint(store, epoch, digests or {n: digest(d) for n, d in
                                                           files.items()}, info, step)
    except OSError as exc:
        raise not_written(store, epoch, exc) from exc


def not_written(store: CheckpointStore, epoch: int, exc: OSError) -> OSError:
    """A checkpoint write that failed (a full disk, a store refusing writes), with what is still
    there to resume from."""
    last = store.committed
    if last is None:
        try:
            last = latest(store)
        except Exception:  # noqa: BLE001 - the store may be failing altogether
            last = None
    kept = (f"the last complete checkpoint is {store.describe(last['file'])} (epoch "
            f"{last['epoch']}; latest.json still names it, so the run folder is resumable)"
            if last else "no earlier checkpoint was written")
    return OSError(exc.errno, f"checkpoint of epoch {epoch} not written: {exc}. {kept}. Fix: "
                              "free space (or point output_dir at a larger disk), then run again "
                              "with resume_from=True.")


def commit_checkpoint(store: CheckpointStore, epoch: int, files: Mapping[str, dict],
                      info: dict, step: int = 0) -> dict:
    """Write the record of a checkpoint whose ``files`` (name -> :func:`digest`) are in, then
    ``latest.json``. ``step``: steps of epoch ``epoch`` done (0: an epoch-end checkpoint)."""
    return _commit(store, record_of(epoch, files, info, step))


def record_of(epoch: int, files: Mapping[str, dict], info: dict, step: int = 0) -> dict:
    """The record of a checkpoint of ``files`` (name -> :func:`digest`) after ``step`` steps of
    epoch ``epoch`` (0: an epoch-end checkpoint)."""
    return {**info, "epoch": epoch, "step": step, "files": dict(files)}


def _commit(store: CheckpointStore, record: dict) -> dict:
    epoch, step = progress(record)
    data = json.dumps(record).encode()
    store.write(record_name(epoch, step), data)
    store.write(LATEST, data)
    store.committed = record  # what a later failed write names as the last good one
    return record


def prune(store: CheckpointStore, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints (by epoch, then step: the step counts on
    across resizes, so the order only grows) from ``store``: each record's files, then the
    record. The newest is never deleted, nor the one ``latest.json`` names (the last one
    committed), and a checkpoint whose record cannot be read is left as it is. Returns the
    records deleted."""
    records = sorted(((made, name) for name in store.list()
                      if (made := _progress_of(name)) is not None), reverse=True)
    try:
        committed = latest(store)
        spared = record_name(*progress(committed)) if committed else None
    except Exception:  # noqa: BLE001 - an unreadable latest.json protects nothing
        spared = None
    deleted = []
    for _, name in records[max(1, keep):]:
        if name == spared:
            continue
        try:
            record = json.loads(store.read(name))
        except Exception:  # noqa: BLE001 - an unreadable record is left for a person to see
            continue
        for file in expected_files(record):
            store.delete(file)
        store.delete(name)
        deleted.append(name)
    return deleted


def _progress_of(name: str) -> Optional[tuple[int, int]]:
    """``(epoch, step)`` of a record's name, None for other files."""
    match = _RECORD.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def newest_checked(store: CheckpointStore) -> Optional[dict]:
    """The newest checkpoint's record when it names a SHA-256 for each of its files -- what
    a host copy must equal to be read instead -- else None."""
    newest = next(_candidates(store, []), None)
    files = expected_files(newest) if newest is not None else {}
    if not files or not all(expected and expected.get("sha256") for expected in files.values()):
        return None
    return newest


def files_of(record: dict) -> dict[str, dict]:
    """A checked record's files: name -> its size and SHA-256 (and, sharded, its rank)."""
    return {name: dict(expected or {}) for name, expected in expected_files(record).items()}


def _candidates(store: CheckpointStore, problems: list[str]) -> Iterator[dict]:
    """Every checkpoint record the folder has, newest first (by epoch, then step):
    ``latest.json`` and each ``epoch-000N[-step-K].json`` (a corrupt ``latest.json`` is a
    problem, not the end). Read one at a time, as they are tried: a folder of a run that saved
    every step keeps thousands of records, and a resume needs the newest (reading them all
    through the run folder's service took 5 s for 110)."""
    names = store.list()
    newest = _record(store, LATEST, problems) if not names or LATEST in names else None
    order: list[tuple[tuple[int, int], int, str]] = []
    if newest is not None:
        order.append((progress(newest), 1, LATEST))  # ties: latest.json's own record
    for name in names:
        match = _RECORD.match(name)
        if match:
            order.append(((int(match.group(1)), int(match.group(2) or 0)), 0, name))
    tried: set[tuple[int, int]] = set()
    for made, _, name in sorted(order, reverse=True):
        if made in tried:
            continue
        record = newest if name == LATEST else _record(store, name, problems)
        if record is None:
            continue
        tried.add(progress(record))
        yield record


def _record(store: CheckpointStore, name: str, problems: list[str]) -> Optional[dict]:
    """The record ``name`` (None: gone, or unreadable -- then a problem)."""
    try:
        record = json.loads(store.read(name))
        progress(record)
        return dict(record)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - any unreadable record is one problem
        problems.append(f"{store.describe(name)}: unreadable ({_why(exc)})")
        return None


def progress(record: dict) -> tuple[int, int]:
    """``(epoch, step)`` of a record: which of two checkpoints is newer."""
    return int(record["epoch"]), int(record.get("step") or 0)


def expected_files(record: dict) -> dict[str, Optional[dict]]:
    """name -> expected digest (None for checkpoints written before records had them)."""
    if isinstance(record.get("files"), dict):
        return dict(record["files"])
    legacy = [record.get("file"), record.get("optimizer")]
    return {name: None for name in legacy if isinstance(name, str)}


def _read_checked(store: CheckpointStore, record: dict, problems: list[str],
                  needs: Optional[Needs] = None) -> Optional[dict[str, Any]]:
    """The checkpoint's files, each checked against its record (None: one is missing or
    changed, a problem said) -- with ``needs``, its index files, then only what this rank's
    load reads of the others (:class:`FilePieces` where that is less than the file)."""
    expected_of = expected_files(record)
    files: dict[str, Any] = {}
    for name in index_files(needs, record, expected_of):
        files[name] = read_file_checked(store, name, expected_of[name], problems)
        if files[name] is None:
            return None
    if needs is None:
        return files
    spans = load_plan(needs, record, files)
    for name, expected in expected_of.items():
        if name in files or (spans is not None and name not in spans):
            continue
        files[name] = read_file_checked(store, name, expected, problems,
                                        None if spans is None else spans[name])
        if files[name] is None:
            return None
    return files


def read_copy(store: CheckpointStore, name: str, expected: Optional[dict], copy: Any,
              problems: list[str], mapped: bool = False) -> Union[bytes, memoryview, None]:
    """The host copy ``copy`` of the checkpoint file ``name`` when it is the one the record
    names and reads back whole (``mapped``: as a view of the file mapped into memory, see
    :meth:`~sparkhvd.runfolder.host_copy.HostCopy.read`); None otherwise (a copy that does
    not read back is a problem)."""
    if copy is None or expected is None or copy.sha256 != expected.get("sha256"):
        return None
    try:
        return copy.read(mapped)  # checked against the same size and SHA-256
    except ValueError as exc:
        problems.append(f"{exc}; read {store.describe(name)} instead")
        return None


def read_file_checked(store: CheckpointStore, name: str, expected: Optional[dict],
                      problems: list[str], spans: Optional[list[Span]] = None
                      ) -> Union[bytes, FilePieces, None]:
    """The checkpoint file ``name`` from the folder, checked against its record's size and
    SHA-256 (``expected``; None for records from before digests); None when it is missing or
    changed (a problem said). With ``spans`` and a record of its pieces' CRC-32s
    (:func:`digest_file`), only the pieces that hold those byte ranges, each checked: the
    :class:`FilePieces` a rank's load reads of another rank's shard file."""
    if spans is not None and expected is not None and expected.get("pieces"):
        return _read_pieces_checked(store, name, expected, spans, problems)
    try:
        data = store.read(name)
    except FileNotFoundError:
        problems.append(f"{store.describe(name)}: missing")
        return None
    if expected is not None and len(data) != expected.get("size"):
        problems.append(f"{store.describe(name)}: truncated or changed ({len(data):,} of "
                        f"{expected.get('size'):,} bytes)")
        return None
    if expected is not None and hashlib.sha256(data).hexdigest() != expected.get("sha256"):
        problems.append(f"{store.describe(name)}: checksum mismatch (corrupt)")
        return None
    return data


def _read_pieces_checked(store: CheckpointStore, name: str, expected: dict,
                         spans: list[Span], problems: list[str]) -> Optional[FilePieces]:
    """The pieces of ``name`` (:func:`digest_file`'s) that hold ``spans``, one range read per
    run of them, each piece checked against its CRC-32 in ``expected``; None when one is short
    or changed (a problem said)."""
    size = int(expected["size"])
    starts = [int(offset) for offset, _ in expected["pieces"]]
    crcs = [int(crc) for _, crc in expected["pieces"]]
    ends = starts[1:] + [size]
    first = [bisect.bisect_right(starts, offset) - 1 for offset, length in spans if length > 0]
    last = [bisect.bisect_right(starts, offset + length - 1) - 1
            for offset, length in spans if length > 0]
    runs = merged((starts[a], ends[b] - starts[a]) for a, b in zip(first, last))
    pieces: dict[int, bytes] = {}
    for start, length in runs:
        try:
            data = store.read_range(name, start, length)
        except FileNotFoundError:
            problems.append(f"{store.describe(name)}: missing")
            return None
        if len(data) != length:
            problems.append(f"{store.describe(name)}: truncated or changed (bytes {start:,}-"
                            f"{start + length:,} of {size:,} read as {len(data):,})")
            return None
        for i in range(bisect.bisect_left(starts, start), len(starts)):
            if starts[i] >= start + length:
                break
            if zlib.crc32(data[starts[i] - start:ends[i] - start]) != crcs[i]:
                problems.append(f"{store.describe(name)}: checksum mismatch in bytes "
                                f"{starts[i]:,}-{ends[i]:,} (corrupt)")
                return None
        pieces[start] = data
    return FilePieces(size, pieces)


def restore_newest(store: CheckpointStore, load: Callable[[dict, dict[str, Any]], T],
                   needs: Optional[Needs] = None
                   ) -> tuple[Optional[dict], Optional[T], list[str]]:
    """Resume from the newest checkpoint in ``store`` that is complete and readable.

    Each candidate's files are checked against its record (size, SHA-256) and then given to
    ``load(record, files)`` -- with ``needs``, only what this rank's load reads of them
    (:func:`_read_checked`); a candidate that fails either is skipped with a problem naming the
    file and why, and the next older one is tried. Returns ``(record, load's value, problems)``,
    or ``(None, None, [])`` when the folder has no checkpoint at all (train from scratch).

    Raises:
        CheckpointError: the folder has checkpoints but none is usable -- never a silent start
            from scratch, never a raw h5py/zip/pickle error.
    """
    problems: list[str] = []
    for record in _candidates(store, problems):
        files = _read_checked(store, record, problems, needs)
        if files is None:
            continue
        try:
            value = load(record, files)
        except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint is skipped
            name = record.get("file") or next(iter(files), "?")
            problems.append(f"{store.describe(name)}: unreadable ({_why(exc)})")
            continue
        return record, value, problems
    if not problems:
        return None, None, []
    from sparkhvd.common.errors import CheckpointError

    raise CheckpointError(
        f"No usable checkpoint to resume from in {store.describe()}: "
        + "; ".join(problems) + ". Fix: resume from an earlier run folder "
        "(HorovodRunner(resume_from='<run folder>')), or train from scratch with "
        "resume_from=False (or the helper's resume=False); the files above are kept as they "
        "are.")


def _why(exc: BaseException) -> str:
    text = str(exc).split("\n", 1)[0]
    return f"{type(exc).__name__}: {text[:200]}"


_RECORD = re.compile(r"^epoch-(\d{4,})(?:-step-(\d+))?\.json$")


#: How the resume line names each copy a checkpoint can be read from (``Resumed.copy``).
COPIES = {"folder": "", "host": " (its copy on this host)",
          "peer": " (another rank's host copy, sent over the process group)"}


def announce_resume(store: CheckpointStore, file: Optional[str] = None, epoch: int = 0,
                    problems: Sequence[str] = (), step: int = 0, copy: str = "folder",
                    uploaded: bool = True) -> None:
    """Rank 0 says what it resumed from (``file`` None: nothing found) and which copy of it it
    read -- and, ``uploaded`` False, that the folder does not have it (kept on the hosts
    before an upload that never ended) -- on its console line and to the driver
    (``run.json``'s ``resume``), for every framework's helpers."""
    from sparkhvd.common import protocol
    from sparkhvd.common.events import emit

    if file is None:
        print(f"resume: no checkpoint under {store.describe()}; training from scratch",
              flush=True)
        emit(protocol.Resumed(rank=0, source=None, epoch=0))
        return
    where = store.describe(file)
    for problem in problems:
        print(f"resume: WARNING: {problem}", flush=True)
    # one numbering: the training loop's epoch index, as the checkpoint files name it
    # (epoch-0001-step-0000040 is step 40 of the loop's epoch 1; epoch-0002 continues at 2)
    at = f"epoch {epoch}" + (f" after its step {step}" if step else "")
    unsent = "" if uploaded else (
        "; a memory snapshot of that step: the folder does not have it"
        if file.endswith(".snapshot") else
        "; its upload had not ended: the folder does not have it")
    print(f"resume: restored {where}{COPIES[copy]}{unsent}; continuing at {at}", flush=True)
    emit(protocol.Resumed(rank=0, source=where, epoch=epoch, skipped=list(problems), step=step,
                          copy=copy, uploaded=uploaded))


def resume_store(resume: object, own: Optional[CheckpointStore],
                 storage_options: Optional[dict] = None) -> Optional[CheckpointStore]:
    """Where a rank resumes from (the one rule, for every framework's helpers).

    ``resume``: ``None`` resumes when the driver asked for it (``HorovodRunner(resume_from=...)``
    resolved it into ``SPARKHVD_RESUME_URL``, read through the run-folder service); ``True``
    resumes from there, or from ``own`` (this run's store) when the driver asked nothing; a
    URL resumes from that folder (a run folder's ``checkpoints/`` when it has one); ``False``
    never resumes. A relaunch of the run (a retry or a resize: attempt 2 on) whose checkpoints
    go to a URL of the user's (``own``, not the run folder, so the driver cannot see them)
    resumes from there when it holds one -- with ``None`` as with ``True``. A relaunch the
    driver asked nothing of (the run folder had no checkpoint) resumes from ``own`` too: the
    ranks' hosts may keep a checkpoint the folder does not have yet (kept before its upload,
    a memory snapshot), and only the ranks see those. The rule reads nothing a rank's host
    has, so every rank takes the same path into the restore's collectives.
    """
    from sparkhvd.common import protocol

    requested = os.environ.get(protocol.RESUME_URL_ENV)
    relaunched = int(os.environ.get(protocol.ATTEMPT_ENV) or 1) > 1
    if resume is None and relaunched and (
            not requested or isinstance(own, UrlStore) and own.exists(LATEST)):
        return own
    if resume is None:
        resume = bool(requested)
    if resume is True:
        return RunFolderStore("resume", label=requested) if requested else own
    if resume:
        return url_store(str(resume), storage_options)
    return None
