"""Where rank 0's checkpoints live: a folder of files with ``latest.json`` written last.

Shared by the Keras (:mod:`sparkhvd.keras.checkpoints`) and PyTorch
(:mod:`sparkhvd.torch.checkpoints`) helpers. A store is the run folder (``checkpoints/``, through
:mod:`sparkhvd.runfolder.rank_files`, so it works from any host without storage credentials), the
checkpoints of the run being resumed (read-only, through the same service), or a URL the user
gave. ``latest.json`` names the newest complete checkpoint, so a partial one is never read.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import (
    IO,
    Iterator,
    Optional,
    Sequence,
)

from sparkhvd.checkpoint.lineage import LATEST, complete_in
from sparkhvd.common import owned_temp

__side__ = "rank"


log = logging.getLogger(__name__)

def spool_file() -> tuple[int, str]:
    """A temporary file (``mkstemp``) to spool one checkpoint file in before its upload; named
    by this process, so that the spool of a rank killed mid-upload (as big as the checkpoint) is
    deleted by the next process that spools on the host (:mod:`sparkhvd.common.owned_temp`)."""
    return tempfile.mkstemp(prefix=owned_temp.prefix("spool"))


def spool_folder() -> str:
    """:func:`spool_file`, for a folder (``mkdtemp``): DCP's files before they are uploaded."""
    return tempfile.mkdtemp(prefix=owned_temp.prefix("dcp"))


