"""Restore PyTorch checkpoints from the nearest copy of the newest one, over the process
group: the framework's half of :mod:`sparkhvd.runfolder.nearest_copy` (which decides what is
read from where). Rank 0 keeps its :class:`sparkhvd.torch.Checkpoints` file on its host, every
rank its shards of a :class:`sparkhvd.torch.ShardedCheckpoints` one; every rank loads the
state, and a copy some rank lacks is sent by the lowest rank that has it (on gloo, beside an
nccl group)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from sparkhvd.runfolder import nearest_copy
from sparkhvd.runfolder.checkpoint_store import CheckpointStore
from sparkhvd.torch.side_group import side_group

__side__ = "rank"

#: Bytes per broadcast when a host copy is sent to the ranks that lack it.
CHUNK = 256 << 20


def restore_nearest(store: CheckpointStore, load: Callable[[dict, dict[str, bytes]], Any],
                    rank: int) -> tuple[Optional[dict], Any, list[str], str]:
    """``(record, load's value, problems, copy)``: the newest checkpoint in ``store``, read from
    the nearest copy -- ``copy`` is ``"host"``, ``"peer"`` or ``"folder"``. Call on every rank
    (a collective when there are several; ``load`` may be one too: every rank calls it with
    the same record, or none does)."""
    import torch.distributed as dist

    world: nearest_copy.Collectives = TorchCollectives() \
        if dist.is_initialized() and dist.get_world_size() > 1 else nearest_copy.Alone()
    return nearest_copy.restore_nearest(store, load, rank, world)


class TorchCollectives:
    """:class:`sparkhvd.runfolder.nearest_copy.Collectives` on the helpers' gloo group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.size = dist.get_world_size()

    def gather(self, held: dict[str, Any]) -> list[dict[str, Any]]:
        import torch.distributed as dist

        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, held, group=side_group())
        return everyone

    def broadcast_record(self, record: Optional[dict], source: int) -> Optional[dict]:
        import torch.distributed as dist

        box = [record]
        dist.broadcast_object_list(box, src=source, group=side_group())
        return box[0]

    def broadcast_bytes(self, data: Optional[bytes], source: int, rank: int
                        ) -> Optional[bytes]:
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

    def everyone(self, ok: bool) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=side_group())
        return bool(flag[0])
