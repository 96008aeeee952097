"""Running a training script written for `horovodrun` or `torchrun` in every rank: read on the
driver (:func:`read_script`), run as ``__main__`` in the rank (:func:`run_script`)."""
from __future__ import annotations

import os
import sys
from typing import Sequence

from sparkhvd.common.protocol import exit_status

__side__ = "common"


def read_script(path: str) -> str:
    """The script's source, read on the driver (the ranks may not see the driver's disk)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No training script at {path}")
    with open(path, encoding="utf-8") as f:
        return f.read()


def run_script(source: str, path: str, argv: Sequence[str]) -> int:
    """Execute a script's source as ``__main__`` with ``sys.argv = [path, *argv]``.

    Returns 0, or the script's ``sys.exit`` status; a non-zero status is raised as
    ``SystemExit`` so the rank fails and the driver reports it.
    """
    folder = os.path.dirname(os.path.abspath(path))
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *argv]
    if os.path.isdir(folder):
        sys.path.insert(0, folder)  # the script's own helper modules, when the rank can see them
    try:
        code = compile(source, path, "exec")
        exec(code, {"__name__": "__main__", "__file__": path})  # noqa: S102 - the user's script
    except SystemExit as exc:
        status = exit_status(exc)
        if status:
            raise RuntimeError(f"{os.path.basename(path)} exited with status {status}") from None
        return 0
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0
