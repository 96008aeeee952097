"""The executor side of the barrier launcher: what one Spark barrier task does.

The stage is a DataFrame barrier stage (``mapInArrow(..., barrier=True)``), the same on classic
and Spark Connect sessions; each task returns its rows (:data:`ROW_SCHEMA`) through
``collect()``.

A task runs one rank, or ``ranks_per_task`` of them (a node's GPUs scheduled as one task): each
is its own supervised process, numbered and reported on its own.

1. Connect to the driver's control server and register (:class:`~sparkhvd.common.protocol.Hello`:
   partition, host, address, a reserved port per rank if the backend needs them). A run the
   driver gave up starting never runs: the driver answers nothing to a late task, and a task
   that cannot reach the driver after ``TaskSpec.start_by`` returns without starting a rank.
2. **Live** (every task reached the driver): receive the ranks' variables
   (:class:`~sparkhvd.common.protocol.Assign`); forward output lines and events as they come, send a
   heartbeat every second, kill the rank when the driver says :class:`~sparkhvd.common.protocol.Abort`
   or goes away.
   **Rows** (a task could not connect -- a Spark Connect client on a laptop, a firewall -- or
   the driver answered :class:`~sparkhvd.common.protocol.Detached` because another could not): the
   tasks share where they are (``BarrierTaskContext.allGather``), assign ranks themselves
   (backends that need nothing from the driver: ``tf``), keep the rank's output and events, and
   return them in their rows; the driver shows them when the job ends.
3. Either way the rank's environment is built by :func:`sparkhvd.common.environment.process_env`
   (this executor's variables *filtered*, the driver's, the rank's), the GPU Spark gave the task
   is pinned, the interface that reaches the driver is picked when no ``nics`` were given, and
   the rank runs as a :class:`~sparkhvd.common.rankprocess.RankProcess`.
4. The rows carry the exit statuses and the pickled results, in chunks.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any, Iterator, Mapping, Optional

from sparkhvd.common import protocol
from sparkhvd.common.environment import process_env
from sparkhvd.common.identity import RankIdentity
from sparkhvd.common.netif import PortReservation, collective_iface_env, route_address
from sparkhvd.common.rankprocess import RankProcess

__side__ = "executor"

#: Seconds between heartbeats (the driver declares a task lost after ``heartbeat_timeout``).
HEARTBEAT_S = 1.0
#: How long a task tries to reach the driver's control server before it runs in rows mode.
CONNECT_TIMEOUT_S = 10.0
#: What each task returns: ``kind`` is ``status`` (JSON), ``result`` or ``events``, split into
#: ``seq``-numbered chunks (a 100 MB model must not be one Arrow value or one gRPC message).
ROW_SCHEMA = "partition long, kind string, seq long, data binary"
CHUNK_BYTES = 4 << 20
#: Rows mode keeps at most this much of a rank's output (the newest lines win; events stay).
ROWS_LOG_BYTES = 8 << 20
#: After one of a task's ranks failed, its siblings get this long to end by themselves.
SIBLING_GRACE_S = 10.0
#: What a task allows for the difference between its host's clock and the driver's when it
#: checks :attr:`~sparkhvd.common.protocol.TaskSpec.start_by` (only without the driver's channel).
CLOCK_SLACK_S = 2.0


class _Channel:
    """The task's control connection: messages out (any thread), messages in (one thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        data = protocol.encode(msg)
        with self.lock, contextlib.suppress(OSError):
            self.sock.sendall(data)

    def receive(self) -> Optional[Any]:
        try:
            line = self.rfile.readline()
            return protocol.decode(line) if line else None
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.rfile.close()
            self.sock.close()


def _connect(driver: tuple[str, int], timeout: float) -> Optional[_Channel]:
    try:
        sock = socket.create_connection(driver, timeout=timeout)
    except OSError:
        return None
    sock.settimeout(None)
    return _Channel(sock)


class _Kept:
    """Rows mode: the rank's messages, bounded (old output lines go first; events stay)."""

    def __init__(self, limit: int = ROWS_LOG_BYTES) -> None:
        self.messages: list[tuple[bool, bytes]] = []  # (an output line?, encoded message)
        self.size, self.limit, self.dropped = 0, limit, 0
        self.lock = threading.Lock()

    def add(self, msg: Any) -> None:
        if isinstance(msg, (protocol.Heartbeat, protocol.TimeSplit)) or \
                getattr(msg, "update", False):
            return  # progress updates and time splits are for a live driver only
        data = protocol.encode(msg)
        with self.lock:
            self.messages.append((isinstance(msg, protocol.Line), data))
            self.size += len(data)
            while self.size > self.limit:
                index = next((i for i, (line, _) in enumerate(self.messages) if line), None)
                if index is None:
                    break
                self.size -= len(self.messages.pop(index)[1])
                self.dropped += 1

    def blob(self) -> bytes:
        with self.lock:
            return b"".join(data for _, data in self.messages)


