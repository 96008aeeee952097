"""Warm starts: a rank's process forked from one that already imported its framework.

The client half of :mod:`sparkhvd.rank.warm_server` (read it first). :class:`~sparkhvd.common.
rankprocess.RankProcess` asks :func:`spawn` for a rank's supervisor; when no server is there
(the first run on this executor, warm starts turned off, a framework that is unsafe to fork)
it starts a fresh process as before, and after its ranks ended it calls :func:`keep_warm`, so
the next run, retry or elastic relaunch on this executor finds one.

One server per executor process, backend and what a framework reads when it loads
(:func:`import_env`), so a rank never gets a runtime loaded under other settings: the socket's
name is a hash of them (:func:`server_key`), in a folder only this user may enter. Off with
``warm_start=False`` on the runner, or ``SPARKHVD_WARM_START=0`` in an executor's environment.
:func:`servers` lists the running ones and :func:`end_servers` ends them by PID.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Mapping, Optional

from sparkhvd.common.owned_temp import alive

__side__ = "common"

#: An executor's variable that turns warm starts off on its host (``0``).
OFF_ENV = "SPARKHVD_WARM_START"
#: A server with no rank running ends after this many seconds.
IDLE_S = 600.0
#: Variables a framework or the C libraries under it read when they load: a server is started
#: with these alone, and only a rank whose values are the same uses it.
IMPORT_PREFIXES = ("PYTHON", "LD_", "TF_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_",
                   "OPENBLAS_", "XLA_", "KERAS", "CUDA_", "NVIDIA_", "GOMP_", "LC_")
IMPORT_NAMES = ("PATH", "HOME", "LANG", "TMPDIR", "USER", "VIRTUAL_ENV")
#: Read per rank at run time, not at load: never part of the key.
PER_RANK = ("TF_CONFIG", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
#: The longest temporary folder a server's socket goes under (a Unix socket's path is at most
#: 107 bytes; the socket's own name takes about 55 of them): a longer one gives ``/tmp``.
MAX_BASE = 48
_said: set[str] = set()
#: True in a rank forked by a warm server (set by the server's child before the supervisor).
FORKED_WARM = False


def enabled(requested: bool, env: Mapping[str, str]) -> bool:
    """Whether this rank may start warm: asked for by the run, not turned off on this host."""
    return requested and os.environ.get(OFF_ENV, env.get(OFF_ENV, "1")) != "0" and \
        sys.platform.startswith("linux") and hasattr(socket, "recv_fds")


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` a framework may read when it loads (the server's whole environment):
    never a variable named like a credential (it would outlive the run in the server)."""
    from sparkhvd.common.redaction import SECRET_NAME

    return {name: value for name, value in env.items()
            if (name.startswith(IMPORT_PREFIXES) or name in IMPORT_NAMES)
            and name not in PER_RANK and not name.startswith("TORCHELASTIC_")
            and not SECRET_NAME.search(name)}


def watched_pid() -> int:
    """The process a server lives no longer than: this executor's JVM (the nearest ``java``
    ancestor), else this process (the driver, for local ranks)."""
    pid = os.getpid()
    for _ in range(8):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent = int(fields[1])
            with open(f"/proc/{parent}/comm") as f:
                if f.read().strip() == "java":
                    return parent
        except (OSError, ValueError, IndexError):
            break
        if parent <= 1:
            break
        pid = parent
    return os.getpid()


