"""The barrier launcher's control channel, driver side: the server every barrier task of an
attempt registers with (a per-run token), which hands out the ranks once all of them are in,
receives their output, events, heartbeats and exits, and reaches them back (stacks, a notice,
abort). What it knows of each task is a :class:`TaskState`; :meth:`ControlServer.facts` says it
as facts (an exit status, a vanished or a silent rank) -- what they mean is decided in
:mod:`sparkhvd.driver.rank_end`. The task side is :mod:`sparkhvd.executor.barrier`.
"""
from __future__ import annotations

import contextlib
import logging
import re
import secrets
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sparkhvd.common import protocol
from sparkhvd.common.backends import TaskInfo, assign_with_hosts
from sparkhvd.common.guarded_server import GuardedServer, hello_line
from sparkhvd.common.identity import RankIdentity
from sparkhvd.common.protocol import rank_slots, task_slots
from sparkhvd.driver.launchers.seam import RankFact, Sink

__side__ = "driver"

log = logging.getLogger(__name__)

#: :meth:`ControlServer.register`'s answer when the run goes on without the channel.
DETACHED: dict = {}

#: What Spark says when a barrier stage failed because an executor or its worker went.
_EXECUTOR_LOST = re.compile(r"ExecutorLostFailure[^\n]*?(?:worker lost|Executor lost|"
                            r"Remote RPC client disassociated|exited)[^\n]*")


@dataclass
class TaskState:
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

    @property
    def where(self) -> str:
        return f"Spark partition {self.info.partition} on host {self.info.host}"

    def facts(self) -> list[RankFact]:
        """How each of its ranks that ended ended: an exit status, or vanished (the task's
        connection closed without one)."""
        info = self.info
        out = [RankFact(r, "exited", self.rank_ended[r], exit_code=c, host=info.host,
                        executor=info.address, partition=info.partition,
                        detail=f"rank {r} ({self.where}) exited with status {c}")
               for r, c in self.codes.items()]
        if self.vanished:
            out += [RankFact(r, "vanished", self.ended_at or 0.0, host=info.host,
                             executor=info.address, partition=info.partition,
                             detail=f"rank {r} ({self.where}) vanished without an exit status")
                    for r in self.ranks if r not in self.codes]
        return out


#: Seconds a barrier task's connection has to send its hello (it sends it at once).
HELLO_TIMEOUT_S = 10.0


