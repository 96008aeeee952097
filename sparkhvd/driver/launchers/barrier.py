"""The default Spark launcher: one barrier stage, one supervised rank process per task.

``horovod.spark.run`` spends ~6 s on a no-op (task services, NIC discovery between tasks, a
``python -m horovod.spark.task...`` start per rank, a 3 s minimum command lifetime). This
launcher does what it needs directly:

1. The driver starts the backend's rendezvous (horovod's Gloo server) and a small *control
   server* (TCP, :mod:`sparkhvd.common.protocol` messages, a per-run random token).
2. One Spark **barrier** stage runs ``np`` tasks at once (all or none; the slot check before the
   launch guarantees they fit) -- a DataFrame barrier stage (``mapInArrow(..., barrier=True)``),
   the same call on classic and Spark Connect sessions (:class:`~sparkhvd.spark.sparkview.SparkView`).
   Each task registers (:mod:`sparkhvd.executor.barrier`); once all ``np`` are in, the backend
   assigns ranks host by host and each task gets its variables.
3. Each task starts its rank, forwards its output and events, sends a heartbeat every second,
   reports its exit status and returns the pickled result in its rows of ``collect()``.

When some task cannot reach the control server (a Spark Connect client the executors cannot
reach), the tasks run without it and return the ranks' output and events in their rows;
:func:`replay_rows` delivers them to the sink after the job, so errors are decided as when live.

A failed rank, a vanished one (its connection drops without an exit status: executor lost) or a
silent one (no heartbeat for ``heartbeat_timeout``: host off the network) makes the driver abort
the others over their connections and cancel the job group. A failing rank does not fail its
Spark task, so Spark never retries a training run by itself. Barrier stages cannot run with
dynamic allocation: there a horovod run goes through ``horovod.spark.run``, and the other
backends are refused with the fix (the rules in :mod:`sparkhvd.driver.launchers`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import secrets
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sparkhvd.common import protocol
from sparkhvd.common.backends import TaskInfo, get_backend
from sparkhvd.common.errors import LaunchFailure
from sparkhvd.common.identity import RankIdentity
from sparkhvd.common.netif import collective_iface_env
from sparkhvd.common.protocol import TaskSpec, rank_slots, task_slots
from sparkhvd.driver.launchers import LaunchSpec, Sink
from sparkhvd.driver.launchers.base import (
    SPARK_TIMEOUT,
    ThreadedGroup,
    preempted_now,
    stopper,
)
from sparkhvd.driver.payload import load_result
from sparkhvd.spark.sparkview import stopped_session_error

__side__ = "driver"

log = logging.getLogger(__name__)

#: :meth:`ControlServer.register`'s answer when the run goes on without the channel.
DETACHED: dict = {}
#: How often a running launch checks that its session is still there (a Spark Connect server).
LIVENESS_S = 3.0
#: A run whose tasks did not all register this long after the first did goes on without the
#: channel (a task gives up connecting after ``task.barrier.CONNECT_TIMEOUT_S``).
DETACH_AFTER_S = 15.0


@dataclass
class _Task:
    """What the driver knows about one barrier task and its ranks."""

    info: TaskInfo
    conn: Any = None
    #: the task's ranks, in the order it starts them (one, or ``ranks_per_task``)
    ranks: list = field(default_factory=list)
    #: rank -> exit status, as each rank ends
    codes: dict = field(default_factory=dict)
    ended_at: Optional[float] = None
    vanished: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    #: when each rank ended (its exit status, or the connection broke)
    rank_ended: dict = field(default_factory=dict)

    @property
    def rank(self) -> Optional[int]:
        """The task's first rank (its only one, unless it runs several)."""
        return self.ranks[0] if self.ranks else None

    def failed(self) -> list[tuple[float, int, Optional[int]]]:
        """``(when, rank, exit status)`` of each rank that failed (status None: vanished)."""
        out = [(self.rank_ended[r], r, c) for r, c in self.codes.items() if c]
        if self.vanished:
            out += [(self.ended_at or 0.0, r, None) for r in self.ranks if r not in self.codes]
        return sorted(out, key=lambda e: (e[0], e[2] is None))


