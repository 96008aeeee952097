"""PyTorch helpers for ``HorovodRunner(backend="torch")`` -- public as :mod:`sparkhvd.torch`.

The backend gives each rank torchrun's variables, so plain ``torch.distributed`` code needs none
of this. These helpers add what sparkhvd gives Keras users::

    import sparkhvd.torch as st

    def train(data, epochs, lr):
        import torch
        ctx = st.setup()                                  # init_process_group: gloo / nccl
        model = ctx.wrap(Net())                           # DistributedDataParallel on its device
        opt = torch.optim.SGD(model.parameters(), lr=ctx.scale_lr(lr))
        ckpt = st.Checkpoints(model, opt)                 # rank 0 -> the run folder's checkpoints/
        for epoch in range(ckpt.restore(), epochs):      # resume_from=True continues exactly
            for x, y in data.torch_batches(64, epoch, shuffle=True, seed=1):
                ...
            st.report(epoch, loss=float(loss))            # rank-averaged; progress, metrics.csv, MLflow
            ckpt.save(epoch)
        return st.model_bytes(model) if ctx.rank == 0 else None   # TorchScript: the run's model

This module is the setup (the process group, the device, DDP) and the metrics; the checkpoints
are :mod:`sparkhvd.torch.checkpoints` (rank 0's) and :mod:`sparkhvd.torch.sharded_checkpoints`
(every rank's shards, DCP); a library's own files and the model's bytes
:mod:`sparkhvd.torch.output`. Nothing here imports TensorFlow or horovod.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from sparkhvd.common import protocol
from sparkhvd.common.events import emit
from sparkhvd.common.identity import current_rank
from sparkhvd.elastic.notices import Preempted, WorldSizeChange
from sparkhvd.elastic.notices import world_size_change as _world_size_change

__side__ = "rank"


@dataclass
class TorchContext:
    """This rank in the process group :func:`setup` joined."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    #: ``cuda:N`` (the GPU this rank was pinned to) or ``cpu``.
    device: Any
    #: The process group's backend: ``gloo`` or ``nccl`` (``None``: a single process).
    backend: Optional[str]

    def wrap(self, model: Any, **ddp_kwargs: Any) -> Any:
        """``model`` on this rank's device, in ``DistributedDataParallel`` when there are
        several ranks (gradients are averaged in ``backward()``)."""
        import torch

        model = model.to(self.device)
        if self.backend is None:
            return model
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)

    def scale_lr(self, lr: float) -> float:
        """``lr`` scaled by the number of ranks (the usual rule for data-parallel SGD)."""
        return lr * self.world_size


def setup(backend: Optional[str] = None, timeout_s: float = 1800.0) -> TorchContext:
    """Join the run's process group (``env://``, from the variables every rank got), once.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default ``nccl`` when this rank has a GPU, else
            ``gloo``.
        timeout_s: how long collectives may wait for the slowest rank.
    """
    import datetime

    import torch
    import torch.distributed as dist

    me = current_rank()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if me.size > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"),
                                timeout=datetime.timedelta(seconds=timeout_s))
    used = dist.get_backend() if dist.is_initialized() else None
    return TorchContext(me.rank, me.size, me.local_rank, me.local_size, device, used)


def unwrap(model: Any) -> Any:
    """The module inside ``DistributedDataParallel`` (or ``model`` itself)."""
    return getattr(model, "module", model)


def _average(values: dict[str, float]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()
    return dict(zip(values, tensor.tolist()))


_last_report: dict = {"time": None}


def report(epoch: int, *, epochs: Optional[int] = None, **metrics: float) -> dict[str, float]:
    """End of epoch ``epoch`` (0-based): average ``metrics`` over the ranks (a collective: call it
    on every rank) and send them to the driver from rank 0 -- the progress line
    (``[rank 0] epoch 3/10 - loss 0.4321 - ...``, as for Keras), ``metrics.csv``/``curves.png``
    and MLflow. ``epochs``: the total, for the line. Returns the averages."""
    averaged = _average({k: float(v) for k, v in metrics.items()})
    now = time.monotonic()
    elapsed = now - _last_report["time"] if _last_report["time"] is not None else None
    _last_report["time"] = now
    if current_rank().rank == 0:
        names = sorted(averaged, key=lambda k: k != "loss")  # loss first, as Keras shows it
        parts = [f"epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")]
        parts += [f"{k} {averaged[k]:.4f}" for k in names]
        if elapsed:
            parts.append(f"{elapsed:.2f} s")
        print(" - ".join(parts), flush=True)
        record = {"epoch": epoch + 1, **averaged}
        if elapsed:
            record["seconds"] = round(elapsed, 3)
        emit(protocol.Metrics(rank=0, record=record))
    return averaged


def world_size_change() -> WorldSizeChange:
    """``(before, now)``: the world size of the attempt before this one and of this one, after
    an elastic run resized (equal otherwise). The usual rules, for data-parallel SGD::

        change = st.world_size_change()
        lr = base_lr * ctx.world_size            # per-sample rule: re-derived from the size
        per_rank_batch = global_batch // ctx.world_size   # or: keep the global batch

    ``change.factor`` (now / before) rescales a value computed for the old size.
    """
    return _world_size_change()



__all__ = ["TorchContext", "setup", "unwrap", "report", "world_size_change", "WorldSizeChange",
           "Preempted"]