class ControlServer(GuardedServer):
    """Driver side: registers the tasks, hands out ranks, receives their messages. A
    :class:`~sparkhvd.common.guarded_server.GuardedServer`: a connection sends its hello --
    with the run's token -- within :data:`HELLO_TIMEOUT_S`, whole; a flood of silent ones
    pushes the oldest out."""

    what = "control"
    hello_timeout_s = HELLO_TIMEOUT_S

    def __init__(self, bind_host: str, task_count: int, token: str, sink: Sink,
                 run_env: dict, backend: Any, ranks_per_task: int = 1,
                 node_per_task: bool = False) -> None:
        super().__init__((bind_host, 0), _ControlHandler)
        # every task of a large launch connects at once: none of them may be pushed out
        self.max_waiting = max(self.max_waiting, task_count + 8)
        #: how many Spark tasks register (each runs ``ranks_per_task`` ranks)
        self.task_count, self.token, self.sink = task_count, token, sink
        self.ranks_per_task, self.node_per_task = ranks_per_task, node_per_task
        self.run_env, self.backend = dict(run_env), backend
        self.tasks: dict[int, TaskState] = {}
        self.plan: Optional[dict[int, dict[str, str]]] = None
        self.cond = threading.Condition()
        self.aborted = False
        #: some task cannot reach this server: the registered ones are told to run without it
        self.detached = False
        self.first_hello: Optional[float] = None
        self.ports: dict[int, list] = {}

    # -- called from handler threads ------------------------------------------------------
    def register(self, task: TaskState, ports: list) -> Any:
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
                self.plan = assign_with_hosts(self.backend, slots)
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

    def deliver(self, task: TaskState, msg: Any) -> None:
        task.last_seen = time.monotonic()
        if isinstance(msg, protocol.Heartbeat):
            return
        if isinstance(msg, protocol.Line) and len(task.ranks) == 1 and task.rank is not None:
            msg.rank = task.rank
        if isinstance(msg, protocol.Started) and not msg.host:
            msg.host = task.info.host
        self.sink.receive(msg)

    def rank_exited(self, task: TaskState, rank: int, code: Optional[int]) -> None:
        """One of the task's ranks reported its exit status."""
        with self.cond:
            if rank not in task.codes:
                task.codes[rank] = code
                task.rank_ended[rank] = time.monotonic()
            self.cond.notify_all()
        self.sink.receive(protocol.Exit(rank=rank, code=code))

    def ended(self, task: TaskState) -> None:
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

    def facts(self, heartbeat_timeout: float) -> list[RankFact]:
        """What is known of the ranks: each exit status, each vanished rank, and -- once the
        ranks were assigned -- each task silent for ``heartbeat_timeout`` (its host lost or
        off the network)."""
        with self.cond:
            tasks = list(self.tasks.values())
        facts = [fact for task in tasks for fact in task.facts()]
        if self.plan is None:
            return facts
        now = time.monotonic()
        for task in tasks:
            if task.ended_at is None and now - task.last_seen > heartbeat_timeout:
                facts.append(RankFact(
                    task.rank, "silent", task.last_seen + heartbeat_timeout,
                    host=task.info.host, executor=task.info.address,
                    partition=task.info.partition,
                    detail=f"the Spark task of rank {task.rank} on host {task.info.host} "
                    f"stopped answering (no heartbeat for {now - task.last_seen:.0f} s): the "
                    "host was lost or its network is down"))
        return facts

    def running(self) -> bool:
        """Whether some rank may still run (its task has not ended nor reported every exit)."""
        with self.cond:
            return self.plan is None or any(
                t.ended_at is None and len(t.codes) < len(t.ranks) for t in self.tasks.values())

    def lost_in(self, spark_error: str) -> Optional[RankFact]:
        """The rank whose executor Spark says it lost (``ExecutorLostFailure ... worker lost:
        10.0.0.3:37911``), as the fact a silent heartbeat would have made -- Spark can abort
        the stage before the heartbeat timeout."""
        said = _EXECUTOR_LOST.search(spark_error)
        if said is None:
            return None
        with self.cond:
            tasks = list(self.tasks.values())
        for task in sorted(tasks, key=lambda t: t.info.partition):
            names = {n for n in (task.info.address, task.info.host) if n}
            if any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", spark_error) for n in names):
                return RankFact(
                    task.rank, "silent", time.monotonic(), host=task.info.host,
                    executor=task.info.address, partition=task.info.partition, detail=f"the executor of rank {task.rank} on "
                    f"host {task.info.host} was lost (Spark: {said.group(0)[:200]})")
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
            self._handle(server)
        finally:
            server.leave(self.connection)

    def _handle(self, server: ControlServer) -> None:
        try:  # the whole hello within the deadline: a silent or slow socket is closed
            hello = protocol.decode(hello_line(self.connection, server.hello_timeout_s))
        except (ValueError, OSError):
            hello = None
        if not isinstance(hello, protocol.Hello) or \
                not secrets.compare_digest(str(hello.token), server.token):
            server.refuse(self.client_address[0], "came without the run's token")
            return
        if not server.admit(self.connection):
            server.refuse(self.client_address[0], f"sent its hello (partition "
                          f"{hello.partition}) after it was pushed out or the launch ended")
            return
        self.connection.settimeout(None)
        task = TaskState(TaskInfo(int(hello.partition), str(hello.host),
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
