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

import contextlib
import functools
import logging
import os
import pickle
import threading
from typing import IO, Any, Iterator, Mapping, Union, cast

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


def load_state(data: Union[bytes, memoryview], device: Any) -> Any:
    """What :func:`save_state` wrote (its tensors on ``device``), or a memory snapshot of the
    state (:mod:`sparkhvd.torch.snapshot_ring`; its tensors on the CPU, for
    ``load_state_dict`` to copy where they belong). ``data``: the file's bytes, or a view of
    a host copy mapped into memory, read into the tensors without a copy of the file."""
    import torch

    from sparkhvd.torch import snapshot_ring

    if snapshot_ring.is_snapshot(data):
        return snapshot_ring.load_snapshot(data)
    try:  # tensors, numbers, strings and containers: nothing in the file can run code
        return torch.load(cast(IO[bytes], as_stream(data)), map_location=device,
                          weights_only=True)
    except pickle.UnpicklingError as exc:
        # the user's ``extra`` state holds other objects: a full unpickle, of bytes whose
        # SHA-256 the checkpoint's record vouched for, from a folder only the user can write
        log.debug("checkpoint state needs a full unpickle (%s)", str(exc).split("\n", 1)[0])
        return torch.load(cast(IO[bytes], as_stream(data)), map_location=device,
                          weights_only=False)


def reader_of(files: Mapping[str, Any], folder: str) -> Any:
    """A DCP storage reader of the checkpoint ``folder``'s files, already in memory (name in the
    checkpoint folder -> bytes, read and checked against the record, a view of this host's copy
    mapped into memory, or the :class:`~sparkhvd.checkpoint.file_pieces.FilePieces` of it this
    rank's load reads): DCP reads its slices of them where they are, not from a copy written
    to disk first (that write was 1.5 s of a 5.3 s restore of a 1 GB state, B15)."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(f"/{folder}")
    by_path = {str(reader.fs.concat_path(reader.path, os.path.relpath(name, folder))): data
               for name, data in files.items()}
    reader.fs = _in_memory()(by_path)
    return reader


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
