"""Restore PyTorch checkpoints from the nearest copy of the newest one, over the process
group: the framework's half of :mod:`sparkhvd.checkpoint.nearest_copy` (which decides what is
read from where). Rank 0 keeps its :class:`sparkhvd.torch.Checkpoints` file on its host, every
rank its shards of a :class:`sparkhvd.torch.ShardedCheckpoints` one; every rank loads the
state, and a copy some rank lacks is sent by the lowest rank that has it (on gloo, beside an
nccl group)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from sparkhvd.checkpoint import nearest_copy
from sparkhvd.checkpoint.file_pieces import Span, merged
from sparkhvd.checkpoint.stores import CheckpointStore
from sparkhvd.torch.side_group import side_group

__side__ = "rank"

#: Bytes per broadcast when a host copy is sent to the ranks that lack it.
CHUNK = 256 << 20


def load_nearest_copy(store: CheckpointStore, load: Callable[[dict, dict[str, Any]], Any],
                      rank: int, needs: Optional[nearest_copy.Needs] = None
                      ) -> tuple[Optional[dict], Any, list[str], str]:
    """``(record, load's value, problems, copy)``: the newest checkpoint in ``store``, read from
    the nearest copy -- ``copy`` is ``"host"``, ``"peer"`` or ``"folder"``. Call on every rank
    (a collective when there are several; ``load`` may be one too: every rank calls it with
    the same record, or none does), with what ``needs`` says it reads (default: every file).
    ``load`` gets this host's copies as views of the files mapped into memory
    (:func:`sparkhvd.torch.serialise.load_state` and DCP's reader read them in place)."""
    import torch.distributed as dist

    world: nearest_copy.Collectives = TorchCollectives() \
        if dist.is_initialized() and dist.get_world_size() > 1 else nearest_copy.Alone()
    return nearest_copy.load_nearest(store, load, rank, world, needs=needs, mapped=True)


class DcpNeeds:
    """What of a DCP checkpoint this rank's load reads (:class:`nearest_copy.Needs`): its
    ``.metadata`` whole, then the byte ranges of the items that DCP's default load plan for
    :attr:`state` names -- under FSDP its own shards and the few replicated items DCP wrote into
    other ranks' files, not those files whole."""

    def __init__(self, state: Callable[[], dict]) -> None:
        self._build = state
        self._state: Optional[dict] = None

    @property
    def state(self) -> dict:
        """The state dict DCP plans the load from and the load fills: built once, and only
        when there is a checkpoint to load (building an optimizer's with
        ``get_state_dict`` gives a fresh optimizer its state)."""
        if self._state is None:
            self._state = self._build()
        return self._state

    def index(self, record: dict) -> set[str]:
        return {f"{record['file']}/.metadata"}

    def spans(self, record: dict, index: dict[str, bytes]
              ) -> dict[str, Optional[list[Span]]]:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        from sparkhvd.torch.serialise import reader_of

        metadata = reader_of(index, record["file"]).read_metadata()
        planner = DefaultLoadPlanner()
        planner.set_up_planner(self.state, metadata, is_coordinator=False)
        wanted: dict[str, list[Span]] = {}
        for item in planner.create_local_plan().items:
            stored = metadata.storage_data[item.storage_index]
            wanted.setdefault(f"{record['file']}/{stored.relative_path}", []).append(
                (int(stored.offset), int(stored.length)))
        return {name: merged(spans) for name, spans in wanted.items()}


class TorchCollectives:
    """:class:`sparkhvd.checkpoint.nearest_copy.Collectives` on the helpers' gloo group."""

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
