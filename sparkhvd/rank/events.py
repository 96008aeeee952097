"""What a rank reports: typed events (:mod:`sparkhvd.common.protocol`), apart from its output.

They go to the launcher's event pipe (its descriptor is taken out of the environment at once, so
a child process the user starts cannot write into it), else as marker lines on stderr.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Optional

from sparkhvd.common import protocol


class _Events:
    """Where :func:`emit` writes: the launcher's event pipe, else marker lines on stderr."""

    def __init__(self) -> None:
        self.fd: Optional[int] = None
        self.lock = threading.Lock()
        self.rank = 0

    def take_from_env(self) -> None:
        # Taken out of the environment at once: a child process the user starts must not
        # inherit the number and write into whatever file it names there.
        raw = os.environ.pop(protocol.EVENTS_FD_ENV, None)
        if raw and self.fd is None:
            with contextlib.suppress(ValueError):
                self.fd = int(raw)

    def send(self, msg: Any) -> None:
        if self.fd is not None:
            data = protocol.encode(msg)
            try:
                with self.lock:
                    while data:
                        data = data[os.write(self.fd, data):]
                return
            except OSError:
                self.fd = None
        with contextlib.suppress(OSError, ValueError):
            print(protocol.as_text(msg), file=sys.__stderr__, flush=True)


#: This process's event sender (the rank it reports as, after elastic resets).
events = _Events()


def emit(msg: Any) -> None:
    """Send an event (a :mod:`sparkhvd.common.protocol` message) to the driver."""
    events.send(msg)


def error_event(rank: int, exc: BaseException) -> protocol.Error:
    """The :class:`~sparkhvd.common.protocol.Error` event for an exception that ended a rank."""
    return protocol.Error(
        rank=rank, exc_type=type(exc).__name__, message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        time=time.time())


def announce(rank: int) -> None:
    """Tell the driver which rank this process is (again, after an elastic reset)."""
    events.rank = rank
    emit(protocol.Started(rank=rank, pid=os.getpid(), host=socket.gethostname()))
