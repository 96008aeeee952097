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

Nothing here imports TensorFlow or horovod.
"""
from __future__ import annotations

import atexit
import io
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sparkhvd.common import protocol
from sparkhvd.common.events import emit
from sparkhvd.common.function_end import at_function_end, at_function_return, held_weakly
from sparkhvd.common.identity import current_rank
from sparkhvd.elastic.notices import Preempted, WorldSizeChange, listen, noticed, stop
from sparkhvd.elastic.notices import world_size_change as _world_size_change
from sparkhvd.runfolder import host_copy
from sparkhvd.runfolder.background_save import SavesInBackground, UploadQueue
from sparkhvd.runfolder.checkpoint_store import (
    CHECK_BLOCK,
    DISCARD,
    CheckpointStore,
    RunFolderStore,
    UrlStore,
    announce_resume,
    check_cadence,
    checkpoint_name,
    commit_checkpoint,
    digest_file,
    not_written,
    prune,
    record_of,
    restore_newest,
    resume_store,
    serialise_into,
    spool_folder,
    upload_checkpoint,
    write_checkpoint_streamed,
)
from sparkhvd.torch.async_save import BackgroundSave, HostSnapshot, ShardedStaging
from sparkhvd.torch.nearest_copy import DcpNeeds, restore_nearest
from sparkhvd.torch.serialise import load_state, reader_of, save_state
from sparkhvd.torch.side_group import side_group
from sparkhvd.torch.snapshot_ring import SLOTS, SnapshotRing

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


def _store(url: Optional[str], storage_options: Optional[dict]) -> Optional[CheckpointStore]:
    """Where checkpoints go: ``url``, else the run folder (None outside a sparkhvd run)."""
    from sparkhvd.runfolder.rank_files import run_files

    if url:
        return UrlStore(url, storage_options)
    return RunFolderStore("run") if run_files().available else None


def _newest(resume_from: Any, load: Callable, rank: int, needs: Optional[DcpNeeds] = None
            ) -> tuple[Any, Any, list]:
    """``restore_newest``, and rank 0 says so when there was nothing to resume from."""
    record, state, skipped = restore_newest(resume_from, load, needs)
    if (record is None or state is None) and rank == 0:
        announce_resume(resume_from)
    return record, state, skipped


class _CheckpointsBase(SavesInBackground):
    """What both kinds of checkpoints hold: the model, its optimizer, this rank, where they
    are saved and where they resume from (and, with ``async_save``, their background
    writer)."""

    def __init__(self, model: Any, optimizer: Any = None, *, url: Optional[str] = None,
                 storage_options: Optional[dict] = None, resume: Any = None,
                 data: Any = None, every_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, keep: Optional[int] = None) -> None:
        check_cadence(every_steps, every_seconds, keep)
        self.model, self.optimizer = model, optimizer
        self.data = data
        self.every_steps, self.every_seconds, self.keep = every_steps, every_seconds, keep
        self.rank = current_rank().rank
        listen()  # in a sparkhvd rank, a notice now becomes a checkpoint after the step
        self.store: Optional[CheckpointStore] = _store(url, storage_options)
        if isinstance(self.store, UrlStore) and self.rank == 0:
            self.store.remove_torn()
        self.resume_from = resume_store(resume, self.store, storage_options)
        #: What :meth:`restore` loaded: ``extra`` state you saved, the epoch and the step.
        self.restored: dict = {}
        self._last_save = time.monotonic()
        self._counted = (-1, 0)  # (epoch, steps) when there is no data to count them
        self._background: Optional[BackgroundSave] = None  # set by Checkpoints(async_save=True)
        self._ring: Optional[SnapshotRing] = None  # ... and its saves due meanwhile
        self.host_copy = False  # each kind sets its own

    def step(self, epoch: int, **extra: Any) -> Optional[str]:
        """Call after each optimizer step (on every rank): writes a mid-epoch checkpoint when
        one is due -- every ``every_steps`` steps of the epoch and/or ``every_seconds`` since the
        last save (rank 0's clock decides), or at once after a *notice* (SIGTERM to any rank:
        its node is about to go, or the driver resizes the run; then every rank raises
        :class:`~sparkhvd.elastic.notices.Preempted` after it, and the run relaunches) -- and
        returns its name on every rank (None when none was due). The step number comes from
        ``data`` (its position) or is counted here. One small collective per call agrees on
        both."""
        self._raise_failed_save()
        done = self._steps_done(epoch)
        by_steps = bool(self.every_steps and done % self.every_steps == 0)
        by_time = bool(self.every_seconds and
                       time.monotonic() - self._last_save >= self.every_seconds)
        by_time, notice, busy = self._agree(by_time, noticed() is not None, self._writing())
        if not (by_steps or by_time or notice):
            return None
        if busy and not notice:  # async_save: due while the last one is still being written
            self._due_while_writing(epoch, done, extra)
            return None
        return self._checkpoint(epoch, done, extra, notice) or self._name(epoch, done)

    def save(self, epoch: int, step: Optional[int] = None, **extra: Any) -> Optional[str]:
        """After epoch ``epoch`` (0-based), or after its step ``step`` (1-based: steps done):
        write the checkpoint (see the class). After a notice, every rank then raises
        :class:`~sparkhvd.elastic.notices.Preempted`."""
        self._raise_failed_save()
        _, notice, _ = self._agree(False, noticed() is not None, False)
        return self._checkpoint(epoch, step, extra, notice)

    def _checkpoint(self, epoch: int, step: Optional[int], extra: dict,
                    notice: bool) -> Optional[str]:
        name = self._write(epoch, step, extra)
        if notice:
            import torch.distributed as dist

            self._finish_save()  # durable before the rank stops
            if dist.is_initialized():
                dist.barrier()  # every rank's part is in before any rank leaves
            raise stop(name or self._name(epoch + 1 if not step else epoch, step or 0))
        return name

    def _write(self, epoch: int, step: Optional[int], extra: dict) -> Optional[str]:
        raise NotImplementedError  # each kind writes its own

    def _due_while_writing(self, epoch: int, step: int, extra: dict) -> None:
        """A save came due while one is being written: skipped (said once per save in
        flight)."""
        self._skip(self._name(epoch, step))

    def _agree(self, by_time: bool, notice: bool, busy: bool) -> tuple[bool, bool, bool]:
        """Whether to checkpoint now, the same on every rank: rank 0's clock decides
        ``by_time``; a save still being written on any rank (``busy``: rank 0's for
        :class:`Checkpoints`, every rank's part for sharded ones) and any rank's notice are
        everyone's -- one 3-element all_reduce (on a gloo group beside an nccl one, so no GPU
        sync)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return by_time, notice, busy
        mine = self.rank == 0
        flags = torch.tensor([int(by_time and mine), int(notice), int(busy)],
                             dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=side_group())
        return bool(flags[0]), bool(flags[1]), bool(flags[2])

    def _name(self, epoch: int, step: int) -> str:
        """The name :meth:`save` gives a mid-epoch checkpoint of ``epoch`` after ``step``."""
        return checkpoint_name(epoch, step)

    def _steps_done(self, epoch: int) -> int:
        position = getattr(self.data, "position", None)
        if position is not None and position.epoch == epoch:
            return int(position.step)
        counted_epoch, steps = self._counted
        self._counted = (epoch, steps + 1 if counted_epoch == epoch else 1)
        return self._counted[1]

    def _saved(self) -> None:
        """After a save is written: rank 0 prunes to the newest ``keep``. (The ``every_seconds``
        clock restarts where the save's state was taken -- before a synchronous write, at the
        host copy of a background one -- not when its write ends.)"""
        if self.keep and self.rank == 0 and self.store is not None:
            prune(self.store, self.keep)

    def _data_state(self, epoch: int, step: Optional[int]) -> Optional[dict]:
        """The data's position to save with the model: where it is after ``step`` of
        ``epoch``, or at the start of the next epoch for an epoch-end checkpoint."""
        if self.data is None:
            return None
        state = self.data.state_dict()
        if state is not None and step is None and "samples" in state:
            state = {**state, "epoch": epoch + 1, "samples": 0, "step": 0}
        return state

    def _restore_data(self, state: Optional[dict]) -> None:
        if self.data is not None and state:
            self.data.load_state_dict(state)

    def _read_newest(self, load: Callable[[dict, dict[str, Any]], Any],
                     needs: Optional[DcpNeeds] = None
                     ) -> tuple[Optional[dict], Any, list, str]:
        """``(record, load's value, problems, copy)`` of the newest checkpoint to resume from:
        from the nearest copy with ``host_copy`` (a collective; ``needs``: each rank gets what
        its load reads), else from the folder; rank 0 says when there was none."""
        assert self.resume_from is not None
        if not self.host_copy:
            return (*_newest(self.resume_from, load, self.rank, needs), "folder")
        record, state, skipped, copy = restore_nearest(self.resume_from, load, self.rank, needs)
        if (record is None or state is None) and self.rank == 0:
            announce_resume(self.resume_from)
        return record, state, skipped, copy

    def _announce(self, file: str, epoch: int, step: int, skipped: list,
                  copy: str = "folder", uploaded: bool = True) -> None:
        self.restored = {**self.restored, "epoch": epoch, "step": step}
        if step:  # steps counted without data= go on from the restored one
            self._counted = (epoch, step)
        if self.rank == 0 and self.resume_from is not None:
            announce_resume(self.resume_from, file, epoch, skipped, step, copy, uploaded)


