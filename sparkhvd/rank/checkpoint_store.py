"""Where rank 0's checkpoints live: a folder of files with ``latest.json`` written last.

Shared by the Keras (:mod:`sparkhvd.rank.keras.checkpoints`) and PyTorch
(:mod:`sparkhvd.rank.torch`) helpers. A store is the run folder (``checkpoints/``, through
:mod:`sparkhvd.rank.runfiles`, so it works from any host without storage credentials), the
checkpoints of the run being resumed (read-only, through the same service), or a URL the user
gave. ``latest.json`` names the newest complete checkpoint, so a partial one is never read.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

LATEST = "latest.json"
#: A sharded checkpoint's list of files (with sizes), written once every rank's are in.
MANIFEST = "manifest.json"


class CheckpointStore:
    """A checkpoints folder: read, write, check, describe."""

    def write(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def write_file(self, name: str, local_path: str) -> None:
        """Copy a local file in as ``name`` (streamed where the store can)."""
        with open(local_path, "rb") as f:
            self.write(name, f.read())

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Remove a file (best effort; a service-backed store keeps everything)."""

    def describe(self, name: str = "") -> str:
        raise NotImplementedError


class RunFolderStore(CheckpointStore):
    """``checkpoints/`` of this run (``root="run"``) or of the run resumed (``root="resume"``)."""

    def __init__(self, root: str = "run", prefix: str = "checkpoints",
                 label: Optional[str] = None) -> None:
        from sparkhvd.rank.runfiles import run_files

        self.files = run_files()
        self.root = root
        self.prefix = prefix if root == "run" else ""
        self.label = label

    def _path(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def write(self, name: str, data: bytes) -> None:
        self.files.write_bytes(self._path(name), data)

    def write_file(self, name: str, local_path: str) -> None:
        self.files.write_file(self._path(name), local_path)

    def read(self, name: str) -> bytes:
        return self.files.read_bytes(self._path(name), root=self.root)

    def exists(self, name: str) -> bool:
        return self.files.exists(self._path(name), root=self.root)

    def delete(self, name: str) -> None:
        if self.root == "run" and self.files.local:
            path = os.path.join(self.files.local, self._path(name))
            if os.path.exists(path):
                os.unlink(path)

    def describe(self, name: str = "") -> str:
        if self.label:
            return f"{self.label}/{name}".rstrip("/")
        return self.files.describe(self._path(name))


class UrlStore(CheckpointStore):
    """A folder URL the user gave (local path, ``file://``, ``abfss://``)."""

    def __init__(self, url: str, storage_options: Optional[dict] = None) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = storage_options

    def write(self, name: str, data: bytes) -> None:
        from sparkhvd import storage

        storage.write_bytes(f"{self.url}/{name}", data, self.storage_options)

    def read(self, name: str) -> bytes:
        from sparkhvd import storage

        return storage.read_bytes(f"{self.url}/{name}", self.storage_options)

    def exists(self, name: str) -> bool:
        from sparkhvd import storage

        return storage.exists(f"{self.url}/{name}", self.storage_options)

    def delete(self, name: str) -> None:
        from sparkhvd import storage

        storage.delete(f"{self.url}/{name}", self.storage_options)

    def describe(self, name: str = "") -> str:
        from sparkhvd.storage import public_url

        return public_url(f"{self.url}/{name}".rstrip("/"))


class _Discard(CheckpointStore):
    """Where a worker that only takes part in saving writes: nowhere."""

    def write(self, name: str, data: bytes) -> None:
        pass

    def describe(self, name: str = "") -> str:
        return "(not written by this rank)"


DISCARD = _Discard()


def url_store(url: str, storage_options: Optional[dict] = None) -> UrlStore:
    """A store for ``url``: its ``checkpoints/`` when ``url`` is a run folder."""
    store = UrlStore(url, storage_options)
    nested = UrlStore(f"{store.url}/checkpoints", storage_options)
    return nested if nested.exists(LATEST) else store


def latest(store: CheckpointStore) -> Optional[dict]:
    """The newest checkpoint's ``latest.json`` record, or None."""
    if not store.exists(LATEST):
        return None
    return json.loads(store.read(LATEST))


def announce_resume(store: CheckpointStore, file: Optional[str] = None, epoch: int = 0,
                    problems: Sequence[str] = ()) -> None:
    """Rank 0 says what it resumed from (``file`` None: nothing found), on its console line
    and to the driver (``run.json``'s ``resume``), for every framework's helpers."""
    from sparkhvd.common import protocol
    from sparkhvd.rank.events import emit

    if file is None:
        print(f"resume: no checkpoint under {store.describe()}; training from scratch",
              flush=True)
        emit(protocol.Resumed(rank=0, source=None, epoch=0))
        return
    where = store.describe(file)
    for problem in problems:
        print(f"resume: WARNING: {problem}", flush=True)
    print(f"resume: restored {where}; continuing at epoch {epoch + 1}", flush=True)
    emit(protocol.Resumed(rank=0, source=where, epoch=epoch))


def resume_store(resume: object, own: Optional[CheckpointStore],
                 storage_options: Optional[dict] = None) -> Optional[CheckpointStore]:
    """Where a rank resumes from (the one rule, for every framework's helpers).

    ``resume``: ``None`` resumes when the driver asked for it (``HorovodRunner(resume_from=...)``
    resolved it into ``SPARKHVD_RESUME_URL``, read through the run-folder service); ``True``
    resumes from there, or from ``own`` (this run's store) when the driver asked nothing; a
    URL resumes from that folder (a run folder's ``checkpoints/`` when it has one); ``False``
    never resumes.
    """
    from sparkhvd.common import protocol

    requested = os.environ.get(protocol.RESUME_URL_ENV)
    if resume is None:
        resume = bool(requested)
    if resume is True:
        return RunFolderStore("resume", label=requested) if requested else own
    if resume:
        return url_store(str(resume), storage_options)
    return None
