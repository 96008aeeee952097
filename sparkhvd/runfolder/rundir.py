"""One folder per run: ``run.json``, ``logs/rank-N.log``, the model, and room for more.

Layout::

    runs/<run-id>/
        run.json            np, versions, Spark master, timings, status, error (never a secret)
        logs/rank-N.log     everything rank N printed
        model.h5|model.keras|result.pkl   what rank 0 returned
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
import secrets
import time
from typing import Any, Callable, Iterable, Mapping, Optional

from sparkhvd.common.fileio import atomic_write
from sparkhvd.runfolder.record import RunRecord
from sparkhvd.spark.installed import package_version

__side__ = "driver"

log = logging.getLogger(__name__)

MODEL_NAMES = {b"\x89HDF\r\n\x1a\n": "model.h5", b"PK\x03\x04": "model.keras"}


def new_run_id() -> str:
    """A sortable run id, ``YYYYmmdd-HHMMSS-xxxxxxxx``: 32 random bits after the second, so
    runs started in the same second (a sweep) draw different ones -- and :class:`RunDir`
    creates its folder exclusively, so two that drew the same still never share one."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(4)


#: A zip archive holding these is a TorchScript module (torch.jit.save), not a .keras file.
TORCHSCRIPT_MARKERS = ("/constants.pkl", "/code/")


def is_torchscript(data: bytes) -> bool:
    """Whether ``data`` is a TorchScript archive (told from a .keras zip by its entries)."""
    import io
    import zipfile

    try:
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    except zipfile.BadZipFile:
        return False
    return any(marker in name for name in names for marker in TORCHSCRIPT_MARKERS)


def model_filename(data: bytes) -> Optional[str]:
    """``model.h5`` / ``model.keras`` for a saved Keras model, ``model.pt`` for TorchScript, else
    ``None``."""
    for magic, name in MODEL_NAMES.items():
        if data[:len(magic)] == magic:
            if name == "model.keras":
                return "model.pt" if is_torchscript(data) else name
            return name
    return None


def is_state_dict(value: Any) -> bool:
    """Whether ``value`` is a PyTorch ``state_dict`` (names -> tensors)."""
    return isinstance(value, Mapping) and bool(value) and all(
        isinstance(k, str) and type(v).__module__.startswith("torch") for k, v in value.items())


def versions() -> dict[str, Optional[str]]:
    """Versions recorded in ``run.json``."""
    found: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in ("sparkhvd", "horovod", "tensorflow", "tensorflow-cpu", "keras", "tf-keras",
                 "pyspark", "petastorm", "pyarrow", "numpy"):
        v = package_version(name)
        if v:
            found[name] = v
    return found


def staging_root() -> str:
    """Where runs bound for remote storage are staged locally (``SPARKHVD_STAGING_DIR``)."""
    return os.environ.get("SPARKHVD_STAGING_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sparkhvd", "runs")


def _exists(url: str, storage_options: Optional[dict]) -> bool:
    """Whether ``url`` exists; False where the store cannot say (bad credentials: the run's
    pre-flight says so, with the fix, once its folder is made)."""
    from sparkhvd import storage

    try:
        return bool(storage.exists(url, storage_options))
    except Exception:  # noqa: BLE001 - reported by the pre-flight, not here
        return False


def _claimed_run_id(local_root: str, run_id: Optional[str],
                    taken_remotely: Optional[Callable[[str], bool]]) -> str:
    """A run id whose folder under ``local_root`` this process created (``mkdir``: exclusive,
    so no two runs share a folder, host copies or row cache): ``run_id`` -- an error when its
    folder exists -- or a new one, drawn again while taken (here, or in the remote output
    folder: ``taken_remotely``)."""
    os.makedirs(local_root, exist_ok=True)
    for _ in range(100):
        name = run_id or new_run_id()
        if taken_remotely is not None and taken_remotely(name):
            if run_id:
                raise FileExistsError(f"run {run_id} already exists in the output folder: "
                                      "give another run id, or none (a new one is drawn)")
            continue
        try:
            os.mkdir(os.path.join(local_root, name))
            return name
        except FileExistsError:
            if run_id:
                raise FileExistsError(
                    f"run folder {os.path.join(local_root, name)} already exists: give another "
                    "run id, or none (a new one is drawn)") from None
    raise FileExistsError(f"could not create a new run folder under {local_root}")