def _rows(partition: int, kind: str, data: bytes) -> Iterator[Any]:
    import pyarrow as pa

    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for seq, chunk in enumerate(chunks):
        yield pa.RecordBatch.from_pydict(
            {"partition": [partition], "kind": [kind], "seq": [seq], "data": [chunk]},
            schema=pa.schema([("partition", pa.int64()), ("kind", pa.string()),
                              ("seq", pa.int64()), ("data", pa.binary())]))


def result_kind(index: int) -> str:
    """The row kind of the ``index``-th rank's result in a task's rows."""
    return "result" if index == 0 else f"result{index}"


def arrow_barrier_task(spec: protocol.TaskSpec, batches: Any) -> Any:
    """One barrier task of ``mapInArrow`` (see the module docstring): yields Arrow batches of
    :data:`ROW_SCHEMA`."""
    for _ in batches:  # the stage's one input row per task
        pass
    partition, status, results, events = barrier_task(spec)
    yield from _rows(partition, "status", json.dumps(status).encode())
    for index, result in enumerate(results):
        if result is not None:
            yield from _rows(partition, result_kind(index), result)
    if events is not None:
        yield from _rows(partition, "events", events)


def _rows_plan(spec: protocol.TaskSpec, gathered: list[dict], partition: int) -> list[dict]:
    """Rows mode: the variables of each of this task's ranks, assigned by the tasks themselves."""
    from sparkhvd.common.backends import assign_with_hosts, get_backend

    chosen = get_backend(spec.backend)
    if not getattr(chosen, "assigns_in_tasks", False):
        raise RuntimeError(
            f"backend={spec.backend!r} needs every Spark task to reach the driver (its "
            "rendezvous runs there), but some could not connect to its control channel. Fix: "
            "let the executors reach this machine (firewall, spark.driver.host; `sparkhvd "
            "doctor` checks it), or use backend='tf', which runs without that channel.")
    k = spec.ranks_per_task
    slots: dict = {}
    for g in gathered:
        slots.update(protocol.rank_slots(g["partition"], g["host"], g["address"], g["ports"], k,
                                         spec.node_per_task))
    plan = assign_with_hosts(chosen, slots)
    return [{**spec.run_env, **plan[slot]} for slot in protocol.task_slots(partition, k)]


def _rank_env(spec: protocol.TaskSpec, assigned: Mapping[str, str], gpus: Any,
              connected: bool) -> dict[str, str]:
    """One rank's whole environment on this executor (module docstring, step 3)."""
    rank_env = process_env(os.environ, spec.env, assigned)
    if not connected:  # the run-folder service is on the driver: out of reach
        for name in (protocol.FILES_ADDR_ENV, protocol.FILES_TOKEN_ENV):
            rank_env.pop(name, None)
    if gpus is not None and gpus.addresses:
        if spec.node_per_task:
            # The task is the node: its GPUs are the node's (cuda:LOCAL_RANK), as
            # TorchDistributor sets them -- unless the user set the variable on purpose.
            if "CUDA_VISIBLE_DEVICES" not in spec.env:
                rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
        else:
            rank_env[protocol.TASK_GPUS_ENV] = ",".join(gpus.addresses)
    if not rank_env.get("HOROVOD_GLOO_IFACE"):  # no nics given: the one that reaches the driver
        rank_env.update(collective_iface_env(None, spec.driver[0]))
    return rank_env


def barrier_task(spec: protocol.TaskSpec) -> tuple[int, dict, list, Optional[bytes]]:
    """One Spark barrier task: ``(partition, status, results, events)`` -- a pickled result
    (or None) per rank the task ran; ``events`` only in rows mode."""
    from pyspark import BarrierTaskContext

    from sparkhvd.common.backends import get_backend

    started = time.time()
    context = BarrierTaskContext.get()
    partition = context.partitionId()
    gpus = context.resources().get("gpu")
    host = socket.gethostname()
    channel = _connect(spec.driver, min(float(spec.start_timeout), CONNECT_TIMEOUT_S))
    address = channel.sock.getsockname()[0] if channel else route_address(spec.driver[0])
    # Held until the ranks end, so no other task on this host is handed the same port.
    with PortReservation(spec.ranks_per_task
                         if get_backend(spec.backend).needs_port else 0) as reserved:
        return _task_with_ports(spec, context, partition, started, channel, host, address,
                                reserved.ports, gpus)


