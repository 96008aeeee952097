"""A TCP server that anyone who can reach its port cannot hold down: the driver's run-folder
service and the barrier launcher's control channel both stand on it.

- a new connection must send its hello -- one line -- within :attr:`GuardedServer.
  hello_timeout_s`, whole (:func:`hello_line`: a byte a second gains nothing);
- at most :attr:`GuardedServer.max_waiting` connections wait for theirs at once: a new one
  pushes the oldest out, so a flood of silent sockets holds neither threads nor descriptors;
- a connection that passed its hello is :meth:`GuardedServer.admit`-ted up to a cap, and
  :meth:`GuardedServer.end_all` ends every live one (a server that stops leaves none);
- refusals are counted and logged at most once per :data:`REFUSALS_SAID_EVERY_S`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import threading
import time
from typing import Any, Optional, cast

__side__ = "common"

log = logging.getLogger(__name__)

#: Seconds between two log lines about refused connections.
REFUSALS_SAID_EVERY_S = 60.0


class GuardedServer(socketserver.ThreadingTCPServer):
    """See the module. Subclasses name themselves (:attr:`what`) and set their limits."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    #: what the log calls this server's connections
    what = "server"
    #: seconds a new connection has to send its hello, whole
    hello_timeout_s = 5.0
    #: connections waiting for their hello at once (a new one pushes the oldest out)
    max_waiting = 32
    #: connections served at once (past their hello)
    max_connections = 1 << 16

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        super().__init__(address, handler)
        self.over = False
        self._waiting: list[socket.socket] = []  # connected, no hello yet (oldest first)
        self._live: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        #: connections refused (no hello in time, a wrong one, pushed out, over the cap)
        self.refused = 0
        self._refused_unsaid, self._refusals_said = 0, -REFUSALS_SAID_EVERY_S

    def process_request(self, request: Any, client_address: Any) -> None:
        """A new connection waits for its hello; past :attr:`max_waiting` the oldest waiting
        one is pushed out (its thread ends now and counts it)."""
        pushed = None
        with self._connections_lock:
            if self.over:
                pushed = request
            else:
                self._waiting.append(request)
                if len(self._waiting) > self.max_waiting:
                    pushed = self._waiting.pop(0)
        if pushed is request:  # the server ended: no thread for it
            self.refuse(client_address[0], "came after the end")
            self.shutdown_request(cast(socket.socket, request))
            return
        if pushed is not None:
            hang_up(pushed)
        super().process_request(request, client_address)

    def admit(self, sock: socket.socket) -> bool:
        """A waiting connection passed its hello: served, unless the server ended or serves
        :attr:`max_connections` already (or it was pushed out meanwhile)."""
        with self._connections_lock:
            if sock not in self._waiting:
                return False
            self._waiting.remove(sock)
            if self.over or len(self._live) >= self.max_connections:
                return False
            self._live.add(sock)
            return True

    def leave(self, sock: socket.socket) -> None:
        """A connection ended (served or not)."""
        with self._connections_lock:
            with contextlib.suppress(ValueError):
                self._waiting.remove(sock)
            self._live.discard(sock)

    def connections(self) -> tuple[int, int]:
        """``(waiting, served)`` connections now."""
        with self._connections_lock:
            return len(self._waiting), len(self._live)

    def end_all(self) -> None:
        """End every connection, waiting or served, and take no more."""
        with self._connections_lock:
            self.over = True
            ending = [*self._waiting, *self._live]
            self._waiting, self._live = [], set()
        for sock in ending:
            hang_up(sock)

    def refuse(self, client: Optional[str], why: str, note: str = "") -> None:
        """Count a refused connection; say so at most once per :data:`REFUSALS_SAID_EVERY_S`
        (a flood of bad connections is not a flood of log lines)."""
        with self._connections_lock:
            self.refused += 1
            self._refused_unsaid += 1
            now = time.monotonic()
            if now - self._refusals_said < REFUSALS_SAID_EVERY_S:
                return
            count, self._refused_unsaid, self._refusals_said = self._refused_unsaid, 0, now
        log.warning("Refused %d %s connection(s) in the last minute (the latest %s%s)%s",
                    count, self.what, why, f" from {client}" if client else "", note)


def hang_up(sock: socket.socket) -> None:
    """End a connection another thread may be reading (its read returns at once)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def hello_line(sock: socket.socket, timeout_s: float, limit: int = 1 << 16) -> bytes:
    """One line from ``sock`` within ``timeout_s`` in all (``TimeoutError`` after it,
    ``ValueError`` past ``limit`` bytes, ``ConnectionError`` when it closes first). Read a byte
    at a time: nothing past the line is taken from the stream (the caller's reader gets it)."""
    deadline = time.monotonic() + timeout_s
    line = bytearray()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no hello in time")
        sock.settimeout(left)
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("closed before its hello")
        line += chunk
        if len(line) > limit:
            raise ValueError("hello too long")
    return bytes(line)


def hello_json(sock: socket.socket, timeout_s: float, limit: int = 4096) -> dict[str, Any]:
    """:func:`hello_line` as a JSON object (``ValueError`` if it is not one)."""
    value: Any = json.loads(hello_line(sock, timeout_s, limit))
    if not isinstance(value, dict):
        raise ValueError("hello not an object")
    return value