class ControlServer(socketserver.ThreadingTCPServer):
    """Driver side: registers the tasks, hands out ranks, receives their messages."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, bind_host: str, task_count: int, token: str, sink: Sink,
                 run_env: dict, backend: Any, ranks_per_task: int = 1,
                 node_per_task: bool = False) -> None:
        super().__init__((bind_host, 0), _ControlHandler)
        #: how many Spark tasks register (each runs ``ranks_per_task`` ranks)
        self.task_count, self.token, self.sink = task_count, token, sink
        self.ranks_per_task, self.node_per_task = ranks_per_task, node_per_task
        self.run_env, self.backend = dict(run_env), backend
        self.tasks: dict[int, _Task] = {}
        self.plan: Optional[dict[int, dict[str, str]]] = None
        self.cond = threading.Condition()
        self.aborted = False
        #: some task cannot reach this server: the registered ones are told to run without it
        self.detached = False
        self.first_hello: Optional[float] = None
        self.ports: dict[int, list] = {}

    # -- called from handler threads ------------------------------------------------------
    def register(self, task: _Task, ports: list) -> Any:
        """Block until all ``task_count`` tasks registered; the variables of each of the task's ranks,
        or None if aborted."""
        with self.cond:
            if task.info.partition in self.tasks:  # a Spark retry of a started task: never twice
                return None
            if self.detached:
                return DETACHED
            self.first_hello = self.first_hello or time.monotonic()
            self.tasks[task.info.partition] = task
            self.ports[task.info.partition] = ports
            if len(self.tasks) == self.task_count and self.plan is None:
                slots: dict[int, TaskInfo] = {}
                for p, t in self.tasks.items():
                    slots.update(rank_slots(p, t.info.host, t.info.address, self.ports[p],
                                            self.ranks_per_task, self.node_per_task))
                self.plan = self.backend.assign(slots)
                now = time.monotonic()
                for p, t in self.tasks.items():
                    t.ranks = [RankIdentity.from_env(self.plan[slot], default_rank=slot).rank
                               for slot in self._slots(p)]
                    t.last_seen = now
                self.cond.notify_all()
            while self.plan is None and not self.aborted and not self.detached:
                self.cond.wait(0.5)
            if self.aborted:
                return None
            if self.detached:
                self.tasks.pop(task.info.partition, None)
                return DETACHED
            assert self.plan is not None
            return [{**self.run_env, **self.plan[slot]}
                    for slot in self._slots(task.info.partition)]

    def _slots(self, partition: int) -> range:
        return task_slots(partition, self.ranks_per_task)

    def detach_if_incomplete(self, after_s: float) -> None:
        """Some tasks registered but not all, ``after_s`` after the first: the others cannot
        reach this server, so every task runs without it (rows mode)."""
        with self.cond:
            if self.plan is None and not self.detached and self.first_hello is not None and \
                    time.monotonic() - self.first_hello > after_s:
                log.warning("%d of %d Spark task(s) reached the control channel; running "
                            "without it", len(self.tasks), self.task_count)
                self.detached = True
                self.cond.notify_all()

    def deliver(self, task: _Task, msg: Any) -> None:
        task.last_seen = time.monotonic()
        if isinstance(msg, protocol.Heartbeat):
            return
        if isinstance(msg, protocol.Line) and len(task.ranks) == 1 and task.rank is not None:
            msg.rank = task.rank
        if isinstance(msg, protocol.Started) and not msg.host:
            msg.host = task.info.host
        self.sink.receive(msg)

    def rank_exited(self, task: _Task, rank: int, code: Optional[int]) -> None:
        """One of the task's ranks reported its exit status."""
        with self.cond:
            if rank not in task.codes:
                task.codes[rank] = code
                task.rank_ended[rank] = time.monotonic()
            self.cond.notify_all()
        self.sink.receive(protocol.Exit(rank=rank, code=code))

    def ended(self, task: _Task) -> None:
        """The task's connection closed: ranks that reported no exit status vanished."""
        with self.cond:
            if task.ended_at is None:
                task.ended_at = time.monotonic()
                task.vanished = any(r not in task.codes for r in task.ranks)
            self.cond.notify_all()
        for rank in task.ranks:
            if rank not in task.codes:
                self.sink.receive(protocol.Exit(rank=rank, code=None))

    # -- called from the controller's poll loop ------------------------------------------
    def wait_ended(self, timeout_s: float) -> None:
        """Wait until every task's connection has delivered its last message (``collect()``
        returns as soon as the tasks do, possibly before the handler threads read the rest)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(t.ended_at is None for t in self.tasks.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def failure(self, heartbeat_timeout: float) -> Optional[LaunchFailure]:
        """The first failed, vanished or silent task, as a LaunchFailure (or None)."""
        with self.cond:
            tasks = list(self.tasks.values())
        failed = [(*f, t) for t in tasks for f in t.failed()]
        preempted = preempted_now([f[:3] for f in failed],
                                  any(t.ended_at is None and len(t.codes) < len(t.ranks)
                                      for t in tasks))
        if preempted is None:
            return None  # the others are finishing the same step
        if preempted:
            _, rank, code, task = min(failed, key=lambda f: f[0])
            return LaunchFailure(rank, code, f"rank {rank} (Spark partition "
                                 f"{task.info.partition} on host {task.info.host}) stopped on a "
                                 "notice after its checkpoint", host=task.info.host,
                                 preempted=True)
        failed = [f for f in failed if f[2] != protocol.PREEMPTED_EXIT] or failed
        if failed:
            _, rank, code, task = min(failed, key=lambda f: (f[0], f[2] is None))
            where = f"rank {rank} (Spark partition {task.info.partition} on host " \
                    f"{task.info.host})"
            if code is None:
                return LaunchFailure(rank, None, f"{where} vanished without an exit status",
                                     host=task.info.host, vanished=True)
            return LaunchFailure(rank, code, f"{where} exited with status {code}",
                                 host=task.info.host)
        if self.plan is None:
            return None
        now = time.monotonic()
        silent = [t for t in tasks if t.ended_at is None and now - t.last_seen > heartbeat_timeout]
        if silent:
            task = min(silent, key=lambda t: t.last_seen)
            return LaunchFailure(
                task.rank, None,
                f"the Spark task of rank {task.rank} on host {task.info.host} stopped answering "
                f"(no heartbeat for {now - task.last_seen:.0f} s): the host was lost or its "
                "network is down", host=task.info.host, vanished=True, lost=True)
        return None

    def lost_in(self, spark_error: str) -> Optional[LaunchFailure]:
        """The rank whose executor Spark says it lost (``ExecutorLostFailure ... worker lost:
        10.0.0.3:37911``), as the LaunchFailure a silent heartbeat would have made -- Spark
        can abort the stage before the heartbeat timeout, and the loss is the cause."""
        said = _EXECUTOR_LOST.search(spark_error)
        if said is None:
            return None
        with self.cond:
            tasks = list(self.tasks.values())
        for task in sorted(tasks, key=lambda t: t.info.partition):
            names = {n for n in (task.info.address, task.info.host) if n}
            if any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", spark_error) for n in names):
                return LaunchFailure(
                    task.rank, None, f"the executor of rank {task.rank} on host "
                    f"{task.info.host} was lost (Spark: {said.group(0)[:200]})",
                    host=task.info.host, vanished=True, lost=True)
        return None

    def ask_stacks(self) -> None:
        """Ask every task for its rank's stacks (the task signals the rank)."""
        with self.cond:
            conns = [t.conn for t in self.tasks.values()
                     if t.conn is not None and t.ended_at is None]
        data = protocol.encode(protocol.DumpStacks())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sendall(data)

    def notify(self, reason: str) -> None:
        """Give every task's ranks a notice: they checkpoint after their step, then stop."""
        with self.cond:
            conns = [t.conn for t in self.tasks.values()
                     if t.conn is not None and t.ended_at is None]
        data = protocol.encode(protocol.Notice(reason=reason))
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sendall(data)

    def abort(self) -> None:
        """Tell every task to kill its rank now (and registrations still waiting to give up)."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
            conns = [t.conn for t in self.tasks.values() if t.conn is not None]
        data = protocol.encode(protocol.Abort())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.settimeout(2)
                conn.sendall(data)


class _ControlHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:  # noqa: D102 - one connection per barrier task
        server: ControlServer = self.server  # type: ignore[assignment]
        try:
            hello = protocol.decode(self.rfile.readline(1 << 16) or b"{}")
        except ValueError:
            hello = None
        if not isinstance(hello, protocol.Hello) or \
                not secrets.compare_digest(str(hello.token), server.token):
            log.warning("Ignored a control connection without the run's token from %s",
                        self.client_address[0])
            return
        task = _Task(TaskInfo(int(hello.partition), str(hello.host),
                              hello.address or self.client_address[0]),
                     conn=self.connection)
        envs = server.register(task, list(hello.ports or []))
        if envs is None:
            return
        if envs is DETACHED:
            self.wfile.write(protocol.encode(protocol.Detached()))
            self.wfile.flush()
            return
        self.wfile.write(protocol.encode(protocol.Assign(envs=envs)))
        self.wfile.flush()
        try:
            for raw in self.rfile:
                msg = protocol.decode(raw)
                if isinstance(msg, protocol.Exit):
                    server.rank_exited(task, msg.rank, msg.code)
                    if len(task.codes) == len(task.ranks):
                        break
                    continue
                server.deliver(task, msg)
        except (OSError, ValueError) as exc:  # a broken connection: the ranks are lost
            log.debug("control connection of partition %d broke: %s", task.info.partition, exc)
        finally:
            server.ended(task)


class BarrierLauncher:
    """``np`` ranks in one DataFrame barrier stage of the run's session, classic or Spark
    Connect (module docstring)."""

    name = "barrier"

    def start(self, spec: LaunchSpec, sink: Sink) -> ThreadedGroup:
        from sparkhvd.executor.barrier import ROW_SCHEMA, arrow_barrier_task

        view = spec.session
        backend = get_backend(spec.backend)
        # nics given: every rank uses them; else each task picks its way to the driver.
        run_env = {**backend.start(spec.driver_host, spec.nics, spec.verbose, spec.run),
                   **collective_iface_env(spec.nics, None)}
        token = secrets.token_hex(16)
        bind = "127.0.0.1" if spec.placement.executors_here else ""
        server = ControlServer(bind, spec.tasks, token, sink, run_env, backend,
                               spec.ranks_per_task, spec.node_per_task)
        threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True,
                         name="sparkhvd-control").start()
        job = view.job(spec.job, f"sparkhvd: {spec.size} rank(s) of run {spec.run.run_id}")
        mapper = functools.partial(arrow_barrier_task, TaskSpec(
            payload=spec.payload, options=spec.options.as_dict(), env=dict(spec.env),
            driver=control_address(spec, server), token=token,
            start_timeout=float(spec.start_timeout), backend=spec.backend,
            run_env=dict(run_env), ranks_per_task=spec.ranks_per_task,
            node_per_task=spec.node_per_task, start_by=time.time() + spec.start_timeout))

        def target() -> list:
            return job.run(lambda: view.barrier_collect(spec.tasks, mapper, ROW_SCHEMA))

        check = _checker(spec, view, server, sink)

        def cancel() -> None:
            server.abort()
            job.cancel()

        def finish(collected: list) -> list[Any]:
            tasks = gather_rows(collected)
            if any(t.get("status", {}).get("mode") == "late" for t in tasks.values()):
                raise TimeoutError(_not_started(spec))
            server.wait_ended(10.0)
            replay_rows(server, sink, tasks)
            check(0.0)  # a rank that failed as the stage ended
            modes = {t["status"].get("mode") for t in tasks.values()}
            sink.reported_by("rows" if "rows" in modes else "live")
            return _results(server, tasks, spec.size)

        def close() -> None:
            # Both servers poll for shutdown: stop them off the return path.
            threading.Thread(target=_stop_servers, args=(server, backend), daemon=True,
                             name="sparkhvd-stop-servers").start()

        return ThreadedGroup(
            target, name="sparkhvd-barrier",
            timeout_message=SPARK_TIMEOUT.format(timeout=spec.timeout or 0), check=check,
            stop=stopper(cancel, sink), finish=finish,
            translate=lambda exc: _behind_spark_error(exc, server, spec), close=close,
            ask_stacks=server.ask_stacks, notify=server.notify)


#: What Spark says when a barrier stage failed because an executor or its worker went.
_EXECUTOR_LOST = re.compile(r"ExecutorLostFailure[^\n]*?(?:worker lost|Executor lost|"
                            r"Remote RPC client disassociated|exited)[^\n]*")


def _behind_spark_error(exc: Exception, server: ControlServer, spec: LaunchSpec
                        ) -> Optional[LaunchFailure]:
    """The rank failure behind the Spark job's own error, when there is one: Spark may abort
    the barrier stage (a lost worker, a task that failed) before the poll loop has seen why.
    The lost executor's rank when Spark names it, else what the control server sees within a
    heartbeat timeout. None for sparkhvd's own errors and before the ranks started."""
    from sparkhvd.common.errors import SparkhvdError

    if isinstance(exc, (SparkhvdError, TimeoutError)) or server.plan is None:
        return None
    lost = server.lost_in(str(exc))
    if lost is not None:
        return lost
    deadline = time.monotonic() + spec.heartbeat_timeout + 2.0
    while time.monotonic() < deadline:
        failure = server.failure(spec.heartbeat_timeout)
        if failure is not None:
            return failure
        time.sleep(0.2)
    return None