class RunDir:
    """A run's folder: ``root/<run-id>`` on local disk, or staged locally and published to a
    storage URL (``abfss://...``) when ``root`` is one.

    Everything is written locally first (``path``); :meth:`publish` copies it to ``url``. If
    publishing fails, the local copy stays and the error says where: nothing is lost.
    """

    def __init__(self, root: str = "runs", run_id: Optional[str] = None,
                 storage_options: Optional[dict] = None) -> None:
        from sparkhvd import storage

        root_loc = storage.resolve(root, storage_options)
        local_root = root_loc.path if root_loc.is_local else staging_root()
        self.run_id = _claimed_run_id(local_root, run_id, None if root_loc.is_local else
                                      lambda name: _exists(root_loc.child(name).url,
                                                           storage_options))
        self.remote = None if root_loc.is_local else root_loc.child(self.run_id)
        self.path = os.path.abspath(os.path.join(local_root, self.run_id))
        self.url = self.remote.url if self.remote else self.path
        self.logs = os.path.join(self.path, "logs")
        os.makedirs(self.logs, exist_ok=True)
        #: ``run.json`` (:class:`~sparkhvd.runfolder.record.RunRecord`: its only writer)
        self.record = RunRecord(self.file("run.json"), run_id=self.run_id,
                                output=storage.public_url(self.url), versions=versions())

    def __str__(self) -> str:
        """The run folder's path, or its URL once published (never a secret)."""
        return self.location

    def __repr__(self) -> str:
        return f"RunDir({self.location!r})"

    def __fspath__(self) -> str:
        """A local run folder is a path (``open``, ``os.path.join``, ``pathlib`` take it). A
        published remote one is not: read it with :mod:`sparkhvd.storage` (its URL is
        ``str(run_dir)``)."""
        if self.remote is not None and self.path == self.url:
            raise TypeError(f"the run folder {self.location} is remote, not a local path: read "
                            "it with sparkhvd.storage (e.g. storage.read_bytes(f'{run_dir}/run.json'"
                            ", storage_options))")
        return self.path

    @property
    def location(self) -> str:
        """Where the run folder is now, safe to print (the URL once published)."""
        from sparkhvd.storage import public_url

        return public_url(self.path)

    def file(self, name: str) -> str:
        """Absolute local path of a file inside the run folder."""
        return os.path.join(self.path, name)

    def remove_torn(self) -> list[str]:
        """Remove what a writer killed mid-write left in this run's checkpoints folder (atomic
        writes' ``.tmp-*`` files): before each attempt, when no rank writes, so a retry starts
        clean. Returns the names removed (for the log)."""
        from sparkhvd.storage import remove_torn

        folder = self.file("checkpoints")
        removed = remove_torn(folder, before=time.time())
        if removed:
            log.warning("removed %d torn temporary file(s) a killed writer left in %s: %s",
                        len(removed), folder, ", ".join(removed[:5]))
        return removed

    def library_checkpoints(self, names: Iterable[str]) -> Optional[str]:
        """Which of the ``st.output_dir`` folders ``names`` hold files -- a library's own
        checkpoints (Lightning, HF ``Trainer``), which it resumes from when the user's code
        asks it to -- as ``<run folder>/<name>``, or None."""
        found = [self.file(name) for name in sorted(names)
                 if any(files for _, _, files in os.walk(self.file(name)))]
        return ", ".join(found) or None

    def save_result(self, result: Any) -> Optional[str]:
        """Keep what rank 0 returned: model bytes as ``model.h5``/``model.keras``/``model.pt``
        (TorchScript), a PyTorch ``state_dict`` as ``model.state_dict.pt``."""
        if isinstance(result, (bytes, bytearray)):
            name = model_filename(bytes(result)) or "result.bin"
            atomic_write(self.file(name), bytes(result))
            return self.file(name)
        if is_state_dict(result):
            import io

            import torch

            buffer = io.BytesIO()
            torch.save(dict(result), buffer)
            atomic_write(self.file("model.state_dict.pt"), buffer.getvalue())
            return self.file("model.state_dict.pt")
        return None

    def preflight(self) -> None:
        """Check the destination is writable before training (remote runs only)."""
        from sparkhvd.storage import preflight

        if self.remote is not None:
            preflight(self.remote)

    def publish(self, *, keep_local: bool = False) -> None:
        """Copy the local run folder to its storage URL (no-op for local runs).

        Raises:
            StorageError: with ``spilled_to`` = the local folder that keeps everything.
        """
        from sparkhvd.storage import StorageError, public_url, write_bytes

        if self.remote is None:
            return
        try:
            # run.json last: its presence says the folder is complete.
            names = sorted((os.path.relpath(os.path.join(d, f), self.path)
                            for d, _, files in os.walk(self.path) for f in files),
                           key=lambda n: (n == "run.json", n))
            for name in names:
                with open(os.path.join(self.path, name), "rb") as f:
                    write_bytes(self.remote.child(name.replace(os.sep, "/")), f.read())
        except Exception as exc:  # noqa: BLE001
            raise StorageError(f"Could not publish run {self.run_id} to "
                               f"{public_url(self.remote.url)}: {exc}. Nothing is lost: the "
                               f"whole run folder is kept at {self.path}.",
                               spilled_to=self.path) from None
        if not keep_local:
            import shutil

            shutil.rmtree(self.path, ignore_errors=True)
            self.path = self.url

    def publish_quietly(self) -> None:
        """Publish a failed or interrupted run too (its logs and checkpoints matter most then);
        if that fails as well, say where the local copy is and go on with the run's own error."""
        try:
            self.publish()
        except Exception as exc:  # noqa: BLE001 - the run's own error is what the user gets
            log.warning("%s", exc)
