"""Keras models to and from bytes: the one temp-file helper (Keras saves and loads paths only)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator


@contextlib.contextmanager
def local_file(data: bytes, suffix: str = ".h5") -> Iterator[str]:
    """``data`` as a temporary local file (removed afterwards); yields its path."""
    with tempfile.TemporaryDirectory(prefix="sparkhvd-keras-") as tmp:
        path = os.path.join(tmp, "model" + suffix)
        with open(path, "wb") as f:
            f.write(data)
        yield path


def model_bytes(model: Any, suffix: str = ".h5", **save_kwargs: Any) -> bytes:
    """``model.save(...)`` as bytes (HDF5 by default)."""
    with tempfile.TemporaryDirectory(prefix="sparkhvd-keras-") as tmp:
        path = os.path.join(tmp, "model" + suffix)
        model.save(path, **save_kwargs)
        with open(path, "rb") as f:
            return f.read()


def suffix_of(name: str) -> str:
    """The file suffix Keras needs to read ``name`` back (``.h5`` unless it says otherwise)."""
    return os.path.splitext(name)[1] or ".h5"
