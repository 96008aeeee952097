"""``python -m sparkhvd.rank.warm_server SOCKET WATCH_PID IDLE_S BACKEND``: ranks without the import.

A rank process spends most of its start importing its framework (``import torch``: seconds on a
busy 2-core executor; TensorFlow more), and every run, retry and elastic relaunch paid it again.
This process imports the backend's framework once, then forks a rank's supervisor
(:mod:`sparkhvd.rank.supervisor`) for each request it accepts on a Unix socket, so the rank's
Python already holds the framework. :mod:`sparkhvd.common.warmstart` is the other half: it
finds or starts this process and asks it for a rank.

Safe by construction:

- **Nothing forked after a thread, CUDA or a process group.** The process runs no user code and
  only imports; before each fork it checks that it still has one thread, and that neither CUDA
  nor ``torch.distributed`` was initialised. An import that leaves a thread running makes it
  refuse, with the reason written beside the socket: the client says it once and starts fresh
  processes for that backend. TensorFlow is known to (:data:`FRAMEWORKS`): it is left to the
  rank.
- **No user data, no earlier run's state.** The child gets the rank's own environment (the
  whole ``os.environ`` replaced), working folder, output pipes and event pipe (passed as file
  descriptors), in a new session; numpy's global generator is reseeded as a fresh process's
  would be. The request is JSON: nothing read from the socket runs code, and only a process of
  this user may connect (``SO_PEERCRED``).
- **It dies with its executor, its idle limit, or a signal.** It watches the process it was
  started for (the executor's JVM, or the driver for local ranks) and exits when that ends;
  it exits after ``IDLE_S`` seconds with no rank running; SIGTERM ends it and -- through their
  parent-death signal -- the supervisors it forked. A rank whose requester went away (its
  Spark task killed) is ended. Its PID is in ``SOCKET.json``.

Started only with what frameworks read when they load (:func:`sparkhvd.common.warmstart.
import_env`): no secrets, no run's variables.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Optional

from sparkhvd.common.owned_temp import alive

__side__ = "rank"

#: What each backend's ranks import (besides the rank's own modules, always preloaded).
#: TensorFlow is not: its import leaves a thread running (TF 2.15 to 2.21), and a process
#: with a second thread is never forked -- tf and horovod ranks are forked with Python and
#: sparkhvd loaded, and import TensorFlow themselves.
FRAMEWORKS = {"torch": ("torch", "torch.distributed")}
#: The rank's own modules: what every rank imports before the user's function.
RANK_MODULES = ("numpy", "cloudpickle", "psutil", "sparkhvd.rank.bootstrap",
                "sparkhvd.rank.supervisor", "sparkhvd.timing.sampler")
#: Longest request (the rank's environment and command line).
MAX_REQUEST = 4 << 20
#: How often the loop wakes without an event (the idle limit and the watched process).
TICK_S = 1.0
#: The folder this process started in (``sys.path[0]`` under ``python -m``): a rank gets its own.
STARTED_IN = os.getcwd()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def unsafe_to_fork() -> Optional[str]:
    """Why forking now would hand a child a broken runtime, or None."""
    threads = _threads()
    if threads > 1:
        return (f"{threads} threads run in it (a fork copies their locks but not the threads "
                "that would release them)")
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                return "CUDA is initialised in it"
        with contextlib.suppress(Exception):
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                return "a torch.distributed process group exists in it"
    return None


def preload(backend: str) -> Optional[str]:
    """Import what the backend's ranks import; why this process cannot serve them, or None."""
    import importlib

    for name in RANK_MODULES + FRAMEWORKS.get(backend, ()):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a rank would meet it too: it starts fresh
            return f"importing {name} failed in the warm process ({type(exc).__name__}: {exc})"
        threads = _threads()
        if threads > 1:
            return (f"importing {name} leaves {threads - 1} more thread(s) running, and a fork "
                    "would copy their locks but not the threads")
    return unsafe_to_fork()


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a 4-byte length, then JSON; the pipes' descriptors with its first bytes."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        raise ValueError("short request")
    (size,) = struct.unpack("!I", head)
    if size > MAX_REQUEST:
        raise ValueError("request too long")
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("truncated request")
        data += chunk
    return json.loads(data), fds


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


def _become_rank(request: dict, fds: list[int], closing: list[int]) -> None:
    """In the forked child: the rank's session, pipes, environment and folder, then its
    supervisor (never returns)."""
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        out, err, events = fds
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (null, out, err):
            os.close(fd)
        os.set_inheritable(events, True)
        env = dict(request["env"])
        env[request["fd_env"]] = str(events)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        if sys.path and sys.path[0] == STARTED_IN and not getattr(sys.flags, "safe_path", False):
            sys.path[0] = request["cwd"]  # ``python -m`` puts the starting folder first
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # a fresh process seeds numpy's global generator from the OS
            numpy.random.seed()
        from sparkhvd.common import warmstart
        from sparkhvd.rank import supervisor

        warmstart.FORKED_WARM = True
        sys.argv = [supervisor.__file__, *request["argv"]]
        supervisor.supervise(list(request["argv"]))
    except BaseException:  # noqa: BLE001 - the requester sees the exit status
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    os._exit(1)


