"""``python -m sparkhvd.rank.supervisor PAYLOAD WORK_DIR OPTIONS_JSON``: one rank, supervised.

The process forks at once: the child runs the rank (:func:`sparkhvd.rank.bootstrap.rank_main`)
and stores its kept return value as ``WORK_DIR/rank-N.pkl``; the parent stays a small supervisor that

- is a *child subreaper*, so whatever the rank starts -- even daemonised helpers -- stays its
  descendant;
- ends every such descendant as soon as the rank ends, however it ends (return, exception,
  ``os._exit``, a signal), so no helper outlives the run or holds its output pipes open;
- on SIGTERM (the launcher aborting, or -- through ``PR_SET_PDEATHSIG`` -- the process that
  started it dying) kills the rank and everything below it, then leaves; once the rank has
  ended, a SIGTERM changes nothing (the tree is being ended already) and is ignored, so the
  handler never runs inside that clean-up;
- exits with the rank's status (re-raising a fatal signal, so the launcher sees ``-9``).

Kept apart from :mod:`sparkhvd.rank.bootstrap` so that ``-m`` does not re-execute a module the
package already imported.
"""
from __future__ import annotations

import json
import os
import signal
import sys

from sparkhvd.common import protocol
from sparkhvd.common.proctree import (
    become_subreaper,
    die_with_parent,
    end_tree_and_die,
    kill_descendants,
    preload,
)
from sparkhvd.common.protocol import PARENT_PID_ENV, exit_status

__side__ = "rank"


def run_rank(payload_path: str, work: str, options: dict) -> int:
    """The rank itself (the forked child): run, store the kept result, return an exit status."""
    from sparkhvd.common.fileio import atomic_write
    from sparkhvd.common.identity import current_rank
    from sparkhvd.rank.bootstrap import rank_main

    with open(payload_path, "rb") as f:
        payload = f.read()
    data = rank_main(payload, options, pickle_result=True)
    if data is not None:
        atomic_write(os.path.join(work, protocol.result_file(current_rank().rank)), data)
    return 0


def _exit(code: int) -> None:
    """Run Python's exit handlers and flush, then leave without C++ static destructors.

    Third-party native libraries (pyarrow's and TensorFlow's thread pools, Gloo) can abort
    with "terminate called without an active exception" while the interpreter tears down,
    turning a finished rank into a SIGABRT.
    """
    import atexit
    import logging
    import traceback

    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    except BaseException:  # noqa: BLE001 - exit handlers must not change the outcome
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _child(argv: list[str], supervisor: int) -> None:
    die_with_parent(signal.SIGKILL)  # the rank dies with its supervisor
    if os.getppid() != supervisor:
        os._exit(1)
    payload_path, work, options_json = argv
    try:
        status = run_rank(payload_path, work, json.loads(options_json))
    except SystemExit as exc:
        status = exit_status(exc)
    except BaseException:  # noqa: BLE001 - reported by rank_main; the traceback goes to stderr
        import traceback

        traceback.print_exc()
        status = 1
    _exit(status)


def supervise(argv: list[str]) -> None:
    """Fork the rank, wait for it, end its descendants, exit like it."""
    # End with whoever started us (a Spark task, the driver): asked here rather than between
    # fork and exec; if it already died, the check below sees us re-parented.
    die_with_parent(signal.SIGTERM)
    starter = os.environ.pop(PARENT_PID_ENV, "")
    if starter.isdigit() and os.getppid() != int(starter):
        os._exit(143)
    become_subreaper()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(argv, me)

    def on_term(signum, _frame):  # a dying parent may signal more than once: ignore repeats
        end_tree_and_die((signal.SIGTERM, signal.SIGHUP), signum)

    preload()  # the handler imports nothing
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = 1 << 8
    while True:
        try:
            done, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if done == pid:
            status = st
            break
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the rank ended: its tree ends right here
        signal.signal(sig, signal.SIG_IGN)
    kill_descendants()
    code = os.waitstatus_to_exitcode(status)
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # die the same way, so the launcher sees the signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    supervise(sys.argv[1:])