def _code_identity() -> list[Any]:
    """sparkhvd's own code, as it is on disk now: an edited or upgraded package gets a new
    server (its ranks would otherwise run the old code)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    newest = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with contextlib.suppress(OSError):
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime_ns)
    return [root, newest]


def _framework_identity(backend: str) -> list[Any]:
    """The installed files of what a server preloads: an upgrade gets a new server."""
    import importlib.util

    names = ("numpy", "cloudpickle", "psutil", *{"torch": ("torch",)}.get(backend, ()))
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
            origin = spec.origin if spec else None
            found.append([name, origin, os.stat(origin).st_mtime_ns if origin else None])
        except (ImportError, ValueError, OSError):
            found.append([name, None, None])
    return found


def _machine_identity() -> list[Any]:
    """This boot and these namespaces: containers sharing ``/tmp`` (whose JVMs may have the
    same PID) never share a server."""
    found: list[Any] = []
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            found.append(f.read().strip())
    for ns in ("pid", "net", "mnt"):
        with contextlib.suppress(OSError):
            found.append(os.readlink(f"/proc/self/ns/{ns}"))
    return found


def server_key(backend: str, env: Mapping[str, str], watch: int) -> str:
    """The name of the server a rank with ``env`` may use (see the module docstring)."""
    parts = [sys.executable, backend, watch, _code_identity(), _framework_identity(backend),
             _machine_identity(), sorted(import_env(env).items())]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def folder() -> Optional[str]:
    """This user's folder of servers (created 0700), or None where it is not private."""
    base = tempfile.gettempdir()
    if len(base) > MAX_BASE:  # a Unix socket's path is at most 107 bytes
        base = "/tmp"
    path = os.path.join(base, f"sparkhvd-warm-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None
    return path


def socket_path(backend: str, env: Mapping[str, str]) -> Optional[str]:
    where = folder()
    return os.path.join(where, server_key(backend, env, watched_pid()) + ".sock") \
        if where else None


class WarmChild:
    """A rank's supervisor forked by a server: what :class:`subprocess.Popen` would give
    (``pid``, ``stdout``, ``stderr``, ``poll``, ``wait``, ``returncode``); its exit status comes
    from the server, which is its parent. Safe to poll and wait from several threads (a task's
    loop and its driver-watching thread), as ``Popen`` is."""

    #: The longest a waiting thread holds the reading lock at a time.
    SLICE_S = 0.05

    def __init__(self, conn: socket.socket, pid: int, stdout: IO[bytes], stderr: IO[bytes],
                 buffered: bytes = b"") -> None:
        self.conn, self.pid, self.stdout, self.stderr = conn, pid, stdout, stderr
        self.returncode: Optional[int] = None
        self._buffer = buffered
        self._lock = threading.Lock()
        self._take_lines()

    def _take_lines(self) -> None:
        while b"\n" in self._buffer and self.returncode is None:
            line, self._buffer = self._buffer.split(b"\n", 1)
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if "exit" in message:
                    self._ended(int(message["exit"]))

    def _ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            with contextlib.suppress(OSError):
                self.conn.close()

    def _read(self, timeout: float) -> None:
        import select

        with self._lock:
            if self.returncode is not None:
                return
            try:
                ready, _, _ = select.select([self.conn], [], [], timeout)
                data = self.conn.recv(4096) if ready else None
            except (OSError, ValueError):
                data = b""
            if data is None:
                return
            if not data:  # the server went away without a word: the rank went with it
                self._ended(-9)
                return
            self._buffer += data
            self._take_lines()

    def poll(self) -> Optional[int]:
        self._read(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = self.SLICE_S if deadline is None else min(self.SLICE_S,
                                                             deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired("warm rank", timeout or 0)
            self._read(left)
        return self.returncode


def _connect(path: str) -> Optional[socket.socket]:
    """A connection to the server listening at ``path`` (run by this user), or None. A server
    still importing is not waited for: this rank starts fresh, as fast as it would have."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        if uid == os.getuid() and pid > 0:
            return sock
    except OSError:
        pass
    sock.close()
    return None


def _held(path: str) -> bool:
    """Whether a server for ``path`` is running: importing or listening (it holds
    ``path.lock`` for its life; a socket file without it is a killed server's)."""
    import fcntl

    try:
        fd = os.open(path + ".lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def refused(path: str) -> Optional[str]:
    """Why a server for ``path`` refused to serve (a framework unsafe to fork), or None."""
    try:
        with open(path + ".refused") as f:
            return str(json.load(f).get("refused") or "")
    except (OSError, ValueError):
        return None


def say_once(reason: str, backend: str = "") -> Optional[str]:
    """The line to show the user for ``reason``, the first time this process meets it."""
    if reason in _said:
        return None
    _said.add(reason)
    which = f" for backend={backend!r}" if backend else ""
    return (f"sparkhvd: no warm start{which} here: {reason}; its ranks start as fresh processes "
            "(docs/guides/warm.md)")


def spawn(path: str, argv: list[str], env: Mapping[str, str], events_fd: int, fd_env: str,
          cwd: Optional[str] = None) -> Optional[WarmChild]:
    """A rank's supervisor with ``argv`` forked by the server at ``path`` (``events_fd``: the
    write end of its event pipe, numbered in ``fd_env``), or None: start it fresh -- with a
    new event pipe (a child forked before the answer was lost may still hold this one)."""
    if refused(path) is not None:
        return None
    sock = _connect(path)
    if sock is None:
        return None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    request = json.dumps({"argv": argv, "env": dict(env), "fd_env": fd_env,
                          "cwd": cwd or os.getcwd()}).encode()
    answer: dict[str, Any] = {}
    received = b""
    try:
        sock.settimeout(30.0)
        socket.send_fds(sock, [struct.pack("!I", len(request))], [out_w, err_w, events_fd])
        sock.sendall(request)
        while b"\n" not in received:  # recv, not a buffered reader: what follows is the exit
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
        if b"\n" in received:
            line, received = received.split(b"\n", 1)
            answer = json.loads(line)
    except (OSError, ValueError):
        answer = {}
    finally:
        os.close(out_w)
        os.close(err_w)
    if "pid" not in answer:  # a child it may have forked ends with this connection
        sock.close()
        os.close(out_r)
        os.close(err_r)
        return None
    sock.settimeout(None)
    return WarmChild(sock, int(answer["pid"]), os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"),
                     received)


def keep_warm(path: str, backend: str, env: Mapping[str, str], idle_s: float = IDLE_S) -> None:
    """Start a server for ``path`` unless one runs, is starting or refused: for the next rank
    (it detaches itself; this returns once it has)."""
    if refused(path) is not None or _held(path):
        return
    _sweep(os.path.dirname(path))
    with contextlib.suppress(OSError):
        subprocess.run([sys.executable, "-m", "sparkhvd.rank.warm_server", path,
                        str(watched_pid()), str(idle_s), backend],
                       env=import_env(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, start_new_session=True, timeout=30,
                       cwd=os.path.dirname(path))


def _sweep(where: str) -> None:
    """Remove what servers killed without their clean-up left (a socket no server holds, its
    record, a socket being set up by a process that is gone), and the refusals of executors
    that are gone. Lock files stay: a starting server may be about to take one."""
    for name in os.listdir(where):
        path = os.path.join(where, name)
        with contextlib.suppress(OSError, ValueError, KeyError):
            stem, _, tail = name.rpartition(".")
            if name.endswith(".sock") and not _held(path):
                for leftover in (path, path + ".json"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(leftover)
            elif stem.endswith(".sock") and tail.isdigit() and not alive(int(tail)):
                os.unlink(path)  # a staging socket whose server died before renaming it
            elif name.endswith(".refused"):
                with open(path) as f:
                    watch = int(json.load(f)["watch"])
                if not alive(watch):
                    os.unlink(path)



def servers() -> list[dict[str, Any]]:
    """The running servers of this user on this machine: ``{"pid", "watch", "backend",
    "started", "socket"}`` each."""
    where = folder()
    found = []
    for name in sorted(os.listdir(where)) if where else ():
        if name.endswith(".sock.json"):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(where, name)) as f:  # type: ignore[arg-type]
                    info = json.load(f)
                found.append({**info, "socket": os.path.join(where, name[:-5])})  # type: ignore
    return found


def end_servers(watch: Optional[int] = None) -> list[int]:
    """End this user's servers (those living for ``watch`` only, when given) by PID: the PIDs."""
    import signal

    ended = []
    for info in servers():
        if (watch is None or info.get("watch") == watch) and _held(info["socket"]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(info["pid"]), signal.SIGTERM)
                ended.append(int(info["pid"]))
    return ended