def _task_with_ports(spec: protocol.TaskSpec, context: Any, partition: int, started: float,
                     channel: Optional[_Channel], host: str, address: str, ports: list[int],
                     gpus: Any) -> tuple[int, dict, list, Optional[bytes]]:
    """Register, run the ranks and return their rows (module docstring, 1-4): ports held."""
    status: dict[str, Any] = {"mode": "live", "host": host, "rank": None, "ranks": [],
                              "codes": [], "code": None}
    reply: Any = None
    if channel is not None:
        channel.send(protocol.Hello(token=spec.token, partition=partition, host=host,
                                    address=address, ports=ports))
        reply = channel.receive()
        if not isinstance(reply, (protocol.Assign, protocol.Detached)):
            channel.close()
            return partition, status, [], None  # the driver gave up before the run started
    kept = None
    if isinstance(reply, protocol.Assign):
        assigned = reply.envs
    else:  # this task could not reach the driver, or the driver says another could not
        if channel is not None:
            channel.close()
            channel = None
        if spec.start_by and started > spec.start_by + CLOCK_SLACK_S:
            # The driver gave up on this run (start_timeout) and may be gone: never run late.
            status["mode"] = "late"
            return partition, status, [], None
        status["mode"], kept = "rows", _Kept()
        # Every task comes here (the driver detaches the registered ones), so the barrier's
        # allGather -- about a second -- is paid only without the channel.
        gathered = [json.loads(g) for g in context.allGather(json.dumps(
            {"partition": partition, "host": host, "address": address, "ports": ports}))]
        try:
            assigned = _rows_plan(spec, gathered, partition)
        except RuntimeError as exc:
            rank = sorted(g["partition"] for g in gathered).index(partition)
            kept.add(protocol.Error(rank=rank, exc_type="RuntimeError", message=str(exc),
                                    traceback="", time=0.0))
            status.update(rank=rank, ranks=[rank], codes=[1], code=1)
            return partition, status, [], kept.blob()
    ranks = [RankIdentity.from_env(env, default_rank=partition).rank for env in assigned]
    status.update(rank=ranks[0], ranks=ranks)
    assert channel is not None or kept is not None
    send = channel.send if channel is not None else kept.add  # type: ignore[union-attr]
    procs = [RankProcess(spec.payload, spec.options,
                         _rank_env(spec, env, gpus, channel is not None), rank=rank,
                         on_line=send, on_event=send) for rank, env in zip(ranks, assigned)]
    codes = _run_ranks(procs, channel)
    status.update(codes=codes, code=next((c for c in codes if c), 0))
    results = [proc.result() if code == 0 else None for proc, code in zip(procs, codes)]
    for proc in procs:
        proc.close()
    if kept is not None and kept.dropped:
        status["dropped_lines"] = kept.dropped
    return partition, status, results, kept.blob() if kept is not None else None


def _run_ranks(procs: list[RankProcess], channel: Optional[_Channel]) -> list[Optional[int]]:
    """Start the task's ranks, watch them (heartbeats, the driver's aborts and stack
    requests), report each exit; their exit statuses. A failed rank's siblings in the task get
    :data:`SIBLING_GRACE_S` to end by themselves (a broken collective) before they are
    stopped -- the driver aborts them sooner when it is reachable."""
    done = threading.Event()

    def heartbeat(channel: _Channel) -> None:
        while not done.wait(HEARTBEAT_S):
            channel.send(protocol.Heartbeat(rank=procs[0].rank))

    def watch_driver(channel: _Channel) -> None:  # an abort, or a lost driver, ends the ranks
        while isinstance(msg := channel.receive(), (protocol.DumpStacks, protocol.Notice)):
            for proc in procs:
                if isinstance(msg, protocol.Notice):
                    proc.notice()
                else:
                    proc.request_stacks()
        if not done.is_set():
            for proc in procs:
                proc.terminate()

    codes: list[Optional[int]] = [None] * len(procs)
    try:
        for proc in procs:
            proc.start()
        if channel is not None:  # rows mode (no channel): the ranks just run
            threading.Thread(target=heartbeat, args=(channel,), daemon=True,
                             name="sparkhvd-heartbeat").start()
            threading.Thread(target=watch_driver, args=(channel,), daemon=True,
                             name="sparkhvd-watch").start()
        failed_at: Optional[float] = None
        while any(c is None for c in codes):
            for i, proc in enumerate(procs):
                if codes[i] is None and proc.poll() is not None:
                    proc.finish()
                    codes[i] = proc.poll()
                    if codes[i] and codes[i] != protocol.PREEMPTED_EXIT and failed_at is None:
                        failed_at = time.monotonic()
                    if channel is not None:
                        channel.send(protocol.Exit(rank=proc.rank, code=codes[i]))
            if failed_at is not None and time.monotonic() - failed_at > SIBLING_GRACE_S:
                for proc in procs:
                    proc.terminate()
            if len(procs) == 1 and codes[0] is None:
                procs[0].wait()  # one rank: block on it rather than poll
            elif any(c is None for c in codes):
                done.wait(0.05)
    finally:
        done.set()
        for proc in procs:
            if proc.proc is not None and proc.poll() is None:
                proc.terminate()
        if channel is not None:
            channel.close()
    return codes
