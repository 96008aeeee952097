"""Keras callbacks for Horovod training that work on TF 2.15 and tf-keras 2.18.

Horovod's own metric-average and learning-rate callbacks crash on some of the versions we can
build, so these are ours (built on ``hvd.allreduce``/``hvd.broadcast_variables``, which work).
Each callback takes the module whose collectives it uses (``horovod.tensorflow``), so they can be
unit-tested with a fake.
"""
from __future__ import annotations

import atexit
import logging
import time
from typing import Any, Callable, Optional, Union

import tensorflow as tf

from sparkhvd.checkpoint import host_copy as host_copies
from sparkhvd.checkpoint.background import BackgroundSave, SavesInBackground, UploadQueue
from sparkhvd.common import protocol
from sparkhvd.common.events import emit
from sparkhvd.common.function_end import at_function_end, at_function_return, held_weakly
from sparkhvd.keras import checkpoints

__side__ = "rank"

log = logging.getLogger(__name__)


def uses_schedule(optimizer: Any) -> bool:
    """Whether the optimizer's learning rate is a schedule (which overwrites any assignment)."""
    schedule_type = tf.keras.optimizers.schedules.LearningRateSchedule
    raw = getattr(optimizer, "_learning_rate", None)
    return isinstance(raw, schedule_type) or isinstance(optimizer.learning_rate, schedule_type)


def _set_lr(optimizer: Any, value: float) -> None:
    lr = optimizer.learning_rate
    if uses_schedule(optimizer) or not hasattr(lr, "assign"):
        raise TypeError("Learning-rate warm-up needs a plain float learning rate, not a "
                        f"{type(lr).__name__} schedule: set warmup_epochs=0, or fold the warm-up "
                        "into your schedule.")
    lr.assign(value)


def _get_lr(optimizer: Any) -> float:
    lr = optimizer.learning_rate
    return float(lr.numpy() if hasattr(lr, "numpy") else lr)


class BroadcastInitialState(tf.keras.callbacks.Callback):
    """Make every rank start from rank 0's state.

    Model variables are broadcast when training begins (so a checkpoint restored on rank 0 is
    what every rank's first step uses); optimizer variables, which Keras creates lazily at the
    first step, are broadcast after the first batch.
    """

    def __init__(self, hvd: Any, root_rank: int = 0) -> None:
        super().__init__()
        self.hvd = hvd
        self.root_rank = root_rank
        self._done = False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.model.built and self.model.variables:
            self.hvd.broadcast_variables(self.model.variables, root_rank=self.root_rank)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._done:
            return
        self.hvd.broadcast_variables(self.model.variables, root_rank=self.root_rank)
        opt_vars = self.model.optimizer.variables
        opt_vars = opt_vars() if callable(opt_vars) else opt_vars
        if opt_vars:
            self.hvd.broadcast_variables(opt_vars, root_rank=self.root_rank)
        self._done = True


class MetricAverage(tf.keras.callbacks.Callback):
    """Average every epoch metric over the ranks, in place, so all ranks report the same values.

    Only metrics every rank has are averaged (a metric only rank 0 computes is left as it is).
    Put it before any callback that logs or checkpoints on a metric.
    """

    def __init__(self, hvd: Any) -> None:
        super().__init__()
        self.hvd = hvd
        self._common: Optional[list[str]] = None
        self.history: list[dict[str, float]] = []

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is None:
            return
        if self._common is None:
            keys = sorted(k for k, v in logs.items() if _is_number(v))
            all_keys = self.hvd.allgather_object(keys)
            self._common = sorted(set.intersection(*map(set, all_keys)))
        if self._common:
            values = tf.constant([float(logs[k]) for k in self._common], dtype=tf.float64)
            averaged = self.hvd.allreduce(values, op=self.hvd.Average,
                                          name="sparkhvd.metric_average")
            for key, value in zip(self._common, averaged.numpy().tolist()):
                logs[key] = value
        self.history.append({k: float(v) for k, v in logs.items() if _is_number(v)})


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def warmup_lr(step: int, warmup_steps: int, target_lr: float, size: int) -> float:
    """The documented warm-up schedule (Goyal et al., as in horovod's recipe).

    The learning rate rises linearly from ``target_lr / size`` (the single-worker rate) at step 0
    to ``target_lr`` (already scaled by ``size``) at ``warmup_steps``, and stays there:
    ``lr(step) = target_lr * (1/size + (1 - 1/size) * min(1, step / warmup_steps))``.
    """
    if warmup_steps <= 0:
        return target_lr
    progress = min(1.0, step / warmup_steps)
    return target_lr * (1.0 / size + (1.0 - 1.0 / size) * progress)


