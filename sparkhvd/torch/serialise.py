"""How ``Checkpoints`` serialises a state into its file: ``torch.save`` without its CRC-32s,
and reads it back (or a memory snapshot of it); and how ``ShardedCheckpoints`` gives DCP files
it already read and checked.

A checkpoint's record already carries the SHA-256 of the whole file (computed as the bytes
pass, :class:`sparkhvd.checkpoint.write.DigestingWriter`), and every read checks it.
``torch.save`` also computes a CRC-32 of each record with miniz's own routine, about a
core-second per GB on this project's VM: on a 1 GB state that was half the write's CPU, taken
from the training threads by a background save (B15: async / none 0.89-0.94x with it,
0.94-0.95x without). ``torch.load`` reads files written without them (torch's
``set_crc32_options``); only an external ``unzip -t`` would flag them.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import pickle
import re
import threading
from typing import IO, Any, Iterator, Mapping, Sequence, Union, cast

from sparkhvd.checkpoint.file_pieces import as_stream

__side__ = "rank"

log = logging.getLogger(__name__)

_lock = threading.Lock()


@contextlib.contextmanager
def _crc32_off() -> Iterator[None]:
    """torch's process-wide CRC-32 option off while the block runs, as it was after. Torch
    reads it when a save opens its file; a save the user runs on another thread at that moment
    also skips its CRC-32s, which ``torch.load`` does not need."""
    import torch.serialization as serialization

    get = getattr(serialization, "get_crc32_options", None)  # torch >= 2.6
    if get is None:
        yield
        return
    with _lock:
        before = get()
        serialization.set_crc32_options(False)
        try:
            yield
        finally:
            serialization.set_crc32_options(before)


def save_state(state: Any, f: IO[bytes]) -> None:
    """``torch.save(state, f)``, the file's integrity left to its record's SHA-256."""
    import torch

    with _crc32_off():
        torch.save(state, f)


def load_state(data: Union[bytes, memoryview], device: Any, safe_types: Sequence[type] = (),
               name: str = "the checkpoint") -> Any:
    """What :func:`save_state` wrote (its tensors on ``device``), or a memory snapshot of the
    state (:mod:`sparkhvd.torch.snapshot_ring`; its tensors on the CPU, for
    ``load_state_dict`` to copy where they belong). ``data``: the file's bytes, or a view of
    a host copy mapped into memory, read into the tensors without a copy of the file.

    Only tensors, numbers, strings, plain containers and ``safe_types`` (the user's own, named
    in ``Checkpoints(safe_types=...)``) are loaded: torch's ``weights_only`` loader, never a
    full unpickle. The record's SHA-256 vouches for nothing here -- whoever can write the
    checkpoint folder writes the record beside the file.

    Raises:
        UnsafeCheckpoint: the file holds another kind of object (named, with the fix).
    """
    import torch

    from sparkhvd.torch import snapshot_ring

    if snapshot_ring.is_snapshot(data):
        return snapshot_ring.load_snapshot(data)
    if snapshot_ring.is_old_snapshot(data):
        raise ValueError(f"{name} is a memory snapshot of an earlier sparkhvd, whose structure "
                         f"is a pickle: not read (it could run code); the checkpoint before "
                         f"it is used")
    try:
        with allowing(safe_types):
            return torch.load(cast(IO[bytes], as_stream(data)), map_location=device,
                              weights_only=True)
    except pickle.UnpicklingError as exc:
        raise unsafe(name, exc) from None


@contextlib.contextmanager
def allowing(safe_types: Sequence[type]) -> Iterator[None]:
    """torch's ``weights_only`` loader allows ``safe_types`` and numpy's scalars, arrays and
    dtypes (what a user's extra state often holds: ``best=np.float64(...)``, a numpy array;
    their reconstruction runs nothing) while the block runs.

    torch's allowlist is the process's: only the types it lacks are added, and taken out again
    when the last block that added them ends (a lock and a count per type), so a user's own
    ``add_safe_globals`` survives a restore and two threads' restores do not undo each
    other's. torch < 2.4 has no allowlist: only its own types load there."""
    import torch.serialization as serialization

    add = getattr(serialization, "add_safe_globals", None)
    get = getattr(serialization, "get_safe_globals", None)
    if add is None or get is None:
        yield
        return
    wanted = [t for t in (*safe_types, *_numpy_globals()) if isinstance(t, type) or callable(t)]
    with _allow_lock:
        present = set(map(id, get()))
        for kind in wanted:
            if _allowed_by_us.get(id(kind)):
                _allowed_by_us[id(kind)] += 1
            elif id(kind) not in present:
                add([kind])
                _allowed_by_us[id(kind)] = 1
    try:
        yield
    finally:
        with _allow_lock:
            ours = [k for k in wanted if _allowed_by_us.get(id(k))]
            for kind in ours:
                _allowed_by_us[id(kind)] -= 1
            gone = {id(k) for k in ours if not _allowed_by_us[id(k)]}
            if gone:
                clear = getattr(serialization, "clear_safe_globals", None)
                if clear is not None:
                    keep = [g for g in get() if id(g) not in gone]
                    clear()
                    add(keep)
                for key in gone:
                    del _allowed_by_us[key]


