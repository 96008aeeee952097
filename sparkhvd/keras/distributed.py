"""``KerasDistributed``: single-node Keras code to Horovod data-parallel in two calls."""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Optional, Sequence, Union

import tensorflow as tf

from .callbacks import (BroadcastInitialState, EpochProgress, LearningRateWarmup, MetricAverage,
                        RankZeroCheckpoint, latest_checkpoint, uses_schedule)

log = logging.getLogger(__name__)

from ..runner import RESUME_URL_ENV, RUN_URL_ENV


class KerasDistributed:
    """Seed 004's Horovod recipe for Keras, with callbacks that work on our TF versions.

    Creating it calls ``hvd.init()``. Then:

    - :meth:`optimizer` scales the learning rate by ``hvd.size()`` (``scale_lr=False`` to opt
      out) and wraps the optimizer in ``hvd.DistributedOptimizer``;
    - :meth:`fit_kwargs` returns ``callbacks``, ``initial_epoch``, ``epochs`` and ``verbose`` for
      ``model.fit``: rank 0's state broadcast to all ranks, metrics averaged over ranks,
      learning-rate warm-up, and on rank 0 only a progress line per epoch and a checkpoint per
      epoch (into the run folder's ``checkpoints/``); with ``resume`` it restores rank 0's latest
      checkpoint first and starts from its epoch.

    Args:
        epochs: total epochs of the training (also when resuming).
        batch_size: per-rank batch size, for samples/s in the progress line.
        warmup_epochs: epochs of learning-rate warm-up (0 = none), see ``warmup_lr``.
        scale_lr: multiply the optimizer's learning rate by the number of ranks.
        checkpoint: ``True`` (default: into the run folder when run by HorovodRunner), a folder
            URL, or ``False``.
        resume: ``True`` to resume from the checkpoints HorovodRunner(resume_from=...) points
            to (else this run's own), or a folder URL (a run folder or its ``checkpoints/``).
        storage_options: credentials for checkpoint URLs on remote storage (used by rank 0).
        hvd: the horovod Keras module (default ``horovod.tensorflow.keras``); the callbacks
            use ``horovod.tensorflow``'s collectives.
    """

    def __init__(self, *, epochs: int, batch_size: Optional[int] = None,
                 warmup_epochs: float = 0, scale_lr: bool = True,
                 checkpoint: Union[bool, str] = True, resume: Union[bool, str] = False,
                 average_metrics: bool = True, progress: bool = True,
                 storage_options: Optional[dict] = None, hvd: Any = None) -> None:
        if hvd is None:
            import horovod.tensorflow.keras as hvd
        hvd.init()
        self.hvd = hvd  # Keras parts: init, DistributedOptimizer
        import horovod.tensorflow as collectives

        self.collectives = collectives  # broadcast/allreduce/allgather of variables and objects
        self.rank, self.size = hvd.rank(), hvd.size()
        self.epochs = epochs
        self.batch_size = batch_size
        self.warmup_epochs = warmup_epochs
        self.scale_lr = scale_lr
        self.average_metrics = average_metrics
        self.progress = progress
        self.storage_options = storage_options
        run_url = os.environ.get(RUN_URL_ENV)
        if checkpoint is True:
            self.checkpoint_url = f"{run_url}/checkpoints" if run_url else None
        else:
            self.checkpoint_url = checkpoint or None
        if resume is True:
            resume = os.environ.get(RESUME_URL_ENV) or self.checkpoint_url or False
        self.resume_url = _checkpoints_folder(resume, storage_options) if resume else None
        self.initial_epoch = 0
        self.warmup: Optional[LearningRateWarmup] = None
        self.metric_average: Optional[MetricAverage] = None

    def optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` with its learning rate scaled by size, wrapped for Horovod."""
        if self.scale_lr and self.size > 1:
            lr = optimizer.learning_rate
            if uses_schedule(optimizer) or not hasattr(lr, "assign"):
                raise TypeError("scale_lr needs a plain float learning rate, not a schedule: "
                                "scale the schedule yourself and pass scale_lr=False.")
            lr.assign(float(lr.numpy()) * self.size)
        return self.hvd.DistributedOptimizer(optimizer)

    def restore(self, model: Any) -> int:
        """Load rank 0's latest checkpoint (if resuming) and return the epoch to start from."""
        epoch = 0
        if self.resume_url and self.rank == 0:
            found = latest_checkpoint(self.resume_url, self.storage_options)
            if found is None:
                print(f"resume: no checkpoint under {self.resume_url}; starting at epoch 1",
                      flush=True)
            else:
                epoch, url = found
                from .. import storage

                data = storage.read_bytes(url, self.storage_options)
                with tempfile.TemporaryDirectory(prefix="sparkhvd-resume-") as tmp:
                    path = os.path.join(tmp, "weights.h5")
                    with open(path, "wb") as f:
                        f.write(data)
                    model.load_weights(path)
                print(f"resume: restored {url}; continuing at epoch {epoch + 1}", flush=True)
        if self.resume_url:
            epoch = int(self.collectives.broadcast_object(epoch, root_rank=0))
        self.initial_epoch = epoch
        return epoch

    def callbacks(self, extra: Sequence[Any] = ()) -> list:
        """The callback list, in the order that makes the recipe correct."""
        cbs: list = [BroadcastInitialState(self.collectives)]
        if self.average_metrics:
            self.metric_average = MetricAverage(self.collectives)
            cbs.append(self.metric_average)
        if self.warmup_epochs:
            self.warmup = LearningRateWarmup(self.collectives, self.warmup_epochs)
            cbs.append(self.warmup)
        cbs.extend(extra)
        if self.rank == 0:
            if self.progress:
                gbs = self.batch_size * self.size if self.batch_size else None
                cbs.append(EpochProgress(self.epochs, gbs))
            if self.checkpoint_url:
                cbs.append(RankZeroCheckpoint(self.checkpoint_url,
                                              storage_options=self.storage_options))
        return cbs

    def fit_kwargs(self, model: Any, callbacks: Sequence[Any] = ()) -> dict:
        """Keyword arguments for ``model.fit``: restores a checkpoint first when resuming."""
        initial_epoch = self.restore(model)
        return {"callbacks": self.callbacks(callbacks), "initial_epoch": initial_epoch,
                "epochs": self.epochs, "verbose": 0}


def _checkpoints_folder(url: str, storage_options: Optional[dict]) -> str:
    """A run folder's ``checkpoints/`` if ``url`` is a run folder, else ``url`` itself."""
    from .. import storage

    url = str(url).rstrip("/")
    if storage.exists(f"{url}/checkpoints/latest.json", storage_options):
        return f"{url}/checkpoints"
    return url
