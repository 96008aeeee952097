"""Every rank's shards of a sharded PyTorch model with ``torch.distributed.checkpoint``
(:class:`ShardedCheckpoints`) -- public as ``sparkhvd.torch.ShardedCheckpoints``.
"""
from __future__ import annotations

import atexit
import os
import shutil
import time
from typing import Any, Callable, Optional, Sequence

from sparkhvd.checkpoint import host_copy
from sparkhvd.checkpoint.lineage import checkpoint_name, record_of
from sparkhvd.checkpoint.stores import spool_folder
from sparkhvd.checkpoint.write import CHECK_BLOCK, commit_checkpoint, digest_file, not_written
from sparkhvd.common.function_end import at_function_end, at_function_return, held_weakly
from sparkhvd.torch.async_save import BackgroundSave, ShardedStaging
from sparkhvd.torch.checkpoints import CheckpointsBase, drop_host_copy
from sparkhvd.torch.restore_collectives import DcpNeeds
from sparkhvd.torch.serialise import dcp_failure, reader_of, safe_planner

__side__ = "rank"


class ShardedCheckpoints(CheckpointsBase):
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
                 async_save: bool = False, host_copy: bool = True,
                 safe_types: Sequence[type] = ()) -> None:
        super().__init__(model, optimizer, url=url, storage_options=storage_options,
                         resume=resume, data=data, every_steps=every_steps,
                         every_seconds=every_seconds, keep=keep, safe_types=safe_types)
        self.host_copy = host_copy
        self._staging: Optional[ShardedStaging] = None
        if self._keeps_copies():
            at_function_return(drop_host_copy)  # the run is done: the copies can go
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
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self.resume_from is None:
            return 0

        needs = DcpNeeds(self._state)

        def load(record: dict, files: dict) -> dict:
            try:
                dcp.load(needs.state, storage_reader=reader_of(files, record["file"]),
                         planner=safe_planner(self.safe_types, record["file"]))
            except CheckpointException as exc:  # a BaseException: the restore's skip misses it
                raise dcp_failure(exc, record["file"]) from None
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



__all__ = ["ShardedCheckpoints"]
