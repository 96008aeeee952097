"""PyTorch on Spark: Spark's ``TorchDistributor`` as a drop-in, and helpers for
``HorovodRunner(backend="torch")`` -- process group, DDP, rank-averaged metrics to the driver,
rank-0 and sharded (``torch.distributed.checkpoint``) checkpoints with exact resume, a folder
whose files land in the run folder, TorchScript model bytes.

    from sparkhvd.torch import TorchDistributor        # instead of pyspark.ml.torch.distributor
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 1e-3)

    import sparkhvd.torch as st

    def train(data, epochs):
        ctx = st.setup()
        model = ctx.wrap(Net())
        ...
        st.report(epoch, loss=float(loss))

(implementation: :mod:`sparkhvd.torch.training`, :mod:`~sparkhvd.torch.checkpoints`,
:mod:`~sparkhvd.torch.sharded_checkpoints` and :mod:`~sparkhvd.torch.output` in the ranks,
:mod:`sparkhvd.torch.distributor` on the driver -- imported only when used, so a rank stays
light)
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
