"""What every launcher's rank group shares: the helper thread, abort, cancel, kill -- once.

A launch runs in a helper thread (Spark's ``collect()``, horovod's ``run`` or the local process
loop: :class:`ThreadedGroup`) while the controller's thread polls it, a step at a time
(:meth:`sparkhvd.driver.attempt.Attempt.poll`), so that a notebook's stop button
(``KeyboardInterrupt``) and ``run(timeout=...)`` always work. Whatever ends the attempt early --
a failed rank, a stall, the timeout, an interrupt -- the launcher's ``stop`` runs (tell the
ranks to stop, cancel the Spark job by its tag or group, kill what is left on this machine)
first (:meth:`ThreadedGroup.fail`).
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Callable, Optional

from sparkhvd.common.errors import SessionError
from sparkhvd.common.proctree import stop_pids
from sparkhvd.driver.launchers.seam import Sink

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
    """The :class:`~sparkhvd.driver.launchers.RankGroup` of a launch whose ranks are awaited by
    one blocking call -- Spark's ``collect()``, horovod's ``run``, the local process loop --
    run in a helper thread, so the controller's poll loop stays in the caller's thread (a
    notebook's stop button and ``run(timeout=...)`` always work).

    ``check(elapsed_s)`` runs at every poll and may raise (a failed rank); ``finish(value)``
    turns the call's value into the ranks' results; ``stop()`` ends the ranks after any
    exception; ``translate(exc)`` may name the rank behind the launcher's own error (or return
    None); ``close()`` releases what the launch holds, however it ended. ``ask_stacks`` and
    ``notify`` are the launcher's own ways to reach its ranks (None: it has none).
    """

    def __init__(self, target: Callable[[], Any], *, name: str, timeout_message: str,
                 check: Callable[[float], None], stop: Callable[[], None],
                 finish: Optional[Callable[[Any], list]] = None,
                 translate: Optional[Callable[[Exception], Optional[BaseException]]] = None,
                 close: Optional[Callable[[], None]] = None,
                 ask_stacks: Optional[Callable[[], None]] = None,
                 notify: Optional[Callable[[str], None]] = None) -> None:
        self.timeout_message = timeout_message
        self.ask_stacks, self.notify = ask_stacks, notify
        self._check, self._stop, self._finish = check, stop, finish
        self._translate, self._close = translate, close
        self._outcome: dict = {}
        self._thread = threading.Thread(target=self._call, args=(target,), name=name,
                                        daemon=True)
        self._thread.start()

    def _call(self, target: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the polling thread
            self._outcome["error"] = exc

    def poll(self, wait_s: float, elapsed_s: float) -> bool:
        """Wait up to ``wait_s`` for the call to return; check the ranks (may raise); whether
        the call has returned."""
        self._thread.join(wait_s)
        self._check(elapsed_s)
        return not self._thread.is_alive()

    def results(self) -> list:
        """The ranks' results in rank order once :meth:`poll` said so; the call's error."""
        if "error" in self._outcome:
            raise self._outcome["error"]
        value = self._outcome.get("value")
        return self._finish(value) if self._finish is not None else list(value or [])

    def fail(self, exc: BaseException) -> BaseException:
        """Stop the ranks after ``exc``; the exception to raise for it. While the call still
        runs, it is stopped first; once it has ended (its own error), the error is read while
        the launcher can still see why (its control server up) before the ranks are stopped."""
        running = self._thread.is_alive()
        if running:
            with contextlib.suppress(Exception):
                self._stop()
            # a lost session leaves Spark's call in its client's retries: do not wait for it
            self._thread.join(2 if isinstance(exc, SessionError) else 60)
        named = self._translate(exc) \
            if isinstance(exc, Exception) and self._translate is not None else None
        with contextlib.suppress(Exception):
            self._stop()  # (again, if it ran: whatever started meanwhile)
        return named if named is not None else exc  # the caller raises it from ``exc``

    def close(self) -> None:
        if self._close is not None:
            self._close()


def stopper(cancel: Callable[[], None], sink: Sink) -> Callable[[], None]:
    """A Spark launch's ``stop``: ``cancel()`` (tell the ranks, cancel the Spark job), then end
    the run's rank processes on this machine that are still there (SIGKILL: to a rank, SIGTERM
    is a notice, :mod:`sparkhvd.elastic.notices`)."""
    def stop() -> None:
        cancel()
        stop_pids(local_rank_pids(sink), kill=True)

    return stop


def local_rank_pids(sink: Sink) -> list[int]:
    """PIDs of the run's rank processes that reported this machine as their host.

    A PID reported from another host names some unrelated process here: never killed.
    """
    me = socket.gethostname()
    return [pid for pid, host in sink.pid_hosts.items() if host in ("", me)]
