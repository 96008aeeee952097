"""``KerasDistributed``: single-node Keras code to data-parallel in two calls -- on either backend.

The same training function runs on ``HorovodRunner(backend="horovod")`` (Horovod's Keras
recipe) and ``HorovodRunner(backend="tf")`` (``tf.distribute.MultiWorkerMirroredStrategy``)::

    kd = KerasDistributed(epochs=epochs, batch_size=64, warmup_epochs=2)
    with kd.scope():                       # the strategy's scope (nothing to do for Horovod)
        model = build_model()
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(1e-3)), loss=..., ...)
    model.fit(ds, steps_per_epoch=steps, **kd.fit_kwargs(model))

What differs lives in one *flavour* object each: how ranks start (``hvd.init()`` / the strategy
from ``TF_CONFIG``), how gradients are averaged (``DistributedOptimizer`` / the strategy), how
ranks agree on the starting state (a broadcast from rank 0 / every worker restores the same
checkpoint) and whether epoch metrics need averaging (Horovod: yes; the strategy: already
global).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional, Sequence, Union

from sparkhvd.checkpoint import nearest_copy
from sparkhvd.checkpoint.lineage import check_cadence
from sparkhvd.checkpoint.read import announce_resume, resume_store
from sparkhvd.common import protocol
from sparkhvd.elastic.notices import (  # noqa: F401 - public in sparkhvd.keras
    Preempted,
    WorldSizeChange,
    listen,
    take_back,
    world_size_change,
)
from sparkhvd.keras import checkpoints
from sparkhvd.keras.callbacks import (
    BroadcastInitialState,
    EpochProgress,
    LearningRateWarmup,
    MetricAverage,
    RankZeroCheckpoint,
    RunFolderTensorBoard,
    uses_schedule,
)
from sparkhvd.runfolder.rank_files import run_files

__side__ = "rank"

log = logging.getLogger(__name__)


class _HorovodFlavour:
    """Horovod: hvd.init(), DistributedOptimizer, broadcast from rank 0, averaged metrics."""

    name = "horovod"
    restore_everywhere = False
    #: every rank takes part in saving (tf.distribute may read variables collectively)
    save_everywhere = False

    def __init__(self, hvd: Any = None) -> None:
        if hvd is None:
            import horovod.tensorflow.keras

            hvd = horovod.tensorflow.keras
        hvd.init()
        self.hvd = hvd  # Keras parts: init, DistributedOptimizer
        import horovod.tensorflow as collectives

        self.collectives = collectives  # broadcast/allreduce/allgather of variables and objects
        self.rank, self.size = hvd.rank(), hvd.size()

    def scope(self) -> Any:
        return contextlib.nullcontext()

    def wrap(self, optimizer: Any) -> Any:
        return self.hvd.DistributedOptimizer(optimizer)

    def share(self, value: Any) -> Any:
        return self.collectives.broadcast_object(value, root_rank=0)

    def first_callbacks(self, average_metrics: bool) -> tuple[list, Optional[MetricAverage]]:
        average = MetricAverage(self.collectives) if average_metrics else None
        return [BroadcastInitialState(self.collectives)] + ([average] if average else []), average

    def world(self) -> Any:
        return self.collectives

    def copies(self) -> Any:
        """The collectives a host copy travels by to rank 0 (which loads it)."""
        from sparkhvd.keras.restore_collectives import HorovodCollectives

        return HorovodCollectives(self.collectives)

    def agree(self, by_time: bool, notice: bool, busy: bool) -> tuple[bool, bool, bool]:
        """Rank 0's clock, any rank's notice and rank 0's save in flight, on every rank (one
        small allreduce)."""
        import tensorflow as tf

        mine = self.rank == 0
        flags = tf.constant([int(by_time and mine), int(notice), int(busy and mine)], tf.int32)
        total = self.collectives.allreduce(flags, op=self.collectives.Sum).numpy()
        return bool(total[0]), bool(total[1]), bool(total[2])


class _World:
    """What the warm-up needs to know of the world: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _TFFlavour:
    """tf.distribute: a MultiWorkerMirroredStrategy from TF_CONFIG (RING on CPU, NCCL on GPU);
    gradients and epoch metrics are aggregated by the strategy; every worker restores."""

    name = "tf"
    restore_everywhere = True
    save_everywhere = True

    def __init__(self) -> None:
        from sparkhvd.keras.plain import multiworker_strategy

        self.strategy = multiworker_strategy()
        take_back()  # the strategy's runtime took SIGTERM over: notices are ours
        self._collectives: Any = None
        resolver = self.strategy.cluster_resolver
        self.rank = int(resolver.task_id or 0) if resolver is not None else 0
        self.size = int(self.strategy.num_replicas_in_sync)

    def scope(self) -> Any:
        return self.strategy.scope()

    def wrap(self, optimizer: Any) -> Any:
        return optimizer

    def share(self, value: Any) -> Any:
        return value

    def first_callbacks(self, average_metrics: bool) -> tuple[list, None]:
        return [], None

    def world(self) -> Any:
        return _World(self.size)

    def copies(self) -> Any:
        """The collectives a host copy travels by to every worker (each loads it), and the
        flags of :meth:`agree`."""
        if self._collectives is None:
            from sparkhvd.keras.restore_collectives import StrategyCollectives

            self._collectives = StrategyCollectives(self.strategy, self.rank)
        return self._collectives

    def agree(self, by_time: bool, notice: bool, busy: bool) -> tuple[bool, bool, bool]:
        """Rank 0's clock, any rank's notice and rank 0's save in flight, on every worker (one
        small all-reduce)."""
        mine = self.rank == 0
        total = self.copies().summed([int(by_time and mine), int(notice), int(busy and mine)])
        return bool(total[0] > 0), bool(total[1] > 0), bool(total[2] > 0)