class Checkpoints(_CheckpointsBase):
    """Rank 0's checkpoints of model + optimizer, and exact resume.

    A checkpoint of epoch N is ``epoch-000N.pt`` (``torch.save`` of the model's and optimizer's
    ``state_dict``, and your extra state) and ``latest.json`` written last, in the run folder's
    ``checkpoints/`` (from any host, through the driver's run-folder service) or in ``url``.

    Args:
        model: the model (wrapped in ``DistributedDataParallel`` or not).
        optimizer: its optimizer (its state -- momentum, Adam's moments -- is restored too).
        url: a folder URL instead of the run folder (local, ``abfss://`` with
            ``storage_options``).
        resume: ``None`` (default) resumes when ``HorovodRunner(resume_from=...)`` asked,
            and when the run relaunches (a retry or a resize) from its newest checkpoint --
            in ``url`` too; ``False`` never; a URL resumes from that folder.
        data: the ``DatasetShard`` the loop reads (the ``DataFrameDataset`` argument): its
            position in the global order is saved with the model and restored, so a resumed
            run -- with any number of ranks -- continues the epoch where it stopped.
        every_steps: with :meth:`step` after each optimizer step, a mid-epoch checkpoint every
            this many steps of an epoch.
        every_seconds: ... and/or when this many seconds passed since the last save was taken
            (a background save: at its host copy, not when its write ends).
        keep: keep only the newest this many checkpoints (rank 0 deletes older ones after each
            save; the newest is never deleted). Through the run-folder service from a host
            that cannot see the run folder, nothing is deleted.
        async_save: write in the background: a save holds training up only while rank 0
            copies the state into host memory (buffers kept between saves: one more copy of
            the model and optimizer state in host RAM; pinned, on a side stream, for GPU
            tensors); serialising and writing go on while it trains. One save in flight: a save
            ``step()``'s cadence makes due meanwhile is *skipped* (said once per save in
            flight; see ``memory_snapshots``), an explicit ``save()`` waits for it, a notice
            waits and writes its own
            to the end before the ranks stop. What is saved is the state at the step (data
            position and extra state too); the checkpoint is complete only when its record and
            ``latest.json`` are written, so a rank killed mid-write resumes from the one
            before. A failed write is raised by the next ``step()``/``save()`` or when the
            function ends, which waits for the save in flight. Off by default: it costs host
            memory, and with synchronous saves a checkpoint exists when ``save()`` returns.
        host_copy: when the checkpoint folder is not on rank 0's disk (``abfss://``, or a run
            folder on the driver's host reached through its service), rank 0 also keeps its
            newest checkpoint file on its own host (in the background with ``async_save``),
            and a relaunched run restores from the nearest copy: ranks on that host read it
            from disk, the others get it from a rank that has it over the process group, and
            the checkpoint folder is read only when no rank has
            a good one (a missing or corrupt copy is said and passed over). The copy is kept
            with its record *before* its upload: a relaunch restores it even when its upload
            never ended (it outlives rank 0's process, not its host), and with ``async_save``
            uploads run behind the saves -- a step checkpoint still waiting for its upload when
            a newer one comes is never uploaded (said once; an epoch's end always is). The
            resume line and
            ``run.json``'s ``resume.copy`` say which was read (and ``resume.uploaded``
            is false for one the folder never got). Kept in ``$SPARKHVD_HOST_COPY_DIR``
            (default: the temporary folder) when it fits in half its free space, and deleted
            when the function returns (see :mod:`sparkhvd.runfolder.host_copy`). Only inside a
            sparkhvd run.
        memory_snapshots: with ``async_save`` and ``host_copy``, inside a sparkhvd run: every
            due save's state is first kept as a *memory snapshot* on rank 0's host (copied into
            one of three slot files mapped into memory in the host-copy folder -- three more
            copies of the state there; ``$SPARKHVD_HOST_COPY_DIR=/dev/shm`` for memory speed --
            and named the newest once whole), and a save due while one is written is a snapshot
            instead of skipped. A lost process then costs the step in progress, not the seconds
            a save takes to serialise; a relaunch on that host restores the newest snapshot when
            it is newer than every checkpoint file (ranks elsewhere get it over the process
            group; the folder never gets it: the next save written goes there). The step waits
            for the copy of its buffers; the parameters and the optimizer's state are copied on
            a thread while the next step's forward and backward run, and every torch
            optimizer's next ``step()`` waits for that copy. The price is a copy of the state
            each due step, on a core training may want (B15 measures it). Off by default. See
            :mod:`sparkhvd.torch.snapshot_ring`.

    ``save(epoch)`` after an epoch, ``save(epoch, step=k)`` after step ``k`` of it (a mid-epoch
    checkpoint: ``epoch-000N-step-000000K.pt``), or ``step(epoch)`` after every step and the
    cadence above decides.
    """

    def __init__(self, model: Any, optimizer: Any = None, *, url: Optional[str] = None,
                 storage_options: Optional[dict] = None, resume: Any = None,
                 data: Any = None, every_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, keep: Optional[int] = None,
                 async_save: bool = False, host_copy: bool = True,
                 memory_snapshots: bool = False) -> None:
        if memory_snapshots and not (async_save and host_copy):
            raise ValueError("memory_snapshots=True needs async_save=True and host_copy=True "
                             "(a snapshot is the step's copy of a background save, kept on "
                             f"the host); got async_save={async_save!r}, "
                             f"host_copy={host_copy!r}")
        super().__init__(model, optimizer, url=url, storage_options=storage_options,
                         resume=resume, data=data, every_steps=every_steps,
                         every_seconds=every_seconds, keep=keep)
        self.host_copy = host_copy
        if host_copy and self.store is not None:
            # the run is done: this host's copies can go, an earlier attempt's too (every
            # rank: rank 0 may be on another host now; a live rank's folder is left to it)
            at_function_return(_drop_host_copy)
        if self.rank != 0:
            self.store = DISCARD  # one writer; every rank reads
        if async_save and self.rank == 0 and self.store is not None:
            self._background = BackgroundSave()
            #: the state of the save in flight, in host memory (refilled by the next save)
            self._snapshot = HostSnapshot()
            if memory_snapshots:  # every due save's state kept on this host first
                self._ring = SnapshotRing.here()
            if host_copy and not self.store.on_this_host:
                self._uploads = UploadQueue()  # kept on this host first, uploaded behind
            # The rank is done when its last save is, and then its host memory goes; so is a
            # torchrun script. Held weakly: a dropped helper's buffers go with it.
            at_function_end(held_weakly(self._finish_save))
            at_function_end(held_weakly(self._let_go))
            atexit.register(held_weakly(self._finish_quietly))

    def _let_go(self) -> None:
        """After the last save: the host memory kept between saves (the background save's
        buffers, the snapshot slots' mappings) goes when the function ends, not with the
        process; a later save takes it again."""
        self._snapshot = HostSnapshot()
        if self._ring is not None:
            self._ring.close()

    def _name(self, epoch: int, step: int) -> str:
        return f"{checkpoint_name(epoch, step)}.pt"

    def _write(self, epoch: int, step: Optional[int], extra: dict) -> Optional[str]:
        """Rank 0 writes the checkpoint (or starts writing it: ``async_save``); other ranks
        return."""
        if self.rank != 0 or self.store is None:
            self._last_save = time.monotonic()
            return None
        done, state = self._state(epoch, step, extra)
        name = self._name(done, step or 0)
        if self._background is None:
            self._last_save = time.monotonic()  # the clock counts from the state's moment
            self._persist(state, name, done, step or 0)
            return name
        self._background.wait()  # one in flight: its buffers are the ones filled now
        self._wait_for_first_upload()  # the folder's first: what a relaunch finds
        ring = self._ring
        kept = (self._keep_in_memory(state, self._snapshot_name(done, step or 0), done,
                                     step or 0, hold=True) if ring is not None else None)
        if ring is not None and kept is not None:  # written from its memory snapshot

            def persist() -> None:
                try:
                    ring.wait()  # the parameters' copy ended
                    self._persist(kept, name, done, step or 0)
                finally:
                    ring.release()

            self._last_save = time.monotonic()
            self._background.start(name, persist)
            return name
        held = self._snapshot.take(state)  # the only part the step waits for
        self._last_save = time.monotonic()
        self._background.start(name, lambda: self._persist(held, name, done, step or 0))
        return name

    def _state(self, epoch: int, step: Optional[int], extra: dict) -> tuple[int, dict]:
        """The epoch a checkpoint after ``step`` of ``epoch`` names, and the state it saves."""
        done = epoch + 1 if not step else epoch
        return done, {"model": unwrap(self.model).state_dict(),
                      "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                      "epoch": done, "step": step or 0, "extra": extra,
                      "data": self._data_state(epoch, step)}

    def _due_while_writing(self, epoch: int, step: int, extra: dict) -> None:
        """A save came due while one is being written: rank 0 keeps the step's state as a
        memory snapshot on its host (:mod:`sparkhvd.torch.snapshot_ring`), said once per save
        in flight -- or skips it where no snapshot can be kept."""
        ring, background, store = self._ring, self._background, self.store
        if self.rank != 0 or ring is None or background is None or store is None:
            return super()._due_while_writing(epoch, step, extra)
        done, state = self._state(epoch, step, extra)
        file = self._snapshot_name(done, step)
        if self._keep_in_memory(state, file, done, step, hold=False) is not None:
            self._last_save = time.monotonic()
            background.skip(file, snapshot=True)
            return
        super()._due_while_writing(epoch, step, extra)

    def _snapshot_name(self, done: int, step: int) -> str:
        return f"{checkpoint_name(done, step)}.snapshot"

    def _keep_in_memory(self, state: dict, file: str, done: int, step: int,
                        hold: bool) -> Any:
        """``state`` as rank 0's newest memory snapshot (:class:`SnapshotRing`): its copy
        there, or None -- and no more snapshots, said -- when it does not fit."""
        assert self._ring is not None and self.store is not None
        kept = self._ring.keep(state, file, record_of(done, {}, {}, step), self.store.key,
                               self._changed_by_step(), hold)
        if kept is None:
            self._ring = None
            print(f"checkpoint: no memory snapshot kept: {SLOTS} more copies of the state do "
                  f"not fit in half the free space of the host-copy folder; a save due while "
                  f"one is written is skipped. Set {host_copy.DIR_ENV} to a larger folder.",
                  flush=True)
        return kept

    def _changed_by_step(self) -> set[int]:
        """The data pointers of what only an optimizer step changes -- the parameters and the
        optimizer's state -- when a torch optimizer trains the model (a memory snapshot
        copies them while the next step's forward and backward run); none otherwise."""
        import torch

        if not isinstance(self.optimizer, torch.optim.Optimizer):
            return set()
        tensors = [*unwrap(self.model).parameters(),
                   *(value for state in self.optimizer.state.values()
                     for value in state.values() if isinstance(value, torch.Tensor))]
        return {t.data_ptr() for t in tensors}

    def _finish_save(self) -> None:
        if self._ring is not None:
            self._ring.wait()
        super()._finish_save()

    def _persist(self, state: dict, name: str, done: int, step: int) -> None:
        """Serialise ``state`` and write it, its record and ``latest.json``; prune. With
        ``host_copy`` and a folder elsewhere, the file is serialised on this host and kept
        there with its record first (:meth:`_kept_here_first`), then uploaded: at once, or
        behind the saves with ``async_save``."""
        assert self.store is not None  # rank 0 with somewhere to write (see _write)
        info = {"file": name}

        def serialise(f: Any) -> None:
            save_state(state, f)

        spool = (host_copy.spool(name) if self.host_copy and not self.store.on_this_host
                 else None)  # the folder elsewhere: the file is written here, then sent
        if spool is None:
            # streamed into a file, never whole in memory: a write to a file releases the
            # GIL, so a background save does not starve the training thread (B5/B15)
            write_checkpoint_streamed(self.store, done, name, serialise, info, step)
            self._saved()
            return
        try:
            written = serialise_into(spool, serialise)
        except BaseException as exc:
            host_copy.discard(spool)
            if isinstance(exc, OSError):
                raise not_written(self.store, done, exc) from exc
            raise
        upload, drop = self._kept_here_first(name, spool, record_of(done, {name: written},
                                                                    info, step))
        if self._uploads is None:
            upload()
        else:
            self._uploads.put(name, upload, drop, supersedable=bool(step))

    def _kept_here_first(self, name: str, spool: str, record: dict
                         ) -> tuple[Callable[[], None], Callable[[], None]]:
        """Keep the serialised checkpoint file ``spool`` as this host's copy *with its
        record* before it is uploaded -- a relaunch restores it from here even when its
        upload never ended (:mod:`sparkhvd.runfolder.host_copy`) -- and return its upload
        (the file, the record, ``latest.json``, then prune) and what lets its file go when
        the upload is superseded. Where the file cannot be held for the upload (no hard
        links), it is kept here only after its upload, as a plain host copy."""
        store = self.store
        assert store is not None
        sha256 = record["files"][name]["sha256"]
        held = host_copy.hold(spool)

        def upload() -> None:
            source = held or spool
            try:
                upload_checkpoint(store, record, {name: source})
            except BaseException:
                host_copy.discard(source)
                raise
            if held is not None:
                host_copy.discard(held)
            else:
                host_copy.adopt(name, spool, sha256)
            self._saved()

        if held is not None:
            host_copy.adopt(name, spool, sha256, record, store.key)
        return upload, lambda: host_copy.discard(held or spool)

    def restore(self) -> int:
        """Load the newest usable checkpoint, if resuming; the epoch to start from (0
        otherwise) -- the epoch a mid-epoch checkpoint was in, which the data (``data=``)
        continues after its step. Read from the nearest copy (``host_copy``); call it on every
        rank. A truncated, missing or unreadable newest checkpoint is skipped with a warning
        (the next older one is used); none usable is a ``CheckpointError``."""
        import torch

        if self.resume_from is None:
            return 0

        def load(record: dict, files: dict) -> dict:
            device = next(iter(unwrap(self.model).parameters()), torch.zeros(0)).device
            state = load_state(files[record["file"]], device)
            unwrap(self.model).load_state_dict(state["model"])
            if self.optimizer is not None and state.get("optimizer"):
                self.optimizer.load_state_dict(state["optimizer"])
            return state

        record, state, skipped, copy = self._read_newest(load)
        if record is None or state is None:
            return 0
        self.restored = dict(state.get("extra") or {})
        self._restore_data(state.get("data"))
        self._announce(record["file"], int(state["epoch"]), int(state.get("step") or 0),
                       skipped, copy, record.get("uploaded", True))
        return int(state["epoch"])


