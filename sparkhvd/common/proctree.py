"""Process-tree control, written once: child subreaper, death with the parent, stopping trees.

Linux ``prctl`` calls are best effort (elsewhere the launchers' process-group kills remain).
psutil is imported inside the functions, so that importing this module costs nothing -- except
where a signal handler will stop the tree: :func:`preload` imports it first, since a handler
that imports could run while the same import is half done on the interrupted thread (and find
a partial module).
"""
from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Iterable

__side__ = "common"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def become_subreaper() -> None:
    """Orphaned descendants (daemonised helpers) are re-parented to this process, so that
    :func:`kill_descendants` finds them too."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets ``sig`` when the process that started it dies."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def preload() -> None:
    """Import what stopping a tree needs, now, before any signal handler may need it."""
    import psutil  # noqa: F401


def descendants() -> list[Any]:
    """This process's descendants (``psutil.Process`` objects)."""
    import psutil

    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def stop_processes(procs: list[Any], grace_s: float = 5.0) -> None:
    """SIGTERM the given ``psutil.Process`` objects, then SIGKILL those still alive after
    ``grace_s`` (the one way sparkhvd stops processes it owns politely)."""
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def stop_pids(pids: Iterable[int], grace_s: float = 5.0, kill: bool = False) -> None:
    """:func:`stop_processes` for PIDs of this machine and everything they started (those
    already gone are skipped): the descendants are listed *before* anything is stopped, since a
    killed parent's children are re-parented out of reach. ``kill``: SIGKILL the given PIDs
    at once (rank processes, to which SIGTERM is a notice to checkpoint, not to stop); their
    descendants are still stopped politely."""
    import psutil

    procs: dict[int, Any] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for child in proc.children(recursive=True):
                procs.setdefault(child.pid, child)
            if kill:
                proc.kill()
            else:
                procs.setdefault(proc.pid, proc)
    stop_processes(list(procs.values()), grace_s)


def end_tree_on_term() -> None:
    """On SIGTERM, end this process's descendants, then die of SIGTERM as usual.

    For ranks that no supervisor of ours watches (horovod's launcher starts them itself): a
    stopped rank must not leave the processes it started behind.
    """
    preload()
    signal.signal(signal.SIGTERM, lambda signum, _frame: end_tree_and_die((signum,), signum))


def end_tree_and_die(ignored: tuple[int, ...], signum: int) -> None:
    """A signal handler's work: ignore ``ignored`` (repeats while the tree ends: a second run
    of the handler would leave before the first had killed everything), SIGKILL every
    descendant, then die of ``signum`` as its default action would. Call :func:`preload`
    before installing it."""
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)
    kill_descendants()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def end_children(grace_s: float = 1.0) -> None:
    """Politely stop every process this one started (data loaders, tools, workers)."""
    stop_processes(descendants(), grace_s)


def kill_descendants(rounds: int = 3) -> None:
    """SIGKILL every descendant now -- again, since a dying process may start another."""
    import psutil

    for _ in range(rounds):
        procs = descendants()
        if not procs:
            return
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=2)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group (a rank started in its own session), if it is still there."""

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
