"""Keras models to and from bytes: the one temp-file helper (Keras saves and loads paths only)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator, Optional

__side__ = "shared"


@contextlib.contextmanager
def local_file(data: bytes, suffix: str = ".h5") -> Iterator[str]:
    """``data`` as a temporary local file (removed afterwards); yields its path."""
    with tempfile.TemporaryDirectory(prefix="sparkhvd-keras-") as tmp:
        path = os.path.join(tmp, "model" + suffix)
        with open(path, "wb") as f:
            f.write(data)
        yield path


def model_bytes(model: Any, suffix: Optional[str] = None, **save_kwargs: Any) -> bytes:
    """``model.save(...)`` as bytes: HDF5 on Keras 2, the ``.keras`` format on Keras 3 (unless
    ``suffix`` says otherwise). HorovodRunner stores them as ``model.h5`` / ``model.keras``."""
    suffix = suffix or (".keras" if keras_major() >= 3 else ".h5")
    with tempfile.TemporaryDirectory(prefix="sparkhvd-keras-") as tmp:
        path = os.path.join(tmp, "model" + suffix)
        model.save(path, **save_kwargs)
        with open(path, "rb") as f:
            return f.read()


def suffix_of(name: str) -> str:
    """The file suffix Keras needs to read ``name`` back (``.h5`` unless it says otherwise)."""
    return os.path.splitext(name)[1] or ".h5"


def keras_major() -> int:
    """The major version of the Keras that ``tf.keras`` is (2, or 3 from TF 2.16 on)."""
    import tensorflow as tf

    return int(str(getattr(tf.keras, "__version__", "2")).split(".")[0])


def load_keras_model(path: str, **kwargs: Any) -> Any:
    """``tf.keras.models.load_model(path, **kwargs)`` in Keras's safe mode, for every format:
    a model file is whatever its folder's writers put there, and a ``Lambda`` layer's marshalled
    code would run as it loads. Keras's ``safe_mode=True`` covers only the ``.keras`` format
    (Keras 2's HDF5 path ignores it), so its scope is entered around the HDF5 load too.
    ``safe_mode=False`` -- Keras's own opt-in, for a file you wrote -- turns it off."""
    import tensorflow as tf

    safe_mode = kwargs.pop("safe_mode", True)
    try:
        from keras.src.saving.serialization_lib import SafeModeScope
        scope: Any = SafeModeScope(safe_mode)
    except ImportError:  # a Keras without the scope: its load_model's safe_mode is all there is
        scope = contextlib.nullcontext()
    with scope:
        return tf.keras.models.load_model(path, safe_mode=safe_mode, **kwargs)


def checkpoint_bytes(model: Any) -> tuple[bytes, str]:
    """The model saved for a checkpoint (weights, architecture; the optimizer is saved apart),
    and its suffix: HDF5 on Keras 2, the ``.keras`` format on Keras 3."""
    if keras_major() >= 3:
        return model_bytes(model, ".keras"), ".keras"
    return model_bytes(model, ".h5", include_optimizer=False), ".h5"