class ShardedCheckpoints(_CheckpointsBase):
    """Every rank's shards of a sharded model (FSDP2 ``fully_shard``, DeepSpeed-style state, or
    plain DDP) with ``torch.distributed.checkpoint`` (DCP), in the run folder, and exact resume.

    A checkpoint of epoch N is the folder ``checkpoints/epoch-000N/``: each rank's ``*.distcp``
    files and rank 0's ``.metadata`` -- written by DCP into a folder on the rank's own host, then
    copied into the run folder (straight on the driver's disk, else through the driver's
    run-folder service: no storage credentials on the ranks, and the driver publishes them to
    ``abfss://`` with the run folder) -- then its record ``epoch-000N.json`` (every file with its
    rank, size and SHA-256) and ``latest.json``, written by rank 0 only after every rank said its
    files are in. A checkpoint without a record was torn and is never read; one whose files do
    not match it is skipped for the next older one.

    Args:
        model: the (sharded) model.
        optimizer: its optimizer (its sharded state is saved and restored too).
        url: a folder URL instead of the run folder.
        resume: as for :class:`Checkpoints` (``None``: when ``HorovodRunner(resume_from=...)``
            asked).
        data: as for :class:`Checkpoints`: the data's position goes into the record.
        every_steps: as for :class:`Checkpoints`.
        every_seconds: as for :class:`Checkpoints`; rank 0's clock decides (one small
            broadcast per :meth:`step`).
        keep: as for :class:`Checkpoints`.
        async_save: write in the background with DCP's ``async_save``: a save holds training
            up only while each rank's shards are copied into host buffers DCP keeps between
            saves (pinned, non-blocking copies on a GPU); DCP writes them on its thread, then
            each rank copies its files into the folder and rank 0 commits once every rank's
            part is in (all or none, as synchronously). The rules of
            :class:`Checkpoints`' ``async_save`` hold: one save in flight (a due ``step()``
            save is skipped, said once; ``save()`` waits; a notice writes its own to the end),
            the state at the step, errors raised by the next call or at the function's end.
            Each rank's background work gathers on a gloo group of its own.
        host_copy: when the checkpoint folder is not on the ranks' disks (``abfss://``, or a
            run folder on the driver's host), every rank also keeps its newest files on its
            own host (moved there from DCP's folder, no second copy in memory) with the
            checkpoint's record -- every rank's checksums, gathered first -- *before* it
            uploads them, so a checkpoint an upload never finished is restored from the hosts
            when they hold it whole and it is newer than the folder's; and a relaunched run
            restores from the nearest copy: each file is read from the host's disk where
            some rank on that host kept it (any rank's: ranks relaunched at another
            number read them too), sent over the process group by a rank whose host has it,
            and read from the folder only when no rank has a good copy. As
            :class:`Checkpoints`' ``host_copy``: checked against the record, said in the
            resume line and ``run.json``, bounded, deleted when the function returns.

    Call :meth:`save` and :meth:`restore` on every rank (they are collectives).
    """

    def __init__(self, model: Any, optimizer: Any = None, *, url: Optional[str] = None,
                 storage_options: Optional[dict] = None, resume: Any = None,
                 data: Any = None, every_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, keep: Optional[int] = None,
                 async_save: bool = False, host_copy: bool = True) -> None:
        super().__init__(model, optimizer, url=url, storage_options=storage_options,
                         resume=resume, data=data, every_steps=every_steps,
                         every_seconds=every_seconds, keep=keep)
        self.host_copy = host_copy
        self._staging: Optional[ShardedStaging] = None
        if self._keeps_copies():
            at_function_return(_drop_host_copy)  # the run is done: the copies can go
        if async_save and self.store is not None:
            self._background = BackgroundSave()
            self._staging = ShardedStaging(held_weakly(self._finish_save))
            # done when its part is committed (held weakly: a dropped helper's buffers go)
            at_function_end(held_weakly(self._finish_and_release))
            atexit.register(held_weakly(self._finish_quietly))

    def _keeps_copies(self) -> bool:
        return bool(self.host_copy and self.store is not None and not self.store.on_this_host)

    def _finish_and_release(self) -> None:
        """The last save committed, then the staging's host buffers let go."""
        try:
            self._finish_save()
        finally:
            if self._staging is not None:
                self._staging.close()

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return {"model": get_model_state_dict(self.model)}
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def _write(self, epoch: int, step: Optional[int], extra: dict) -> Optional[str]:
        """Every rank's shards, then rank 0's commit (or their start: ``async_save``): the
        checkpoint's folder name."""
        import copy

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self.store is None:
            return None
        done = epoch + 1 if not step else epoch
        name = checkpoint_name(done, step or 0)
        info = {"file": name, "sharded": True, "extra": copy.deepcopy(extra),
                "data": self._data_state(epoch, step)}  # the state at the step
        local = spool_folder()  # swept if this rank is killed mid-save
        if self._background is not None and self._staging is not None:
            self._background.wait()  # one in flight: every rank's part of it committed
            try:
                future = self._staging.save(self._state(), local)  # the step waits for this
            except BaseException:
                shutil.rmtree(local, ignore_errors=True)
                raise
            self._last_save = time.monotonic()
            group = self._staging.group
            self._background.start(name, lambda: self._commit(
                name, done, step or 0, info, local, future.result, group))
            return name
        self._last_save = time.monotonic()  # the clock counts from the state's moment
        self._commit(name, done, step or 0, info, local,
                     lambda: dcp.save(self._state(), storage_writer=dcp.FileSystemWriter(local)))
        if dist.is_initialized():
            dist.barrier()
        return name

    def _commit(self, name: str, done: int, step: int, info: dict, local: str,
                written: Callable[[], Any], group: Any = None) -> None:
        """After ``written()`` (DCP's files in ``local``): every rank's files and checksums
        gathered on ``group`` into the checkpoint's record; with ``host_copy`` each rank keeps
        its files on its host with that record *before* uploading them (a relaunch restores
        them even when an upload never ends); then each rank's files into the folder, and rank
        0 writes the record -- only when every rank's part is in. A rank that failed still
        takes part in each gather (with its error), so no rank waits forever and no checkpoint
        is committed without it."""
        assert self.store is not None  # a rank with somewhere to write (see _write)
        mine: dict[str, Any] = {}
        error: Optional[BaseException] = None
        try:
            try:
                mine = self._digests(name, local, written())
            except BaseException as exc:  # noqa: BLE001 - raised below, after the gather
                error = exc
            everyone = self._gathered(name, done, mine, error, group)
            shards = {k: v for part in everyone for k, v in sorted(part.items())}
            record = record_of(done, shards, info, step)
            try:
                self._copy_in(name, local, mine, record)
            except BaseException as exc:  # noqa: BLE001 - raised below, after the gather
                error = exc
            self._gathered(name, done, {}, error, group)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        if self.rank == 0:
            commit_checkpoint(self.store, done, shards, info, step)
        self._saved()

    def _gathered(self, name: str, done: int, mine: dict, error: Optional[BaseException],
                  group: Any) -> list[dict]:
        """Every rank's part (``mine``, or ``error``), gathered on ``group``; raises on every
        rank when some rank's part failed."""
        import torch.distributed as dist

        assert self.store is not None
        everyone: list[Any] = [_part_of(mine, error)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, _part_of(mine, error), group=group)
        if isinstance(error, OSError):
            raise not_written(self.store, done, error) from error
        if error is not None:
            raise error
        failed = [(r, part["failed"]) for r, part in enumerate(everyone) if "failed" in part]
        if failed:
            rank, why = failed[0]
            raise OSError(f"checkpoint {name} not committed: rank {rank}'s part was not "
                          f"written ({why}); the one before it is still the newest complete "
                          "checkpoint")
        return everyone

    def _digests(self, name: str, local: str, metadata: Any) -> dict[str, Any]:
        """This rank's files in ``local``: their name in the folder -> size, SHA-256, the
        CRC-32 of each item DCP wrote there (``metadata``: what ``dcp.save`` returned on
        every rank; 16 MiB pieces without it) -- a restore from the folder reads and checks
        only the items its load plan reads -- and rank."""
        starts: dict[str, set[int]] = {}
        for stored in (getattr(metadata, "storage_data", None) or {}).values():
            starts.setdefault(str(stored.relative_path), set()).add(int(stored.offset))
        out = {}
        for root, _, files in os.walk(local):
            for file in files:
                path = os.path.join(root, file)
                rel = os.path.relpath(path, local)
                cuts = starts.get(rel) or range(0, os.path.getsize(path), CHECK_BLOCK)
                out[f"{name}/{rel}"] = {**digest_file(path, cuts), "rank": self.rank}
        return out

    def _copy_in(self, name: str, local: str, mine: dict[str, Any], record: dict) -> None:
        """This rank's files in ``local`` (``mine``) into the folder. With ``host_copy``, moved
        into this host's copy with the checkpoint's ``record`` first, the upload reading a
        second name of each (:func:`host_copy.hold`, left in ``local``); where a file cannot
        have one, they are kept here only after their upload, without the record."""
        assert self.store is not None
        paths = {rel: os.path.join(local, rel[len(name) + 1:]) for rel in mine}
        moved = {rel: (path, mine[rel]["sha256"]) for rel, path in paths.items()}
        keeps = self._keeps_copies()
        held = {rel: host_copy.hold(path) for rel, path in paths.items()} if keeps else {}
        first = keeps and all(held.values())
        if first:
            host_copy.keep_moved(moved, record, self.store.key)
        else:
            for link in filter(None, held.values()):
                host_copy.discard(link)
        for rel, path in sorted((held if first else paths).items()):
            self.store.write_file(rel, str(path))
        if keeps and not first:
            host_copy.keep_moved(moved)

    def restore(self) -> int:
        """Load the newest checkpoint into the model and optimizer, if resuming (every rank);
        the epoch to start from (0 otherwise). From the nearest copy (``host_copy``), a rank
        gets what its DCP load plan reads: its own shards, and of the other ranks' files the
        items every rank holds (optimizer settings, step counts: DCP writes each into one
        rank's file) -- byte ranges, not the files; from the folder, the same items, each
        checked by the CRC-32 the record keeps of it (every file whole from a checkpoint
        written before records kept them)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self.resume_from is None:
            return 0

        needs = DcpNeeds(self._state)

        def load(record: dict, files: dict) -> dict:
            dcp.load(needs.state, storage_reader=reader_of(files, record["file"]))
            return needs.state

        record, state, skipped, copy = self._read_newest(load, needs)
        if record is None or state is None:
            return 0
        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        epoch = int(record["epoch"])
        self.restored = dict(record.get("extra") or {})
        self._restore_data(record.get("data"))
        self._announce(record["file"], epoch, int(record.get("step") or 0), skipped, copy,
                       record.get("uploaded", True))
        return epoch


def _part_of(mine: dict, error: Optional[BaseException]) -> dict:
    """What a rank gives the commit's gather: its files, or why it has none."""
    return mine if error is None else {"failed": f"{type(error).__name__}: {str(error)[:300]}"}