class WarmServer:
    """The loop: accept requests, fork ranks, report their exits, end when no longer useful."""

    def __init__(self, path: str, watch_pid: int, idle_s: float, lock_fd: int) -> None:
        self.path, self.watch_pid, self.idle_s = path, watch_pid, idle_s
        self.lock_fd = lock_fd  # held for this process's life; never by a rank
        self.children: dict[int, socket.socket] = {}  # supervisor pid -> its requester
        self.selector = selectors.DefaultSelector()
        self.last_busy = time.monotonic()
        self.listener: Optional[socket.socket] = None
        self.wakeup_r, self.wakeup_w = os.pipe()
        self.watch_fd: Optional[int] = None
        self.inode = 0

    def listen(self) -> None:
        """Listen on ``path``: bound under a temporary name, then renamed, so a client sees
        either no socket or one that accepts."""
        staging = f"{self.path}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(staging)
        listener.listen(64)
        os.rename(staging, self.path)
        self.inode = os.stat(self.path).st_ino
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        os.set_blocking(self.wakeup_w, False)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "signal")
        with contextlib.suppress(OSError, AttributeError):  # Linux >= 5.3: exit seen at once
            self.watch_fd = os.pidfd_open(self.watch_pid)
            self.selector.register(self.watch_fd, selectors.EVENT_READ, "watched")

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select(TICK_S):
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    with contextlib.suppress(OSError):
                        os.read(self.wakeup_r, 4096)
                    self._reap()
                elif key.data == "watched":
                    return
                else:
                    self._requester_spoke(key.fileobj, key.data)  # type: ignore[arg-type]
            self._reap()
            if not alive(self.watch_pid):
                return
            if self.children:
                self.last_busy = time.monotonic()
            elif time.monotonic() - self.last_busy > self.idle_s:
                return

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.last_busy = time.monotonic()
        conn.settimeout(5.0)
        fds: list[int] = []
        try:
            if not _same_user(conn):
                conn.close()
                return
            request, fds = _recv_request(conn)
            if len(fds) != 3:
                raise ValueError("a rank needs its stdout, stderr and event pipes")
            refused = unsafe_to_fork()
            if refused:
                _send(conn, {"refused": refused})
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                own = [self.listener.fileno(), self.wakeup_r, self.wakeup_w, conn.fileno(),
                       self.lock_fd, self.selector.fileno(),  # type: ignore[attr-defined]
                       *(c.fileno() for c in self.children.values())]
                if self.watch_fd is not None:
                    own.append(self.watch_fd)
                _become_rank(request, fds, own)
        except (OSError, ValueError) as exc:
            _send(conn, {"refused": f"bad request ({exc})"})
            conn.close()
            return
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        conn.settimeout(None)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        _send(conn, {"pid": pid})

    def _requester_spoke(self, conn: socket.socket, pid: int) -> None:
        """The requester closed its end (its Spark task ended or was killed): the rank goes
        with it, as a rank started by that task would through its parent-death signal."""
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:  # to the supervisor only: SIGTERM to the rank itself is a notice
            self.selector.unregister(conn)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(conn)
                conn.close()

    def close(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):  # only our own socket: a newer one stays
                if os.stat(self.path).st_ino == self.inode:
                    os.unlink(self.path)
                    os.unlink(self.path + ".json")
                    os.unlink(self.path + ".lock")  # we hold it: no server waits on it
            self.listener.close()
        for pid in list(self.children):  # supervisors end their ranks' trees
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)



def main(argv: list[str]) -> int:
    path, watch, idle, backend = argv[0], int(argv[1]), float(argv[2]), argv[3]
    if os.fork() > 0:  # detached: the starter (a Spark task) returns at once and never reaps us
        os._exit(0)
    # One server per socket: the lock is held for this process's life (a second one started
    # at the same moment leaves at once).
    lock = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path + ".lock").st_ino != os.fstat(lock).st_ino:
            return 0  # swept away between our open and our lock: the next rank starts another
    except OSError:
        return 0
    info = {"pid": os.getpid(), "watch": watch, "backend": backend, "started": time.time()}
    # numpy's OpenBLAS starts its thread pool when it loads, and a pool's threads are not
    # forked: here it loads on one thread (a warm rank's numpy BLAS runs on one thread).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    refused = preload(backend)
    if refused or not alive(watch):
        if refused:
            info["refused"] = refused
            _write_json(path + ".refused", info)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = WarmServer(path, watch, idle, lock)
    try:
        try:
            server.listen()
        except OSError as exc:  # the client says it once and starts its ranks fresh
            _write_json(path + ".refused", {**info, "refused": f"it cannot listen on {path} "
                                            f"({exc})"})
            return 0
        _write_json(path + ".json", info)
        server.serve()
    finally:
        server.close()
    return 0


def _write_json(path: str, data: dict) -> None:
    staging = f"{path}.{os.getpid()}"
    with open(staging, "w") as f:
        json.dump(data, f)
    os.replace(staging, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
