"""The adapter to horovod's launchers: Spark tasks (``horovod.spark.run``) or local processes.

Both paths run :func:`sparkhvd.rank.rank_main` in every rank and send the ranks' output through a
:class:`~sparkhvd.logs.RankLogRouter`. A rank failure comes back as :class:`LaunchFailure` with the
rank and exit code parsed from horovod's message, for the runner to turn into a ``TrainingError``.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import cloudpickle
import logging

from .logs import RankLogRouter
from .rank import rank_main

log = logging.getLogger(__name__)

_PROCESS_FAILED = re.compile(r"Process name: (?P<rank>\d+)\s+Exit code: (?P<code>-?\d+)")


@dataclass
class LaunchFailure(Exception):
    """A rank process exited non-zero (rank/exit code as horovod reported them)."""

    rank: Optional[int]
    exit_code: Optional[int]
    detail: str

    def __str__(self) -> str:
        return self.detail


def _parse_failure(exc: BaseException) -> Optional[LaunchFailure]:
    m = _PROCESS_FAILED.search(str(exc))
    if not m:
        return None
    return LaunchFailure(int(m.group("rank")), int(m.group("code")), str(exc))


@contextlib.contextmanager
def preserved_signal_handlers() -> Iterator[None]:
    """Restore SIGINT/SIGTERM handlers that horovod's launcher replaces for good.

    ``horovod.runner.gloo_run.launch_gloo`` installs handlers that only set an event; left in
    place, a notebook's stop button would never raise ``KeyboardInterrupt`` again.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextlib.contextmanager
def quiet_cancelled_spark_thread() -> Iterator[None]:
    """Silence horovod's Spark thread when *we* cancelled its job group.

    When a rank fails, horovod cancels the Spark job group and its thread dies with a
    Py4JJavaError ("cancelled job group horovod.spark.run") printed with a Java stack trace;
    the user gets the real error from us instead. Any other thread exception is reported as usual.
    """
    previous = threading.excepthook

    def hook(args) -> None:
        name = getattr(args.thread, "name", "") or ""
        if name.endswith("(run_spark)") and "cancelled job group" in str(args.exc_value):
            log.debug("horovod's Spark job group was cancelled: %s", args.exc_value)
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def launch_spark(np: int, payload: bytes, options: Mapping[str, Any], *, env: Mapping[str, str],
                 router: RankLogRouter, start_timeout: int, nics: Optional[set[str]],
                 verbose: bool) -> list[Any]:
    """Run ``np`` ranks as Spark tasks of the active SparkContext; results in rank order."""
    import horovod.spark

    with preserved_signal_handlers(), quiet_cancelled_spark_thread():
        try:
            return horovod.spark.run(
                rank_main, args=(payload, dict(options)), num_proc=np,
                start_timeout=start_timeout, use_gloo=True, env=dict(env),
                stdout=router.stdout, stderr=router.stderr, verbose=2 if verbose else 0,
                nics=nics, prefix_output_with_timestamp=False)
        except RuntimeError as exc:
            failure = _parse_failure(exc)
            if failure is None:
                raise
            raise failure from exc
        finally:
            router.close()


def _pump(pipe, channel, rank: int, tag: str) -> None:
    """Copy a rank's pipe to the router as ``[rank]<tag>:line`` (horovod's wire format)."""
    for raw in iter(pipe.readline, b""):
        channel.write(f"[{rank}]<{tag}>:" + raw.decode("utf-8", "replace").rstrip("\n") + "\n")
    pipe.close()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch_local(n: int, payload: bytes, options: Mapping[str, Any], *, env: Mapping[str, str],
                 router: RankLogRouter, start_timeout: int, verbose: bool) -> list[Any]:
    """Run ``n`` ranks as processes on this machine (no Spark); results in rank order.

    Uses horovod's rendezvous server and Gloo, with plain subprocesses (each in its own process
    group, so that a failure or an interrupt terminates every rank and its children).
    """
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    options = dict(options)
    with tempfile.TemporaryDirectory(prefix="sparkhvd-local-") as work:
        payload_path = os.path.join(work, "payload.pkl")
        with open(payload_path, "wb") as f:
            f.write(payload)
        rendezvous = RendezvousServer(verbose=1 if verbose else 0)
        plan = get_host_assignments(parse_hosts(f"localhost:{n}"), n)
        port = rendezvous.start()
        rendezvous.init(plan)
        base_env = {**env, **{k: str(v) for k, v in
                              create_run_env_vars("127.0.0.1", {"lo"}, port).items()},
                    "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "sparkhvd._rank_process", payload_path, work, json.dumps(options)]
        procs: list[subprocess.Popen] = []
        pumps: list[threading.Thread] = []
        exit_times: dict[int, float] = {}
        try:
            for slot in plan:
                proc = subprocess.Popen(command, env={**base_env, **create_slot_env_vars(slot)},
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                procs.append(proc)
                for pipe, channel, tag in ((proc.stdout, router.stdout, "stdout"),
                                           (proc.stderr, router.stderr, "stderr")):
                    t = threading.Thread(target=_pump, args=(pipe, channel, slot.rank, tag),
                                         daemon=True)
                    t.start()
                    pumps.append(t)
            while len(exit_times) < n:
                for rank, proc in enumerate(procs):
                    if rank not in exit_times and proc.poll() is not None:
                        exit_times[rank] = time.monotonic()
                if any(p.returncode not in (None, 0) for p in procs):
                    break  # like horovod: one failed rank terminates the others
                time.sleep(0.05)
        finally:
            for proc in procs:
                _kill_group(proc)
            for t in pumps:
                t.join(10)
            rendezvous.stop()
            router.close()
        for rank, proc in enumerate(procs):
            exit_times.setdefault(rank, time.monotonic())
        failed = sorted((exit_times[r], r, p.returncode) for r, p in enumerate(procs)
                        if p.returncode != 0)
        if failed:
            _, rank, code = failed[0]  # the first to exit; the others were terminated after it
            raise LaunchFailure(rank, code, f"local rank {rank} exited with status {code}")
        results = []
        for rank in range(n):
            path = os.path.join(work, f"rank-{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(cloudpickle.load(f))
            else:
                results.append(None)
        return results
