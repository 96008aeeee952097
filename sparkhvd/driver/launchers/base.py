"""What the Spark launchers share: their one blocking call, waited for off the run's thread.

Spark's ``collect()`` and horovod's ``run`` block until the ranks end, so a launch runs it in a
helper thread (:class:`BlockingCall`) that only keeps what the call returned or raised, while
the run's thread polls the group a step at a time
(:meth:`sparkhvd.driver.attempt.Attempt.poll`) -- a notebook's stop button
(``KeyboardInterrupt``) and ``run(timeout=...)`` always work. Stopping a Spark launch ends with
:func:`kill_local_ranks`: what is left of its ranks on this machine.
"""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Optional

from sparkhvd.common.proctree import stop_pids
from sparkhvd.driver.launchers.seam import Sink

__side__ = "driver"

#: The TimeoutError of a Spark launch that ran past run(timeout=...) (which counts from the
#: call: waiting for slots and for the tasks to start included).
SPARK_TIMEOUT = ("The training did not finish within {timeout:g} s; the ranks were stopped and "
                 "the Spark job cancelled.")


class BlockingCall:
    """``fn()`` in a daemon thread named ``name``: whether it returned, and its value or the
    exception it raised -- kept, never raised in the thread (the poll reads it as data)."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as exc:  # noqa: BLE001 - read by the polling thread
            self.error = exc

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the call; whether it has returned."""
        self._thread.join(seconds)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


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
