"""Which of five buckets a rank's stack is in: the one place that decides.

A sample is the main thread's frames, innermost first, as ``(file, line, function)``. Its bucket:

- ``checkpoint``: any frame writes or reads a checkpoint or the run folder (sparkhvd's run-folder
  and storage code, ``torch.save``/``torch.load``, ``torch.distributed.checkpoint``, Keras
  saving, h5py, safetensors, a library's ``save_checkpoint``) -- even when that code waits for
  its peers (a sharded commit's barrier is the checkpoint's cost);
- ``data`` or ``collective``: whichever comes first from the innermost frame: a data loader's
  frame (sparkhvd's readers, ``torch.utils.data``, ``tf.data``, Keras' data adapters, HF
  ``datasets``, petastorm) or a library's collective (``all_reduce``, ``barrier``,
  ``broadcast``, horovod's ``synchronize``, ...; a function of the user's with such a name does
  not count, nor a wait for the device such as ``torch.cuda.synchronize``);
- ``other``: a module is being imported (a rank's start; decided first, since an imported
  module's body may live in a data or checkpoint library), or no frame is the user's or an ML
  library's (sparkhvd's own start and end);
- ``compute``: everything else -- the user's code and the frameworks' (forward, backward, the
  optimizer, a Keras step).

What the sampler cannot see: work a framework does in C++ threads. DDP's gradient all-reduce
overlaps ``backward()`` and a Keras/``tf.distribute`` step runs its collectives inside the
graph, so there the wait for peers counts as ``compute``; a straggler still stands out by its
larger share of data loading or checkpointing.
"""
from __future__ import annotations

import functools
import os
import re
import sysconfig
from typing import Optional, Sequence

__side__ = "common"

#: The buckets, in the order reports show them.
BUCKETS = ("data", "compute", "collective", "checkpoint", "other")
#: How each bucket reads in a sentence.
LABELS = {"data": "data loading", "compute": "computing", "collective": "waiting in collectives",
          "checkpoint": "checkpoint and run-folder I/O", "other": "other (start, imports)"}

#: A library frame in one of these functions means the rank waits for its peers.
COLLECTIVE = re.compile(r"(?i)(all_?reduce|all_?gather|broadcast|barrier|reduce_scatter|"
                        r"all_?to_?all|collective|_wait_for_workers)")
#: horovod's ``synchronize`` (a handle's result) is a collective; ``torch.cuda.synchronize``
#: and the like wait for the device -- computing.
_HOROVOD_SYNC = re.compile(r"(?i)synchronize")
_DATA_FILES = re.compile(
    r"(/sparkhvd/data/|/torch/utils/data/|/tensorflow/python/data/|/keras/src/trainers/"
    r"data_adapters/|/keras/engine/data_adapter|-packages/datasets/|/petastorm/|/pyarrow/dataset"
    r"|/lightning/pytorch/loops/fetchers)")
_CHECKPOINT_FILES = re.compile(
    r"(/sparkhvd/runfolder/|/sparkhvd/storage/|/sparkhvd/keras/checkpoints|/sparkhvd/keras/"
    r"modelio|/torch/serialization\.py|/torch/distributed/checkpoint/|/keras/src/saving/|"
    r"/keras/saving/|/h5py/|/safetensors/|/fsspec/|/adlfs/)")
_CHECKPOINT_FUNCS = re.compile(r"(?i)^_?(save|load)_?(checkpoint|model|state)")
_ML_FILES = re.compile(r"/(torch|tensorflow|keras|jax|numpy|lightning|pytorch_lightning|"
                       r"transformers|accelerate|deepspeed|horovod|trl|peft|sklearn)/")

_LIBRARY = tuple(p for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib",
                                                                    "purelib", "platlib")} if p)
_SPARKHVD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Sample = Sequence[tuple[str, int, str]]


@functools.lru_cache(maxsize=4096)
def is_user_code(file: str) -> bool:
    """Whether ``file`` is the user's (not the standard library, an installed package or
    sparkhvd)."""
    if file.startswith("<"):
        return False
    path = os.path.abspath(file)
    return not (path.startswith(_LIBRARY) or path.startswith(_SPARKHVD) or
                "site-packages" in path or "dist-packages" in path)


@functools.lru_cache(maxsize=4096)
def _file_kind(file: str) -> str:
    path = file.replace("\\", "/")
    if _CHECKPOINT_FILES.search(path):
        return "checkpoint"
    if _DATA_FILES.search(path):
        return "data"
    if file.startswith("<frozen importlib"):
        return "import"
    if is_user_code(file):
        return "user"
    return "ml" if _ML_FILES.search(path) else "library"


def is_collective(file: str, func: str) -> bool:
    """Whether a library frame waits for the rank's peers (the user's own names never count)."""
    if is_user_code(file):
        return False
    path = file.replace("\\", "/")
    return bool(COLLECTIVE.search(func) or ("/horovod/" in path and _HOROVOD_SYNC.search(func)))


def _frame_text(file: str, line: int, func: str) -> str:
    return f"{os.path.basename(file)}:{line} {func}"


def bucket_of(frames: Sample) -> tuple[str, str]:
    """``(bucket, where)`` of one sample (innermost frame first). ``where`` is the innermost
    user frame ("train.py:42 load_batch"), or for a collective the library function waited
    in ("all_reduce"); empty when there is none."""
    kinds = [_file_kind(file) for file, _, _ in frames]
    user = next((_frame_text(*f) for f, kind in zip(frames, kinds) if kind == "user"), "")
    if "import" in kinds:  # a module being imported (its body may live in a data library)
        return "other", user
    for (_, _, func), kind in zip(frames, kinds):
        if kind == "checkpoint" or (kind in ("ml", "library") and _CHECKPOINT_FUNCS.match(func)):
            return "checkpoint", user
    for (file, _, func), kind in zip(frames, kinds):
        if kind == "data":
            return "data", user
        if kind != "user" and is_collective(file, func):
            return "collective", func
    if any(kind in ("user", "ml") for kind in kinds):
        return "compute", user
    return "other", user


def share(seconds: dict[str, float]) -> dict[str, float]:
    """Each bucket's fraction of the time in ``seconds`` (all buckets; zeros when empty)."""
    total = sum(seconds.get(b, 0.0) for b in BUCKETS)
    return {b: (seconds.get(b, 0.0) / total if total else 0.0) for b in BUCKETS}


def dominant(where: Optional[dict[str, dict[str, float]]], bucket: str) -> str:
    """The place a bucket's time was mostly spent, from ``{bucket: {place: seconds}}``."""
    places = (where or {}).get(bucket) or {}
    return max(places, key=lambda p: places[p]) if places else ""
