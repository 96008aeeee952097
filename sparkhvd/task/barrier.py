"""The executor side of the barrier launcher: what one Spark barrier task does.

1. Connect to the driver's control server and register (:class:`~sparkhvd.protocol.Hello`:
   partition, host, the address it reaches the driver from, a reserved port if the backend
   needs one).
2. Receive the rank's variables (:class:`~sparkhvd.protocol.Assign`), build the rank's
   environment (:func:`sparkhvd.environment.process_env`: this executor's variables *filtered*,
   the driver's, the rank's), pin the GPU Spark gave the task, pick the network interface that
   reaches the driver when no ``nics`` were given.
3. Start the rank (:class:`~sparkhvd.task.process.RankProcess`), forward its output lines and
   events over the connection as they come, send a heartbeat every second, and kill the rank
   when the driver says :class:`~sparkhvd.protocol.Abort` or goes away.
4. Send the exit status and return the pickled result through ``collect()``.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any, Mapping, Optional

from .. import protocol
from ..environment import process_env
from ..rank import iface_towards
from .process import RankProcess

#: Seconds between heartbeats (the driver declares a task lost after ``heartbeat_timeout``).
HEARTBEAT_S = 1.0


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


def barrier_task(payload: bytes, options: Mapping[str, Any], env: Mapping[str, str],
                 driver: tuple[str, int], token: str, start_timeout: float,
                 reserve_port: bool, _rows: Any) -> Any:
    """One Spark barrier task (see the module docstring); yields ``(partition, result)``."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    gpus = context.resources().get("gpu")
    sock = socket.create_connection(driver, timeout=start_timeout)
    sock.settimeout(None)
    channel = _Channel(sock)
    address = sock.getsockname()[0]
    channel.send(protocol.Hello(token=token, partition=partition, host=socket.gethostname(),
                                address=address,
                                port=_reserve_port(address) if reserve_port else None))
    reply = channel.receive()
    if not isinstance(reply, protocol.Assign):
        channel.close()
        yield (partition, None)  # the driver gave up on this run before it started
        return
    rank_env = process_env(os.environ, env, reply.env)
    if gpus is not None and gpus.addresses:
        rank_env[protocol.TASK_GPUS_ENV] = ",".join(gpus.addresses)
    if not rank_env.get("HOROVOD_GLOO_IFACE"):  # no nics given: the one that reaches the driver
        iface = iface_towards(driver[0]) or "lo"
        rank_env["HOROVOD_GLOO_IFACE"] = rank_env["NCCL_SOCKET_IFNAME"] = iface
    rank = int(reply.env.get("SPARKHVD_RANK", reply.env.get("HOROVOD_RANK", partition)))
    proc = RankProcess(payload, options, rank_env, rank=rank, on_line=channel.send,
                       on_event=channel.send)
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_S):
            channel.send(protocol.Heartbeat(rank=rank))

    def watch_driver() -> None:  # an abort, or a lost driver, ends the rank
        channel.receive()
        if not done.is_set():
            proc.terminate()

    try:
        proc.start()
        threading.Thread(target=heartbeat, daemon=True, name="sparkhvd-heartbeat").start()
        threading.Thread(target=watch_driver, daemon=True, name="sparkhvd-watch").start()
        code = proc.wait()
        proc.finish()
        done.set()
        channel.send(protocol.Exit(rank=rank, code=code))
        result = proc.result() if code == 0 else None
    finally:
        done.set()
        if proc.proc is not None and proc.poll() is None:
            proc.terminate()
        channel.close()
        proc.close()
    yield (partition, result)
