"""The run-folder service's wire format, shared by the driver's service and a rank's client.

Wire format (one TCP connection per client): the service sends ``{"nonce": ...}``; the client
answers ``{"proof": ...}`` -- :func:`proof`, an HMAC of the nonce under the run's key, which
never crosses the wire -- and the service ``{"ok": true}`` (or ``{"ok": false, "kind":
"busy"}`` and closes). Then requests ``{"op": "put"|"get"|"exists"|"list"|"delete", "root":
"run"|"resume"|"row-groups", "path": ..., "size": n}`` (``put`` followed by ``n`` raw bytes;
``get`` with ``"span": [offset, length]`` asks for those bytes of the file only; ``delete``
only a file of the run folder's ``checkpoints/``: what ``keep=`` prunes), each answered by
``{"ok": true, "size": n}`` (``get`` followed by the bytes), or ``{"ok": false, "error":
...}``.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import posixpath
import socket
from typing import IO, Any, Union

__side__ = "common"

#: A socket's file or a local file, read as bytes.
Readable = Union[IO[bytes], io.BufferedIOBase]

#: The run folder (read/write), the resume source (read-only), and the driver's copies of the
#: row groups ranks on other hosts read (:mod:`sparkhvd.data.row_group_cache`)
ROOTS = ("run", "resume", "row-groups")
#: The run folder's checkpoints: the only files a rank may delete there (``keep=``)
CHECKPOINTS = "checkpoints"
CHUNK = 1 << 20
#: Seconds the service lets a proved connection wait between requests before it ends it; a
#: rank reconnects before it reuses one idle for :data:`IDLE_RECONNECT_S` (no retry spent).
IDLE_TIMEOUT_S = 120.0
IDLE_RECONNECT_S = 0.75 * IDLE_TIMEOUT_S


def proof(key: str, nonce: str) -> str:
    """What shows a connection holds the run's ``key``: HMAC-SHA256 of the service's ``nonce``
    (fresh for each connection: a proof seen on one is worth nothing on another)."""
    return hmac.new(key.encode(), b"sparkhvd-run-files-1:" + nonce.encode(),
                    hashlib.sha256).hexdigest()


def clean_path(path: str) -> str:
    """A run-folder-relative path, or ``ValueError`` if it would leave the folder."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"not a run-folder path: {path!r}")
    norm = posixpath.normpath(path.replace(os.sep, "/"))
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"{path!r} is outside the run folder: use a path inside it, e.g. "
                         "'checkpoints/epoch-0001.h5'")
    return norm


def remove_file(folder: str, path: str) -> None:
    """Delete the file ``path`` (cleaned: :func:`clean_path`) of ``folder`` -- gone already is
    fine -- and the folders above it that it leaves empty, up to the first one of ``path``."""
    target = os.path.join(folder, path)
    if os.path.isdir(target) and not os.path.islink(target):
        raise IsADirectoryError(f"{path!r} is a folder: delete its files")
    try:
        os.unlink(target)
    except FileNotFoundError:
        return
    parent = posixpath.dirname(path)
    while posixpath.dirname(parent):  # never the first folder of the path (checkpoints/)
        try:
            os.rmdir(os.path.join(folder, parent))
        except OSError:
            return
        parent = posixpath.dirname(parent)


def send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def read_json(rfile: Readable) -> dict[str, Any]:
    line = rfile.readline(1 << 16)
    if not line:
        raise ConnectionError("the driver's run-folder service closed the connection")
    value: dict[str, Any] = json.loads(line)
    return value


def copy_exact(src: Readable, dst: Any, size: int) -> None:
    """Copy exactly ``size`` bytes from ``src`` to ``dst.write`` (or ``dst.sendall``)."""
    write = getattr(dst, "sendall", None) or dst.write
    left = size
    while left:
        chunk = src.read(min(CHUNK, left))
        if not chunk:
            raise ConnectionError(f"connection closed with {left} of {size} bytes missing")
        write(chunk)
        left -= len(chunk)
