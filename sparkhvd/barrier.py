"""The fast Spark launcher: one barrier stage, one Gloo rank process per task.

``horovod.spark.run`` spends ~6 s on a no-op (task services, NIC discovery between tasks, a
``python -m horovod.spark.task...`` start per rank, a 3 s minimum command lifetime). sparkhvd's
default launcher does what it needs directly:

1. The driver starts horovod's Gloo rendezvous server and a small *control server* (TCP, one
   line of JSON per message, a per-run random token).
2. One Spark **barrier** stage runs ``np`` tasks at once (all or none; the slot check before the
   launch guarantees they fit). Each task registers with the control server (its partition and
   host); once all ``np`` are in, the driver assigns ranks host by host (horovod's
   ``get_host_assignments``) and answers each task with its ``HOROVOD_*`` environment.
3. Each task starts ``python -m sparkhvd._rank_process`` (the same entry point as local ranks),
   streams its stdout/stderr lines to the driver as they are printed, reports its exit status and
   returns the pickled result through ``collect()``.

A failed or vanished rank (its connection drops without an exit status: executor lost) makes the
driver abort the others over their connections and cancel the job group; a rank never outlives
its task (``PR_SET_PDEATHSIG``) or its driver (the task kills it when the connection drops). A
failing rank does not fail its Spark task, so Spark never retries a training run by itself.
Barrier stages cannot run with dynamic allocation; the runner uses ``horovod.spark.run`` there.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .launch import LaunchFailure, kill_local_pids, watch_thread
from .logs import RankLogRouter
from .rank import TASK_GPUS_ENV

log = logging.getLogger(__name__)


#: Accepted values of ``HorovodRunner(launcher=...)``.
LAUNCHERS = ("auto", "barrier", "horovod")


def choose_launcher(requested: str, sc: Any, elastic: Any = None) -> str:
    """``"barrier"`` or ``"horovod"`` for this run (see ``HorovodRunner``'s ``launcher``)."""
    dynamic = sc.getConf().get("spark.dynamicAllocation.enabled", "false").lower() == "true"
    if requested == "barrier" and dynamic:
        raise ValueError("launcher='barrier' cannot run with spark.dynamicAllocation.enabled="
                         "true (Spark refuses barrier stages there); use launcher='auto'.")
    if requested != "auto":
        return requested
    if elastic or dynamic:
        log.info("Using horovod.spark.run%s (%s)", "_elastic" if elastic else "",
                 "elastic training" if elastic else "dynamic allocation is on")
        return "horovod"
    return "barrier"


def driver_host(sc: Any) -> str:
    """The address executors reach the driver at (127.0.0.1 for a local/loopback master)."""
    from .session import is_loopback_master

    if is_loopback_master(sc.master):
        return "127.0.0.1"
    return sc.getConf().get("spark.driver.host") or socket.gethostname()


@dataclass
class _Task:
    """What the driver knows about one barrier task and its rank."""

    partition: int
    host: str
    conn: Any = None
    rank: Optional[int] = None
    exit_code: Optional[int] = None
    ended_at: Optional[float] = None
    vanished: bool = False


def assign_ranks(tasks: Mapping[int, str]) -> tuple[list[Any], dict[int, dict[str, str]]]:
    """partition -> host; returns horovod's slots and partition -> slot env.

    Ranks are contiguous per host; hosts are ordered by their lowest partition and partitions
    keep their order within a host, so the assignment is deterministic.
    """
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_slot_env_vars

    by_host: dict[str, list[int]] = {}
    for partition in sorted(tasks):
        by_host.setdefault(tasks[partition], []).append(partition)
    hosts = ",".join(f"{host}:{len(parts)}" for host, parts in by_host.items())
    slots = get_host_assignments(parse_hosts(hosts), len(tasks))
    envs = {by_host[slot.hostname][slot.local_rank]:
            {k: str(v) for k, v in create_slot_env_vars(slot).items()} for slot in slots}
    return slots, envs


class ControlServer(socketserver.ThreadingTCPServer):
    """Driver side: registers the tasks, hands out ranks, receives output and exit statuses."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, bind_host: str, np: int, token: str, router: RankLogRouter,
                 run_env: Mapping[str, str], rendezvous: Any) -> None:
        super().__init__((bind_host, 0), _ControlHandler)
        self.np, self.token, self.router = np, token, router
        self.run_env, self.rendezvous = dict(run_env), rendezvous
        self.tasks: dict[int, _Task] = {}
        self.plan: Optional[dict[int, dict[str, str]]] = None
        self.cond = threading.Condition()
        self.aborted = False

    # -- called from handler threads ------------------------------------------------------
    def register(self, task: _Task) -> Optional[dict[str, str]]:
        """Block until all ``np`` tasks registered; the task's rank env, or None when aborted."""
        with self.cond:
            if task.partition in self.tasks:  # a Spark retry of a started task: never twice
                return None
            self.tasks[task.partition] = task
            if len(self.tasks) == self.np and self.plan is None:
                slots, self.plan = assign_ranks({p: t.host for p, t in self.tasks.items()})
                self.rendezvous.init(slots)
                for p, t in self.tasks.items():
                    t.rank = int(self.plan[p]["HOROVOD_RANK"])
                self.cond.notify_all()
            while self.plan is None and not self.aborted:
                self.cond.wait(0.5)
            if self.aborted:
                return None
            return {**self.run_env, **self.plan[task.partition]}

    def line(self, task: _Task, tag: str, text: str) -> None:
        channel = self.router.stdout if tag == "stdout" else self.router.stderr
        channel.write(f"[{task.rank}]<{tag}>:{text}\n")

    def ended(self, task: _Task, code: Optional[int]) -> None:
        with self.cond:
            if task.ended_at is None:
                task.exit_code, task.ended_at = code, time.monotonic()
                task.vanished = code is None
            self.cond.notify_all()

    # -- called from the driver's watch loop ----------------------------------------------
    def wait_ended(self, timeout_s: float) -> None:
        """Wait until every registered task's connection has delivered its last line.

        ``collect()`` returns as soon as the tasks do, which can be before the handler threads
        have read the rest of what the ranks printed.
        """
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(t.ended_at is None for t in self.tasks.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def first_failure(self) -> Optional[_Task]:
        with self.cond:
            failed = [t for t in self.tasks.values()
                      if t.ended_at is not None and (t.vanished or t.exit_code != 0)]
        return min(failed, key=lambda t: t.ended_at) if failed else None

    def abort(self) -> None:
        """Tell every task to kill its rank now (and registrations still waiting to give up)."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
            conns = [t.conn for t in self.tasks.values() if t.conn is not None]
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sendall(b'{"abort": true}\n')


class _ControlHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:  # noqa: D102 - one connection per barrier task
        server: ControlServer = self.server  # type: ignore[assignment]
        try:
            hello = json.loads(self.rfile.readline() or b"{}")
        except ValueError:
            return
        if not secrets.compare_digest(str(hello.get("token", "")), server.token):
            log.warning("Ignored a control connection with a wrong token from %s",
                        self.client_address[0])
            return
        task = _Task(partition=int(hello["partition"]), host=str(hello["host"]),
                     conn=self.connection)
        env = server.register(task)
        if env is None:
            return
        self.wfile.write((json.dumps({"env": env}) + "\n").encode())
        self.wfile.flush()
        code: Optional[int] = None
        try:
            for raw in self.rfile:
                msg = json.loads(raw)
                if "exit" in msg:
                    code = int(msg["exit"])
                    break
                server.line(task, msg.get("tag", "stdout"), msg.get("text", ""))
        except (OSError, ValueError) as exc:  # a broken connection: the rank is lost
            log.debug("control connection of partition %d broke: %s", task.partition, exc)
        finally:
            server.ended(task, code)


# -- executor side ------------------------------------------------------------------------
def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL the rank when the task's Python worker dies (a killed Spark task)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _iface_towards(address: str) -> Optional[str]:
    """The name of this host's network interface that routes to ``address``."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        local_ip = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local_ip for a in addrs):
            return name
    return None


def barrier_task(payload: bytes, options: Mapping[str, Any], env: Mapping[str, str],
                 driver: tuple[str, int], token: str, start_timeout: float, _rows: Any) -> Any:
    """One Spark barrier task: register, run one rank process, stream it, return its result."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    gpus = context.resources().get("gpu")
    sock = socket.create_connection(driver, timeout=start_timeout)
    sock.settimeout(None)
    rfile, lock = sock.makefile("rb"), threading.Lock()

    def send(msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with lock:
            sock.sendall(data)

    send({"token": token, "partition": partition, "host": socket.gethostname()})
    reply = json.loads(rfile.readline() or b"{}")
    if "env" not in reply:
        sock.close()
        yield (partition, None)  # the driver gave up on this run before it started
        return
    rank_env = {**os.environ, **env, **reply["env"], "PYTHONUNBUFFERED": "1"}
    if gpus is not None and gpus.addresses:
        rank_env[TASK_GPUS_ENV] = ",".join(gpus.addresses)
    if not rank_env.get("HOROVOD_GLOO_IFACE"):  # no nics given: the one that reaches the driver
        iface = _iface_towards(driver[0]) or "lo"
        rank_env["HOROVOD_GLOO_IFACE"] = rank_env["NCCL_SOCKET_IFNAME"] = iface
    with tempfile.TemporaryDirectory(prefix="sparkhvd-rank-") as work:
        payload_path = os.path.join(work, "payload.pkl")
        with open(payload_path, "wb") as f:
            f.write(payload)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkhvd._rank_process", payload_path, work,
             json.dumps(dict(options))],
            env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)

        def pump(pipe: Any, tag: str) -> None:
            for raw in iter(pipe.readline, b""):
                with contextlib.suppress(OSError):
                    send({"tag": tag, "text": raw.decode("utf-8", "replace").rstrip("\n")})
            pipe.close()

        def watch_driver() -> None:  # an abort message or a lost driver kills the rank
            with contextlib.suppress(OSError, ValueError):
                rfile.readline()
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        pumps = [threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True)]
        for t in pumps:
            t.start()
        threading.Thread(target=watch_driver, daemon=True).start()
        code = proc.wait()
        for t in pumps:
            t.join(10)
        with contextlib.suppress(OSError):
            send({"exit": code})
        sock.close()
        results = [f for f in os.listdir(work) if f.startswith("rank-") and f.endswith(".pkl")]
        result = None
        if code == 0 and results:
            with open(os.path.join(work, results[0]), "rb") as f:
                result = f.read()
        yield (partition, result)


# -- driver side --------------------------------------------------------------------------
def launch_barrier(np: int, payload: bytes, options: Mapping[str, Any], *,
                   env: Mapping[str, str], router: RankLogRouter, start_timeout: int,
                   nics: Optional[set[str]], verbose: bool, driver_host: str,
                   timeout: Optional[float] = None) -> list[Any]:
    """Run ``np`` ranks in one Spark barrier stage of the active SparkContext (module docstring).

    Returns the ranks' results in rank order; raises :class:`LaunchFailure` for a failed or
    vanished rank, ``TimeoutError`` past ``timeout`` (or when the tasks do not all start within
    ``start_timeout``), and lets ``KeyboardInterrupt`` through -- in every case after the ranks
    were aborted and the Spark job group cancelled.
    """
    import cloudpickle
    from horovod.runner.gloo_run import create_run_env_vars
    from horovod.runner.http.http_server import RendezvousServer
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    rendezvous = RendezvousServer(verbose=1 if verbose else 0)
    port = rendezvous.start()
    run_env = {k: str(v) for k, v in
               create_run_env_vars(driver_host, nics or {"lo"}, port).items()}
    if not nics:  # each task finds the interface that reaches the driver (barrier_task)
        for key in ("HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME"):
            run_env.pop(key)
    token = secrets.token_hex(16)
    bind = "127.0.0.1" if driver_host == "127.0.0.1" else ""
    server = ControlServer(bind, np, token, router, run_env, rendezvous)
    threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True,
                     name="sparkhvd-control").start()
    group = f"sparkhvd-{token[:12]}"
    outcome: dict = {}
    mapper = _mapper(payload, options, env, (driver_host, server.server_address[1]), token,
                     start_timeout)

    def target() -> None:
        sc.setJobGroup(group, f"sparkhvd: {np} Horovod rank(s)", interruptOnCancel=True)
        try:
            outcome["results"] = sc.parallelize(range(np), np).barrier() \
                .mapPartitions(mapper).collect()
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = exc

    def check(elapsed: float) -> None:
        failed = server.first_failure()
        if failed is not None:
            raise _failure(failed)
        if server.plan is None and elapsed > start_timeout:
            raise TimeoutError(f"The {np} Spark task(s) did not all start within "
                               f"start_timeout={start_timeout} s; check the cluster's free "
                               "task slots, or raise start_timeout.")

    thread = threading.Thread(target=target, name="sparkhvd-barrier", daemon=True)
    try:
        watch_thread(thread, timeout=timeout, check=check)
        server.wait_ended(10.0)
        check(0.0)  # a rank that failed as the stage ended
    except BaseException:
        server.abort()
        sc.cancelJobGroup(group)
        thread.join(60)
        kill_local_pids(router.all_pids)
        raise
    finally:
        # Both servers poll for shutdown (horovod's every 0.5 s): stop them off the return path.
        threading.Thread(target=_stop_servers, args=(server, rendezvous), daemon=True,
                         name="sparkhvd-stop-servers").start()
        router.close()
    if "error" in outcome:
        raise outcome["error"]
    by_partition = dict(outcome["results"])
    results = [None] * np
    for partition, task in server.tasks.items():
        blob = by_partition.get(partition)
        if task.rank is not None and blob is not None:
            results[task.rank] = cloudpickle.loads(blob)
    return results


def _stop_servers(server: ControlServer, rendezvous: Any) -> None:
    server.shutdown()
    server.server_close()
    rendezvous.stop()


def _mapper(payload: bytes, options: Mapping[str, Any], env: Mapping[str, str],
            driver: tuple[str, int], token: str, start_timeout: float) -> Any:
    import functools

    return functools.partial(barrier_task, payload, dict(options), dict(env), driver, token,
                             float(start_timeout))


def _failure(task: _Task) -> LaunchFailure:
    if task.vanished:
        detail = (f"rank {task.rank} (Spark partition {task.partition} on {task.host}) vanished "
                  "without an exit status")
    else:
        detail = f"rank {task.rank} exited with status {task.exit_code}"
    return LaunchFailure(task.rank, task.exit_code, detail)
