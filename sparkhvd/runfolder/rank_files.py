"""A rank's access to its run folder: checkpoints, the Horovod timeline, resume sources.

Where a rank runs decides how it reaches the run folder, never what it may do there:

- on the driver's machine (local mode, ``np < 0``) the driver sets ``SPARKHVD_RUN_URL`` to the
  run folder's local path, and rank 0 writes straight into it;
- on other hosts the driver's disk is out of reach and the storage credentials must stay on the
  driver: files go to the driver's run-folder service (``SPARKHVD_FILES_ADDR``, one-off token in
  ``SPARKHVD_FILES_TOKEN``; :mod:`sparkhvd.runfolder.service`), which writes them into the run folder --
  and only there: paths are relative, ``..`` is refused -- and publishes them with it.

Reads of the checkpoints a run resumes from (``root="resume"``, read-only) always go through the
service: the source may be another run folder on remote storage that only the driver can read.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import IO, Mapping, Optional

from sparkhvd.common import protocol
from sparkhvd.runfolder.wire import (
    CHECKPOINTS,
    IDLE_RECONNECT_S,
    clean_path,
    copy_exact,
    proof,
    read_json,
    remove_file,
    send_json,
)

__side__ = "rank"

#: Seconds a rank keeps trying to reach the driver's run-folder service before it gives up.
CONNECT_PATIENCE_S = 60.0

class RunFiles:
    """The run folder as a rank sees it (see the module docstring)."""

    def __init__(self, environ: Optional[Mapping[str, str]] = None) -> None:
        environ = os.environ if environ is None else environ
        self.local = environ.get(protocol.RUN_URL_ENV) or None
        if self.local and not os.path.isdir(self.local):
            self.local = None  # set for another host: this one cannot see it
        addr = environ.get(protocol.FILES_ADDR_ENV, "")
        host, _, port = addr.rpartition(":")
        self.addr = (host, int(port)) if host and port.isdigit() else None
        self.token = environ.get(protocol.FILES_TOKEN_ENV, "")
        self._sock: Optional[socket.socket] = None
        self._rfile: Optional[IO[bytes]] = None
        self._used = 0.0  # when the connection last answered
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """Whether this process has a run folder to write to."""
        return bool(self.local or self.addr)

    def describe(self, path: str = "") -> str:
        """Where ``path`` lands, for messages."""
        base = self.local or "the driver's run folder"
        return f"{base}/{path}".rstrip("/")

    # -- service connection -------------------------------------------------------------
    def _connect(self) -> None:
        """Connect and prove the run's key (:func:`~sparkhvd.runfolder.wire.proof`); a service
        that refuses (busy: someone holds its connections) or cannot be reached is tried again
        for up to :data:`CONNECT_PATIENCE_S`."""
        if self.addr is None:
            raise FileNotFoundError("This rank has no run folder: it was not started by "
                                    "sparkhvd.HorovodRunner (pass a checkpoint URL instead).")
        deadline = time.monotonic() + CONNECT_PATIENCE_S
        pause = 0.05
        while True:
            try:
                self._sock, self._rfile = self._proved_connection()
                return
            except OSError as exc:
                if time.monotonic() + pause > deadline:
                    raise ConnectionError(f"the driver's run-folder service at "
                                          f"{self.addr[0]}:{self.addr[1]} refused or dropped "
                                          f"this rank's connection for {CONNECT_PATIENCE_S:g} "
                                          f"s ({exc})") from exc
                time.sleep(pause)  # a retry's pause, growing: the service is busy or away
                pause = min(2.0, pause * 2)

    def _proved_connection(self) -> tuple[socket.socket, IO[bytes]]:
        assert self.addr is not None
        sock = socket.create_connection(self.addr, timeout=60)
        try:
            # a request is a header then a body: without this each waits for a delayed ack
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rfile = sock.makefile("rb")
            challenge = read_json(rfile)
            send_json(sock, {"proof": proof(self.token, str(challenge.get("nonce", "")))})
            answer = read_json(rfile)
            if not answer.get("ok"):
                raise ConnectionRefusedError(answer.get("error", "refused"))
        except BaseException:
            sock.close()
            raise
        sock.settimeout(600)
        return sock, rfile

    def _request(self, header: dict, body: Optional[IO[bytes]] = None,
                 sink: Optional[IO[bytes]] = None) -> dict:
        with self._lock:
            if self._sock is not None and time.monotonic() - self._used > IDLE_RECONNECT_S:
                self.close()  # the service ends idle connections: a fresh one, no retry spent
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._connect()
                    assert self._sock is not None and self._rfile is not None
                    send_json(self._sock, header)
                    if body is not None:
                        copy_exact(body, self._sock, header["size"])
                    reply = read_json(self._rfile)
                    if reply.get("ok") and sink is not None:
                        copy_exact(self._rfile, sink, int(reply["size"]))
                    self._used = time.monotonic()
                    break
                except OSError:  # a broken connection: reconnect once and start over
                    self.close()
                    if attempt:
                        raise
                    if body is not None:
                        body.seek(0)
                    if sink is not None:  # what the broken answer wrote is not the file
                        sink.seek(0)
                        sink.truncate()
        if not reply.get("ok"):
            error = reply.get("error", "refused")
            if reply.get("kind") == "missing":
                raise FileNotFoundError(error)
            raise PermissionError(error) if reply.get("kind") == "refused" else OSError(error)
        return reply

    def close(self) -> None:
        """Close the connection to the driver's service (reopened when needed)."""
        for item in (self._rfile, self._sock):
            with contextlib.suppress(Exception):
                if item is not None:
                    item.close()
        self._sock = self._rfile = None

    # -- operations -----------------------------------------------------------------------
    def write_file(self, path: str, local_path: str, *, root: str = "run") -> None:
        """Copy a local file into the run folder at ``path``, atomically (or, ``root=
        "row-groups"``, into the driver's row-group copies)."""
        path = clean_path(path)
        if self.local and root == "run":
            from sparkhvd.common.fileio import atomic_copy

            atomic_copy(local_path, os.path.join(self.local, path))
            return
        with open(local_path, "rb") as f:
            self._request({"op": "put", "root": root, "path": path,
                           "size": os.path.getsize(local_path)}, body=f)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` into the run folder at ``path``, atomically."""
        import io

        path = clean_path(path)
        if self.local:
            from sparkhvd.common.fileio import atomic_write

            atomic_write(os.path.join(self.local, path), data)
            return
        self._request({"op": "put", "root": "run", "path": path, "size": len(data)},
                      body=io.BytesIO(data))

    def read_bytes(self, path: str, *, root: str = "run",
                   span: Optional[tuple[int, int]] = None) -> bytes:
        """The content of ``path`` in the run folder, or in the resume source (``root="resume"``)
        -- with ``span`` (offset, length), only those bytes of it (fewer where it ends first)."""
        import io

        path = clean_path(path)
        if root == "run" and self.local:
            with open(os.path.join(self.local, path), "rb") as f:
                if span is None:
                    return f.read()
                f.seek(span[0])
                return f.read(span[1])
        out = io.BytesIO()
        self._request({"op": "get", "root": root, "path": path,
                       **({} if span is None else {"span": list(span)})}, sink=out)
        return out.getvalue()

    def listdir(self, path: str = "", *, root: str = "run") -> list[str]:
        """Names directly below a folder of the run folder (or the resume source); empty when
        there is none."""
        path = clean_path(path) if path else ""
        if root == "run" and self.local:
            folder = os.path.join(self.local, path)
            return sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        if self.addr is None:
            return []
        return list(self._request({"op": "list", "root": root, "path": path}).get("names", []))

    def delete(self, path: str) -> None:
        """Delete a checkpoint's file of the run folder (``checkpoints/...``: what ``keep=``
        prunes); gone already is fine."""
        path = clean_path(path)
        if self.local:
            if not path.startswith(CHECKPOINTS + "/"):
                raise PermissionError(f"only the run's checkpoints can be deleted, not {path!r}")
            remove_file(self.local, path)
            return
        self._request({"op": "delete", "root": "run", "path": path})

    def exists(self, path: str, *, root: str = "run") -> bool:
        """Whether ``path`` exists in the run folder (or the resume source)."""
        path = clean_path(path)
        if root == "run" and self.local:
            return os.path.exists(os.path.join(self.local, path))
        if self.addr is None:
            return False
        return bool(self._request({"op": "exists", "root": root, "path": path}).get("exists"))


class DriverRowCopies:
    """The driver's copies of the row groups of a small table (root ``row-groups`` of the
    run-folder service, :mod:`sparkhvd.data.row_group_cache`): a connection of their own, so
    a checkpoint never waits behind them."""

    def __init__(self, files: RunFiles) -> None:
        self.files = files

    def put(self, name: str, local_path: str) -> None:
        self.files.write_file(name, local_path, root="row-groups")

    def get(self, name: str) -> bytes:
        return self.files.read_bytes(name, root="row-groups")


def driver_row_copies() -> Optional[DriverRowCopies]:
    """This rank's way to the driver's row-group copies; None on the driver's machine (its
    host's own copies are the driver's) or without the service."""
    files = RunFiles()
    if files.local or files.addr is None:
        return None
    return DriverRowCopies(files)


_shared: Optional[RunFiles] = None


def run_files() -> RunFiles:
    """This process' :class:`RunFiles` (one connection per process)."""
    global _shared
    if _shared is None:
        _shared = RunFiles()
    return _shared


def publish_timeline(rank: int) -> None:
    """Rank 0: bring the Horovod timeline into the run folder when it was written elsewhere.

    On a remote host horovod writes ``HOROVOD_TIMELINE`` to a local file; horovod is shut down
    first (the timeline is complete only then), then the file goes to ``timeline.json``.
    """
    path = os.environ.get(protocol.TIMELINE_ENV)
    files = run_files()
    if rank != 0 or not path or files.local or not files.addr:
        return
    import sys

    if "horovod.tensorflow" in sys.modules:
        with contextlib.suppress(Exception):
            hvd = sys.modules["horovod.tensorflow"]
            if hvd.is_initialized():
                hvd.shutdown()
    if os.path.exists(path):
        files.write_file("timeline.json", path)


#: output_folder(): name -> the local folder on this host whose files go to the run folder.
_outputs: dict[str, str] = {}


def output_folder(name: str) -> str:
    """A folder for ``<run folder>/<name>/`` (see :func:`sparkhvd.torch.output_dir`): the run
    folder's own when this host sees it, else a local one :func:`publish_outputs` copies in."""
    name = clean_path(name)
    files = run_files()
    if files.available:  # the driver says what a relaunch can resume from
        from sparkhvd.common.events import emit
        from sparkhvd.common.identity import current_rank

        emit(protocol.OutputDir(rank=current_rank().rank, name=name))
    if not files.available:  # not in a sparkhvd run (plain torchrun, a test): here
        path = os.path.abspath(name)
    elif files.local:
        path = os.path.join(files.local, name)
    elif name in _outputs:
        return _outputs[name]
    else:
        import tempfile

        path = _outputs[name] = tempfile.mkdtemp(prefix=f"sparkhvd-{name.replace('/', '-')}-")
    os.makedirs(path, exist_ok=True)
    return path


def publish_outputs() -> None:
    """Copy every file of the local output folders into the run folder (the rank's last act)."""
    files = run_files()
    if not files.available:
        return
    for name, local in list(_outputs.items()):
        for root, _, names in os.walk(local):
            for file in names:
                path = os.path.join(root, file)
                files.write_file(f"{name}/{os.path.relpath(path, local)}", path)