class KerasDistributed:
    """The data-parallel recipe for Keras, with callbacks that work on our TF versions.

    Creating it starts the rank's side of the backend (``hvd.init()``, or the
    ``MultiWorkerMirroredStrategy`` -- create it first thing in the training function). Then:

    - :meth:`scope` -- build and compile the model inside it (the strategy's scope; a no-op on
      Horovod, so the same code serves both);
    - :meth:`optimizer` scales the learning rate by the number of ranks (``scale_lr=False`` to
      opt out) and, on Horovod, wraps it in ``hvd.DistributedOptimizer``;
    - :meth:`fit_kwargs` returns ``callbacks``, ``initial_epoch``, ``epochs`` and ``verbose`` for
      ``model.fit``: ranks start from the same state, metrics are global, the learning rate warms
      up, and rank 0 prints a progress line and writes a checkpoint (model + optimizer state)
      into the run folder every epoch; when resuming it restores the latest checkpoint first
      and starts at the epoch after it.

    Args:
        epochs: total epochs of the training (also when resuming).
        batch_size: per-rank batch size, for samples/s in the progress line.
        warmup_epochs: epochs of learning-rate warm-up (0 = none), see ``warmup_lr``.
        scale_lr: multiply the optimizer's learning rate by the number of ranks.
        checkpoint: ``True`` (default: into the run folder, from any host), a folder URL, or
            ``False``.
        resume: ``None`` (default): resume when ``HorovodRunner(resume_from=...)`` asked, and
            when the run relaunches (a retry or a resize) from its newest checkpoint -- in a
            checkpoint URL too; ``True``: also from this run's own checkpoints; ``False``:
            never; or a folder URL (a run folder or its ``checkpoints/``). Rank 0 reports what
            it restored (or that it found nothing) to the driver.
        tensorboard: rank 0 writes TensorBoard event files into the run folder's
            ``tensorboard/`` (``tensorboard --logdir runs/`` then shows every run).
        storage_options: credentials for checkpoint/resume URLs on remote storage (rank 0).
        backend: ``"horovod"`` or ``"tf"``; default: what ``HorovodRunner(backend=...)`` set.
        hvd: (Horovod) the horovod Keras module (default ``horovod.tensorflow.keras``).
        data: the ``DatasetShard`` whose ``tf_dataset`` feeds ``fit``: its position goes into
            every checkpoint, so a resumed run's data continues the global order where the
            checkpoint was taken -- in the middle of an epoch too, with any number of ranks
            (without it, epoch N of a resumed run reads epoch 0's order, and a mid-epoch
            checkpoint resumes at the start of its epoch). On ``backend="tf"`` with several
            workers its ``tf_dataset`` is then a distributed dataset of each worker's own
            batches (``distribute_datasets_from_function``): without it, the strategy takes a
            worker's batch for the global one and trains a ``1/np`` of it per step.
        every_steps: also a checkpoint every this many steps of an epoch.
        every_seconds: ... and/or when this many seconds passed since the last one.
        keep: keep only the newest this many checkpoints.
        async_save: a checkpoint holds training up only while the model and optimizer are
            serialised into memory; rank 0 writes them in the background (one save in flight:
            a step save due meanwhile is skipped and said once, an epoch's save waits for it, a
            notice writes its own to the end; the function's end waits for the last one). Off
            by default: with synchronous saves a checkpoint exists when its step ends.
        host_copy: where the checkpoints folder is not on rank 0's own disk, rank 0 also keeps
            the newest checkpoint on its host -- with its record, before writing it to the
            folder, so a relaunch restores it even when that write never ended -- and a
            relaunch restores from it: rank 0 back on that host reads it (the resume line says
            "its copy on this host"), else the rank now on that host sends it
            (:mod:`sparkhvd.checkpoint.nearest_copy`); on by default, deleted when the function
            returns (see :mod:`sparkhvd.checkpoint.host_copy`).

    In a sparkhvd run the checkpoints also *listen for notices*: SIGTERM to any rank (a node
    about to be reclaimed) or the driver resizing the run makes every rank save after its
    step and stop (the run relaunches from that checkpoint). With ``every_steps`` or
    ``every_seconds``, or in an elastic run, the ranks agree on it after every step (one small
    collective, :meth:`agree`); otherwise at the epoch's end.
    """

    def __init__(self, *, epochs: int, batch_size: Optional[int] = None,
                 warmup_epochs: float = 0, scale_lr: bool = True,
                 checkpoint: Union[bool, str] = True, resume: Union[None, bool, str] = None,
                 average_metrics: bool = True, progress: bool = True, tensorboard: bool = False,
                 storage_options: Optional[dict] = None, backend: Optional[str] = None,
                 hvd: Any = None, data: Any = None, every_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, keep: Optional[int] = None,
                 async_save: bool = False, host_copy: bool = True) -> None:
        backend = backend or os.environ.get(protocol.BACKEND_ENV) or "horovod"
        if backend not in ("horovod", "tf"):
            raise ValueError(f"backend must be 'horovod' or 'tf'; got {backend!r}")
        self.flavour: Any = _TFFlavour() if backend == "tf" else _HorovodFlavour(hvd)
        self.backend = backend
        self.hvd = getattr(self.flavour, "hvd", None)
        self.collectives = getattr(self.flavour, "collectives", None)
        self.strategy = getattr(self.flavour, "strategy", None)
        self.rank, self.size = self.flavour.rank, self.flavour.size
        self.epochs = epochs
        self.batch_size = batch_size
        self.warmup_epochs = warmup_epochs
        self.scale_lr = scale_lr
        self.average_metrics = average_metrics
        self.progress = progress
        if tensorboard:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:  # on every rank, before fit()
                raise ImportError(
                    "KerasDistributed(tensorboard=True) needs the tensorboard package, which "
                    "is not installed here (TensorFlow >= 2.20 no longer installs it). Fix: pip "
                    "install tensorboard (on the driver and the executors), or tensorboard=False.")
        self.tensorboard = tensorboard
        self.storage_options = storage_options
        self.data = data
        if self.strategy is not None and self.size > 1 and hasattr(data, "distribute_with"):
            data.distribute_with(self.strategy)  # its tf_dataset: a batch per replica, as is
        check_cadence(every_steps, every_seconds, keep)
        self.every_steps, self.every_seconds, self.keep = every_steps, every_seconds, keep
        self.async_save, self.host_copy = async_save, host_copy
        self.start: tuple[int, int] = (0, 0)
        files = run_files()
        self.checkpoint_store: Optional[checkpoints.CheckpointStore]
        if checkpoint is True:
            self.checkpoint_store = checkpoints.RunFolderStore("run") if files.available \
                else None
        elif checkpoint:
            self.checkpoint_store = checkpoints.UrlStore(checkpoint, storage_options)
        else:
            self.checkpoint_store = None
        self.resume_store = resume_store(resume, self.checkpoint_store, storage_options)
        if self.checkpoint_store is not None:
            listen()  # in a sparkhvd rank, a notice now becomes a checkpoint after the step
        self.initial_epoch = 0
        self.state: dict = {}
        self.warmup: Optional[LearningRateWarmup] = None
        self.metric_average: Optional[MetricAverage] = None

    def scope(self) -> Any:
        """Build and compile the model in this context (the strategy's scope on ``tf``)."""
        return self.flavour.scope()

    def optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` with its learning rate scaled by size (wrapped for Horovod there)."""
        if self.scale_lr and self.size > 1:
            lr = optimizer.learning_rate
            if uses_schedule(optimizer) or not hasattr(lr, "assign"):
                raise TypeError("scale_lr needs a plain float learning rate, not a schedule: "
                                "scale the schedule yourself and pass scale_lr=False.")
            lr.assign(float(lr.numpy()) * self.size)
        return self.flavour.wrap(optimizer)

    def restore(self, model: Any) -> int:
        """Load the latest checkpoint (model, optimizer, state) when resuming, and return the
        epoch to start from. On Horovod rank 0 loads and broadcasts; with the strategy every
        worker loads the same files; with ``host_copy`` every rank takes part (the files may
        come from any rank's host). Call after ``model.compile``."""
        epoch, state = 0, {}
        if self.resume_store is not None and getattr(model, "optimizer", None) is not None:
            # Every rank creates its optimizer variables now, the same way: they are restored
            # into, and their names must match across ranks (Keras names them otherwise when
            # it builds them lazily at the first step).
            with self.scope():
                checkpoints.build_optimizer(model.optimizer, model)
        loads = self.rank == 0 or self.flavour.restore_everywhere
        if self.resume_store is not None and (loads or self.host_copy):
            with self.scope():
                if self.host_copy:  # every rank: one may send the copy its host has
                    world = self.flavour.copies() if self.size > 1 else nearest_copy.Alone()
                    info, problems, copy = checkpoints.restore_nearest(
                        self.resume_store, model, self.rank, world,
                        None if self.flavour.restore_everywhere else {0})
                else:
                    (info, problems), copy = checkpoints.restore_latest(self.resume_store,
                                                                        model), "folder"
            if info is None:
                if self.rank == 0:
                    announce_resume(self.resume_store)
            else:
                epoch, state = int(info["epoch"]), dict(info.get("state") or {})
                step = int(info.get("step") or 0)
                state["step"] = step
                if self.rank == 0:
                    announce_resume(self.resume_store, info["file"], epoch, problems, step,
                                    copy, info.get("uploaded", True))
        if self.resume_store is not None:
            epoch, state = self.flavour.share((epoch, state))
        self.initial_epoch, self.state = int(epoch), dict(state)
        step = int(self.state.pop("step", 0) or 0)
        position = self.state.pop("data", None)
        samples = int(position.get("samples") or 0) if step and position else 0
        if self.data is not None and position:
            self.data.load_state_dict(position)  # as the data made it
        elif self.data is not None and self.initial_epoch:
            self.data.begin_at(self.initial_epoch)  # a checkpoint without the data's position
        if step and self.data is None:
            log.warning("sparkhvd: the checkpoint was taken after step %d of epoch %d; without "
                        "KerasDistributed(data=...) the run resumes at the start of that epoch "
                        "(those steps are trained again)", step, self.initial_epoch)
        self.start = (self.initial_epoch, samples if self.data is not None else 0)
        return self.initial_epoch

    def agree(self, by_time: bool, notice: bool, busy: Optional[bool] = None) -> tuple:
        """Whether to checkpoint now, the same on every rank: rank 0's clock decides
        ``by_time``, any rank's notice is everyone's -- and, when ``busy`` is given (async_save),
        whether rank 0's last save is still being written: then a 3-tuple."""
        agreed = self.flavour.agree(by_time, notice, bool(busy))
        return agreed if busy is not None else agreed[:2]

    def _checkpoint_state(self) -> dict:
        return {"warmup_target_lr": self.warmup.target_lr if self.warmup else None}

    def callbacks(self, extra: Sequence[Any] = ()) -> list:
        """The callback list, in the order that makes the recipe correct."""
        cbs, self.metric_average = self.flavour.first_callbacks(self.average_metrics)
        if self.warmup_epochs:
            self.warmup = LearningRateWarmup(self.flavour.world(), self.warmup_epochs,
                                             target_lr=self.state.get("warmup_target_lr"))
            cbs.append(self.warmup)
        cbs.extend(extra)
        if self.rank == 0 and self.progress:
            gbs = self.batch_size * self.size if self.batch_size else None
            cbs.append(EpochProgress(self.epochs, gbs))
        if self.checkpoint_store is not None:  # on every rank: they agree on when to save
            cbs.append(RankZeroCheckpoint(
                self.checkpoint_store, state=self._checkpoint_state, write=self.rank == 0,
                keep=self.keep, every_steps=self.every_steps, every_seconds=self.every_seconds,
                agree=self.agree if self.size > 1 else None, data=self.data, start=self.start,
                collective=self.flavour.save_everywhere,
                every_step_notices=bool(os.environ.get(protocol.ELASTIC_ENV)),
                async_save=self.async_save, host_copy=self.host_copy))
        if self.rank == 0 and self.tensorboard:
            cbs.append(RunFolderTensorBoard())
        return cbs

    def fit_kwargs(self, model: Any, callbacks: Sequence[Any] = ()) -> dict:
        """Keyword arguments for ``model.fit``: restores a checkpoint first when resuming."""
        initial_epoch = self.restore(model)
        return {"callbacks": self.callbacks(callbacks), "initial_epoch": initial_epoch,
                "epochs": self.epochs, "verbose": 0}