class LearningRateWarmup(tf.keras.callbacks.Callback):
    """Ramp the learning rate over the first ``warmup_epochs`` epochs (see :func:`warmup_lr`).

    ``recorded`` keeps ``(epoch, batch, lr)`` for every step of the warm-up and the first step
    after it.
    """

    def __init__(self, hvd: Any, warmup_epochs: float, steps_per_epoch: Optional[int] = None,
                 target_lr: Optional[float] = None) -> None:
        super().__init__()
        self.hvd = hvd
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.target_lr = target_lr
        self.recorded: list[tuple[int, int, float]] = []
        self._epoch = 0

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if uses_schedule(self.model.optimizer):
            _set_lr(self.model.optimizer, 0.0)  # raises the explanatory TypeError
        if self.target_lr is None:
            self.target_lr = _get_lr(self.model.optimizer)
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ValueError("Learning-rate warm-up needs the number of steps per epoch: pass "
                             "steps_per_epoch to model.fit (or to the warm-up).")

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        assert self.steps_per_epoch and self.target_lr is not None  # on_train_begin saw to it
        warmup_steps = int(round(self.warmup_epochs * self.steps_per_epoch))
        step = self._epoch * self.steps_per_epoch + batch
        if step > warmup_steps:
            return
        lr = warmup_lr(step, warmup_steps, self.target_lr, self.hvd.size())
        _set_lr(self.model.optimizer, lr)
        self.recorded.append((self._epoch, batch, lr))


