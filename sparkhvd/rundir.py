"""One folder per run: ``run.json``, ``logs/rank-N.log``, the model, and room for more.

Layout::

    runs/<run-id>/
        run.json            np, versions, Spark master, timings, status, error (never a secret)
        logs/rank-N.log     everything rank N printed
        model.h5|model.keras|result.pkl   what rank 0 returned
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import secrets
import tempfile
import time
from typing import Any, Optional

from .compat import package_version

MODEL_NAMES = {b"\x89HDF\r\n\x1a\n": "model.h5", b"PK\x03\x04": "model.keras"}


def new_run_id() -> str:
    """A sortable, unique run id: ``YYYYmmdd-HHMMSS-xxxx``."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def model_filename(data: bytes) -> Optional[str]:
    """``model.h5`` / ``model.keras`` when ``data`` is a saved Keras model, else ``None``."""
    for magic, name in MODEL_NAMES.items():
        if data[:len(magic)] == magic:
            return name
    return None


def versions() -> dict[str, Optional[str]]:
    """Versions recorded in ``run.json``."""
    found = {"python": platform.python_version()}
    for name in ("sparkhvd", "horovod", "tensorflow", "tensorflow-cpu", "keras", "tf-keras",
                 "pyspark", "petastorm", "pyarrow", "numpy"):
        v = package_version(name)
        if v:
            found[name] = v
    return found


class RunDir:
    """A run's folder on local disk (``root/<run-id>``), with its ``run.json`` record."""

    def __init__(self, root: str = "runs", run_id: Optional[str] = None) -> None:
        self.run_id = run_id or new_run_id()
        self.path = os.path.abspath(os.path.join(root, self.run_id))
        self.logs = os.path.join(self.path, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.record: dict[str, Any] = {"run_id": self.run_id, "status": "created",
                                       "versions": versions(), "timings": {}}
        self._t0 = time.monotonic()

    def file(self, name: str) -> str:
        """Absolute path of a file inside the run folder."""
        return os.path.join(self.path, name)

    def update(self, **fields: Any) -> None:
        """Merge ``fields`` into the record and rewrite ``run.json`` atomically."""
        self.record.update(fields)
        atomic_write(self.file("run.json"),
                     json.dumps(self.record, indent=2, default=str).encode())

    def mark(self, timing: str) -> None:
        """Record seconds since the run started under ``timings[timing]``."""
        self.record["timings"][timing] = round(time.monotonic() - self._t0, 3)

    def save_result(self, result: Any) -> Optional[str]:
        """Keep what rank 0 returned: model bytes as ``model.h5``/``model.keras``."""
        if isinstance(result, (bytes, bytearray)):
            name = model_filename(bytes(result)) or "result.bin"
            atomic_write(self.file(name), bytes(result))
            return self.file(name)
        return None
