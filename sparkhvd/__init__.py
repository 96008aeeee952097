"""sparkhvd: run single-node training data-parallel on Spark executors -- TensorFlow/Keras (Horovod
or tf.distribute) or PyTorch (torch.distributed).

Public API::

    from sparkhvd import HorovodRunner, TrainingError
    model_bytes = HorovodRunner(np=2).run(train_fn, lr=0.1, epochs=3)

The code is arranged by where it runs: ``driver/``, ``executor/`` (inside a Spark task),
``rank/`` (the rank process), ``common/`` and ``storage/`` (shared); this module and
``keras``, ``data``, ``cli`` re-export what users import.
"""
from __future__ import annotations

import importlib
from typing import Any

from sparkhvd.common.errors import (CheckpointError, EnvironmentMismatchError, NotEnoughSlotsError,
    PayloadError, RankFailure, SessionError, SparkhvdError, StallError, StorageError,
    TrainingError)

# The rest is imported on first use: every rank process imports this package, and numpy,
# fsspec and friends would add ~0.2 s to each rank's start for nothing.
_LAZY = {
    "DataFrameDataset": ("driver.data.dataset", "DataFrameDataset"),
    "load_model": ("driver.models", "load_model"),
    "predict": ("driver.scoring", "predict"),
    "RunDir": ("driver.rundir", "RunDir"),
    "HorovodRunner": ("driver.runner", "HorovodRunner"),
    "ScalingConfig": ("driver.settings", "ScalingConfig"),
    "LaunchConfig": ("driver.settings", "LaunchConfig"),
    "RunConfig": ("driver.settings", "RunConfig"),
    "SessionConfig": ("driver.settings", "SessionConfig"),
    "ENV_ALLOWLIST": ("common.environment", "ENV_ALLOWLIST"),
    "storage": ("storage", None),
    "stacks": ("driver.stacks", "request_stacks"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sparkhvd' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(f".{module_name}", __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "HorovodRunner", "ScalingConfig", "LaunchConfig", "RunConfig", "SessionConfig",
    "TrainingError", "NotEnoughSlotsError", "PayloadError", "EnvironmentMismatchError",
    "SessionError", "SparkhvdError", "RankFailure", "RunDir", "ENV_ALLOWLIST", "StorageError",
    "load_model", "predict", "storage", "DataFrameDataset", "stacks", "StallError",
    "CheckpointError",
    "__version__",
]
