"""The executor side of the barrier launcher: what one Spark barrier task does.

The stage is a DataFrame barrier stage (``mapInArrow(..., barrier=True)``), the same on classic
and Spark Connect sessions; each task returns its rows (:data:`ROW_SCHEMA`) through
``collect()``.

1. Connect to the driver's control server and register (:class:`~sparkhvd.common.protocol.Hello`:
   partition, host, address, a reserved port if the backend needs one).
2. **Live** (every task reached the driver): receive the rank's variables
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
   the rank runs as a :class:`~sparkhvd.executor.process.RankProcess`.
4. The rows carry the exit status and the pickled result, in chunks.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from typing import Any, Iterator, Mapping, Optional

from sparkhvd.common import protocol
from sparkhvd.common.environment import process_env
from sparkhvd.common.identity import RankIdentity
from sparkhvd.common.netif import collective_iface_env, route_address
from sparkhvd.executor.process import RankProcess

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


def _reserve_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address or "", 0))
        return s.getsockname()[1]


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
        if isinstance(msg, protocol.Heartbeat) or getattr(msg, "update", False):
            return  # progress updates are for a live console only
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


def arrow_barrier_task(payload: bytes, options: Mapping[str, Any], env: Mapping[str, str],
                       driver: tuple[str, int], token: str, start_timeout: float,
                       backend: str, run_env: Mapping[str, str], batches: Any) -> Any:
    """One barrier task of ``mapInArrow`` (see the module docstring): yields Arrow batches of
    :data:`ROW_SCHEMA`."""
    for _ in batches:  # the stage's one input row per task
        pass
    partition, status, result, events = barrier_task(payload, options, env, driver, token,
                                                     start_timeout, backend, run_env)
    yield from _rows(partition, "status", json.dumps(status).encode())
    if result is not None:
        yield from _rows(partition, "result", result)
    if events is not None:
        yield from _rows(partition, "events", events)


def _rows_plan(backend: str, run_env: Mapping[str, str], gathered: list[dict],
               partition: int) -> dict[str, str]:
    """Rows mode: the rank's variables, assigned by the tasks themselves."""
    from sparkhvd.common.backends import TaskInfo, get_backend

    chosen = get_backend(backend)
    if not getattr(chosen, "assigns_in_tasks", False):
        raise RuntimeError(
            f"backend={backend!r} needs every Spark task to reach the driver (its rendezvous "
            "runs there), but some could not connect to its control channel. Fix: let the "
            "executors reach this machine (firewall, spark.driver.host; `sparkhvd doctor` "
            "checks it), or use backend='tf', which runs without that channel.")
    infos = {g["partition"]: TaskInfo(g["partition"], g["host"], g["address"], g["port"])
             for g in gathered}
    return {**run_env, **chosen.assign(infos)[partition]}


def barrier_task(payload: bytes, options: Mapping[str, Any], env: Mapping[str, str],
                 driver: tuple[str, int], token: str, start_timeout: float, backend: str,
                 run_env: Mapping[str, str]) -> tuple[int, dict, Optional[bytes],
                                                      Optional[bytes]]:
    """One Spark barrier task: ``(partition, status, result, events)`` -- ``events`` only in
    rows mode."""
    from pyspark import BarrierTaskContext

    from sparkhvd.common.backends import get_backend

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    gpus = context.resources().get("gpu")
    host = socket.gethostname()
    channel = _connect(driver, min(float(start_timeout), CONNECT_TIMEOUT_S))
    address = channel.sock.getsockname()[0] if channel else route_address(driver[0])
    port = _reserve_port(address) if get_backend(backend).needs_port else None
    status: dict[str, Any] = {"mode": "live", "host": host, "rank": None, "code": None}
    reply: Any = None
    if channel is not None:
        channel.send(protocol.Hello(token=token, partition=partition, host=host,
                                    address=address, port=port))
        reply = channel.receive()
        if not isinstance(reply, (protocol.Assign, protocol.Detached)):
            channel.close()
            return partition, status, None, None  # the driver gave up before the run started
    kept = None
    if isinstance(reply, protocol.Assign):
        assigned = reply.env
    else:  # this task could not reach the driver, or the driver says another could not
        if channel is not None:
            channel.close()
            channel = None
        status["mode"], kept = "rows", _Kept()
        # Every task comes here (the driver detaches the registered ones), so the barrier's
        # allGather -- about a second -- is paid only without the channel.
        gathered = [json.loads(g) for g in context.allGather(json.dumps(
            {"partition": partition, "host": host, "address": address, "port": port}))]
        try:
            assigned = _rows_plan(backend, run_env, gathered, partition)
        except RuntimeError as exc:
            rank = sorted(g["partition"] for g in gathered).index(partition)
            kept.add(protocol.Error(rank=rank, exc_type="RuntimeError", message=str(exc),
                                    traceback="", time=0.0))
            status.update(rank=rank, code=1)
            return partition, status, None, kept.blob()
    rank_env = process_env(os.environ, env, assigned)
    if channel is None:  # the run-folder service is on the driver: out of reach
        for name in (protocol.FILES_ADDR_ENV, protocol.FILES_TOKEN_ENV):
            rank_env.pop(name, None)
    if gpus is not None and gpus.addresses:
        rank_env[protocol.TASK_GPUS_ENV] = ",".join(gpus.addresses)
    if not rank_env.get("HOROVOD_GLOO_IFACE"):  # no nics given: the one that reaches the driver
        rank_env.update(collective_iface_env(None, driver[0]))
    rank = RankIdentity.from_env(assigned, default_rank=partition).rank
    status["rank"] = rank
    send = channel.send if channel is not None else kept.add
    proc = RankProcess(payload, options, rank_env, rank=rank, on_line=send, on_event=send)
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_S):
            channel.send(protocol.Heartbeat(rank=rank))

    def watch_driver() -> None:  # an abort, or a lost driver, ends the rank
        while isinstance(channel.receive(), protocol.DumpStacks):
            proc.request_stacks()
        if not done.is_set():
            proc.terminate()

    result = None
    try:
        proc.start()
        if channel is not None:
            threading.Thread(target=heartbeat, daemon=True, name="sparkhvd-heartbeat").start()
            threading.Thread(target=watch_driver, daemon=True, name="sparkhvd-watch").start()
        code = proc.wait()
        proc.finish()
        done.set()
        status["code"] = code
        if channel is not None:
            channel.send(protocol.Exit(rank=rank, code=code))
        result = proc.result() if code == 0 else None
    finally:
        done.set()
        if proc.proc is not None and proc.poll() is None:
            proc.terminate()
        if channel is not None:
            channel.close()
        proc.close()
    if kept is not None and kept.dropped:
        status["dropped_lines"] = kept.dropped
    return partition, status, result, kept.blob() if kept is not None else None