def _checker(spec: LaunchSpec, view: Any, server: ControlServer, sink: Sink
             ) -> Callable[[float], None]:
    """What the controller's poll loop checks each time: a stopped or lost session, a lost or
    failed rank, tasks that never reached the control channel (then the run goes on in rows
    mode)."""
    waited = {"warned": False, "probed": 0.0}

    def check(elapsed: float) -> None:
        if view.stopped():
            raise stopped_session_error(during=True)
        failure = server.failure(spec.heartbeat_timeout) or sink.stale_error()
        if failure is not None or elapsed - waited["probed"] >= LIVENESS_S:
            # a rank lost, or time to look: is it the session that is gone? (a lost
            # Connect server takes its executors' ranks with it, and says nothing)
            waited["probed"] = elapsed
            lost = view.lost()
            if lost is not None:
                view.abandon()
                raise lost
        if failure is not None:
            raise failure
        server.detach_if_incomplete(DETACH_AFTER_S)
        if server.plan is None and not server.detached and elapsed > spec.start_timeout:
            if not view.connect:
                raise TimeoutError(_not_started(spec, server))
            if not waited["warned"]:
                waited["warned"] = True
                log.warning(
                    "No Spark task reached this client's control channel (%s) within %g s: "
                    "if the executors cannot reach this machine, the ranks run without live "
                    "logs and their output, errors and results arrive when the job ends "
                    "(timeout= bounds the wait).", spec.driver_host, spec.start_timeout)

    return check


