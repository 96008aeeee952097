"""Restore PyTorch checkpoints from the nearest copy of the newest one.

The rank that writes a checkpoint file keeps its newest on its host
(:mod:`sparkhvd.runfolder.host_copy`): rank 0 its :class:`sparkhvd.torch.Checkpoints` file,
every rank its shards of a :class:`sparkhvd.torch.ShardedCheckpoints` one. After a relaunch,
the ranks need that state: read from the run folder, it crosses the network once per rank
(minutes for a large model on ``abfss://``). Here:

1. every rank says which copies its host has (one small all-gather);
2. rank 0 reads the newest complete checkpoint's record from the checkpoint folder and tells
   every rank its files and checksums (one small broadcast): the one decision, so every rank
   takes the same path through the collectives below;
3. for each file, a rank whose host has it reads it from disk (checked against the checksum);
   when some rank's host has none, the lowest rank that has it sends its bytes to every rank
   over the process group (on gloo, beside an nccl group); a file no rank has (or whose only
   copy is bad, said with a warning) is read from the checkpoint folder;
4. when a rank has not every file that way, or the state does not load, every rank reads the
   checkpoint folder as before (:func:`sparkhvd.runfolder.checkpoint_store.restore_newest`).

Returns which copy was used, for the resume line and ``run.json`` (``resume.copy``): the
farthest any file came from.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from sparkhvd.runfolder import host_copy
from sparkhvd.runfolder.checkpoint_store import (
    CheckpointStore,
    files_of,
    newest_checked,
    read_copy,
    read_file_checked,
    restore_newest,
)
from sparkhvd.torch.side_group import side_group

__side__ = "rank"

#: Bytes per broadcast when a host copy is sent to the ranks that lack it.
CHUNK = 256 << 20
#: The copies a file can come from, nearest first (``resume.copy`` is the farthest used).
FARTHEST = ("host", "peer", "folder")


def restore_nearest(store: CheckpointStore, load: Callable[[dict, dict[str, bytes]], Any],
                    rank: int) -> tuple[Optional[dict], Any, list[str], str]:
    """``(record, load's value, problems, copy)``: the newest checkpoint in ``store``, read from
    the nearest copy -- ``copy`` is ``"host"``, ``"peer"`` or ``"folder"``. Call on every rank
    (a collective when there are several; ``load`` may be one too: every rank calls it with
    the same record, or none does)."""
    mine = host_copy.find_all()
    everyone = _gather({file: copy.sha256 for file, copy in mine.items()})
    record = _decide(store, rank, any(everyone))
    problems: list[str] = []
    if record is not None:
        files, copy = _fetch(store, record, mine, everyone, rank, problems)
        if files is not None:
            try:
                return record, load(record, files), problems, copy
            except Exception as exc:  # noqa: BLE001 - a copy that does not load: the folder
                problems.append(f"{copy} copy of {record.get('file')}: unreadable "
                                f"({type(exc).__name__}: {str(exc)[:200]})")
    newest, state, skipped = restore_newest(store, load)
    return newest, state, problems + skipped, "folder"


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(held: dict[str, str]) -> list[dict[str, str]]:
    """Every rank's host copies (file -> sha256), by rank."""
    import torch.distributed as dist

    if _world() == 1:
        return [held]
    everyone: list = [None] * _world()
    dist.all_gather_object(everyone, held, group=side_group())
    return everyone


def _decide(store: CheckpointStore, rank: int, any_copy: bool) -> Optional[dict]:
    """Rank 0's reading of the newest checkpoint's record, the same on every rank; None when
    no rank has a host copy or the record has no checksums to check a copy against."""
    import torch.distributed as dist

    if not any_copy:
        return None
    wanted = None
    if rank == 0:
        try:
            wanted = newest_checked(store)
        except Exception:  # noqa: BLE001 - the folder path below says what is wrong
            wanted = None
    if _world() == 1:
        return wanted
    box = [wanted]
    dist.broadcast_object_list(box, src=0, group=side_group())
    return box[0]


def _fetch(store: CheckpointStore, record: dict, mine: dict[str, host_copy.HostCopy],
           everyone: list[dict[str, str]], rank: int, problems: list[str]
           ) -> tuple[Optional[dict[str, bytes]], str]:
    """Each of the checkpoint's files from this host's copy, else from the lowest rank that
    holds it (a collective whenever some rank does not), else from the folder; and the
    farthest copy read. None (on every rank) when some rank could not get every file."""
    files: dict[str, bytes] = {}
    farthest = 0
    complete = True
    said = len(problems)
    for name, expected in sorted(files_of(record).items()):
        holders = [r for r, held in enumerate(everyone) if held.get(name) == expected["sha256"]]
        data = read_copy(store, name, expected, mine.get(name), problems) \
            if rank in holders else None
        where = 0
        if holders and len(holders) < len(everyone):  # the same holders on every rank
            sent = _broadcast(data if rank == holders[0] else None, holders[0], rank)
            if data is None and sent is not None:
                data, where = sent, 1
        if data is None and complete:
            data, where = read_file_checked(store, name, expected, problems), 2
        if data is None:
            complete = False  # every broadcast still taken part in
            continue
        files[name] = data
        farthest = max(farthest, where)
    if rank != 0:  # rank 0 says its own with the resume line
        for problem in problems[said:]:
            print(f"resume: WARNING: {problem}", flush=True)
    if not _everyone(complete):
        return None, FARTHEST[2]
    return files, FARTHEST[farthest]


def _everyone(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank."""
    import torch
    import torch.distributed as dist

    if _world() == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=side_group())
    return bool(flag[0])


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
