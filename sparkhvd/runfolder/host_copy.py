"""The newest checkpoint kept on the writing rank's own host: restored without the run folder.

A relaunched run reads its newest checkpoint back from the run folder -- on ``abfss://`` that is
the whole state over the network, once per rank. When the checkpoint folder is not on its own
disk, the rank that writes a checkpoint also keeps its newest file here, on its host's disk, so
a relaunch restores from the nearest copy: a rank on the same host reads it from disk, a rank on
another host gets it from a rank that has it (:mod:`sparkhvd.torch.nearest_copy`), and only
when no rank has it does a rank read the run folder.

Rules:

- **only the newest**: keeping a checkpoint deletes the copy before it; a copy is trusted only
  when its SHA-256 equals the one the run folder's newest complete checkpoint records, so a
  stale, torn or foreign copy is never used (it is read back, checked, and passed over with a
  warning).
- **bounded**: a checkpoint is kept when it fits in half the folder's free space (the older
  copy is deleted once the new one is in); otherwise no copy is kept and the older one is
  deleted too, said once on the rank's console.
- **where**: ``$SPARKHVD_HOST_COPY_DIR`` (``/dev/shm`` for memory speed, where it is large
  enough), else the system's temporary folder, in ``sparkhvd-host-copies/<run id>/``.
- **cleaned**: when the training function returns on the writing rank (the run is done), and a
  folder left by a run that failed is deleted by the next run on that host a day later.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from sparkhvd.common import protocol

__side__ = "rank"

#: Where the host copies go (a folder on the host's own disk or memory).
DIR_ENV = "SPARKHVD_HOST_COPY_DIR"
#: The share of the folder's free space a copy may take.
FREE_SHARE = 0.5
#: A folder of another run not touched for this long is left over from a failed run.
STALE_S = 24 * 3600.0

_META = "host-copy.json"
_said: set = set()
_swept: set = set()  # the base folders this process looked for stale runs in (once each)


@dataclass(frozen=True)
class HostCopy:
    """A checkpoint file kept on this host: what the run folder calls it and its checksum."""

    file: str
    sha256: str
    size: int
    path: str

    def read(self) -> bytes:
        """The file's bytes, checked against the size and checksum kept with it.

        Raises:
            ValueError: the copy is missing, truncated or corrupt (why, in words).
        """
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"host copy {self.path} unreadable ({exc})") from None
        if len(data) != self.size:
            raise ValueError(f"host copy {self.path} truncated ({len(data):,} of "
                             f"{self.size:,} bytes)")
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"host copy {self.path} corrupt (checksum mismatch)")
        return data


def base_folder() -> str:
    """The folder that holds every run's host copies on this host."""
    base = os.environ.get(DIR_ENV) or tempfile.gettempdir()
    return os.path.join(base, "sparkhvd-host-copies")


def folder() -> Optional[str]:
    """This run's host-copy folder; None outside a sparkhvd run (no run id)."""
    run_id = os.environ.get(protocol.RUN_ID_ENV)
    return os.path.join(base_folder(), run_id) if run_id else None


def keep(file: str, data: bytes, sha256: str) -> Optional[HostCopy]:
    """Keep ``data`` (the checkpoint file ``file``, whose checksum is ``sha256``) as this host's
    newest copy, replacing the one before. None when it was not kept (no run, over the budget,
    a failing disk: said once, never an error -- the run folder has the checkpoint)."""
    path = spool(file)
    if path is None:
        return None
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as exc:
        _unlink(path)
        _said_failed(exc)
        return None
    return adopt(file, path, sha256)


def spool(file: str) -> Optional[str]:
    """A path in this run's host-copy folder to write the checkpoint file ``file`` into, then
    hand to :func:`adopt` (a writer that streams the file there keeps it without a second
    copy). None outside a run or where the folder cannot be made (said once)."""
    where = folder()
    if where is None:
        return None
    try:
        os.makedirs(where, exist_ok=True)
        if os.path.dirname(where) not in _swept:  # once per process, not once per save
            _swept.add(os.path.dirname(where))
            _remove_stale(os.path.dirname(where), keep_name=os.path.basename(where))
    except OSError as exc:
        _said_failed(exc)
        return None
    return os.path.join(where, f"{os.path.basename(file)}.tmp-{os.getpid()}")


def adopt(file: str, path: str, sha256: str) -> Optional[HostCopy]:
    """Make the complete file at ``path`` (from :func:`spool`) this host's newest copy of the
    checkpoint file ``file``, replacing the one before -- or delete it and keep none when it
    takes more than half of what the folder had free (said once). Never an error: None when
    not kept."""
    where = os.path.dirname(path)
    try:
        size = os.path.getsize(path)
        old = find()
        room = shutil.disk_usage(where).free + size  # what was free before this file
        if size > FREE_SHARE * room:
            _say_once(f"over:{where}", "no host copy of %s kept: %d MB is more than half the "
                      "free space of %s (%d MB); relaunches restore from the run folder. "
                      "Set %s to a larger folder.", file, size >> 20, where, room >> 20,
                      DIR_ENV)
            _unlink(path)
            clean()
            return None
        name = os.path.basename(file)
        final = os.path.join(where, name)
        os.replace(path, final)  # the new file, then what names it, then the old one goes
        meta = {"file": file, "sha256": sha256, "size": size, "name": name}
        _replace(os.path.join(where, _META), json.dumps(meta).encode())
        if old is not None and old.path != final:
            _unlink(old.path)
        return HostCopy(file, sha256, size, final)
    except OSError as exc:
        _unlink(path)
        _said_failed(exc)
        return None


def discard(path: str) -> None:
    """Delete a spool file that will not be adopted (its write failed)."""
    _unlink(path)


def _said_failed(exc: OSError) -> None:
    _say_once(f"fail:{folder()}", "no host copy kept in %s (%s); relaunches restore from the "
              "run folder", folder(), exc)


def find() -> Optional[HostCopy]:
    """This host's newest copy for this run (not yet checked: :meth:`HostCopy.read` checks)."""
    where = folder()
    if where is None:
        return None
    try:
        with open(os.path.join(where, _META), "rb") as f:
            meta = json.loads(f.read())
        return HostCopy(str(meta["file"]), str(meta["sha256"]), int(meta["size"]),
                        os.path.join(where, str(meta["name"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clean() -> None:
    """Delete this run's host copies (the run is done, or a copy is no longer wanted)."""
    where = folder()
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)


def _remove_stale(base: str, keep_name: str) -> None:
    """Delete the folders of runs that ended without cleaning theirs (untouched a day)."""
    now = time.time()
    for name in os.listdir(base):
        path = os.path.join(base, name)
        try:
            if name != keep_name and now - os.path.getmtime(path) > STALE_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def _replace(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it). Not fsynced: a
    copy torn by a crash fails its checksum and the run folder is read instead."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        _unlink(temporary)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _say_once(key: str, message: str, *args: object) -> None:
    if key not in _said:
        _said.add(key)
        print("checkpoint: " + message % args, flush=True)  # the rank's [rank N] lines