def _not_started(spec: LaunchSpec, server: Optional[ControlServer] = None) -> str:
    """Why a launch gave up starting: its job is cancelled and no task of it will run."""
    started = f" ({len(server.tasks)} of {spec.tasks} started)" if server is not None else ""
    return (f"The {spec.tasks} Spark task(s) did not all start within start_timeout="
            f"{spec.start_timeout:g} s{started}, or could not reach this driver's control "
            f"channel ({spec.driver_host}); the run's Spark job was cancelled and none of its "
            "tasks will run. Other jobs may hold the task slots: check the Spark UI and "
            "`sparkhvd doctor --np N`; or raise start_timeout.")


def _results(server: ControlServer, tasks: dict[int, dict[str, Any]], np: int) -> list[Any]:
    """The ranks' return values in rank order, from the collected rows."""
    from sparkhvd.executor.barrier import result_kind

    results: list[Any] = [None] * np
    for partition, task in server.tasks.items():
        for i, rank in enumerate(task.ranks):
            data = tasks.get(partition, {}).get(result_kind(i))
            if data is not None:
                results[rank] = load_result(rank, data)
    return results


def control_address(spec: LaunchSpec, server: ControlServer) -> tuple[str, int]:
    """Where the tasks reach the control server (a seam the tests use to make it unreachable)."""
    return spec.driver_host, server.server_address[1]


