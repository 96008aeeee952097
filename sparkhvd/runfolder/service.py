"""The driver's run-folder service: ranks on other hosts read and write run files through it.

Why: a rank on another machine cannot see the driver's disk (the default ``runs/`` folder), and
it must not hold the storage account key or connection string the driver was given. So rank 0
sends its checkpoints and timeline here, and the driver -- which has the credentials -- writes
them into the run folder, which is published with everything else. The service only ever writes
inside the run folder and only reads the run folder and the resume source; it accepts nothing
without the run's one-off token, and stops with the run. Client and wire format:
:mod:`sparkhvd.runfolder.rank_files`.

It also keeps the run's *row-group copies* (root ``row-groups``): ranks on other hosts send it
each row group of a small table they read from the files, and a later attempt's rank reads
there what no rank on its host kept -- a lost host's rows, a new host's -- instead of the files
(:mod:`sparkhvd.data.row_group_cache`). They live in a private folder of the driver's
(:func:`row_copies_folder`, named by the run and the driver's process: every attempt's service
uses it), at most :data:`~sparkhvd.common.protocol.ROW_COPIES_BYTES` of them, under names the
cache gives (nothing else is written there), and are deleted when the run ends
(:func:`remove_row_copies`) -- or, where the driver died first, by the next run's service.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import socketserver
import tempfile
import threading
from typing import Any, Mapping, Optional, Sequence

from sparkhvd.common import owned_temp, protocol
from sparkhvd.common.fileio import atomic_open
from sparkhvd.common.redaction import remember_secret
from sparkhvd.runfolder.wire import (
    CHECKPOINTS,
    ROOTS,
    clean_path,
    copy_exact,
    read_json,
    remove_file,
    send_json,
)

__side__ = "driver"

log = logging.getLogger(__name__)

#: The only names a row-group copy may have (:meth:`sparkhvd.data.row_group_cache.RowGroupCache.name`)
_COPY_NAME = re.compile(r"[0-9a-f]{24}-[0-9]{1,9}\.arrow")


def row_copies_folder(run_id: str) -> str:
    """Where the driver keeps run ``run_id``'s row-group copies (this user's, private; named
    by this process too, so a driver that did not end well leaves them to the next one)."""
    return os.path.join(tempfile.gettempdir(), f"sparkhvd-row-copies-{os.getuid()}",
                        f"{clean_path(run_id)}-{os.getpid()}")


def remove_row_copies(run_id: str) -> None:
    """The run is over: its row-group copies go (every row of them is in the files)."""
    shutil.rmtree(row_copies_folder(run_id), ignore_errors=True)


def _remove_stale_copies(folder: str) -> None:
    """Delete the copies of runs whose driver process is gone (it ended without removing
    them)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(os.path.dirname(folder)):
            pid = entry.name.rsplit("-", 1)[-1]
            if entry.path != folder and entry.is_dir(follow_symlinks=False) and \
                    pid.isdigit() and not owned_temp.alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