def _drop_host_copy() -> None:
    host_copy.clean()


def world_size_change() -> WorldSizeChange:
    """``(before, now)``: the world size of the attempt before this one and of this one, after
    an elastic run resized (equal otherwise). The usual rules, for data-parallel SGD::

        change = st.world_size_change()
        lr = base_lr * ctx.world_size            # per-sample rule: re-derived from the size
        per_rank_batch = global_batch // ctx.world_size   # or: keep the global batch

    ``change.factor`` (now / before) rescales a value computed for the old size.
    """
    return _world_size_change()


def last_checkpoint(folder: str, complete: str = "trainer_state.json") -> Optional[str]:
    """The newest *complete* ``checkpoint-N`` folder a library left in ``folder``, or None.

    A rank killed while its library wrote a checkpoint leaves a folder that is not whole; a
    Hugging Face ``Trainer`` writes ``trainer_state.json`` last, so a folder without it is
    skipped -- ``transformers``' own ``get_last_checkpoint`` would pick it and ``train`` then
    refuse it. The one line that resumes a ``Trainer`` after any relaunch::

        trainer.train(resume_from_checkpoint=st.last_checkpoint(args.output_dir))
    """
    import re

    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.exists(os.path.join(folder, name, complete)):
            found.append((int(match.group(1)), name))
    return os.path.join(folder, max(found)[1]) if found else None


