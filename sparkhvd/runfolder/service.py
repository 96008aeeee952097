"""The driver's run-folder service: ranks on other hosts read and write run files through it.

Why: a rank on another machine cannot see the driver's disk (the default ``runs/`` folder), and
it must not hold the storage account key or connection string the driver was given. So rank 0
sends its checkpoints and timeline here, and the driver -- which has the credentials -- writes
them into the run folder, which is published with everything else. The service only ever writes
inside the run folder and only reads the run folder and the resume source; it accepts nothing
without the run's one-off token, and stops with the run. Client and wire format:
:mod:`sparkhvd.runfiles`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import socketserver
import threading
from typing import Any, Mapping, Optional, Sequence

from sparkhvd.common import protocol
from sparkhvd.common.fileio import atomic_open
from sparkhvd.common.redaction import remember_secret
from sparkhvd.runfolder.wire import ROOTS, clean_path, copy_exact, read_json, send_json

__side__ = "driver"

log = logging.getLogger(__name__)


class RunFileService(socketserver.ThreadingTCPServer):
    """Serves one run folder (read/write) and one resume source (read-only) to the ranks.

    Args:
        bind_host: the driver address the ranks reach (``spark.driver.host``).
        run_path: the run folder's local path (staged, for remote output folders).
        resume: ``(url, storage_options)`` of the checkpoints the run resumes from, or None.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, bind_host: str, run_path: str,
                 resume: Optional[tuple[str, Mapping[str, Any]]] = None) -> None:
        address = _bind_address(bind_host)
        super().__init__((address, 0), _Handler)
        self.advertised = bind_host
        self.run_path = run_path
        self.resume = resume
        self.token = secrets.token_urlsafe(24)
        remember_secret(self.token)
        self.received: list[str] = []
        self._thread = threading.Thread(target=self.serve_forever, args=(0.2,), daemon=True,
                                        name="sparkhvd-files")

    def start(self) -> "RunFileService":
        self._thread.start()
        return self

    def env(self) -> dict[str, str]:
        """The variables that point a rank at this service."""
        return {protocol.FILES_ADDR_ENV: f"{self.advertised}:{self.server_address[1]}",
                protocol.FILES_TOKEN_ENV: self.token}

    def stop(self) -> None:
        """Stop serving (off the caller's path: shutdown polls every 0.2 s)."""
        def _stop() -> None:
            self.shutdown()
            self.server_close()

        threading.Thread(target=_stop, daemon=True, name="sparkhvd-files-stop").start()

    # -- operations (handler threads) -------------------------------------------------------
    def local_path(self, root: str, path: str) -> str:
        if root != "run":
            raise PermissionError(f"the {root!r} files are read-only")
        return os.path.join(self.run_path, clean_path(path))

    def read(self, root: str, path: str, span: Optional[Sequence[int]] = None) -> bytes:
        """The file at ``path`` -- or, with ``span`` (offset, length), those bytes of it (fewer
        where it ends first): what a rank's restore reads of a large checkpoint file."""
        path = clean_path(path)
        if span is not None:
            offset, length = (int(n) for n in span)
            if offset < 0 or length < 0:
                raise ValueError(f"bad byte range {list(span)!r}")
        if root == "run":
            with open(os.path.join(self.run_path, path), "rb") as f:
                if span is None:
                    return f.read()
                f.seek(offset)
                return f.read(length)
        if self.resume is None:
            raise FileNotFoundError("this run does not resume from anything")
        from sparkhvd import storage

        url, options = self.resume
        if span is None:
            return storage.read_bytes(f"{url.rstrip('/')}/{path}", options)
        return storage.read_range(f"{url.rstrip('/')}/{path}", offset, length, options)

    def listdir(self, root: str, path: str) -> list[str]:
        """Names directly below a folder (empty when there is none)."""
        path = clean_path(path) if path else ""
        if root == "run":
            folder = os.path.join(self.run_path, path)
            return sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        if self.resume is None:
            return []
        from sparkhvd import storage

        url, options = self.resume
        try:
            return storage.listdir(f"{url.rstrip('/')}/{path}".rstrip("/"), options)
        except (FileNotFoundError, OSError):
            return []

    def exists(self, root: str, path: str) -> bool:
        path = clean_path(path)
        if root == "run":
            return os.path.exists(os.path.join(self.run_path, path))
        if self.resume is None:
            return False
        from sparkhvd import storage

        url, options = self.resume
        return storage.exists(f"{url.rstrip('/')}/{path}", options)


def _bind_address(host: str) -> str:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return ""
    with contextlib.suppress(OSError), socket.socket() as probe:
        probe.bind((address, 0))
        return address
    return ""


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:  # noqa: D102 - one connection per client
        server: RunFileService = self.server  # type: ignore[assignment]
        try:
            hello = read_json(self.rfile)
        except (ValueError, ConnectionError):
            return
        if not secrets.compare_digest(str(hello.get("token", "")), server.token):
            log.warning("Ignored a run-folder connection with a wrong token from %s",
                        self.client_address[0])
            return
        while True:
            try:
                request = read_json(self.rfile)
            except (ValueError, ConnectionError, OSError):
                return
            try:
                self._serve(server, request)
            except (ConnectionError, OSError) as exc:
                if isinstance(exc, (FileNotFoundError, PermissionError)):
                    continue
                log.debug("run-folder client %s went away: %s", self.client_address[0], exc)
                return

    def _serve(self, server: RunFileService, request: dict) -> None:
        op, root, path = request.get("op"), request.get("root", "run"), request.get("path", "")
        sock = self.connection
        try:
            if root not in ROOTS:
                raise PermissionError(f"unknown root {root!r}")
            if op == "put":
                size = int(request["size"])
                try:
                    target = server.local_path(root, path)
                except (ValueError, PermissionError):
                    _drain(self.rfile, size)
                    raise
                with atomic_open(target) as f:
                    copy_exact(self.rfile, f, size)
                server.received.append(clean_path(path))
                send_json(sock, {"ok": True, "size": size})
            elif op == "get":
                data = server.read(root, path, request.get("span"))
                send_json(sock, {"ok": True, "size": len(data)})
                sock.sendall(data)
            elif op == "exists":
                send_json(sock, {"ok": True, "exists": server.exists(root, path)})
            elif op == "list":
                send_json(sock, {"ok": True, "names": server.listdir(root, path)})
            else:
                raise PermissionError(f"unknown operation {op!r}")
        except (ValueError, PermissionError) as exc:
            send_json(sock, {"ok": False, "kind": "refused", "error": str(exc)})
        except FileNotFoundError as exc:
            send_json(sock, {"ok": False, "kind": "missing",
                             "error": f"{root} file {path!r} not found ({exc})"})
        except Exception as exc:  # noqa: BLE001 - reported to the rank, which raises it
            from sparkhvd.common.redaction import redact

            send_json(sock, {"ok": False, "kind": "error",
                             "error": redact(f"{type(exc).__name__}: {exc}")})


def _drain(rfile: Any, size: int) -> None:
    left = size
    while left:
        chunk = rfile.read(min(1 << 20, left))
        if not chunk:
            return
        left -= len(chunk)
