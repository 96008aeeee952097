"""The adapter to horovod's launchers: Spark tasks (``horovod.spark.run``) or local processes.

Both paths run :func:`sparkhvd.rank.rank_main` in every rank and send the ranks' output through a
:class:`~sparkhvd.logs.RankLogRouter`. A rank failure comes back as :class:`LaunchFailure` with the
rank and exit code parsed from horovod's message, for the runner to turn into a ``TrainingError``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import cloudpickle

from .logs import RankLogRouter
from .rank import rank_main

log = logging.getLogger(__name__)

_PROCESS_FAILED = re.compile(r"Process name: (?P<rank>\d+)\s+Exit code: (?P<code>-?\d+|None)")


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
    code = None if m.group("code") == "None" else int(m.group("code"))
    return LaunchFailure(int(m.group("rank")), code, str(exc))


def _send_one_live(self, addr, req, stream=None):
    """horovod's ``BasicClient._send_one``, but streamed output is passed on as it arrives.

    horovod copies a rank's output with ``shutil.copyfileobj``, whose 64 KiB blocking reads hold
    every line back until 64 KiB piled up or the rank exited. ``read1`` returns what is there.
    """
    import codecs
    import socket

    from horovod.runner.common.util.network import AckStreamResponse

    for attempt in range(self._attempts):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.connect(addr)
            rfile = sock.makefile("rb")
            wfile = sock.makefile("wb")
            try:
                self._wire.write(req, wfile)
                resp = self._wire.read(rfile)
                if stream and isinstance(resp, AckStreamResponse):
                    decoder = codecs.getincrementaldecoder("utf-8")("replace")
                    while True:
                        chunk = rfile.read1(65536)
                        text = decoder.decode(chunk, final=not chunk)
                        if text:
                            stream.write(text)
                        if not chunk:
                            break
                return resp
            finally:
                rfile.close()
                wfile.close()
        except Exception:  # noqa: BLE001 - same retry policy as horovod's
            if attempt == self._attempts - 1:
                raise
        finally:
            sock.close()


@contextlib.contextmanager
def horovod_launch_hooks(elastic: bool = False) -> Iterator[dict]:
    """Take over two things horovod's launcher does by itself.

    - ``launch_gloo`` installs SIGINT/SIGTERM handlers that only set an event (so a notebook's
      stop button would never raise ``KeyboardInterrupt`` again, and it fails outside the main
      thread). We hand it *our* event instead: setting it makes horovod abort every rank's command
      through the task services, on whatever executor the rank runs.
    - The Spark job group name is recorded, so we can cancel exactly that job group.
    - Rank output is streamed to the driver as it is printed (see :func:`_send_one_live`).
    - Spark tasks keep a finished command for 1 s instead of 3 s (see
      :func:`sparkhvd.rank.spark_task_mapper`).
    - When one rank exits non-zero the others are aborted at once (horovod's Spark path would
      wait for them to finish by themselves) -- except in ``elastic`` mode, where horovod's
      elastic driver decides whether the remaining ranks carry on.
    """
    from horovod.runner import gloo_run
    from horovod.runner.common.util import network
    from horovod.spark.driver import job_id

    hooks: dict = {"stop": threading.Event(), "job_group": None}
    original_event, original_next = gloo_run.register_shutdown_event, job_id.next_job_id

    def next_job_id() -> int:
        value = original_next()
        hooks["job_group"] = f"horovod.spark.run.{value}"
        return value

    from horovod.spark import gloo_run as spark_gloo_run

    original_exec_fn = spark_gloo_run._exec_command_fn

    def exec_command_fn(*args: Any, **kwargs: Any):
        run_one = original_exec_fn(*args, **kwargs)

        def run_and_watch(command, slot_info, events):
            exit_code, when = run_one(command, slot_info, events)
            if exit_code != 0 and not elastic:
                hooks["stop"].set()  # one rank failed: stop the others now, not when they finish
            return exit_code, when

        return run_and_watch

    import functools

    from horovod.spark import runner as spark_runner

    from .rank import spark_task_mapper

    def make_mapper(driver_addresses, settings, use_gloo, is_elastic):
        return functools.partial(spark_task_mapper, driver_addresses, settings.key, settings,
                                 use_gloo, is_elastic)

    original_mapper = spark_runner._make_mapper
    spark_runner._make_mapper = make_mapper
    original_send = network.BasicClient._send_one
    spark_gloo_run._exec_command_fn = exec_command_fn
    gloo_run.register_shutdown_event = lambda: hooks["stop"]
    job_id.next_job_id = next_job_id
    network.BasicClient._send_one = _send_one_live
    try:
        yield hooks
    finally:
        gloo_run.register_shutdown_event = original_event
        job_id.next_job_id = original_next
        network.BasicClient._send_one = original_send
        spark_gloo_run._exec_command_fn = original_exec_fn
        spark_runner._make_mapper = original_mapper


def kill_local_pids(pids: Iterable[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the given processes if they run on this machine and still live."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


@contextlib.contextmanager
def quiet_cancelled_spark_thread() -> Iterator[None]:
    """Silence horovod's Spark thread when *we* cancelled its job group.

    When a rank fails (or the driver is interrupted), the Spark job is cancelled and horovod's
    thread dies with a Py4JJavaError ("... cancelled ...") printed with a Java stack trace;
    the user gets the real error from us instead. Any other thread exception is reported as usual.
    """
    previous = threading.excepthook

    def hook(args) -> None:
        name = getattr(args.thread, "name", "") or ""
        if name.endswith("(run_spark)") and "cancel" in str(args.exc_value):
            log.debug("horovod's Spark job group was cancelled: %s", args.exc_value)
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def watch_thread(thread: threading.Thread, *, timeout: Optional[float],
                 check: Optional[Callable[[float], None]] = None, poll_s: float = 0.1) -> None:
    """Start ``thread`` and wait for it, staying interruptible.

    ``check(elapsed_s)`` runs at every poll and may raise; past ``timeout`` a ``TimeoutError``
    is raised. The caller cleans up (abort, cancel, join) on any exception.
    """
    started = time.monotonic()
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        elapsed = time.monotonic() - started
        if check is not None:
            check(elapsed)
        if timeout is not None and elapsed > timeout:
            raise TimeoutError(f"The training did not finish within {timeout:g} s; the "
                               "ranks were stopped and the Spark job cancelled.")


def launch_spark(np: int, payload: bytes, options: Mapping[str, Any], *, env: Mapping[str, str],
                 router: RankLogRouter, start_timeout: int, nics: Optional[set[str]],
                 verbose: bool, timeout: Optional[float] = None,
                 elastic: Optional[tuple[int, int]] = None) -> list[Any]:
    """Run ``np`` ranks as Spark tasks of the active SparkContext; results in rank order.

    With ``elastic=(min_np, max_np)`` horovod's elastic mode is used (``run_elastic``): ranks
    may leave and join; the training function must use ``hvd.elastic`` state.

    horovod runs in a helper thread while this thread watches the clock and stays interruptible:
    on ``timeout`` (``TimeoutError``) or ``KeyboardInterrupt`` the ranks are aborted through
    horovod's task services, the Spark job group is cancelled, leftover local rank processes are
    killed, and the exception propagates. The SparkSession stays usable.
    """
    import horovod.spark
    from pyspark import SparkContext

    outcome: dict = {}

    common = dict(args=(payload, dict(options)), num_proc=np, start_timeout=start_timeout,
                  env=dict(env), stdout=router.stdout, stderr=router.stderr,
                  verbose=2 if verbose else 0, nics=nics, prefix_output_with_timestamp=False)

    def target() -> None:
        try:
            if elastic:
                outcome["results"] = horovod.spark.run_elastic(
                    rank_main, min_num_proc=elastic[0], max_num_proc=elastic[1],
                    elastic_timeout=start_timeout, **common)
            else:
                outcome["results"] = horovod.spark.run(rank_main, use_gloo=True, **common)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = exc

    with horovod_launch_hooks(elastic=bool(elastic)) as hooks, quiet_cancelled_spark_thread():
        thread = threading.Thread(target=target, name="sparkhvd-horovod", daemon=True)
        try:
            watch_thread(thread, timeout=timeout, poll_s=0.2)
        except BaseException:
            hooks["stop"].set()
            sc = SparkContext._active_spark_context
            if sc is not None and hooks["job_group"]:
                sc.cancelJobGroup(hooks["job_group"])
            thread.join(60)
            kill_local_pids(router.all_pids)
            raise
        finally:
            router.close()
    if "error" in outcome:
        exc = outcome["error"]
        failure = _parse_failure(exc) if isinstance(exc, RuntimeError) else None
        if failure is not None:
            raise failure from exc
        raise exc
    if elastic:
        from .rank import elastic_result

        return elastic_result(outcome["results"])
    return outcome["results"]


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
                 router: RankLogRouter, start_timeout: int, verbose: bool,
                 timeout: Optional[float] = None) -> list[Any]:
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
            started = time.monotonic()
            while len(exit_times) < n:
                if timeout is not None and time.monotonic() - started > timeout:
                    raise TimeoutError(f"The training did not finish within {timeout:g} s; the "
                                       "rank processes were stopped.")
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
