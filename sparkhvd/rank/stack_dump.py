"""Every thread's stack, on request, from a rank that may be stuck anywhere.

:func:`install` (every rank, every launcher) registers :mod:`faulthandler` on
:data:`~sparkhvd.common.protocol.STACKS_SIGNAL`: the dump is written by C code from the signal
handler, so it works while the main thread sits in a collective, in C++ or in a blocking read --
exactly when a Python-level handler would never run. It writes into a pipe; a small thread of ours
reads it, names the threads it can (``threading``'s names for faulthandler's ids) and sends the
text to the driver as a :class:`~sparkhvd.common.protocol.Stacks` event.

A rank that crashes by itself -- a native library's SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL --
writes every thread's stack to its stderr as it dies (:func:`install_crash_dump`), so its
``[rank N]`` log says where it was and the ``TrainingError``'s last lines show the main
thread's frames (faulthandler lists it last); the signal still ends the process as before.

Who sends the signal: the rank's Spark task (barrier launcher, asked over its control channel),
the driver itself for ranks on its own machine, or -- for launchers with no channel to ranks on
other hosts (horovod's; :data:`~sparkhvd.common.protocol.STACKS_POLL_ENV`) -- the rank, when it
finds a new request in its run folder.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import select
import socket
import sys
import threading
from typing import Optional

from sparkhvd.common import protocol
from sparkhvd.common.events import emit, events

__side__ = "rank"

#: How long the dump may pause before it counts as complete.
QUIET_S = 0.3
#: How often a polling rank looks for a request in the run folder.
POLL_S = 2.0

_THREAD = re.compile(r"^(Thread|Current thread) (0x[0-9a-f]+)", re.M)
_state: dict = {"installed": False}


def _named(text: str) -> str:
    """faulthandler's thread ids with their ``threading`` names: ``Thread 0x7f.. "MainThread"``."""
    names = {f"0x{t.ident:016x}": t.name for t in threading.enumerate() if t.ident}

    def name(m: re.Match) -> str:
        known = names.get(m.group(2))
        return f'{m.group(0)} "{known}"' if known else m.group(0)

    return _THREAD.sub(name, text)


def _read_dumps(fd: int) -> None:
    while True:
        chunks = [os.read(fd, 1 << 16)]
        if not chunks[0]:
            return
        while select.select([fd], [], [], QUIET_S)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode("utf-8", "replace")
        with contextlib.suppress(Exception):
            emit(protocol.Stacks(rank=events.rank, pid=os.getpid(), host=socket.gethostname(),
                                 text=_named(text)))


def _poll_requests() -> None:
    """Ranks without a channel from the driver: look for a new request in the run folder."""
    import time

    from sparkhvd.runfolder.rank_files import run_files

    files = run_files()
    seen: Optional[str] = None
    while True:
        time.sleep(POLL_S)
        try:
            if not files.exists(protocol.STACKS_REQUEST_FILE):
                continue
            request = json.loads(files.read_bytes(protocol.STACKS_REQUEST_FILE))
        except Exception:  # noqa: BLE001 - the run is ending, or the service is away
            continue
        if seen is None:
            seen = request.get("id") if request.get("at", 0) < _state["started"] else None
        if request.get("id") != seen:
            seen = request.get("id")
            os.kill(os.getpid(), protocol.STACKS_SIGNAL)


def install_crash_dump() -> None:
    """Make a fatal signal of this process's own write every thread's stack to its stderr."""
    stream = sys.__stderr__
    if stream is not None and not faulthandler.is_enabled():
        faulthandler.enable(file=stream, all_threads=True)


def install() -> None:
    """Make this process dump its stacks on :data:`~sparkhvd.common.protocol.STACKS_SIGNAL`,
    and on a crash of its own (:func:`install_crash_dump`)."""
    import time

    if _state["installed"]:
        return
    install_crash_dump()
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, False)
    _state["file"] = os.fdopen(write_fd, "w")  # kept open for faulthandler
    faulthandler.register(protocol.STACKS_SIGNAL, file=_state["file"],
                          all_threads=True, chain=False)
    threading.Thread(target=_read_dumps, args=(read_fd,), daemon=True,
                     name="sparkhvd-stacks").start()
    _state.update(installed=True, started=time.time())
    if os.environ.pop(protocol.STACKS_POLL_ENV, None):
        threading.Thread(target=_poll_requests, daemon=True,
                         name="sparkhvd-stacks-poll").start()