_allow_lock = threading.Lock()
_allowed_by_us: dict[int, int] = {}  # id of a type allowed by allowing() -> blocks using it


@functools.cache
def _numpy_globals() -> tuple:
    """What a pickled numpy scalar, array or dtype names (numpy 1 and 2)."""
    try:
        import numpy as np
    except ImportError:
        return ()
    core = getattr(np, "_core", None) or np.core
    dtypes = getattr(np, "dtypes", None)
    kinds = [getattr(dtypes, n) for n in getattr(dtypes, "__all__", ())] if dtypes else []
    return (core.multiarray.scalar, core.multiarray._reconstruct, np.ndarray, np.dtype,
            *[k for k in kinds if isinstance(k, type)])


def unusual_types(value: Any, safe_types: Sequence[Any] = (), limit: int = 100_000
                  ) -> set[str]:
    """The types in ``value`` (an extra state) that :func:`load_state` will refuse unless
    named in ``safe_types``: said when the checkpoint is saved, not found at the resume.
    Exact types (an ``IntEnum`` is not an int to the loader); at most ``limit`` values looked
    at (a huge list is not walked on every save)."""
    import numpy as np
    import torch

    plain = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype,
             torch.device)
    named = tuple(t for t in safe_types if isinstance(t, type))
    found: set[str] = set()
    stack, seen = [value], 0
    while stack and seen < limit:
        item = stack.pop()
        seen += 1
        kind = type(item)
        if kind in plain or isinstance(item, (torch.Tensor, np.generic, np.ndarray)) or \
                kind in named:
            continue
        if kind in (dict, collections.OrderedDict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind in (list, tuple, set):
            stack.extend(item)
        else:
            found.add(f"{kind.__module__}.{kind.__qualname__}")
    return found


def dcp_failure(exc: BaseException, name: str) -> Exception:
    """DCP's ``CheckpointException`` (a ``BaseException``: what skips a bad checkpoint
    catches ``Exception``) as the first rank's own error -- an :class:`UnsafeCheckpoint` as
    it is -- else a ``CheckpointError`` naming the checkpoint."""
    from sparkhvd.common.errors import CheckpointError

    failures = getattr(exc, "failures", None) or {}
    for failure in failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, CheckpointError):
            return error
    first = next(iter(failures.values()), None)
    error = first[0] if isinstance(first, tuple) else first
    return CheckpointError(f"{name} could not be loaded: "
                           f"{type(error).__name__ if error else 'DCP'}: {error or exc}")


