"""The newest checkpoint kept on the writing rank's own host: restored without the run folder.

A relaunched run reads its newest checkpoint back from the run folder -- on ``abfss://`` that is
the whole state over the network, once per rank. When the checkpoint folder is not on its own
disk, the rank that writes a checkpoint also keeps its newest files here, on its host's disk,
so a relaunch restores from the nearest copy (:mod:`sparkhvd.checkpoint.nearest_copy`, for
every framework's helpers): a rank on the same host reads them from disk, a rank on another
host gets the files from a rank that has them, and only when no rank has them does a rank read
the run folder.

Rules:

- **only the newest**: keeping a checkpoint (a rank's files of it: one for PyTorch, the model
  and the optimizer's for Keras, a rank's shards for DCP) deletes that rank's copy before it; a
  copy is trusted only
  when its SHA-256 equals the one the run folder's newest complete checkpoint records, so a
  stale, torn or foreign copy is never used (it is read back, checked, and passed over with a
  warning).
- **committed here first**: the copy is kept *with its checkpoint's record* as soon as it is
  serialised, before its upload to the checkpoint folder begins -- PyTorch's
  :class:`sparkhvd.torch.Checkpoints` and Keras' checkpoints (one writer), and every rank's
  shards of a :class:`sparkhvd.torch.ShardedCheckpoints` once the ranks have gathered their
  files' checksums into the record (:func:`hold` keeps PyTorch's files for the upload;
  Keras' files are uploaded from memory). So a rank
  killed while a large checkpoint uploads -- or while uploads lag behind every-step saves --
  loses only the steps since its last copy here: a relaunch restores the newest checkpoint
  any rank's host holds whole (its checksum checked) when it is newer than the folder's
  newest. Such a checkpoint survives the loss of a process, not of its host; the folder's is
  the one a lost host falls back to.
- **bounded**: a checkpoint is kept when it fits in half the folder's free space (the older
  copy is deleted once the new one is in); otherwise no copy is kept and the older one is
  deleted too, said once on the rank's console.
- **private**: whoever can write the folder could replace a copy and its record (nothing in
  one runs -- torch's ``weights_only`` loader, :mod:`sparkhvd.torch.serialise` -- but a
  planted state would train on). The folder is the user's own
  (``sparkhvd-host-copies-<uid>``, made ``0700``), and it is checked before anything is kept
  or read there: owned by this user, not a link, no one else may write in it -- else no host
  copy is kept or read (said once) and relaunches read the run folder. A copy is read only
  when its SHA-256 equals the checkpoint's record.
- **where**: ``$SPARKHVD_HOST_COPY_DIR`` (``/dev/shm`` for memory speed, where it is large
  enough), else the system's temporary folder, in ``sparkhvd-host-copies-<uid>/<run id>/rank-<N>/``:
  each writing rank keeps its own files (rank 0 writes PyTorch's and Keras' checkpoints; every
  rank writes its shards of a sharded one), and a relaunched rank reads every copy its host
  has, whichever rank kept it.
- **a snapshot of the newest step** (PyTorch's ``memory_snapshots=True``): every due save's
  state is copied into one of three slot files in this rank's folder
  (:mod:`sparkhvd.torch.snapshot_ring`, mapped into memory) and named by ``snapshot.json`` with
  its record once whole -- a commit by renaming that list, so a process killed mid-copy leaves
  the slot before it named. Its record names it by an identity of its own (``snapshot``), not
  a SHA-256 (that of every step's state would cost several times the copy); it is read back
  whole (its size and the snapshot's end marker are checked). A snapshot is not flushed to
  disk (no ``msync``): it serves a process lost on a host that lives on. In memory
  (``/dev/shm``, as advised) a crash of the host takes the snapshot with it; on a disk it may
  leave the slot torn and a relaunch there read it, so there the record also carries the
  file's CRC-32 (``crc32``), taken on the copying thread after the copy (the optimizer step
  does not wait for it) and checked when it is read back: a torn slot falls back to the
  checkpoint file before it.
  (B15: the CRC of 1 GB each step cost a third of a core, training on 2 busy cores 0.67 of
  0.84 steps/s.)
- **cleaned**: when the training function returns (the run is done), each rank deletes its own
  folder and every rank folder on its host whose owner process is gone (a rank of an earlier
  attempt) -- never one a live process owns (another rank on this host, perhaps still
  finishing its last save: that rank deletes its own); the run's folder goes with the last
  one. When a run that succeeded had used hosts its last attempt did not (a host lost and
  back, a resize), the driver sweeps those too (:func:`sweep`, one small Spark job). A folder
  left by a run that failed is kept (its newest checkpoint may be there alone, if its upload
  failed) and deleted by the next run on that host a day later.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from sparkhvd.common import owned_temp, protocol
from sparkhvd.common.identity import current_rank
from sparkhvd.storage.host_store import HostStore

__side__ = "rank"

#: Where the host copies go (a folder on the host's own disk or memory).
DIR_ENV = "SPARKHVD_HOST_COPY_DIR"
#: The share of the folder's free space a copy may take.
FREE_SHARE = 0.5
#: A folder of another run not touched for this long is left over from a failed run.
STALE_S = 24 * 3600.0

_META = "host-copy.json"
#: In each rank folder: the process that last kept files there (:func:`clean` asks it).
_OWNER = "owner.pid"
#: The list naming this rank's newest memory snapshot (beside :data:`_META`'s files).
_SNAPSHOT_META = "snapshot.json"
_METAS = (_META, _SNAPSHOT_META)
_swept: set = set()  # this process' rank folders it looked for orphans in (once each)


@dataclass(frozen=True)
class HostCopy:
    """A checkpoint file kept on this host: what the run folder calls it and its checksum --
    or, a memory snapshot, its identity and (on a disk) its CRC-32."""

    file: str
    #: the file's SHA-256; None for a memory snapshot
    sha256: Optional[str]
    size: int
    path: str
    #: a memory snapshot's identity (its record's ``snapshot``); None for a checkpoint file
    snapshot: Optional[str] = None
    #: a memory snapshot's CRC-32, taken where its slot is on a disk (None: in memory)
    crc32: Optional[int] = None

    @property
    def content(self) -> str:
        """What names this copy's content, to match it to a record's file (:func:`content_of`)."""
        return content_of({"sha256": self.sha256, "snapshot": self.snapshot})

    def read(self, mapped: bool = False) -> Union[bytes, memoryview]:
        """The file's bytes, checked against the size and checksum kept with it.

        ``mapped``: a read-only view of the file mapped into memory instead of a copy of it.
        A reader that loads from the view saves a copy of the whole state and as much memory
        (0.9 s of a 1 GB restore's 2.5 s on one rank of this project's VM). The view stays
        what was checked: a checkpoint's copy is never changed in place, only replaced; a
        memory snapshot's slot is rewritten in place only by the process that made its file
        (:mod:`sparkhvd.torch.snapshot_ring` lays a new file out the first time a process
        fills a slot), and a restore reads the snapshot of an earlier process -- or this
        process's named one, which no save fills while the restore runs.

        Raises:
            ValueError: the copy is missing, truncated or corrupt (why, in words).
        """
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self.size:
                    raise ValueError(f"host copy {self.path} truncated ({size:,} of "
                                     f"{self.size:,} bytes)")
                data: Union[bytes, memoryview] = \
                    memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) \
                    if mapped and size else f.read()
        except OSError as exc:
            raise ValueError(f"host copy {self.path} unreadable ({exc})") from None
        if len(data) != self.size:
            raise ValueError(f"host copy {self.path} truncated ({len(data):,} of "
                             f"{self.size:,} bytes)")
        if self.snapshot:  # whole by its commit; its CRC-32 says nothing changed it since
            if self.crc32 is not None and zlib.crc32(data) != self.crc32:
                raise ValueError(f"host copy {self.path} corrupt (checksum mismatch)")
            return data
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"host copy {self.path} corrupt (checksum mismatch)")
        return data


def content_of(entry: Mapping) -> str:
    """What names a checkpoint file's content in a record's entry for it (``record["files"]
    [name]``, or a host copy's): its SHA-256, or a memory snapshot's identity, tagged
    (``snapshot <id>``) so that the two never match each other; empty when it names neither.
    A host copy is the file's copy when their contents are the same."""
    snapshot = entry.get("snapshot")
    return f"snapshot {snapshot}" if snapshot else str(entry.get("sha256") or "")


#: This user's host copies on this host (``sparkhvd-host-copies-<uid>``, in
#: ``$SPARKHVD_HOST_COPY_DIR`` or the temporary folder): the rules every host store keeps.
STORE = HostStore("host-copies", DIR_ENV, stale_s=STALE_S,
                  refused=("no host copy kept or read",
                           "plant a checkpoint there; relaunches restore from the run folder"),
                  say=lambda message: print(f"checkpoint: {message}", flush=True))
BASE_NAME = STORE.name


def base_folder() -> str:
    """The folder that holds every run's host copies on this host (this user's)."""
    return STORE.base()


def private_base() -> bool:
    """Whether :func:`base_folder` is this user's alone (made ``0700`` if it is not there):
    else (said once) no copy is kept or read there (:meth:`HostStore.private`)."""
    return STORE.private()


def folder() -> Optional[str]:
    """This run's host-copy folder; None outside a sparkhvd run (no run id), or where the
    base folder is not private (:func:`private_base`)."""
    return STORE.run_folder(os.environ.get(protocol.RUN_ID_ENV))


def _own_folder() -> Optional[str]:
    """The folder of this rank's own copies within :func:`folder`."""
    where = folder()
    return os.path.join(where, f"rank-{current_rank().rank}") if where else None


def keep(files: Mapping[str, tuple[bytes, str]], record: Optional[dict] = None,
         store: Optional[str] = None) -> dict[str, HostCopy]:
    """Keep one checkpoint's files (name -> (bytes, sha256)) as this host's newest copy,
    replacing the one before -- with its ``record`` when kept before their upload to ``store``
    (:func:`adopt_all`). Empty when they were not kept (no run, over the budget, a failing
    disk: said once, never an error -- the run folder has the checkpoint)."""
    spools: dict[str, tuple[str, str]] = {}
    for file, (data, sha256) in files.items():
        path = spool(file)
        if path is None:
            break
        spools[file] = (path, sha256)
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as exc:
            _said_failed(exc)
            break
    else:
        return adopt_all(spools, record, store)
    for path, _ in spools.values():
        _unlink(path)
    return {}


def keep_moved(files: Mapping[str, tuple[str, str]], record: Optional[dict] = None,
               store: Optional[str] = None) -> dict[str, HostCopy]:
    """:func:`keep` for files already on this host's disk (checkpoint file -> (path, sha256)):
    moved into this run's host-copy folder, not copied (they are not needed where they are;
    an upload still to read one holds a second name for it: :func:`hold`) -- with ``record``
    when kept before their upload to ``store``. Empty when not kept (a file that cannot be
    moved: none is)."""
    spools: dict[str, tuple[str, str]] = {}
    for file, (path, sha256) in files.items():
        spooled = spool(file)
        if spooled is None:
            break
        try:
            shutil.move(path, spooled)
        except OSError as exc:
            discard(spooled)
            _said_failed(exc)
            break
        spools[file] = (spooled, sha256)
    else:
        return adopt_all(spools, record, store)
    for spooled, _ in spools.values():
        discard(spooled)
    return {}


def spool(file: str) -> Optional[str]:
    """A path in this run's host-copy folder to write the checkpoint file ``file`` into, then
    hand to :func:`adopt` (a writer that streams the file there keeps it without a second
    copy). None outside a run or where the folder cannot be made (said once)."""
    run, where = folder(), _own_folder()
    if run is None or where is None:
        return None
    try:
        _claimed(where)
        STORE.remove_stale(keep=os.path.basename(run))  # once per process, not once per save
        if where not in _swept:
            _swept.add(where)
            owned_temp.remove_orphans(where)  # a killed rank's spool and upload hold
    except OSError as exc:
        _said_failed(exc)
        return None
    return os.path.join(where, f"sparkhvd-spool-{os.getpid()}-{_copy_name(file)}")


def adopt(file: str, path: str, sha256: str, record: Optional[dict] = None,
          store: Optional[str] = None) -> Optional[HostCopy]:
    """Make the complete file at ``path`` (from :func:`spool`) this host's newest copy of the
    one-file checkpoint ``file`` (:func:`adopt_all`). None when not kept."""
    return adopt_all({file: (path, sha256)}, record, store).get(file)


def hold(path: str) -> Optional[str]:
    """A second name for the spooled file ``path`` (a hard link beside it: no copy), for its
    upload to read after :func:`adopt` -- and a newer save's :func:`adopt`, which deletes this
    copy -- took the first. The caller deletes it (:func:`discard`). None where the folder's
    file system has no hard links."""
    held = f"{path}.upload"
    try:
        os.link(path, held)
    except OSError:
        return None
    return held


def snapshot_slot(slot: int) -> Optional[str]:
    """The path of this rank's memory-snapshot slot file ``slot`` (made by
    :mod:`sparkhvd.torch.snapshot_ring`), its folder made; None outside a run or where the
    folder cannot be made (said once)."""
    where = _own_folder()
    if where is None:
        return None
    try:
        _claimed(where)
    except OSError as exc:
        _said_failed(exc)
        return None
    return os.path.join(where, f"snapshot-{slot}")


def committed_snapshot() -> Optional[str]:
    """The slot file this rank's ``snapshot.json`` names (an earlier process's, after a
    relaunch): the one a new snapshot must not overwrite. None: none."""
    where = _own_folder()
    files = _load_meta(where, _SNAPSHOT_META).get("files") if where else None
    try:
        return os.path.join(str(where), str(files[0]["name"])) if files else None
    except (KeyError, TypeError, IndexError):
        return None


def snapshot_entry(size: int, identity: str, crc: Optional[int]) -> dict:
    """A memory snapshot's entry in its record's files: its ``size``, ``identity`` (this
    snapshot's own, in place of a SHA-256) and the CRC-32 of its file, which
    :meth:`HostCopy.read` checks (None: a file in memory, none taken)."""
    return {"size": size, "snapshot": identity, "crc32": crc}


def commit_snapshot(file: str, path: str, size: int, record: dict, store: str) -> bool:
    """Name the whole snapshot at ``path`` (``size`` bytes) this rank's newest, as the copy of
    the checkpoint file ``file`` of ``record`` (its entry from :func:`snapshot_entry`; kept
    before any upload to ``store``): one rename of ``snapshot.json``. False when it could not
    be written (said once)."""
    entry = record["files"][file]
    meta = {"files": [{"file": file, "snapshot": entry["snapshot"], "crc32": entry["crc32"],
                       "size": size, "name": os.path.basename(path)}],
            "record": _kept_record(record), "store": store}
    try:
        _replace(os.path.join(os.path.dirname(path), _SNAPSHOT_META), json.dumps(meta).encode())
    except OSError as exc:
        _said_failed(exc)
        return False
    return True


#: File systems whose files live in memory: gone with the host, never torn by its crash.
_IN_MEMORY = frozenset({"tmpfs", "ramfs"})


def in_memory(path: str) -> bool:
    """Whether ``path`` lies on a file system held in memory (``/dev/shm``): a file there
    cannot outlive its host, so no crash can leave it torn for a relaunch to read."""
    import psutil

    where = os.path.realpath(path)
    best, kind = "", ""
    with contextlib.suppress(OSError):
        for part in psutil.disk_partitions(all=True):
            mount = part.mountpoint.rstrip("/") + "/"
            if (where + "/").startswith(mount) and len(mount) > len(best):
                best, kind = mount, part.fstype
    return kind in _IN_MEMORY


def free_bytes(path: str) -> int:
    """What the file system of ``path``'s folder has free (0 when it cannot say)."""
    return STORE.free(os.path.dirname(path))


def adopt_all(spools: Mapping[str, tuple[str, str]], record: Optional[dict] = None,
              store: Optional[str] = None) -> dict[str, HostCopy]:
    """Make the complete files at the spooled paths (checkpoint file -> (path, sha256)) this
    host's newest copy, replacing the one before -- or delete them and keep none when they take
    more than half of what the folder had free (said once). Never an error: empty when not
    kept. ``record`` (with ``store``, :attr:`CheckpointStore.key` of the folder it goes to):
    the checkpoint's record, kept with the files when they are kept before their upload, so a
    relaunch can restore them before the folder has them (:func:`records`)."""
    if not spools:
        return {}
    where = os.path.dirname(next(iter(spools.values()))[0])
    try:
        sizes = {file: os.path.getsize(path) for file, (path, _) in spools.items()}
        total = sum(sizes.values())
        old = _read_meta(where)
        room = shutil.disk_usage(where).free + total  # what was free before these files
        if total > FREE_SHARE * room:
            _say_once(f"over:{where}", "no host copy of %s kept: %d MB is more than half the "
                      "free space of %s (%d MB); relaunches restore from the run folder. "
                      "Set %s to a larger folder.", ", ".join(spools), total >> 20, where,
                      room >> 20, DIR_ENV)
            for path in [p for p, _ in spools.values()] + [c.path for c in old.values()]:
                _unlink(path)  # not the folder: an upload may still read a file held there
            _unlink(os.path.join(where, _META))
            return {}
        kept: dict[str, HostCopy] = {}
        for file, (path, sha256) in spools.items():
            final = os.path.join(where, _copy_name(file))
            os.replace(path, final)  # the new files, then what names them, then the old go
            kept[file] = HostCopy(file, sha256, sizes[file], final)
        meta: dict = {"files": [{"file": c.file, "sha256": c.sha256, "size": c.size,
                                 "name": os.path.basename(c.path)} for c in kept.values()]}
        if record is not None and store is not None:
            meta.update(record=_kept_record(record), store=store)
        _replace(os.path.join(where, _META), json.dumps(meta).encode())
        for copy in old.values():
            if copy.path not in {c.path for c in kept.values()}:
                _unlink(copy.path)
        return kept
    except OSError as exc:
        for path, _ in spools.values():
            _unlink(path)
        _said_failed(exc)
        return {}


def _copy_name(file: str) -> str:
    """The name a checkpoint file's copy has: its path in the checkpoint folder, flattened
    (``epoch-0002/__1_0.distcp`` never overwrites ``epoch-0001/__1_0.distcp``'s copy before
    the list names the new one)."""
    return file.replace("/", "~")


def discard(path: str) -> None:
    """Delete a spool file that will not be adopted (its write failed)."""
    _unlink(path)


def _said_failed(exc: OSError) -> None:
    where = os.path.join(base_folder(), os.environ.get(protocol.RUN_ID_ENV) or "")
    _say_once(f"fail:{where}", "no host copy kept in %s (%s); relaunches restore from the "
              "run folder", where, exc)


def find_all() -> dict[str, HostCopy]:
    """Every copy this host keeps for this run -- each writing rank's newest checkpoint files
    -- by checkpoint file (not yet checked: :meth:`HostCopy.read` checks each). Where two
    ranks' copies name the same file, the newer one."""
    copies: dict[str, HostCopy] = {}
    for owner in sorted(_owners(), key=_meta_time):  # newer ones last: they win
        for meta in _METAS:
            copies.update(_read_meta(owner, meta))
    return copies


def _owners(where: Optional[str] = None) -> list[str]:
    """The folders of the ranks that kept copies on this host for this run (or for the run
    whose folder is ``where``)."""
    where = where or folder()
    try:
        return [os.path.join(where, name) for name in os.listdir(where)
                if name.startswith("rank-")] if where else []
    except OSError:
        return []


def records(store: str) -> list[dict]:
    """The records of the checkpoints this host keeps for this run whose copies were kept
    before their upload to the folder ``store`` (:attr:`CheckpointStore.key`) -- the ones a
    relaunch may restore before the folder has them, as :func:`_kept_record` wrote them. Not
    checked: their files are, when read."""
    metas = (_load_meta(owner, meta) for owner in _owners() for meta in _METAS)
    return [meta["record"] for meta in metas
            if meta.get("store") == store and isinstance(meta.get("record"), dict)]


def _kept_record(record: dict) -> dict:
    """A checkpoint's record as a host copy keeps it: without each file's ``pieces`` (the
    CRC-32s a read of parts of the folder's copy checks; thousands for a large sharded
    checkpoint) -- every rank gathers every rank's kept records (:func:`records`), and a
    checkpoint restored from here is not read from the folder."""
    files = record.get("files")
    if not isinstance(files, dict):
        return record
    return {**record, "files": {name: {k: v for k, v in entry.items() if k != "pieces"}
                                if isinstance(entry, dict) else entry
                                for name, entry in files.items()}}


def _load_meta(where: str, name: str = _META) -> dict:
    """The list ``name`` one rank keeps in ``where`` (empty: none, or unreadable)."""
    try:
        with open(os.path.join(where, name), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _read_meta(where: str, name: str = _META) -> dict[str, HostCopy]:
    """The copies one rank's list ``name`` names in ``where`` (empty: none, or the list is
    unreadable). A memory snapshot's entry has its ``snapshot`` and ``crc32`` where a
    checkpoint file's has its ``sha256`` (one whose ``sha256`` is ``snapshot:...``, from
    before, fails its check when read and is passed over)."""
    def optional(value: object, kind: type) -> Any:
        return None if value is None else kind(value)

    try:
        return {str(m["file"]): HostCopy(str(m["file"]), optional(m.get("sha256"), str),
                                         int(m["size"]), os.path.join(where, str(m["name"])),
                                         optional(m.get("snapshot"), str),
                                         optional(m.get("crc32"), int))
                for m in _load_meta(where, name).get("files", [])}
    except (AttributeError, KeyError, TypeError, ValueError):
        return {}


def _meta_time(where: str) -> float:
    times = [0.0]
    for name in _METAS:
        with contextlib.suppress(OSError):
            times.append(os.path.getmtime(os.path.join(where, name)))
    return max(times)


def _claimed(where: str) -> None:
    """Make this rank's folder ``where`` and mark this process its owner."""
    os.makedirs(where, exist_ok=True)
    if _owner_of(where) != os.getpid():
        _replace(os.path.join(where, _OWNER), str(os.getpid()).encode())


def _owner_of(where: str) -> Optional[int]:
    """The process that last kept files in the rank folder ``where`` (None: not said)."""
    try:
        with open(os.path.join(where, _OWNER), "rb") as f:
            return int(f.read().strip() or b"0") or None
    except (OSError, ValueError):
        return None


def clean() -> None:
    """This rank's part of deleting the run's host copies on this host (the run is done): its
    own folder and every rank folder whose owner process is gone; then the run's folder, once
    empty. A folder a live process owns is left to it (see the module's rules)."""
    run_id = os.environ.get(protocol.RUN_ID_ENV)
    mine = _own_folder()
    if run_id and mine is not None:
        STORE.sweep(run_id, _owner_of, mine=[mine])


def sweep(run_id: str) -> int:
    """Delete run ``run_id``'s host copies on this host that no live process owns (ranks of an
    attempt that ended here while the run went on elsewhere); the run's folder too, once empty.
    How many rank folders went. Called by the driver's sweep of the hosts a succeeded run used
    (:mod:`sparkhvd.executor.host_sweep`); the folder is checked as for a copy (private)."""
    return STORE.sweep(run_id, _owner_of)


def _replace(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it). Not fsynced: a
    copy torn by a crash fails its checksum and the run folder is read instead."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        _unlink(temporary)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _say_once(key: str, message: str, *args: object) -> None:
    STORE.say_once(key, message % args)  # the rank's [rank N] lines
