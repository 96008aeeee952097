"""Run a test's rank scripts as processes that start with torch already imported.

The host-copy unit tests run real ranks (a gloo group met through a file) as separate
processes: each `python script.py` spent about 3 s of CPU importing torch before its first
line, several times a test. Here every such process is forked from one multiprocessing
forkserver that imported torch once (it has started no thread to copy: torch starts its
thread pools on first use), so a rank begins with ``import torch`` done and runs the script
as ``__main__`` with its own arguments, environment and output file -- what the script does
is unchanged. sparkhvd itself is not preloaded: it is imported by each rank, after its
environment is set.
"""
from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
from typing import Optional

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])


def _run_script(script: str, argv: list[str], env: dict, output: str) -> None:
    """In the forked child: the script's own process, as `python script argv...` would be."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        sys.stdout.flush()
        os._exit(end.code if isinstance(end.code, int) else 1)
    except BaseException:  # noqa: BLE001 - said as Python would say it, then the status 1
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


class Rank:
    """One script run in a preloaded process: ``wait()`` gives its output and exit status."""

    def __init__(self, script: str, argv: list[str], env: dict, output: str):
        self.output = output
        self.process = _CONTEXT.Process(target=_run_script, args=(script, argv, env, output))
        self.process.start()

    def wait(self, timeout: float) -> tuple[Optional[int], str]:
        """(exit status, stdout and stderr together); a rank still running at ``timeout`` is
        killed (status None)."""
        self.process.join(timeout)
        status = self.process.exitcode
        if status is None:
            self.process.kill()
            self.process.join()
        with open(self.output, errors="replace") as f:
            return status, f.read()


def run_ranks(script: str, argvs: list[list[str]], envs: list[dict], outputs: list[str],
              timeout: float = 150) -> list[tuple[Optional[int], str]]:
    """Start every rank at once (they meet each other), then each one's (status, output)."""
    ranks = [Rank(script, argv, env, output) for argv, env, output in zip(argvs, envs, outputs)]
    return [rank.wait(timeout) for rank in ranks]
