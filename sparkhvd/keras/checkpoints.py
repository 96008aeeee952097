"""Rank 0's checkpoints: where they live, and everything needed to continue exactly.

A checkpoint of epoch N is these files in a checkpoints folder:

- ``epoch-000N.h5`` (``.keras`` on Keras 3) -- the model (loadable with
  ``tf.keras.models.load_model``),
- ``epoch-000N.optimizer.npz`` -- every optimizer variable (Adam's moments, the step count),
- ``epoch-000N.json`` and then ``latest.json`` -- written last, so they never name a partial
  checkpoint: ``{"epoch": N, "file": ..., "optimizer": ..., "files": {name: {size, sha256}},
  "state": {"lr": ..., "warmup_target_lr": ...}}``. Resuming checks every file against it and
  falls back to the newest complete one (:func:`~sparkhvd.checkpoint.read.restore_newest`).

With all three, "train 2 epochs, then resume for 2 more" ends where 4 epochs straight would.
Where the folder is not on the writing rank's own disk, that rank also keeps the newest
checkpoint's files on its host (:mod:`sparkhvd.checkpoint.host_copy`), and a relaunched run
reads them from there, or from a rank that landed on that host (:func:`restore_nearest`).

Where the folder is: :mod:`sparkhvd.checkpoint.stores` (shared with the PyTorch helpers).
"""
from __future__ import annotations

import io
from typing import Any, Optional

from sparkhvd.checkpoint import nearest_copy
from sparkhvd.checkpoint.lineage import LATEST, checkpoint_name, record_name
from sparkhvd.checkpoint.read import restore_newest
from sparkhvd.checkpoint.stores import (
    DISCARD,
    CheckpointStore,
    RunFolderStore,
    UrlStore,
    latest,
    url_store,
)
from sparkhvd.checkpoint.write import write_checkpoint

__side__ = "rank"

__all__ = ["DISCARD", "LATEST", "CheckpointStore", "RunFolderStore", "UrlStore", "latest",
           "url_store", "save", "serialise", "restore", "restore_latest", "restore_nearest",
           "build_optimizer",
           "optimizer_variables", "record_name"]


def optimizer_variables(optimizer: Any) -> list:
    """The optimizer's variables (Keras 2.11+ property, or the legacy method)."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def build_optimizer(optimizer: Any, model: Any) -> None:
    """Create the optimizer's variables now (Keras creates them lazily at the first step)."""
    built = getattr(optimizer, "built", None)
    if built is None:
        built = getattr(optimizer, "_built", None)
    if built is True or (built is None and optimizer_variables(optimizer)[1:]):
        return
    if hasattr(optimizer, "build"):
        optimizer.build(model.trainable_variables)
    elif hasattr(optimizer, "_create_all_weights"):  # legacy optimizers
        optimizer._create_all_weights(model.trainable_variables)


def save(store: CheckpointStore, model: Any, epoch: int, state: dict, step: int = 0) -> str:
    """Write the checkpoint of ``epoch`` (model, optimizer, state) -- after its ``step`` of the
    next epoch, for a mid-epoch one -- ``latest.json`` last."""
    name, files, info = serialise(model, epoch, state, step)
    write_checkpoint(store, epoch, files, info, step)
    return name


def serialise(model: Any, epoch: int, state: dict, step: int = 0
              ) -> tuple[str, dict[str, bytes], dict]:
    """The checkpoint's files as bytes and its record's info, taken from the model now (what
    an asynchronous save holds the step for; the write can come later)."""
    import numpy as np

    from sparkhvd.keras.modelio import checkpoint_bytes

    data, suffix = checkpoint_bytes(model)
    base = checkpoint_name(epoch, step)
    name = f"{base}{suffix}"
    files = {name: data}
    info: dict = {"file": name, "state": state}
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables = optimizer_variables(optimizer)
        if variables:
            buffer = io.BytesIO()
            np.savez(buffer, **{f"v{i}": v.numpy() for i, v in enumerate(variables)})
            info["optimizer"] = f"{base}.optimizer.npz"
            info["optimizer_names"] = [v.name for v in variables]
            files[info["optimizer"]] = buffer.getvalue()
    return name, files, info


def restore_latest(store: CheckpointStore, model: Any) -> tuple[Optional[dict], list[str]]:
    """Load the newest usable checkpoint into ``model``: its record (None: there is none) and
    what was skipped or not restored, for the warning (CheckpointError: none is usable)."""
    record, problems, skipped = restore_newest(store, lambda info, files: restore(
        store, info, model, files))
    return record, [*skipped, *(problems or [])]


def restore_nearest(store: CheckpointStore, model: Any, rank: int,
                    world: nearest_copy.Collectives, loaders: Optional[set[int]] = None
                    ) -> tuple[Optional[dict], list[str], str]:
    """:func:`restore_latest` from the nearest copy of the newest checkpoint: this host's, a
    rank's that has it, else the folder (:mod:`sparkhvd.checkpoint.nearest_copy`); also which
    copy was read (``"host"``, ``"peer"`` or ``"folder"``, for the resume line). Call on every
    rank; it loads on ``loaders`` (default: every rank), the others return no record."""
    record, value, problems, copy = nearest_copy.load_nearest(
        store, lambda info, files: restore(store, info, model, files), rank, world, loaders)
    return record, [*problems, *(value or [])], copy


def restore(store: CheckpointStore, info: dict, model: Any,
            files: Optional[dict] = None) -> list[str]:
    """Load the checkpoint ``info`` names into ``model`` (and its optimizer); ``files``: its
    files' bytes, already read and checked.

    Returns what could not be restored (e.g. an optimizer of another shape), for a warning.
    """
    import numpy as np

    from sparkhvd.keras.modelio import local_file, suffix_of

    files = files or {}
    problems: list[str] = []
    data = files.get(info["file"]) or store.read(info["file"])
    with local_file(data, suffix_of(info["file"])) as path:
        model.load_weights(path)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not info.get("optimizer"):
        return ["the checkpoint has no optimizer state (saved by an older sparkhvd)"] \
            if optimizer is not None else []
    build_optimizer(optimizer, model)
    variables = optimizer_variables(optimizer)
    saved = np.load(io.BytesIO(files.get(info["optimizer"]) or store.read(info["optimizer"])),
                    allow_pickle=False)  # arrays only: an object array would unpickle
    values = [saved[f"v{i}"] for i in range(len(saved.files))]
    if len(values) != len(variables) or any(tuple(v.shape) != a.shape
                                            for v, a in zip(variables, values)):
        return [f"the optimizer has {len(variables)} variables, the checkpoint "
                f"{len(values)} of other shapes: optimizer state not restored"]
    for var, value in zip(variables, values):
        var.assign(value)
    lr = (info.get("state") or {}).get("lr")
    if lr is not None and hasattr(getattr(optimizer, "learning_rate", None), "assign"):
        optimizer.learning_rate.assign(lr)
    return problems
