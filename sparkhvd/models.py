"""Loading a trained Keras model back from a run folder or a model URL (local or abfss)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Mapping, Optional

from . import storage


def model_url(url: str, storage_options: Optional[Mapping[str, Any]] = None) -> storage.Location:
    """The model file's location: ``url`` itself, or the model a run folder's run.json names."""
    loc = storage.resolve(url, storage_options)
    record_loc = loc.child("run.json")
    if storage.exists(record_loc):
        record = json.loads(storage.read_bytes(record_loc))
        name = record.get("model")
        if not name:
            raise FileNotFoundError(
                f"Run {record.get('run_id')} at {storage.public_url(url)} has no model "
                f"(status {record.get('status')!r}); rank 0 must return the model's bytes.")
        return loc.child(name)
    return loc


def load_model(url: str, storage_options: Optional[Mapping[str, Any]] = None, **load_kwargs: Any):
    """Return the Keras model stored at ``url`` (a run folder or a model file).

    Example::

        model = sparkhvd.load_model("abfss://models@acct.dfs.core.windows.net/runs/20260101-...")
    """
    loc = model_url(url, storage_options)
    if loc.is_local:
        path = loc.path
        if not os.path.exists(path):
            raise FileNotFoundError(f"No model at {path}")
        import tensorflow as tf

        return tf.keras.models.load_model(path, **load_kwargs)
    data = storage.read_bytes(loc)
    suffix = os.path.splitext(loc.path)[1] or ".h5"
    with tempfile.TemporaryDirectory(prefix="sparkhvd-model-") as tmp:
        path = os.path.join(tmp, "model" + suffix)
        with open(path, "wb") as f:
            f.write(data)
        import tensorflow as tf

        return tf.keras.models.load_model(path, **load_kwargs)