def gather_rows(rows: list) -> dict[int, dict[str, Any]]:
    """The collected rows per partition: ``status`` (dict), ``result`` and ``events`` (bytes)."""
    import json

    chunks: dict[tuple[int, str], list[tuple[int, bytes]]] = {}
    for row in rows:
        chunks.setdefault((int(row["partition"]), row["kind"]), []).append(
            (int(row["seq"]), bytes(row["data"])))
    tasks: dict[int, dict[str, Any]] = {}
    for (partition, kind), parts in chunks.items():
        data = b"".join(chunk for _, chunk in sorted(parts))
        tasks.setdefault(partition, {})[kind] = json.loads(data) if kind == "status" else data
    return tasks


def replay_rows(server: ControlServer, sink: Sink, tasks: dict[int, dict[str, Any]]) -> None:
    """Rows mode: deliver what each rank said, in rank order, as if it had come live, and
    record each task's exit -- so failures and errors are decided as in live mode."""
    replayed = []
    for partition, task in tasks.items():
        if task.get("status", {}).get("mode") != "rows":
            continue
        messages = []
        for raw in (task.get("events") or b"").splitlines():
            with contextlib.suppress(ValueError):
                messages.append(protocol.decode(raw))
        raised = min((m.time for m in messages if isinstance(m, protocol.Error)),
                     default=float("inf"))
        replayed.append((raised, task["status"].get("rank") or 0, partition, messages))
    if replayed:
        log.warning("The executors could not reach this machine's control channel: the ranks' "
                    "output below was kept by the Spark tasks and shown when the job ended.")
    # The rank that raised first ends first, so it is the one the error names (as when live).
    for _, _, partition, messages in sorted(replayed, key=lambda r: (r[0], r[1])):
        status = tasks[partition]["status"]
        entry = _Task(TaskInfo(partition, status.get("host", "?")),
                      ranks=list(status.get("ranks") or []))
        server.tasks[partition] = entry
        for msg in messages:
            server.deliver(entry, msg)
        if status.get("dropped_lines"):
            log.warning("rank %s: %d older output line(s) were not kept (rows mode keeps the "
                        "newest 8 MB)", status.get("rank"), status["dropped_lines"])
        for rank, code in zip(entry.ranks, status.get("codes") or []):
            if code is not None:
                server.rank_exited(entry, rank, code)
        server.ended(entry)


def _stop_servers(server: ControlServer, backend: Any) -> None:
    server.shutdown()
    server.server_close()
    backend.stop()


LAUNCHER = BarrierLauncher()
