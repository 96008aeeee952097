"""One checkpoint write at a time on a background thread, for every framework's helpers.

The step copies what it saves into host memory (``sparkhvd.torch``'s host buffers, DCP's
stager, Keras' serialised files) and hands the write to this thread; the rules it keeps are
said in :mod:`sparkhvd.torch.async_save`: one save in flight, a failed write raised by the
next call, a due save skipped -- or kept as a memory snapshot -- while one is in flight (said
once).

A checkpoint committed on its host first (:mod:`sparkhvd.checkpoint.host_copy`) is uploaded
behind the saves by :class:`UploadQueue`, so a slow folder delays the folder's copy, not the
next save.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sparkhvd.checkpoint.lineage import LATEST

__side__ = "rank"


#: The writer thread's nice value: the lowest, so a background save takes the CPU the step
#: leaves idle -- plenty on a GPU host -- and little else. Measured on 2 cores that training
#: keeps busy (B15's loop, 48 steps, 6 rounds): every-step async saves cost 0.98x of no
#: checkpoints at 19 (1 GB saves landing about every 30 s) against 0.88x at 10 (about every
#: 10 s). A step's loss is bounded by ``memory_snapshots``, not by how fast the writer runs.
WRITER_NICE = 19


def _yield_cpu() -> None:
    """The calling thread gives way to training for the CPU: on Linux a thread has its own
    nice value, so serialising and writing use the cores the step leaves idle."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


class BackgroundSave:
    """At most one save running on a background thread; its error kept for the caller."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        #: the save in flight (or the last one): its name
        self.name = ""
        #: seconds the last completed background write took
        self.last_write_s: Optional[float] = None
        #: due saves skipped while :attr:`name` was in flight (the log says so once per save)
        self.skipped = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, name: str, work: Callable[[], None]) -> None:
        """Run ``work`` in the background (the previous save must have ended: :meth:`wait`)."""
        assert not self.busy, "one save in flight at a time"
        self.raise_error()
        self.name, self.skipped = name, 0

        def run() -> None:
            _yield_cpu()
            began = time.monotonic()
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept and raised by the training loop
                self._error = exc
            self.last_write_s = time.monotonic() - began

        self._thread = threading.Thread(target=run, name=f"sparkhvd-save-{name}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the save in flight ended; its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_error()

    def raise_error(self) -> None:
        """The error of a save that failed since the last call, raised once."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def skip(self, due: str, snapshot: bool = False) -> None:
        """A save came due while :attr:`name` is being written: skipped -- or (``snapshot``)
        kept as a memory snapshot on this host only -- said once per save."""
        self.skipped += 1
        if self.skipped == 1 and snapshot:
            print(f"checkpoint: {due} kept in memory on this host only: {self.name} is still "
                  "being written (async_save: a save that comes due while one is in flight is "
                  "a snapshot of the step's state, not written to the folder)", flush=True)
        elif self.skipped == 1:
            print(f"checkpoint: {due} skipped: {self.name} is still being written "
                  "(async_save: a save that comes due while one is in flight is skipped)",
                  flush=True)


@dataclass
class _Upload:
    name: str
    run: Callable[[], None]
    drop: Callable[[], None]
    supersedable: bool


class UploadQueue:
    """Uploads of checkpoints already kept on this host, one at a time on a thread of their
    own, oldest first -- so the folder's ``latest.json`` only moves forward.

    When the uploads lag behind the saves (a large state, a slow store), a *step* checkpoint
    whose upload has not begun when a newer one is queued is dropped: it stays on this host
    only (until the newer copy replaces it there) and the newer one is uploaded in its place
    -- said once. An epoch-end checkpoint is always uploaded. A failed upload is kept and
    raised by the next call (the later ones still run)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._pending: list[_Upload] = []
        self._uploading = False
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        #: step checkpoints left on the host only (a newer one came before their upload began)
        self.dropped = 0

    def put(self, name: str, run: Callable[[], None], drop: Callable[[], None],
            supersedable: bool) -> None:
        """Queue ``run`` (the upload of ``name``); ``drop`` lets its file go when it is
        superseded (``supersedable``: a step checkpoint) before its upload began."""
        with self._ready:
            if self._pending and self._pending[-1].supersedable:
                gone = self._pending.pop()
                gone.drop()
                self.dropped += 1
                if self.dropped == 1:
                    print(f"checkpoint: {gone.name} is kept on this host only: {name} came "
                          "before its upload began (uploads lag behind the saves; the newest "
                          "step checkpoint is uploaded next)", flush=True)
            self._pending.append(_Upload(name, run, drop, supersedable))
            self._ready.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="sparkhvd-upload",
                                                daemon=True)
                self._thread.start()

    def _work(self) -> None:
        """Upload what is queued, then end: the thread lives only while uploads are pending
        (the next :meth:`put` starts another), so a finished rank keeps no thread."""
        _yield_cpu()
        while True:
            with self._ready:
                if not self._pending:
                    self._thread = None
                    return
                upload = self._pending.pop(0)
                self._uploading = True
            try:
                upload.run()
            except BaseException as exc:  # noqa: BLE001 - kept and raised by the training loop
                self._error = self._error or exc
            with self._ready:
                self._uploading = False
                self._ready.notify_all()

    def wait(self) -> None:
        """Until every queued upload ended; the first error, if one failed."""
        with self._ready:
            while self._pending or self._uploading:
                self._ready.wait()
        self.raise_error()

    def raise_error(self) -> None:
        """The error of an upload that failed since the last call, raised once."""
        error, self._error = self._error, None
        if error is not None:
            raise error


class SavesInBackground:
    """What a checkpoint helper with an optional background writer does with it -- the
    torch helpers and the Keras callback alike. ``_background`` None: saves are synchronous."""

    _background: Optional[BackgroundSave] = None
    _uploads: Optional[UploadQueue] = None  # the saves kept on the host first, uploaded behind
    _found_latest = False  # an earlier attempt's latest.json is in the folder (found once)
    store: Any  # the checkpoints folder (a CheckpointStore)

    def _folder_resumable(self) -> bool:
        """Whether the folder already has a ``latest.json`` a relaunch can resume from: one
        this process committed, or one an earlier attempt left (asked of the folder until
        this process has committed one). Until then a save waits for the upload before it,
        so a relaunch never finds the folder empty."""
        if self.store.committed is None and not self._found_latest:
            self._found_latest = self.store.exists(LATEST)
        return self.store.committed is not None or self._found_latest

    def _wait_for_first_upload(self) -> None:
        """Before a save with uploads behind: the one before it in the folder first while the
        folder has nothing to resume from (:meth:`_folder_resumable`)."""
        if self._uploads is not None and not self._folder_resumable():
            self._uploads.wait()

    def _writing(self) -> bool:
        """Whether a save of this rank's is still being written in the background."""
        return self._background is not None and self._background.busy

    def _skip(self, name: str) -> None:
        """A save came due while one is in flight: skipped, said once per save in flight."""
        if self._background is not None:
            self._background.skip(name)

    def _finish_save(self) -> None:
        """Wait until the save in flight is durable, in the checkpoint folder too (raising its
        error)."""
        if self._background is not None:
            self._background.wait()
        if self._uploads is not None:
            self._uploads.wait()

    def _finish_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self._finish_save()

    def _raise_failed_save(self) -> None:
        """The error of a background save that failed, raised in the training loop."""
        if self._background is not None:
            self._background.raise_error()
        if self._uploads is not None:
            self._uploads.raise_error()
