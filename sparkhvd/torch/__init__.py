"""PyTorch on Spark: Spark's ``TorchDistributor`` as a drop-in (``from sparkhvd.torch import
TorchDistributor``), and helpers for ``HorovodRunner(backend="torch")`` -- ``setup()`` (process
group, DDP: ``ctx.wrap(model)``), rank-averaged metrics to the driver (``report``), rank-0 and
sharded checkpoints with exact resume, a folder whose files land in the run folder, TorchScript
model bytes. This face hands names on: :mod:`~sparkhvd.torch.training`,
:mod:`~sparkhvd.torch.checkpoints`, :mod:`~sparkhvd.torch.sharded_checkpoints` and
:mod:`~sparkhvd.torch.output` in the ranks; :mod:`~sparkhvd.torch.distributor` on the driver,
imported only when used, so a rank stays light.
"""
from typing import Any

from sparkhvd.torch.checkpoints import Checkpoints
from sparkhvd.torch.output import last_checkpoint, model_bytes, output_dir
from sparkhvd.torch.sharded_checkpoints import ShardedCheckpoints
from sparkhvd.torch.training import (
    Preempted,
    TorchContext,
    WorldSizeChange,
    report,
    setup,
    unwrap,
    world_size_change,
)

__side__ = "public"

__all__ = ["Checkpoints", "Preempted", "ShardedCheckpoints", "TorchContext", "TorchDistributor",
           "WorldSizeChange", "last_checkpoint", "model_bytes", "output_dir", "report", "setup",
           "unwrap", "world_size_change"]


def __getattr__(name: str) -> Any:
    if name == "TorchDistributor":
        from sparkhvd.torch.distributor import TorchDistributor

        return TorchDistributor
    raise AttributeError(f"module 'sparkhvd.torch' has no attribute {name!r}")