class CheckpointStore:
    """A checkpoints folder: read, write, check, describe."""

    #: the record of the last checkpoint this process committed here (None: none yet)
    committed: Optional[dict] = None

    @property
    def files_of(self) -> dict[str, list[str]]:
        """Record name -> the files it names, for the checkpoints this process committed or
        read here: pruning reads a record at most once
        (:func:`~sparkhvd.checkpoint.write.prune`)."""
        known = self.__dict__.get("_files_of")
        if known is None:
            known = self.__dict__["_files_of"] = {}
        return known

    @property
    def on_this_host(self) -> bool:
        """Whether the folder is on this host's own disk (then it is its nearest copy)."""
        return False

    @property
    def key(self) -> str:
        """What names this folder for the host copies kept before their upload to it
        (:mod:`sparkhvd.checkpoint.host_copy`): the same whether the run writes it or, after a
        relaunch, resumes from it."""
        return self.describe()

    def write(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def write_file(self, name: str, local_path: str) -> None:
        """Copy a local file in as ``name`` (streamed where the store can)."""
        with open(local_path, "rb") as f:
            self.write(name, f.read())

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        """A binary file that becomes ``name`` whole when the block ends without error (and
        never otherwise). Here: spooled to a local temporary file, then :meth:`write_file`;
        a store on this host writes in place."""
        fd, spool = spool_file()
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            self.write_file(name, spool)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(spool)

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``offset`` (fewer where it ends first). Here: read
        whole, then cut; the stores below read only the range."""
        return self.read(name)[offset:offset + length]

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def list(self) -> list[str]:
        """The names in the folder (empty where it cannot be listed)."""
        return []

    def delete(self, name: str) -> None:
        """Remove a file (gone already is fine)."""

    def describe(self, name: str = "") -> str:
        raise NotImplementedError


class RunFolderStore(CheckpointStore):
    """``checkpoints/`` of this run (``root="run"``) or of the run resumed (``root="resume"``)."""

    def __init__(self, root: str = "run", prefix: str = "checkpoints",
                 label: Optional[str] = None) -> None:
        from sparkhvd.runfolder.rank_files import run_files

        self.files = run_files()
        self.root = root
        self.prefix = prefix if root == "run" else ""
        self.label = label

    @property
    def on_this_host(self) -> bool:
        return self.root == "run" and bool(self.files.local)

    def _path(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def write(self, name: str, data: bytes) -> None:
        self.files.write_bytes(self._path(name), data)

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        if not self.files.local:
            with super().open_write(name) as f:
                yield f
            return
        from sparkhvd.common.fileio import atomic_open

        with atomic_open(os.path.join(self.files.local, self._path(name))) as f:
            yield f

    def write_file(self, name: str, local_path: str) -> None:
        self.files.write_file(self._path(name), local_path)

    def read(self, name: str) -> bytes:
        return self.files.read_bytes(self._path(name), root=self.root)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        return self.files.read_bytes(self._path(name), root=self.root, span=(offset, length))

    def exists(self, name: str) -> bool:
        return self.files.exists(self._path(name), root=self.root)

    def list(self) -> list[str]:
        return self.files.listdir(self.prefix, root=self.root)

    def delete(self, name: str) -> None:
        """Delete a file of this run's checkpoints -- on this host, or through the driver's
        service from another (``keep=`` keeps its word everywhere); the resumed run's are
        read-only."""
        if self.root == "run":
            self.files.delete(self._path(name))

    @property
    def key(self) -> str:
        from sparkhvd.common import protocol

        run_id = os.environ.get(protocol.RUN_ID_ENV, "")
        own = self.root == "run" or \
            (self.label or "").rstrip("/").endswith(f"/{run_id}/checkpoints")
        return f"run folder {run_id}" if own and run_id else self.describe()

    def describe(self, name: str = "") -> str:
        if self.label:
            return f"{self.label}/{name}".rstrip("/")
        return self.files.describe(self._path(name))


#: A ``.tmp-*`` file in a user's checkpoint folder is torn (its writer gone) when it is older
#: than the writing rank's process by this much (:meth:`UrlStore.remove_torn`).
TORN_MARGIN_S = 60.0


class UrlStore(CheckpointStore):
    """A folder URL the user gave (local path, ``file://``, ``abfss://``)."""

    def __init__(self, url: str, storage_options: Optional[dict] = None) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = storage_options

    @property
    def on_this_host(self) -> bool:
        from urllib.parse import urlparse

        return urlparse(self.url).scheme in ("", "file")

    def write(self, name: str, data: bytes) -> None:
        from sparkhvd import storage

        storage.write_bytes(f"{self.url}/{name}", data, self.storage_options)

    def write_file(self, name: str, local_path: str) -> None:
        from sparkhvd import storage

        storage.write_file(f"{self.url}/{name}", local_path, self.storage_options)

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        if not self.on_this_host:
            with super().open_write(name) as f:
                yield f
            return
        from sparkhvd import storage

        with storage.open_atomic(f"{self.url}/{name}", self.storage_options) as f:
            yield f

    def read(self, name: str) -> bytes:
        from sparkhvd import storage

        return storage.read_bytes(f"{self.url}/{name}", self.storage_options)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        from sparkhvd import storage

        return storage.read_range(f"{self.url}/{name}", offset, length, self.storage_options)

    def exists(self, name: str) -> bool:
        from sparkhvd import storage

        return storage.exists(f"{self.url}/{name}", self.storage_options)

    def list(self) -> list[str]:
        from sparkhvd import storage

        try:
            return storage.listdir(self.url, self.storage_options)
        except (FileNotFoundError, OSError):
            return []

    def delete(self, name: str) -> None:
        from sparkhvd import storage

        storage.delete(f"{self.url}/{name}", self.storage_options)

    def describe(self, name: str = "") -> str:
        from sparkhvd.storage import public_url

        return public_url(f"{self.url}/{name}".rstrip("/"))

    def remove_torn(self) -> Sequence[str]:
        """Delete the ``.tmp-*`` files a writer killed mid-write left in this folder (an
        earlier attempt or run): called by the writing rank as its checkpoints are set up.
        Only those older than this process by :data:`TORN_MARGIN_S` go: this attempt's writes
        all began after it started, and a folder's clock (a blob store's) may differ from the
        host's. A run folder's own are removed by the driver before each attempt."""
        import psutil

        from sparkhvd import storage

        before = psutil.Process().create_time() - TORN_MARGIN_S
        try:
            removed = storage.remove_torn(self.url, before, self.storage_options)
        except Exception as exc:  # noqa: BLE001 - a sweep never stops the training
            log.warning("could not look for torn temporary files in %s: %s",
                        self.describe(), exc)
            return []
        if removed:
            log.warning("removed %d torn temporary file(s) a killed writer left in %s: %s",
                        len(removed), self.describe(), ", ".join(removed[:5]))
        return removed


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
    return nested if holds_checkpoint(nested) else store


def holds_checkpoint(store: CheckpointStore) -> bool:
    """Whether ``store`` holds a complete checkpoint (``latest.json`` or a record:
    :func:`~sparkhvd.checkpoint.lineage.complete_in`)."""
    return complete_in(store.list())


def latest(store: CheckpointStore) -> Optional[dict]:
    """The newest checkpoint's ``latest.json`` record, or None."""
    if not store.exists(LATEST):
        return None
    return json.loads(store.read(LATEST))


