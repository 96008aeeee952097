"""``KerasDistributed``: single-node Keras code to Horovod data-parallel in two calls."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence, Union

from .. import protocol
from ..rank import emit
from ..runfiles import run_files
from . import checkpoints
from .callbacks import (BroadcastInitialState, EpochProgress, LearningRateWarmup, MetricAverage,
                        RankZeroCheckpoint, RunFolderTensorBoard, uses_schedule)

log = logging.getLogger(__name__)


class KerasDistributed:
    """Seed 004's Horovod recipe for Keras, with callbacks that work on our TF versions.

    Creating it calls ``hvd.init()``. Then:

    - :meth:`optimizer` scales the learning rate by ``hvd.size()`` (``scale_lr=False`` to opt
      out) and wraps the optimizer in ``hvd.DistributedOptimizer``;
    - :meth:`fit_kwargs` returns ``callbacks``, ``initial_epoch``, ``epochs`` and ``verbose`` for
      ``model.fit``: rank 0's state broadcast to all ranks, metrics averaged over ranks,
      learning-rate warm-up, and on rank 0 only a progress line per epoch and a checkpoint per
      epoch (model + optimizer state, into the run folder's ``checkpoints/``); when resuming it
      restores rank 0's latest checkpoint first and starts at the epoch after it.

    Args:
        epochs: total epochs of the training (also when resuming).
        batch_size: per-rank batch size, for samples/s in the progress line.
        warmup_epochs: epochs of learning-rate warm-up (0 = none), see ``warmup_lr``.
        scale_lr: multiply the optimizer's learning rate by the number of ranks.
        checkpoint: ``True`` (default: into the run folder, from any host), a folder URL, or
            ``False``.
        resume: ``None`` (default): resume exactly when ``HorovodRunner(resume_from=...)`` asked;
            ``True``: also from this run's own checkpoints; ``False``: never; or a folder URL (a
            run folder or its ``checkpoints/``). Rank 0 reports what it restored (or that it
            found nothing) to the driver.
        tensorboard: rank 0 writes TensorBoard event files into the run folder's
            ``tensorboard/`` (``tensorboard --logdir runs/`` then shows every run).
        storage_options: credentials for checkpoint/resume URLs on remote storage (rank 0).
        hvd: the horovod Keras module (default ``horovod.tensorflow.keras``); the callbacks
            use ``horovod.tensorflow``'s collectives.
    """

    def __init__(self, *, epochs: int, batch_size: Optional[int] = None,
                 warmup_epochs: float = 0, scale_lr: bool = True,
                 checkpoint: Union[bool, str] = True, resume: Union[None, bool, str] = None,
                 average_metrics: bool = True, progress: bool = True, tensorboard: bool = False,
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
        self.tensorboard = tensorboard
        self.storage_options = storage_options
        files = run_files()
        if checkpoint is True:
            self.checkpoint_store = checkpoints.RunFolderStore("run") if files.available \
                else None
        elif checkpoint:
            self.checkpoint_store = checkpoints.UrlStore(checkpoint, storage_options)
        else:
            self.checkpoint_store = None
        requested = os.environ.get(protocol.RESUME_URL_ENV)
        if resume is None:
            resume = bool(requested)
        if resume is True:
            self.resume_store = (checkpoints.RunFolderStore("resume", label=requested)
                                 if requested else self.checkpoint_store)
        elif resume:
            self.resume_store = checkpoints.url_store(str(resume), storage_options)
        else:
            self.resume_store = None
        self.initial_epoch = 0
        self.state: dict = {}
        self.warmup: Optional[LearningRateWarmup] = None
        self.metric_average: Optional[MetricAverage] = None

    @property
    def checkpoint_url(self) -> Optional[str]:
        """Where checkpoints go, for messages (None: no checkpoints)."""
        return self.checkpoint_store.describe() if self.checkpoint_store else None

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
        """Rank 0 loads the latest checkpoint (model, optimizer, state) when resuming; every
        rank learns the epoch to start from. Call after ``model.compile``."""
        epoch, state = 0, {}
        if self.resume_store is not None and getattr(model, "optimizer", None) is not None:
            # Every rank creates its optimizer variables now, the same way: rank 0 needs them to
            # restore into, and the variables' names must match across ranks for the broadcast
            # after the first step (Keras names them differently when it builds them lazily).
            checkpoints.build_optimizer(model.optimizer, model)
        if self.resume_store is not None and self.rank == 0:
            info = checkpoints.latest(self.resume_store)
            if info is None:
                print(f"resume: no checkpoint under {self.resume_store.describe()}; training "
                      "from scratch", flush=True)
                emit(protocol.Resumed(rank=0, source=None, epoch=0))
            else:
                problems = checkpoints.restore(self.resume_store, info, model)
                epoch, state = int(info["epoch"]), dict(info.get("state") or {})
                where = self.resume_store.describe(info["file"])
                for problem in problems:
                    print(f"resume: WARNING: {problem}", flush=True)
                print(f"resume: restored {where}; continuing at epoch {epoch + 1}", flush=True)
                emit(protocol.Resumed(rank=0, source=where, epoch=epoch))
        if self.resume_store is not None:
            epoch, state = self.collectives.broadcast_object((epoch, state), root_rank=0)
        self.initial_epoch, self.state = int(epoch), dict(state)
        return self.initial_epoch

    def _checkpoint_state(self) -> dict:
        return {"warmup_target_lr": self.warmup.target_lr if self.warmup else None}

    def callbacks(self, extra: Sequence[Any] = ()) -> list:
        """The callback list, in the order that makes the recipe correct."""
        cbs: list = [BroadcastInitialState(self.collectives)]
        if self.average_metrics:
            self.metric_average = MetricAverage(self.collectives)
            cbs.append(self.metric_average)
        if self.warmup_epochs:
            self.warmup = LearningRateWarmup(self.collectives, self.warmup_epochs,
                                             target_lr=self.state.get("warmup_target_lr"))
            cbs.append(self.warmup)
        cbs.extend(extra)
        if self.rank == 0:
            if self.progress:
                gbs = self.batch_size * self.size if self.batch_size else None
                cbs.append(EpochProgress(self.epochs, gbs))
            if self.checkpoint_store is not None:
                cbs.append(RankZeroCheckpoint(self.checkpoint_store,
                                              state=self._checkpoint_state))
            if self.tensorboard:
                cbs.append(RunFolderTensorBoard())
        return cbs

    def fit_kwargs(self, model: Any, callbacks: Sequence[Any] = ()) -> dict:
        """Keyword arguments for ``model.fit``: restores a checkpoint first when resuming."""
        initial_epoch = self.restore(model)
        return {"callbacks": self.callbacks(callbacks), "initial_epoch": initial_epoch,
                "epochs": self.epochs, "verbose": 0}
