"""The driver's run-folder service: ranks on other hosts read and write run files through it.

Why: a rank on another machine cannot see the driver's disk (the default ``runs/`` folder), and
it must not hold the storage account key or connection string the driver was given. So rank 0
sends its checkpoints and timeline here, and the driver -- which has the credentials -- writes
them into the run folder, which is published with everything else. The service only ever writes
inside the run folder (never the files the driver writes there: ``run.json``, ``logs/``, the
model) and only reads the run folder and the resume source. Client and wire format:
:mod:`sparkhvd.runfolder.rank_files`, :mod:`sparkhvd.runfolder.wire`.

It holds under abuse from anyone who can reach its port (bound to the driver's cluster
address: :func:`~sparkhvd.common.netif.bind_address`), on
:class:`~sparkhvd.common.guarded_server.GuardedServer`:

- a connection proves it holds the run's one-off key by an HMAC over a nonce the service sends
  (:func:`~sparkhvd.runfolder.wire.proof`): the key never crosses the wire, and a proof seen
  once is worth nothing on another connection;
- a connection that has not proved it within :data:`HELLO_TIMEOUT_S` is closed, at most
  :data:`MAX_WAITING` wait at once (a new one pushes the oldest out: a flood of idle sockets
  holds neither threads nor descriptors), and at most :func:`connections_for` proved ones are
  served at once, each ended after :data:`~sparkhvd.runfolder.wire.IDLE_TIMEOUT_S` idle (the
  rank reconnects); refusals are logged once a minute, counted;
- every size and name is checked before a byte is written; a file is written to a temporary
  name and renamed only while the service runs: :meth:`RunFileService.stop` ends every live
  connection, and nothing is written after it returns;
- a ``get`` is streamed in pieces (:data:`~sparkhvd.runfolder.wire.CHUNK` from a local file,
  eight of it from a remote resume source: np ranks restoring a large checkpoint through it
  cost no driver memory per byte), and a read that breaks off ends its connection.

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
import errno
import logging
import os
import re
import secrets
import shutil
import socket
import socketserver
import tempfile
import threading
from typing import IO, Any, Iterator, Mapping, Optional, Sequence

from sparkhvd.common import owned_temp, protocol
from sparkhvd.common.fileio import TEMP_PREFIX, explain_write_error
from sparkhvd.common.guarded_server import GuardedServer, hello_json
from sparkhvd.common.netif import bind_address
from sparkhvd.common.redaction import remember_secret
from sparkhvd.runfolder.wire import (
    CHECKPOINTS,
    CHUNK,
    IDLE_TIMEOUT_S,
    ROOTS,
    clean_path,
    copy_exact,
    proof,
    read_json,
    remove_file,
    send_json,
)

__side__ = "driver"

log = logging.getLogger(__name__)

#: Seconds a new connection has to prove it holds the run's key.
HELLO_TIMEOUT_S = 5.0
#: Connections waiting to prove it at once (a new one pushes the oldest out).
MAX_WAITING = 32
#: Proved connections served at once, at least (a rank holds one or two -- its files, its row
#: copies -- and each DataLoader worker its own: :func:`connections_for` scales it by np).
MAX_CONNECTIONS = 256
#: The largest file a rank may send (a checkpoint file; far above any real one).
MAX_PUT_BYTES = 1 << 40
#: What a refusal of a connection without the key adds to the log line.
KEY_NOTE = ": only the run's ranks hold its key"
#: Folders of the run folder only the driver writes (besides its files at the top).
DRIVER_FOLDERS = ("logs", "control")
#: The one file at the run folder's top a rank writes (the Horovod timeline).
RANK_TOP_FILES = ("timeline.json",)
#: The share of the copies folder's free space row copies may take (as a host's cache).
COPIES_FREE_SHARE = 0.25

#: The only names a row-group copy may have (:meth:`sparkhvd.data.row_group_cache.RowGroupCache.name`)
_COPY_NAME = re.compile(r"[0-9a-f]{24}-[0-9]{1,9}\.arrow")


def connections_for(np: int) -> int:
    """The proved connections a run of ``np`` ranks may hold at once: 8 a rank, at least
    :data:`MAX_CONNECTIONS`."""
    return max(MAX_CONNECTIONS, 8 * np)


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


class RunFileService(GuardedServer):
    """Serves one run folder (read/write) and one resume source (read-only) to the ranks.

    Args:
        bind_host: the driver address the ranks reach (``spark.driver.host``); the service
            listens there only.
        run_path: the run folder's local path (staged, for remote output folders).
        resume: ``(url, storage_options)`` of the checkpoints the run resumes from, or None.
        row_copies: the folder of the run's row-group copies (:func:`row_copies_folder`), or
            None: none are kept.
        copies_budget: the most bytes of copies the folder may hold.
        max_connections: proved connections served at once (:func:`connections_for`).
    """

    what = "run-folder"
    max_waiting = MAX_WAITING

    def __init__(self, bind_host: str, run_path: str,
                 resume: Optional[tuple[str, Mapping[str, Any]]] = None,
                 row_copies: Optional[str] = None,
                 copies_budget: int = protocol.ROW_COPIES_BYTES,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        super().__init__((bind_address(bind_host), 0), _Handler)
        self.max_connections = max_connections
        self.hello_timeout_s = HELLO_TIMEOUT_S
        self.advertised = bind_host
        self.run_path = run_path
        self.resume = resume
        #: the run's one-off key: given to the ranks in their environment, never sent
        self.token = secrets.token_urlsafe(24)
        remember_secret(self.token)
        self.received: list[str] = []
        self.row_copies = row_copies
        self.copies_budget = copies_budget
        self._copies_held: Optional[int] = None  # bytes in the folder, counted at first use
        self._copies_coming: set[str] = set()  # copies being received (counted once each)
        self._copies_lock = threading.Lock()
        #: set by stop(); checked, under ``_commit_lock``, before every file is made or named
        self.stopped = False
        self._commit_lock = threading.Lock()
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
        """Stop serving: every live connection is ended and nothing is written once this
        returns (a file being received is not named); the listener closes behind (its loop
        polls every 0.2 s)."""
        with self._commit_lock:
            self.stopped = True
        self.end_all()

        def _stop() -> None:
            self.shutdown()
            self.server_close()

        threading.Thread(target=_stop, daemon=True, name="sparkhvd-files-stop").start()

    # -- operations (handler threads) -------------------------------------------------------
    @contextlib.contextmanager
    def receiving(self, root: str, path: str, size: int) -> Iterator[IO[bytes]]:
        """A file to write ``size`` bytes into; named ``path`` (of ``root``) only if the block
        ends well and the service still runs -- checked under the lock :meth:`stop` takes, so
        nothing is written after it. A row copy's share of the budget is given back when it is
        not named.

        Raises:
            ValueError: not a name a rank may write; PermissionError: the service stopped, or
                the run keeps no row copies, or they are full, or the disk is; CopyHeld: a copy
                already there or coming.
        """
        _, target = self._target(root, path, size)  # a row copy's bytes counted from here
        named = False
        try:
            with self._commit_lock:
                if self.stopped:
                    raise PermissionError("the run has ended: nothing more is written")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=TEMP_PREFIX,
                                           suffix="-" + os.path.basename(target))
            try:
                with os.fdopen(fd, "wb") as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
                with self._commit_lock:
                    if self.stopped:
                        raise PermissionError("the run ended while the file was sent: not "
                                              "written")
                    os.replace(tmp, target)
                    named = True
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise explain_write_error(target, exc) from exc
            raise
        finally:
            if root == "row-groups":
                self._copy_done(path, size, failed=not named)

    def _target(self, root: str, path: str, size: int) -> tuple[Optional[str], str]:
        if root == "row-groups":
            return path, self._copy_target(path, size)
        if root != "run":
            raise PermissionError(f"the {root!r} files are read-only")
        path = clean_path(path)
        top = path.split("/", 1)[0]
        if ("/" not in path and path not in RANK_TOP_FILES) or top in DRIVER_FOLDERS:
            raise PermissionError(f"{path!r} is the driver's to write (a rank writes "
                                  f"checkpoints/, timeline.json and its output folders)")
        free = _free_bytes(self.run_path)
        if free is not None and size > free:
            raise PermissionError(f"{path!r} ({size} bytes) does not fit: the run folder's "
                                  f"disk has {free} bytes free")
        return path, os.path.join(self.run_path, path)

    def open_read(self, root: str, path: str, span: Optional[Sequence[int]] = None
                  ) -> tuple[int, Iterator[bytes]]:
        """``(size, its pieces)`` of the file at ``path`` (or of ``span``'s bytes of it): read
        in pieces of at most :data:`CHUNK` as they are sent, never whole. What a rank's restore
        reads of a large checkpoint file, from the run folder, the resume source or a copy."""
        path = clean_path(path)
        offset, length = 0, None
        if span is not None:
            offset, length = (int(n) for n in span)
            if offset < 0 or length < 0:
                raise ValueError(f"bad byte range {list(span)!r}")
        if root in ("run", "row-groups"):
            local = os.path.join(self.run_path, path) if root == "run" else self._copy_path(path)
            f = open(local, "rb")
            size = max(0, os.fstat(f.fileno()).st_size - offset)
            size = size if length is None else min(size, length)
            return size, _pieces_of(f, offset, size)
        if self.resume is None:
            raise FileNotFoundError("this run does not resume from anything")
        from sparkhvd import storage

        url, options = self.resume
        target = f"{url.rstrip('/')}/{path}"
        size = max(0, storage.size(target, options) - offset)
        size = size if length is None else min(size, length)

        def pieces() -> Iterator[bytes]:
            done = 0
            while done < size:
                piece = storage.read_range(target, offset + done, min(CHUNK * 8, size - done),
                                           options)
                if not piece:
                    raise ConnectionError(f"{path!r} ended early: {done} of {size} bytes")
                yield piece
                done += len(piece)
        return size, pieces()

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
        with self._commit_lock:
            if self.stopped:
                raise PermissionError("the run has ended: nothing more is deleted")
            remove_file(self.run_path, path)

    def _copy_path(self, name: str) -> str:
        """The copy ``name`` in the run's folder of copies (``ValueError``: not a copy's name;
        ``FileNotFoundError``: this run keeps none, or not in a private folder)."""
        if not isinstance(name, str) or not _COPY_NAME.fullmatch(name):
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
        """Where a copy of ``size`` bytes goes, its bytes counted (once per name: given back by
        :meth:`_copy_done` when it is not written); ``PermissionError`` where the run keeps
        none, or the copies would pass the budget or a quarter of the folder's free space,
        :class:`CopyHeld` where it is there already or coming."""
        try:
            target = self._copy_path(name)
        except FileNotFoundError as exc:
            raise PermissionError(str(exc)) from None
        free = _free_bytes(os.path.dirname(target)) if os.path.isdir(
            os.path.dirname(target)) else None
        with self._copies_lock:
            assert self._copies_held is not None
            if name in self._copies_coming or os.path.exists(target):
                raise CopyHeld(name)
            if self._copies_held + size > self.copies_budget:
                raise PermissionError(f"the run's row-group copies are full "
                                      f"({self.copies_budget} bytes)")
            if free is not None and size > COPIES_FREE_SHARE * free:
                raise PermissionError(f"a copy of {size} bytes would take more than a quarter "
                                      f"of the {free} bytes free where copies are kept")
            self._copies_held += size
            self._copies_coming.add(name)
        return target

    def _copy_done(self, name: str, size: int, failed: bool) -> None:
        with self._copies_lock:
            self._copies_coming.discard(name)
            if failed and self._copies_held is not None:
                self._copies_held -= size


class CopyHeld(Exception):
    """The driver holds (or is receiving) a copy of this row group already."""


def _pieces_of(f: IO[bytes], offset: int, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``f`` from ``offset``, a piece at a time; ``f`` closed at the end."""
    with f:
        f.seek(offset)
        left = size
        while left:
            piece = f.read(min(CHUNK, left))
            if not piece:
                raise ConnectionError(f"{f.name} ended early: {size - left} of {size} bytes")
            yield piece
            left -= len(piece)


