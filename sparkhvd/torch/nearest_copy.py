"""Restore :class:`sparkhvd.torch.Checkpoints` from the nearest copy of the newest checkpoint.

Rank 0 keeps the newest checkpoint it wrote on its host (:mod:`sparkhvd.runfolder.host_copy`).
After a relaunch, every rank needs that state: read from the run folder, it crosses the network
once per rank (minutes for a large model on ``abfss://``). Here:

1. every rank says which host copy it has (one small all-gather);
2. rank 0 reads the newest complete checkpoint's record from the checkpoint folder and tells
   every rank its file and checksum (one small broadcast): the one decision, so every rank takes
   the same path through the collectives below;
3. a rank whose host has that copy reads it from disk (checked against the checksum); when some
   rank's host has none, the lowest rank that has it sends its bytes to every rank over the
   process group (on gloo, beside an nccl group);
4. a rank with no good copy -- none anywhere, a copy deleted, torn or corrupt (said with a
   warning), or one that does not load -- reads the checkpoint folder as before
   (:func:`sparkhvd.runfolder.checkpoint_store.restore_newest`), on its own.

Returns which copy was used, for the resume line and ``run.json`` (``resume.copy``).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from sparkhvd.runfolder import host_copy
from sparkhvd.runfolder.checkpoint_store import (
    CheckpointStore,
    newest_one_file,
    restore_newest,
)
from sparkhvd.torch.side_group import side_group

__side__ = "rank"

#: Bytes per broadcast when a host copy is sent to the ranks that lack it.
CHUNK = 256 << 20


def restore_nearest(store: CheckpointStore, load: Callable[[dict, dict[str, bytes]], Any],
                    rank: int) -> tuple[Optional[dict], Any, list[str], str]:
    """``(record, load's value, problems, copy)``: the newest checkpoint in ``store``, read from
    the nearest copy -- ``copy`` is ``"host"``, ``"peer"`` or ``"folder"``. Call on every rank
    (a collective when there are several)."""
    mine = host_copy.find()
    keys = _gather((mine.file, mine.sha256) if mine else None)
    wanted = _decide(store, rank, any(keys))
    problems: list[str] = []
    if wanted is not None:
        record, file, sha256 = wanted
        holders = [r for r, key in enumerate(keys) if key == (file, sha256)]
        data, copy = _fetch(mine if rank in holders else None, holders, rank, len(keys),
                            problems)
        if data is not None:
            try:
                return record, load(record, {file: data}), problems, copy
            except Exception as exc:  # noqa: BLE001 - a copy that does not load: the folder
                problems.append(f"{copy} copy of {file}: unreadable "
                                f"({type(exc).__name__}: {str(exc)[:200]})")
    newest, state, skipped = restore_newest(store, load)
    return newest, state, problems + skipped, "folder"


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(key: Optional[tuple[str, str]]) -> list:
    """Every rank's host-copy key (file, sha256), by rank."""
    import torch.distributed as dist

    if _world() == 1:
        return [key]
    keys: list = [None] * _world()
    dist.all_gather_object(keys, key, group=side_group())
    return keys


def _decide(store: CheckpointStore, rank: int, any_copy: bool
            ) -> Optional[tuple[dict, str, str]]:
    """Rank 0's reading of the newest checkpoint (record, file, sha256), the same on every rank;
    None when no rank has a host copy or the newest is not one file."""
    import torch.distributed as dist

    if not any_copy:
        return None
    wanted = None
    if rank == 0:
        try:
            wanted = newest_one_file(store)
        except Exception:  # noqa: BLE001 - the folder path below says what is wrong
            wanted = None
    if _world() == 1:
        return wanted
    box = [wanted]
    dist.broadcast_object_list(box, src=0, group=side_group())
    return box[0]


def _fetch(mine: Optional[host_copy.HostCopy], holders: list[int], rank: int, world: int,
           problems: list[str]) -> tuple[Optional[bytes], str]:
    """The checkpoint's bytes from this host's copy, else from the lowest holder (a collective
    whenever some rank holds none); None when neither is good."""
    data = None
    if mine is not None:
        try:
            data = mine.read()
        except ValueError as exc:
            problems.append(str(exc))  # rank 0 says its own with the resume line
            if rank != 0:
                print(f"resume: WARNING: {exc}; reading the checkpoint folder instead",
                      flush=True)
    if not holders or len(holders) == world:
        return data, "host"
    sent = _broadcast(data if rank == holders[0] else None, holders[0], rank)
    if mine is not None:
        return data, "host"
    return sent, "peer"


def _broadcast(data: Optional[bytes], source: int, rank: int) -> Optional[bytes]:
    """``data`` from ``source`` on every rank (None everywhere when the source has none)."""
    import torch
    import torch.distributed as dist

    group = side_group()
    size = torch.tensor([len(data) if data is not None else -1], dtype=torch.int64)
    dist.broadcast(size, src=source, group=group)
    n = int(size[0])
    if n < 0:
        return None
    if rank == source and data:
        with warnings.catch_warnings():  # read-only bytes: the source only sends them
            warnings.simplefilter("ignore", UserWarning)
            buffer = torch.frombuffer(data, dtype=torch.uint8)
    else:
        buffer = torch.empty(n, dtype=torch.uint8)
    for start in range(0, n, CHUNK):
        dist.broadcast(buffer[start:start + CHUNK], src=source, group=group)
    return data if rank == source else buffer.numpy().tobytes()