def unsafe(name: str, exc: BaseException) -> Exception:
    """The :class:`UnsafeCheckpoint` for a file torch's ``weights_only`` loader refused."""
    from sparkhvd.common.errors import UnsafeCheckpoint

    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = (f"a pickled {found.group(1)}" if found
            else f"what torch's safe loader refuses ({str(exc).splitlines()[0][:120]})")
    return UnsafeCheckpoint(
        f"{name} holds {what}, not a tensor, number, string, numpy value or plain container: "
        f"loading it could run code, so it was not loaded. Fix: if you saved objects of your "
        f"own types in its extra state, name them: Checkpoints(..., safe_types=[YourType]) "
        f"(or torch.serialization.add_safe_globals([YourType])); a file you did not write: "
        f"resume from a run folder you trust, or train from scratch with resume_from=False.")


def reader_of(files: Mapping[str, Any], folder: str, name: str = "") -> Any:
    """A DCP storage reader of the checkpoint ``folder``'s files, already in memory (name in the
    checkpoint folder -> bytes, read and checked against the record, a view of this host's copy
    mapped into memory, or the :class:`~sparkhvd.checkpoint.file_pieces.FilePieces` of it this
    rank's load reads): DCP reads its slices of them where they are, not from a copy written
    to disk first (that write was 1.5 s of a 5.3 s restore of a 1 GB state, B15).

    Its ``.metadata`` is unpickled with only DCP's own metadata classes allowed
    (:class:`_MetadataUnpickler`): DCP's reader unpickles it whole, and whoever can write the
    folder writes it."""
    reader = _safe_reader()(f"/{folder}")
    reader.checkpoint_name = name or folder
    by_path = {str(reader.fs.concat_path(reader.path, os.path.relpath(name, folder))): data
               for name, data in files.items()}
    reader.fs = _in_memory()(by_path)
    return reader


def safe_planner(safe_types: Sequence[type] = (), name: str = "the checkpoint") -> Any:
    """DCP's default load planner, its non-tensor items (the optimizer's settings, step counts,
    the extra state) loaded with torch's ``weights_only`` loader and ``safe_types`` -- DCP's
    own loads them with torch's unrestricted loader."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:  # DCP's, but weights_only
            import torch
            from torch.distributed.checkpoint._traverse import set_element

            try:
                with allowing(safe_types):
                    loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise unsafe(f"{name} ({read_item.dest_index.fqn})", exc) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


#: What a DCP ``.metadata`` pickle may name (seen in torch 2.13's: DCP's metadata classes, the
#: tensors' sizes, dtypes and layouts, the checkpoint's path) -- exact names, never a dotted
#: path (a pickle may name ``StorageMeta.__init__.__code__.__class__``: the code type).
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local")  # Python 3.13's module
      for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: the globals above and torch's dtypes, each by its exact
    name; anything else is refused (an :class:`UnsafeCheckpoint` names it)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if "." not in name and ((module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


@functools.cache
def _safe_reader() -> Any:
    """DCP's ``FileSystemReader``, its ``.metadata`` read by :class:`_MetadataUnpickler`."""
    import torch.distributed.checkpoint.metadata as dcp_metadata
    from torch.distributed.checkpoint import FileSystemReader

    storage_meta: Any = getattr(dcp_metadata, "StorageMeta", None)  # torch >= 2.4

    class SafeReader(FileSystemReader):
        checkpoint_name = "the checkpoint"

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = getattr(self, "_get_metadata_path", None)  # torch >= 2.5's
            path = where(kwargs.get("rank")) if where is not None else \
                self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(path, "rb") as metadata_file:
                try:
                    metadata = _MetadataUnpickler(metadata_file).load()
                except pickle.UnpicklingError as exc:
                    raise unsafe(f"{self.checkpoint_name}/.metadata", exc) from None
            if storage_meta is None:
                return metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = storage_meta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


@functools.cache
def _in_memory() -> Any:
    """DCP's ``FileSystem`` over files in memory (path -> data), each stream sharing its data.

    One class for the process (made once torch is imported), its files an instance's: a class
    made per call over the caller's locals would be in a reference cycle (every class is)
    that holds the files -- and the mappings of host copies read in place -- until a garbage
    collection."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class InMemory(FileSystem):
        def __init__(self, by_path: Mapping[str, Any]) -> None:
            super().__init__()
            self.by_path = by_path

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            yield as_stream(self.by_path[str(path)])  # shares the data: nothing copied

    return InMemory
