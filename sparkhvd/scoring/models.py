"""Loading a trained model back from a run folder or a model URL (local or abfss): Keras
(``.h5``/``.keras``) or PyTorch (TorchScript ``.pt``; a ``state_dict`` ``.state_dict.pt``)."""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from sparkhvd import storage
from sparkhvd.keras.modelio import load_keras_model, local_file, suffix_of
from sparkhvd.runfolder.rundir import is_torchscript

__side__ = "driver"

MODEL_SUFFIXES = (".h5", ".keras", ".hdf5", ".pt")


def _newest_run(loc: storage.Location) -> Optional[str]:
    """The newest run folder directly under ``loc`` (one holding ``run.json``), if any."""
    try:
        names = storage.listdir(loc)
    except (FileNotFoundError, storage.StorageError, NotADirectoryError):
        return None
    for name in sorted(names, reverse=True):
        if not name.startswith(".") and storage.exists(loc.child(name).child("run.json")):
            return name
    return None


def model_url(url: str, storage_options: Optional[Mapping[str, Any]] = None) -> storage.Location:
    """The model file's location: ``url`` itself, or the model a run folder's run.json names.

    Raises:
        FileNotFoundError: naming the URL as given, what was looked for, and -- for a folder of
            run folders -- the newest run in it.
    """
    loc = storage.resolve(url, storage_options)
    shown = storage.public_url(url)
    record_loc = loc.child("run.json")
    if storage.exists(record_loc):
        record = json.loads(storage.read_bytes(record_loc))
        name = record.get("model")
        if not name:
            raise FileNotFoundError(
                f"Run {record.get('run_id')} at {shown} has no model (status "
                f"{record.get('status')!r}); rank 0 must return the model's bytes.")
        return loc.child(name)
    if loc.path.lower().endswith(MODEL_SUFFIXES):
        if not storage.exists(loc):
            raise FileNotFoundError(f"No model file at {shown}.")
        return loc
    newest = _newest_run(loc)
    hint = (f" It is a folder of runs: pass one of them, e.g. the newest, "
            f"{shown.rstrip('/')}/{newest}." if newest else
            " Pass a run folder (it holds run.json) or a model file (.h5 / .keras / .pt).")
    raise FileNotFoundError(f"No model at {shown}: looked for {shown.rstrip('/')}/run.json (a "
                            f"run folder) or a model file (.h5 / .keras / .pt).{hint}")


def is_torch_model(path: str) -> bool:
    """Whether a model file is PyTorch's (``.pt``: TorchScript, or a ``state_dict``)."""
    return path.lower().endswith(".pt")


def load_torch(data: bytes, **load_kwargs: Any) -> Any:
    """A TorchScript module (``model.pt``) or a ``state_dict`` (``model.state_dict.pt``)."""
    import io

    import torch

    if is_torchscript(data):
        return torch.jit.load(io.BytesIO(data), **load_kwargs)
    return torch.load(io.BytesIO(data), weights_only=True, **load_kwargs)


def load_model(url: str, storage_options: Optional[Mapping[str, Any]] = None, **load_kwargs: Any):
    """Return the model stored at ``url`` (a run folder or a model file): a Keras model, a
    TorchScript module, or a PyTorch ``state_dict`` (load it into your model class).

    Example::

        model = sparkhvd.load_model("abfss://models@acct.dfs.core.windows.net/runs/20260101-...")
    """
    loc = model_url(url, storage_options)
    if is_torch_model(loc.path):
        return load_torch(storage.read_bytes(loc), **load_kwargs)
    if loc.is_local:
        return load_keras_model(loc.path, **load_kwargs)
    with local_file(storage.read_bytes(loc), suffix_of(loc.path)) as path:
        return load_keras_model(path, **load_kwargs)