class EpochProgress(tf.keras.callbacks.Callback):
    """Rank 0 prints one line per epoch: epoch/total, (averaged) metrics, samples/s and ETA.

    It also sends the metrics to the driver (a :class:`~sparkhvd.common.protocol.Metrics` event), which
    turns them into ``metrics.csv`` and ``curves.png`` in the run folder.
    """

    def __init__(self, epochs: int, global_batch_size: Optional[int] = None) -> None:
        super().__init__()
        self.epochs = epochs
        self.global_batch_size = global_batch_size
        self._start = 0.0
        self._first_epoch: Optional[int] = None
        self._train_start = 0.0

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._train_start = time.monotonic()

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._start = time.monotonic()
        if self._first_epoch is None:
            self._first_epoch = epoch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        logs = logs or {}
        elapsed = max(time.monotonic() - self._start, 1e-9)
        done = epoch + 1 - (self._first_epoch or 0)
        per_epoch = (time.monotonic() - self._train_start) / max(done, 1)
        eta = per_epoch * (self.epochs - epoch - 1)
        steps = (self.params or {}).get("steps") or 0
        parts = [f"epoch {epoch + 1}/{self.epochs}"]
        # loss first, as Keras 2 orders them (Keras 3 sorts its logs by name)
        names = sorted((k for k, v in logs.items() if _is_number(v)), key=lambda k: k != "loss")
        parts += [f"{k} {float(logs[k]):.4f}" for k in names]
        if self.global_batch_size and steps:
            parts.append(f"{steps * self.global_batch_size / elapsed:,.0f} samples/s")
        elif steps:
            parts.append(f"{steps / elapsed:,.1f} steps/s")
        parts.append(f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
        print(" - ".join(parts), flush=True)
        record = {"epoch": epoch + 1, "seconds": round(elapsed, 3)}
        if self.global_batch_size and steps:  # the report's throughput over time
            record["samples_per_s"] = round(steps * self.global_batch_size / elapsed, 1)
        record.update({k: float(v) for k, v in logs.items() if _is_number(v)})
        emit(protocol.Metrics(rank=0, record=record))


class RankZeroCheckpoint(tf.keras.callbacks.Callback, SavesInBackground):
    """Rank 0 saves a checkpoint every ``every`` epochs -- and, with ``every_steps`` or
    ``every_seconds``, in the middle of epochs -- the model, the optimizer state and the
    training state, atomically (see :mod:`sparkhvd.keras.checkpoints`); after a *notice*
    (SIGTERM: a node about to go, or the driver resizing the run) it saves after the step and
    every rank stops (:class:`~sparkhvd.elastic.notices.Preempted`).

    Checkpoints are named by the *data's* position: ``epoch-000N`` after N epochs,
    ``epoch-000N-step-000000K`` after step K of the next. A run resumed in the middle of an
    epoch (``start``) reads the rest of that epoch first, so its Keras epochs end K steps into
    the data's; its last epoch stops K steps early, where the data's last epoch ends.

    Args:
        url: a :class:`~sparkhvd.keras.checkpoints.CheckpointStore`, or a folder URL.
        every: save after every ``every`` epochs.
        storage_options: credentials for a URL on remote storage.
        keep: keep only the newest ``keep`` checkpoints.
        state: called at each save; returns extra state to continue exactly (learning rate,
            warm-up target...).
        write: whether this rank writes; with tf.distribute every worker takes part in saving
            (reading some variables is a collective) and only rank 0 writes.
        every_steps: a mid-epoch checkpoint every this many steps of an epoch.
        every_seconds: ... and/or when this many seconds passed since the last save (rank 0's
            clock decides).
        agree: ``(by_time, noticed) -> (by_time, noticed)`` the same on every rank (a small
            collective after each step; with ``async_save``, ``(by_time, noticed, busy)`` in
            and out); None: this rank alone decides.
        data: the ``DatasetShard`` whose ``tf_dataset`` feeds ``fit``: its position goes into
            each checkpoint, counted from the steps trained (a prefetching pipeline runs ahead).
        start: ``(epoch, samples)`` of the data where this fit starts (a restored
            checkpoint's: rows of that epoch all ranks consumed).
        collective: every rank takes part in saving (tf.distribute reads some variables
            collectively); else only the writing rank serialises the model.
        every_step_notices: look for a notice after every step (an elastic run), not only at
            the steps that may checkpoint. The ranks agree on it in one small collective per
            step, so it is on only with ``every_steps``/``every_seconds`` or an elastic run;
            otherwise a notice is taken at the epoch's end.
        async_save: the step waits only while the model and optimizer are serialised into
            memory; the writing rank writes the files, the record and ``latest.json`` on a
            background thread. One save in flight: a step save due meanwhile is skipped (said
            once; ``agree`` then takes and returns a third flag, the writer's ``busy``), an
            epoch's save waits for it, a notice writes its own to the end. A failed write is
            raised at the next step or when the function ends (which waits for the last one).
            With ``host_copy``, a save ends once its files are kept on the host; their write
            to the folder is queued behind the saves (a step checkpoint superseded before its
            write began stays on the host only, said once), so a slow folder delays the
            folder's copy, not the next save.
        host_copy: where the folder is not on the writing rank's own disk (``abfss://``, a
            run folder on the driver's host), that rank also keeps the newest checkpoint's
            files on its host with their record, before writing them to the folder, for a
            relaunched rank there to restore from -- even when that write never ended
            (:mod:`sparkhvd.checkpoint.host_copy`); deleted when the function returns.
    """

    def __init__(self, url: Union[str, checkpoints.CheckpointStore], every: int = 1,
                 storage_options: Optional[dict] = None, keep: Optional[int] = None,
                 state: Optional[Callable[[], dict]] = None, write: bool = True,
                 every_steps: Optional[int] = None, every_seconds: Optional[float] = None,
                 agree: Optional[Callable[..., tuple]] = None,
                 data: Any = None, start: tuple[int, int] = (0, 0),
                 collective: bool = False, every_step_notices: bool = False,
                 async_save: bool = False, host_copy: bool = True) -> None:
        super().__init__()
        self.store = url if isinstance(url, checkpoints.CheckpointStore) else \
            checkpoints.UrlStore(url, storage_options)
        if write and isinstance(self.store, checkpoints.UrlStore):
            self.store.remove_torn()
        self.every = max(1, every)
        self.keep = keep
        self.state = state
        self.write = write
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.agree, self.data, self.start = agree, data, start
        self.collective = collective
        self.every_step_notices = every_step_notices
        self.saved: list[str] = []
        self._epoch = start[0]
        self._trained = 0  # steps since this fit began
        self._in_epoch = 0  # steps of the current Keras epoch
        self._last_save = time.monotonic()
        self._stop_at_epoch_end = False  # a notice at an epoch's last step
        self.async_save = async_save
        self.host_copy = host_copy and write and not self.store.on_this_host
        if host_copy and not self.store.on_this_host:  # every rank: its host may have a copy
            at_function_return(host_copies.clean)  # from an earlier attempt; the run is done
        self._background: Optional[BackgroundSave] = None
        if async_save and write:
            self._background = BackgroundSave()
            if self.host_copy:
                self._uploads = UploadQueue()  # kept on this host first, uploaded behind
            # the rank is done when its last save is (held weakly: a dropped callback's
            # files in memory go with it)
            at_function_end(held_weakly(self._finish_save))
            atexit.register(held_weakly(self._finish_quietly))

    def position(self) -> tuple[int, int, int]:
        """``(epoch, samples, step)`` of the data now: epochs done, then rows of the next one
        consumed by all ranks and steps into it (counted on from the step the epoch resumed
        at, whatever the number of ranks then: checkpoint names must only grow). The data
        makes it from the steps trained (``DatasetShard.position_after``: ``data``'s own
        position runs ahead of the model by what the input pipeline prefetched)."""
        now = self._data_position()
        if now is None:
            return self._epoch, 0, self._in_epoch
        return now.epoch, now.samples, now.step

    def _data_position(self) -> Any:
        """The data's position after the steps trained (None: no data, or none read yet)."""
        position_after = getattr(self.data, "position_after", None)
        return position_after(self._trained) if position_after is not None else None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._epoch, self._in_epoch = epoch, 0

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        from sparkhvd.elastic.notices import noticed, stop

        self._raise_failed_save()
        self._trained += 1
        self._in_epoch += 1
        epoch, _, step = self.position()
        epochs = (self.params or {}).get("epochs")
        if self.start[1] and epochs and (epoch, step) == (epochs, 0):
            self.model.stop_training = True  # the data's last epoch ends here
        if not (self.every_steps or self.every_seconds or self.every_step_notices):
            return  # notices are taken at the epoch's end
        by_steps = bool(self.every_steps and step and step % self.every_steps == 0)
        by_time = bool(self.every_seconds and
                       time.monotonic() - self._last_save >= self.every_seconds)
        by_time, notice, busy = self._agree(by_time, noticed() is not None)
        if not (by_steps or by_time or notice) or not step:
            # a notice at the epoch's last step: the epoch's own checkpoint, then stop
            self._stop_at_epoch_end = self._stop_at_epoch_end or notice
            return
        if busy and not notice:  # async_save: due while the last one is still being written
            self._skip(checkpoints.checkpoint_name(epoch, step))
            return
        name = self._save(epoch, step, to_the_end=notice)
        if notice:
            raise stop(name)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        from sparkhvd.elastic.notices import noticed, stop

        self._raise_failed_save()
        data_epoch, _, step = self.position() if self.data is not None else (epoch + 1, 0, 0)
        stopping = self._stop_at_epoch_end
        if not stopping and self.agree is not None and not (
                self.every_steps or self.every_seconds or self.every_step_notices):
            _, stopping, _ = self._agree(False, noticed() is not None)  # once an epoch
        elif not stopping:
            stopping = self.agree is None and noticed() is not None
        if (epoch + 1) % self.every and not stopping:
            return
        name = self._save(data_epoch, step, to_the_end=stopping)
        if stopping:
            raise stop(name)

    def _agree(self, by_time: bool, notice: bool) -> tuple[bool, bool, bool]:
        """``(by_time, notice, busy)`` the same on every rank (``agree``); ``busy``: the writer's
        save is still being written (async_save)."""
        busy = self._writing()
        if self.agree is None:
            return by_time, notice, busy
        if self.async_save:
            by_time, notice, busy = self.agree(by_time, notice, busy)
            return by_time, notice, busy
        by_time, notice = self.agree(by_time, notice)
        return by_time, notice, False

    def _save(self, epoch: int, step: int, to_the_end: bool = False) -> str:
        taken = time.monotonic()  # the every_seconds clock counts from the state's moment
        state = dict(self.state() if self.state else {})
        lr = getattr(self.model.optimizer, "learning_rate", None)
        if lr is not None and hasattr(lr, "numpy") and "lr" not in state:
            state["lr"] = float(lr.numpy())
        position = self._data_position()
        if position is not None:  # as the data made it, stored as it is
            state["data"] = position.as_dict()
        name = checkpoints.checkpoint_name(epoch, step)
        if self._background is not None:  # the writer, async_save
            self._background.wait()  # one in flight
            self._wait_for_first_upload()  # the folder's first: what a relaunch finds
            name, files, info = checkpoints.serialise(self.model, epoch, state, step)
            self._background.start(name, lambda: self._write(epoch, step, files, info))
            if to_the_end:
                self._finish_save()  # in the folder too before the ranks stop
        elif self.write:
            name, files, info = checkpoints.serialise(self.model, epoch, state, step)
            self._write(epoch, step, files, info)
        elif self.collective:  # tf.distribute reads some variables collectively: every rank
            name = checkpoints.serialise(self.model, epoch, state, step)[0]
        self._last_save = taken
        if self.write:
            self.saved.append(name)
        return name

    def _write(self, epoch: int, step: int, files: dict, info: dict) -> None:
        """With ``host_copy``, this host's copy of the files *with their record* first -- a
        relaunch restores it even when the write below never ends or fails
        (:mod:`sparkhvd.checkpoint.host_copy`); then the files, their record and
        ``latest.json`` in the folder -- at once, or (``async_save``) queued behind the saves,
        a step checkpoint superseded by a newer one before its upload began staying on this
        host only (:class:`~sparkhvd.checkpoint.background.UploadQueue`); then the newest
        ``keep`` are kept."""
        from sparkhvd.checkpoint.lineage import record_of
        from sparkhvd.checkpoint.write import digest

        digests = {name: digest(data) for name, data in files.items()}
        if self.host_copy:
            host_copies.keep({name: (data, digests[name]["sha256"])
                              for name, data in files.items()},
                             record_of(epoch, digests, info, step), self.store.key)

        def upload() -> None:
            self._upload(epoch, step, files, info, digests)

        if self._uploads is None:
            upload()
        else:  # its files leave memory with it when superseded
            self._uploads.put(info["file"], upload, lambda: None, supersedable=bool(step))

    def _upload(self, epoch: int, step: int, files: dict, info: dict, digests: dict) -> None:
        from sparkhvd.checkpoint.write import prune, write_checkpoint

        write_checkpoint(self.store, epoch, files, info, step, digests)
        if self.keep:
            prune(self.store, self.keep)


def latest_checkpoint(url: str, storage_options: Optional[dict] = None) -> Optional[tuple[int, str]]:
    """``(epoch, checkpoint url)`` of the newest checkpoint under ``url``, or ``None``."""
    store = checkpoints.UrlStore(url, storage_options)
    info = checkpoints.latest(store)
    if info is None:
        return None
    return int(info["epoch"]), f"{store.url}/{info['file']}"


class RunFolderTensorBoard(tf.keras.callbacks.TensorBoard):
    """Keras' TensorBoard callback writing into the run folder's ``tensorboard/`` (rank 0).

    On the driver's machine the event files are written there directly; from another host they
    are written locally and copied into the run folder (through the driver) after every epoch
    and at the end, so ``tensorboard --logdir runs/`` shows every run wherever rank 0 ran.
    """

    def __init__(self, **kwargs: Any) -> None:
        import os
        import tempfile

        from sparkhvd.runfolder.rank_files import run_files

        self.files = run_files()
        if not self.files.available:
            raise RuntimeError("tensorboard=True needs a run folder: run the function with "
                               "sparkhvd.HorovodRunner, or use tf.keras.callbacks.TensorBoard.")
        self._tmp = None if self.files.local else tempfile.mkdtemp(prefix="sparkhvd-tb-")
        log_dir = os.path.join(self.files.local, "tensorboard") if self.files.local else self._tmp
        super().__init__(log_dir=log_dir, **kwargs)
        self._sizes: dict[str, int] = {}

    def _sync(self) -> None:
        import os

        if self._tmp is None:
            return
        for folder, _, names in os.walk(self._tmp):
            for name in names:
                path = os.path.join(folder, name)
                size = os.path.getsize(path)
                if self._sizes.get(path) != size:
                    rel = os.path.relpath(path, self._tmp).replace(os.sep, "/")
                    self.files.write_file(f"tensorboard/{rel}", path)
                    self._sizes[path] = size

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        self._sync()

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        super().on_train_end(logs)
        self._sync()
