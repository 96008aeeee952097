"""The lifecycle every launcher shares: watch, abort, cancel, kill -- written once.

A launch runs in a helper thread (Spark's ``collect()``, horovod's ``run`` or the local process
loop) while the caller's thread watches it, so that a notebook's stop button (``KeyboardInterrupt``)
and ``run(timeout=...)`` always work. Whatever ends the watch -- a failed rank, the timeout, an
interrupt -- the launcher's ``stop`` runs (tell the ranks to stop, cancel the Spark job group,
kill what is left on this machine) before the exception propagates.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterable, Optional

from ..errors import SessionError

log = logging.getLogger(__name__)

#: A rank that reported an exception but has not exited after this long is stopped anyway
#: (e.g. multiprocessing's exit handler waiting on a child, or a hung collective).
ERROR_EXIT_GRACE_S = 5.0
#: The TimeoutError of a Spark launch that ran past run(timeout=...).
SPARK_TIMEOUT = ("The training did not finish within {timeout:g} s; the ranks were stopped and "
                 "the Spark job cancelled.")


def supervise(target: Callable[[], Any], *, timeout: Optional[float],
              check: Callable[[float], None], stop: Callable[[], None],
              name: str, timeout_message: str, poll_s: float = 0.1) -> Any:
    """Run ``target()`` in a thread; return its value or raise its exception.

    ``check(elapsed_s)`` runs at every poll and may raise (a failed rank); past ``timeout`` a
    ``TimeoutError(timeout_message)`` is raised. On any exception ``stop()`` runs first.
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
            if timeout is not None and elapsed > timeout:
                raise TimeoutError(timeout_message.format(timeout=timeout))
    except BaseException:
        try:
            stop()
        finally:
            thread.join(60)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def session_stopped(sc: Any) -> bool:
    """Whether a SparkContext was stopped, or is stopping (Java marks that first, before it
    kills the tasks; Python clears ``_jsc`` last)."""
    jsc = getattr(sc, "_jsc", None) if sc is not None else None
    if jsc is None:
        return True
    try:
        return bool(jsc.sc().isStopped())
    except Exception:  # noqa: BLE001 - the gateway is going away with the context
        return True


def stopped_session_error(during: bool) -> SessionError:
    when = "while the ranks ran" if during else "before the run"
    return SessionError(
        f"The SparkSession was stopped {when}. Fix: create a new one "
        "(SparkSession.builder.getOrCreate()) and pass it as spark=, or pass spark=None to let "
        "HorovodRunner use the active session or start a local one.")


class SparkJob:
    """One Spark job group for one run: started from the launch thread, cancellable from any."""

    def __init__(self, sc: Any, group: str, description: str) -> None:
        self.sc, self.group, self.description = sc, group, description

    def run(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` (which starts Spark jobs) inside the job group."""
        self.sc.setJobGroup(self.group, self.description, interruptOnCancel=True)
        try:
            return action()
        except Exception as exc:
            if session_stopped(self.sc) or "SparkContext was shut down" in str(exc) or \
                    "stopped SparkContext" in str(exc):
                raise stopped_session_error(during=True) from None
            raise

    def cancel(self) -> None:
        """Cancel the group's jobs; a stopped session has none left to cancel."""
        if session_stopped(self.sc):
            return
        try:
            self.sc.cancelJobGroup(self.group)
        except Exception as exc:  # noqa: BLE001 - stopped meanwhile (Py4J errors)
            log.debug("could not cancel job group %s: %s", self.group, exc)


def kill_local_pids(pids: Iterable[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the given processes of *this machine* that still live."""
    import psutil

    from ..rank import stop_processes

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    stop_processes(procs, grace_s)


def local_rank_pids(sink: Any) -> list[int]:
    """PIDs of the run's rank processes that reported this machine as their host.

    A PID reported from another host names some unrelated process here: never killed.
    """
    me = socket.gethostname()
    return [pid for pid, host in getattr(sink, "pid_hosts", {}).items() if host in ("", me)]
