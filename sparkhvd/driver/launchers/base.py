"""What every launcher's worker group shares: the helper thread, stop, release -- once.

A launch runs in a helper thread (Spark's ``collect()``, horovod's ``run`` or the local process
loop: :class:`ThreadedGroup`) while the controller's thread polls it, a step at a time
(:meth:`sparkhvd.driver.attempt.Attempt.poll`), so that a notebook's stop button
(``KeyboardInterrupt``) and ``run(timeout=...)`` always work. Whatever ends the attempt early --
a failed rank, a stall, the timeout, an interrupt -- the launcher's ``stop`` runs (tell the
ranks to stop, cancel the Spark job by its tag or group, kill what is left on this machine)
first (:meth:`ThreadedGroup.shutdown`).
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Optional

from sparkhvd.common.errors import SessionError
from sparkhvd.common.proctree import stop_pids
from sparkhvd.driver.launchers.seam import RUNNING, GroupStatus, LaunchSpec, RankReach, Sink

__side__ = "driver"

log = logging.getLogger(__name__)

#: After one rank stopped on a notice, how long the others get to stop the same way (they
#: finish the same step and checkpoint) before the attempt ends without them.
PREEMPT_GRACE_S = 60.0


def preempted_now(exits: list[tuple[float, int, Optional[int]]], running: bool) -> Optional[bool]:
    """Whether an attempt whose ranks ended as ``exits`` (``(when, rank, status)`` of each rank
    that failed) ended *preempted*: True once every one of them stopped on a notice and none is
    still running (or :data:`PREEMPT_GRACE_S` passed); None while the others may still follow;
    False when some rank failed otherwise."""
    from sparkhvd.common.protocol import PREEMPTED_EXIT

    if not exits:
        return False
    if any(code != PREEMPTED_EXIT for _, _, code in exits):
        return False
    if running and time.monotonic() - min(when for when, _, _ in exits) < PREEMPT_GRACE_S:
        return None
    return True


#: The TimeoutError of a Spark launch that ran past run(timeout=...) (which counts from the
#: call: waiting for slots and for the tasks to start included).
SPARK_TIMEOUT = ("The training did not finish within {timeout:g} s; the ranks were stopped and "
                 "the Spark job cancelled.")


class ThreadedGroup:
    """The :class:`~sparkhvd.driver.launchers.seam.WorkerGroup` of a launch whose ranks are
    awaited by one blocking call -- Spark's ``collect()``, horovod's ``run``, the local process
    loop -- run in a helper thread, so the run's polls stay in the caller's thread (a
    notebook's stop button and ``run(timeout=...)`` always work). Each launcher's group is a
    subclass and fills in its steps:

    - :meth:`_launch` (before the call: servers, processes; may raise a ``LaunchFailure``),
      :meth:`_call` (the blocking call), :meth:`_results` (its value as the ranks' results);
    - :meth:`_check` (at every poll: a failed rank, a lost session -- raises);
    - :meth:`_stop` (end the ranks after anything), :meth:`_behind` (the rank behind the
      launcher's own error, or None), :meth:`_release` (what the launch holds, however it
      ended; also after a :meth:`_launch` that failed half way).
    """

    #: The ``TimeoutError``'s text (``{timeout}``: the run's limit).
    TIMEOUT = SPARK_TIMEOUT
    #: The helper thread's name.
    THREAD = "sparkhvd-launch"

    def __init__(self, spec: LaunchSpec, sink: Sink) -> None:
        self.spec, self.sink = spec, sink
        self.timeout_message = self.TIMEOUT.format(timeout=spec.timeout or 0)
        self.reach: Optional[RankReach] = None
        self._outcome: dict = {}
        self._thread: Optional[threading.Thread] = None
        self._released = False

    # -- the steps each launcher fills in --------------------------------------------------
    def _launch(self) -> None:
        """Start what the blocking call needs (servers, rank processes)."""

    def _call(self) -> Any:
        raise NotImplementedError

    def _results(self, value: Any) -> list:
        return list(value or [])

    def _check(self, elapsed_s: float) -> None:
        """Raise a failed rank (or an error that is no rank's, as a lost session)."""

    def _stop(self) -> None:
        raise NotImplementedError

    def _behind(self, exc: Exception) -> Optional[BaseException]:
        return None

    def _release(self) -> None:
        pass

    # -- the worker group -----------------------------------------------------------------
    def start(self) -> None:
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise
        self._thread = threading.Thread(target=self._await_call, name=self.THREAD, daemon=True)
        self._thread.start()

    def _await_call(self) -> None:
        try:
            self._outcome["value"] = self._call()
        except BaseException as exc:  # noqa: BLE001 - handed to the polling thread
            self._outcome["error"] = exc

    def poll(self, wait_s: float, elapsed_s: float) -> GroupStatus:
        """Wait up to ``wait_s`` for the call to return; check the ranks; what they do."""
        thread = self._thread
        assert thread is not None, "the group was not started"
        thread.join(wait_s)
        try:
            self._check(elapsed_s)
            if thread.is_alive():
                return RUNNING
            if "error" in self._outcome:
                raise self._outcome["error"]
            return GroupStatus("ended", results=tuple(self._results(self._outcome.get("value"))))
        except Exception as exc:  # noqa: BLE001 - a failure is what the poll found
            return GroupStatus("failed", error=exc)

    def shutdown(self, cause: Optional[BaseException] = None) -> Optional[BaseException]:
        """Release what the launch holds; after ``cause``, stop the ranks first. While the call
        still runs, it is stopped before anything else; once it has ended (its own error), the
        error is read while the launcher can still see why (its control server up) before the
        ranks are stopped."""
        try:
            return None if cause is None else self._stop_after(cause)
        finally:
            if not self._released:
                self._released = True
                self._release()

    def _stop_after(self, cause: BaseException) -> BaseException:
        thread = self._thread
        if thread is not None and thread.is_alive():
            with contextlib.suppress(Exception):
                self._stop()
            # a lost session leaves Spark's call in its client's retries: do not wait for it
            thread.join(2 if isinstance(cause, SessionError) else 60)
        named = self._behind(cause) if isinstance(cause, Exception) else None
        with contextlib.suppress(Exception):
            self._stop()  # (again, if it ran: whatever started meanwhile)
        return named if named is not None else cause  # the caller raises it from ``cause``


def kill_local_ranks(sink: Sink) -> None:
    """End the run's rank processes on this machine that are still there, after a Spark
    launch's cancel (SIGKILL: to a rank, SIGTERM is a notice, :mod:`sparkhvd.elastic.notices`)."""
    stop_pids(local_rank_pids(sink), kill=True)


def local_rank_pids(sink: Sink) -> list[int]:
    """PIDs of the run's rank processes that reported this machine as their host.

    A PID reported from another host names some unrelated process here: never killed.
    """
    me = socket.gethostname()
    return [pid for pid, host in sink.pid_hosts.items() if host in ("", me)]