def _free_bytes(path: str) -> Optional[int]:
    with contextlib.suppress(OSError):
        stat = os.statvfs(path)
        return stat.f_bavail * stat.f_frsize
    return None


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:  # noqa: D102 - one connection per client
        server: RunFileService = self.server  # type: ignore[assignment]
        sock = self.connection
        try:
            if not self._proved(server, sock):
                return
            while True:
                try:
                    request = read_json(self.rfile)
                except (ValueError, ConnectionError, OSError):
                    return
                try:
                    if not self._serve(server, request):
                        return
                except (ConnectionError, OSError) as exc:
                    if isinstance(exc, (FileNotFoundError, PermissionError)):
                        continue
                    log.debug("run-folder client %s went away: %s", self.client_address[0], exc)
                    return
        finally:
            server.leave(sock)

    def _proved(self, server: RunFileService, sock: socket.socket) -> bool:
        """The hello: a nonce out, the key's proof back within :data:`HELLO_TIMEOUT_S`."""
        client = self.client_address[0]
        # an answer is a header then the bytes: sent at once, not after a delayed ack
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_hex(16)
        try:
            send_json(sock, {"nonce": nonce})
            hello = hello_json(sock, server.hello_timeout_s)
        except (OSError, ValueError) as exc:
            server.refuse(client, f"sent no proof in {server.hello_timeout_s:g} s "
                          f"({type(exc).__name__})", KEY_NOTE)
            return False
        if not secrets.compare_digest(str(hello.get("proof", "")), proof(server.token, nonce)):
            server.refuse(client, "did not prove the run's key", KEY_NOTE)
            return False
        if not server.admit(sock):
            server.refuse(client, f"proved the key with {server.max_connections} connections "
                          "served already (or as the run ended): it tries again")
            with contextlib.suppress(OSError):
                send_json(sock, {"ok": False, "kind": "busy", "error": "the run-folder "
                                 "service is busy or stopped"})
            return False
        sock.settimeout(IDLE_TIMEOUT_S)  # between requests; a rank reconnects after it
        send_json(sock, {"ok": True})
        return True

    def _serve(self, server: RunFileService, request: dict) -> bool:
        """Answer one request; False when the connection must end (its stream is lost)."""
        op, root, path = request.get("op"), request.get("root", "run"), request.get("path", "")
        sock = self.connection
        try:
            if root not in ROOTS:
                raise PermissionError(f"unknown root {root!r}")
            if op == "put":
                size = request.get("size")
                if type(size) is not int or not 0 <= size <= MAX_PUT_BYTES:
                    send_json(sock, {"ok": False, "kind": "refused",
                                     "error": f"bad size {size!r}"})
                    return False  # how many bytes follow is unknown: the stream is lost
                received = False
                try:
                    with server.receiving(root, path, size) as f:
                        copy_exact(self.rfile, f, size)
                        received = True
                except CopyHeld:  # another rank sent this row group first
                    _drain(self.rfile, size)
                    send_json(sock, {"ok": True, "size": size})
                    return True
                except (ValueError, PermissionError):
                    if not received:  # refused before its bytes were read: they follow
                        _drain(self.rfile, size)
                    raise
                except ConnectionError:
                    raise
                except Exception as exc:  # noqa: BLE001 - part of the body may be unread:
                    from sparkhvd.common.redaction import redact  # answer, then end

                    send_json(sock, {"ok": False, "kind": "error",
                                     "error": redact(f"{type(exc).__name__}: {exc}")})
                    return False
                if root == "run":
                    server.received.append(clean_path(path))
                send_json(sock, {"ok": True, "size": size})
            elif op == "get":
                size, pieces = server.open_read(root, path, request.get("span"))
                send_json(sock, {"ok": True, "size": size})
                try:
                    for piece in pieces:
                        sock.sendall(piece)
                except Exception as exc:  # the bytes are promised: only an end tells the rank
                    raise ConnectionError(f"{path!r} broke off as it was sent: {exc}") from exc
            elif op == "exists":
                send_json(sock, {"ok": True, "exists": server.exists(root, path)})
            elif op == "list":
                send_json(sock, {"ok": True, "names": server.listdir(root, path)})
            elif op == "delete":
                server.delete(root, path)
                send_json(sock, {"ok": True})
            else:
                raise PermissionError(f"unknown operation {op!r}")
        except (ValueError, PermissionError, TypeError) as exc:
            send_json(sock, {"ok": False, "kind": "refused", "error": str(exc)})
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            send_json(sock, {"ok": False, "kind": "missing",
                             "error": f"{root} file {path!r} not found ({exc})"})
        except ConnectionError:
            raise  # the stream is lost: the connection ends
        except Exception as exc:  # noqa: BLE001 - reported to the rank, which raises it
            from sparkhvd.common.redaction import redact

            send_json(sock, {"ok": False, "kind": "error",
                             "error": redact(f"{type(exc).__name__}: {exc}")})
        return True


def _drain(rfile: Any, size: int) -> None:
    left = size
    while left:
        chunk = rfile.read(min(1 << 20, left))
        if not chunk:
            return
        left -= len(chunk)
