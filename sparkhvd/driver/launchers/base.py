"""The lifecycle every launcher shares: watch, abort, cancel, kill -- written once.

A launch runs in a helper thread (Spark's ``collect()``, horovod's ``run`` or the local process
loop) while the caller's thread watches it, so that a notebook's stop button (``KeyboardInterrupt``)
and ``run(timeout=...)`` always work. Whatever ends the watch -- a failed rank, the timeout, an
interrupt -- the launcher's ``stop`` runs (tell the ranks to stop, cancel the Spark job by its
tag or group, kill what is left on this machine) before the exception propagates.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Optional

from sparkhvd.common.errors import SessionError
from sparkhvd.common.proctree import stop_pids

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


def watch(target: Callable[[], Any], *, timeout: Optional[float],
          check: Callable[[float], None], stop: Callable[[], None],
          name: str, timeout_message: str, poll_s: float = 0.1, monitor: Any = None) -> Any:
    """Run ``target()`` in a thread; return its value or raise its exception.

    ``check(elapsed_s)`` runs at every poll and may raise (a failed rank); so does the run's
    ``monitor`` (:class:`~sparkhvd.driver.monitor.RunMonitor`: stack requests, stalls). Past
    ``timeout`` (what is left of the run's limit) a ``TimeoutError(timeout_message)`` is raised, with where each rank was (their
    stacks are collected before they are stopped). On any exception ``stop()`` runs first.
    """
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the watching thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        while thread.is_alive():
            thread.join(poll_s)
            elapsed = time.monotonic() - started
            check(elapsed)
            if monitor is not None:
                monitor.tick()
            if timeout is not None and elapsed > timeout:
                explained = monitor.explain_timeout() if monitor is not None else ""
                raise TimeoutError(timeout_message + explained)
    except BaseException as exc:
        try:
            stop()
        finally:
            # a lost session leaves Spark's call in its client's retries: do not wait for it
            thread.join(2 if isinstance(exc, SessionError) else 60)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def stopper(cancel: Callable[[], None], sink: Any) -> Callable[[], None]:
    """A Spark launch's ``stop``: ``cancel()`` (tell the ranks, cancel the Spark job), then end
    the run's rank processes on this machine that are still there (SIGKILL: to a rank, SIGTERM
    is a notice, :mod:`sparkhvd.elastic.notices`)."""
    def stop() -> None:
        cancel()
        stop_pids(local_rank_pids(sink), kill=True)

    return stop


def local_rank_pids(sink: Any) -> list[int]:
    """PIDs of the run's rank processes that reported this machine as their host.

    A PID reported from another host names some unrelated process here: never killed.
    """
    me = socket.gethostname()
    return [pid for pid, host in sink.pid_hosts.items() if host in ("", me)]