class RunFileService(socketserver.ThreadingTCPServer):
    """Serves one run folder (read/write) and one resume source (read-only) to the ranks.

    Args:
        bind_host: the driver address the ranks reach (``spark.driver.host``).
        run_path: the run folder's local path (staged, for remote output folders).
        resume: ``(url, storage_options)`` of the checkpoints the run resumes from, or None.
        row_copies: the folder of the run's row-group copies (:func:`row_copies_folder`), or
            None: none are kept.
        copies_budget: the most bytes of copies the folder may hold.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, bind_host: str, run_path: str,
                 resume: Optional[tuple[str, Mapping[str, Any]]] = None,
                 row_copies: Optional[str] = None,
                 copies_budget: int = protocol.ROW_COPIES_BYTES) -> None:
        address = _bind_address(bind_host)
        super().__init__((address, 0), _Handler)
        self.advertised = bind_host
        self.run_path = run_path
        self.resume = resume
        self.token = secrets.token_urlsafe(24)
        remember_secret(self.token)
        self.received: list[str] = []
        self.row_copies = row_copies
        self.copies_budget = copies_budget
        self._copies_held: Optional[int] = None  # bytes in the folder, counted at first use
        self._copies_lock = threading.Lock()
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
    def local_path(self, root: str, path: str, size: int = 0) -> str:
        if root == "row-groups":
            return self._copy_target(path, size)
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
        if root == "row-groups":
            with open(self._copy_path(path), "rb") as f:
                return f.read()
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
        if root == "row-groups":
            if path or self.row_copies is None or not self._copies_private():
                return []
            return sorted(n for n in os.listdir(self.row_copies) if _COPY_NAME.fullmatch(n))
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
        if root == "row-groups":
            return os.path.exists(self._copy_path(path))
        if self.resume is None:
            return False
        from sparkhvd import storage

        url, options = self.resume
        return storage.exists(f"{url.rstrip('/')}/{path}", options)

    def delete(self, root: str, path: str) -> None:
        """Delete a checkpoint's file (what ``keep=`` prunes from a rank on another host): only
        a file inside the run folder's ``checkpoints/``; its folder too once empty (a sharded
        checkpoint's)."""
        path = clean_path(path)
        if root != "run" or not path.startswith(CHECKPOINTS + "/"):
            raise PermissionError(f"only the run's checkpoints can be deleted, not {root} "
                                  f"{path!r}")
        remove_file(self.run_path, path)

    def _copy_path(self, name: str) -> str:
        """The copy ``name`` in the run's folder of copies (``ValueError``: not a copy's name;
        ``FileNotFoundError``: this run keeps none, or not in a private folder)."""
        if not _COPY_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not the name of a row group's copy")
        if self.row_copies is None or not self._copies_private():
            raise FileNotFoundError("this run keeps no row-group copies")
        return os.path.join(self.row_copies, name)

    def _copies_private(self) -> bool:
        """Make the folder of copies (``0700``) and check only this user can write in it, once;
        counts the bytes it holds (an earlier attempt's copies)."""
        with self._copies_lock:
            if self._copies_held is not None:
                return self._copies_held >= 0
            folder = self.row_copies or ""
            try:
                why = owned_temp.private_folder(os.path.dirname(folder)) or \
                    owned_temp.private_folder(folder)
                held = sum(e.stat().st_size for e in os.scandir(folder)
                           if e.is_file(follow_symlinks=False))
            except OSError as exc:
                why, held = str(exc), -1
            if why is not None:
                log.warning("Row groups are not copied to %s: %s. Fix: remove it.", folder, why)
                held = -1
            else:
                _remove_stale_copies(folder)
            self._copies_held = held
            return held >= 0

    def _copy_target(self, name: str, size: int) -> str:
        """Where a copy of ``size`` bytes goes; ``PermissionError`` where the run keeps none or
        the copies would pass the budget, ``FileExistsError`` where it is there already."""
        try:
            target = self._copy_path(name)
        except FileNotFoundError as exc:
            raise PermissionError(str(exc)) from None
        with self._copies_lock:
            assert self._copies_held is not None
            if os.path.exists(target):
                raise FileExistsError(name)
            if self._copies_held + size > self.copies_budget:
                raise PermissionError(f"the run's row-group copies are full "
                                      f"({self.copies_budget} bytes)")
            self._copies_held += size
        return target


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
        # an answer is a header then the bytes: sent at once, not after a delayed ack
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
                    target = server.local_path(root, path, size)
                except FileExistsError:  # another rank sent this row group first
                    _drain(self.rfile, size)
                    send_json(sock, {"ok": True, "size": size})
                    return
                except (ValueError, PermissionError):
                    _drain(self.rfile, size)
                    raise
                with atomic_open(target) as f:
                    copy_exact(self.rfile, f, size)
                if root == "run":
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
            elif op == "delete":
                server.delete(root, path)
                send_json(sock, {"ok": True})
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