def output_dir(name: str) -> str:
    """A folder for files a library writes itself -- Lightning's ``default_root_dir``,
    Hugging Face ``TrainingArguments(output_dir=...)`` -- that ends up in the run folder as
    ``<run folder>/<name>/``.

    On the driver's machine it *is* that folder. Elsewhere it is a folder on this rank's host
    whose files are copied into the run folder (through the driver's run-folder service) when
    the training function ends, however it ends -- nothing written there is lost.
    """
    from sparkhvd.runfolder.rank_files import output_folder

    return output_folder(name)


def model_bytes(model: Any, example_input: Any = None) -> bytes:
    """``model`` as TorchScript bytes: the run's model file (``model.pt``), which
    :func:`sparkhvd.load_model` and :func:`sparkhvd.predict` load without your Python class.

    Scripted (``torch.jit.script``); a model scripting cannot handle is traced with
    ``example_input`` (one batch).
    """
    import torch

    module = unwrap(model)
    was_training = module.training
    module.eval()
    try:
        try:
            scripted = torch.jit.script(module)
        except Exception as exc:  # noqa: BLE001 - any scripting failure: trace instead
            if example_input is None:
                why = (" -- a class defined in your script or notebook travels to the ranks "
                       "without its source file, which scripting reads" if
                       "source" in str(exc) else "")
                raise TypeError(
                    f"torch.jit.script cannot compile {type(module).__name__} ({exc}){why}. "
                    "Fix: pass one batch, model_bytes(model, example_input=x), to trace it; "
                    "or return model.state_dict() (saved as model.state_dict.pt).") from None
            scripted = torch.jit.trace(module, example_input)
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        return buffer.getvalue()
    finally:
        module.train(was_training)


__all__ = ["TorchContext", "setup", "unwrap", "report", "Checkpoints", "ShardedCheckpoints",
           "output_dir", "model_bytes", "world_size_change", "WorldSizeChange", "Preempted",
           "last_checkpoint"]

