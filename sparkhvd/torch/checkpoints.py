"""Rank 0's checkpoints of a PyTorch model and its optimizer (:class:`Checkpoints`), and what
both kinds of checkpoints share (:class:`CheckpointsBase`: where they are saved, where they
resume from, reading the newest from the nearest copy) -- public as
``sparkhvd.torch.Checkpoints``. The sharded kind is :mod:`sparkhvd.torch.sharded_checkpoints`.
"""
from __future__ import annotations

import atexit
import time
from typing import Any, Callable, Optional, Sequence

from sparkhvd.checkpoint import host_copy
from sparkhvd.checkpoint.background import SavesInBackground, UploadQueue
from sparkhvd.checkpoint.lineage import check_cadence, checkpoint_name, record_of
from sparkhvd.checkpoint.read import announce_resume, restore_newest, resume_store
from sparkhvd.checkpoint.stores import DISCARD, CheckpointStore, RunFolderStore, UrlStore
from sparkhvd.checkpoint.write import (
    not_written,
    prune,
    serialise_into,
    upload_checkpoint,
    write_checkpoint_streamed,
)
from sparkhvd.common.function_end import at_function_end, at_function_return, held_weakly
from sparkhvd.common.identity import current_rank
from sparkhvd.elastic.notices import listen, noticed, stop
from sparkhvd.torch.async_save import BackgroundSave, HostSnapshot
from sparkhvd.torch.restore_collectives import DcpNeeds, load_nearest_copy
from sparkhvd.torch.serialise import load_state, save_state, unusual_types
from sparkhvd.torch.side_group import side_group
from sparkhvd.torch.snapshot_ring import SnapshotRing
from sparkhvd.torch.training import unwrap

__side__ = "rank"


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


class CheckpointsBase(SavesInBackground):
    """What both kinds of checkpoints hold: the model, its optimizer, this rank, where they
    are saved and where they resume from (and, with ``async_save``, their background
    writer)."""

    def __init__(self, model: Any, optimizer: Any = None, *, url: Optional[str] = None,
                 storage_options: Optional[dict] = None, resume: Any = None,
                 data: Any = None, every_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, keep: Optional[int] = None,
                 safe_types: Sequence[type] = ()) -> None:
        check_cadence(every_steps, every_seconds, keep)
        #: the user's own types a checkpoint's extra state may hold (loaded; nothing else is)
        self.safe_types = tuple(safe_types)
        self._said_unusual: set[str] = set()
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
        if self.rank == 0 and extra:
            self._say_unusual(extra)
        name = self._write(epoch, step, extra)
        if notice:
            import torch.distributed as dist

            self._finish_save()  # durable before the rank stops
            if dist.is_initialized():
                dist.barrier()  # every rank's part is in before any rank leaves
            raise stop(name or self._name(epoch + 1 if not step else epoch, step or 0))
        return name

    def _say_unusual(self, extra: dict) -> None:
        """Say now -- not at the resume -- which types of the extra state a restore will
        refuse unless ``safe_types`` names them (once per type)."""
        found = unusual_types(extra, self.safe_types) - self._said_unusual
        if found:
            self._said_unusual |= found
            print(f"checkpoint: WARNING the extra state holds {', '.join(sorted(found))}, "
                  f"which a restore loads only when named: Checkpoints(..., safe_types=[...]) "
                  f"(nothing in a checkpoint is unpickled beyond tensors, numbers, strings, "
                  f"numpy values and plain containers)", flush=True)  # the rank's line

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
        """The data's position to save with the model, as the data made it (stored as it is,
        never edited here): after ``step`` of ``epoch``, or at the start of the next epoch for
        an epoch-end checkpoint (:meth:`~sparkhvd.data.shard.DatasetShard.position_at`)."""
        position_at = getattr(self.data, "position_at", None)
        if position_at is None:  # no data=, or a loader of the user's own
            return self.data.state_dict() if self.data is not None else None
        position = position_at(epoch + 1, 0) if not step else position_at(epoch, step)
        return position.as_dict() if position is not None else None

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
        record, state, skipped, copy = load_nearest_copy(self.resume_from, load, self.rank, needs)
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



class Checkpoints(CheckpointsBase):
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
            save; the newest is never deleted) -- in the run folder from any host (through
            the driver's run-folder service where rank 0 cannot see it) and in ``url``.
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
            when the function returns (see :mod:`sparkhvd.checkpoint.host_copy`). Only inside a
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
        safe_types: classes of your own that your extra state (``save(epoch, **extra)``)
            holds, for :meth:`restore` to load. A checkpoint is loaded with torch's
            ``weights_only`` loader, never a full unpickle: whoever can write the checkpoint
            folder could plant a file whose loading runs code, so only tensors, numbers,
            strings, plain containers and these types load (``torch.serialization.
            add_safe_globals`` allows types too); a file holding anything else is skipped with
            an ``UnsafeCheckpoint`` problem naming what it held (an older good one is used).

    ``save(epoch)`` after an epoch, ``save(epoch, step=k)`` after step ``k`` of it (a mid-epoch
    checkpoint: ``epoch-000N-step-000000K.pt``), or ``step(epoch)`` after every step and the
    cadence above decides.
    """

    def __init__(self, model: Any, optimizer: Any = None, *, url: Optional[str] = None,
                 storage_options: Optional[dict] = None, resume: Any = None,
                 data: Any = None, every_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, keep: Optional[int] = None,
                 async_save: bool = False, host_copy: bool = True,
                 memory_snapshots: bool = False, safe_types: Sequence[type] = ()) -> None:
        if memory_snapshots and not (async_save and host_copy):
            raise ValueError("memory_snapshots=True needs async_save=True and host_copy=True "
                             "(a snapshot is the step's copy of a background save, kept on "
                             f"the host); got async_save={async_save!r}, "
                             f"host_copy={host_copy!r}")
        super().__init__(model, optimizer, url=url, storage_options=storage_options,
                         resume=resume, data=data, every_steps=every_steps,
                         every_seconds=every_seconds, keep=keep, safe_types=safe_types)
        self.host_copy = host_copy
        if host_copy and self.store is not None:
            # the run is done: this host's copies can go, an earlier attempt's too (every
            # rank: rank 0 may be on another host now; a live rank's folder is left to it)
            at_function_return(drop_host_copy)
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
            print(f"checkpoint: no memory snapshot kept: {self._ring.why}", flush=True)
            self._ring = None
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
        upload never ended (:mod:`sparkhvd.checkpoint.host_copy`) -- and return its upload
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
            state = load_state(files[record["file"]], device, self.safe_types,
                               name=record["file"])
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


def drop_host_copy() -> None:
    host_copy.clean()



__all__ = ["Checkpoints", "CheckpointsBase"]
