"""Stacks of a process from outside, with py-spy where it is installed.

The fallback when a rank cannot answer a stack request itself (its main thread holds the GIL in
C code, or it ignores signals): ``py-spy dump`` reads the stacks from the process' memory. It
needs ptrace rights over the process (same user; containers may forbid it) -- a failure is
reported, never raised.
"""
from __future__ import annotations

import shutil
import subprocess
from typing import Any, Optional

__side__ = "common"

#: py-spy gets this long to read a process.
PY_SPY_TIMEOUT_S = 10.0


def available() -> bool:
    return shutil.which("py-spy") is not None


def stacks_event(rank: int, pid: int) -> Optional[Any]:
    """A rank's :class:`~sparkhvd.common.protocol.Stacks` read with py-spy, or None."""
    import socket

    from sparkhvd.common import protocol

    text = dump(pid)
    if not text:
        return None
    return protocol.Stacks(rank=rank, pid=pid, host=socket.gethostname(), text=text,
                           source="py-spy")


def dump(pid: int) -> Optional[str]:
    """``py-spy dump`` of ``pid`` (every thread), or None when py-spy is missing or failed."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None
