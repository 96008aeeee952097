"""PyTorch helpers for ``HorovodRunner(backend="torch")``: process group, DDP, rank-averaged
metrics to the driver, rank-0 checkpoints with exact resume, TorchScript model bytes.

    import sparkhvd.torch as st

    def train(data, epochs):
        ctx = st.setup()
        model = ctx.wrap(Net())
        ...
        st.report(epoch, loss=float(loss))

(implementation: :mod:`sparkhvd.rank.torchdist`)
"""
from sparkhvd.rank.torchdist import (Checkpoints, TorchContext, model_bytes, report, setup,
                                     unwrap)

__all__ = ["Checkpoints", "TorchContext", "model_bytes", "report", "setup", "unwrap"]
