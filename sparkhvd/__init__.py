"""sparkhvd: run single-node training data-parallel on Spark executors -- TensorFlow/Keras (Horovod
or tf.distribute) or PyTorch (torch.distributed).

Public API::

    from sparkhvd import SparkRunner, TrainingError
    result = SparkRunner(np=2, backend="torch").run(train_fn, lr=0.1, epochs=3)

(``HorovodRunner`` is its Databricks-compatible subclass, ``backend="horovod"`` by default;
``@sparkhvd.distributed(np=..., backend=...)`` the decorator form.)

The launch machinery is arranged by where it runs: ``driver/``, ``executor/`` (inside a Spark
task), ``rank/`` (the rank process), ``spark/`` (the driver's view of Spark), ``common/``
(shared). Features live in their own folders with both halves -- ``data/``, ``keras/``,
``torch/``, ``runfolder/``, ``scoring/``, ``storage/``, ``elastic/``, ``timing/``, ``ops/`` (CLI,
doctor, notebook helpers) -- each module tagged with the side it runs on (``__side__``;
tests/unit/test_package_layout.py checks that imports point one way, and that folders stand in
one order).
"""
from __future__ import annotations

import importlib
from typing import Any

from sparkhvd.common.errors import (
    CheckpointError,
    EnvironmentMismatchError,
    NotEnoughSlotsError,
    PayloadError,
    RankFailure,
    SessionError,
    SparkhvdError,
    StallError,
    StorageError,
    TrainingError,
)

__side__ = "public"

# The rest is imported on first use: every rank process imports this package, and numpy,
# fsspec and friends would add ~0.2 s to each rank's start for nothing.
_LAZY = {
    "DataFrameDataset": ("data.dataset", "DataFrameDataset"),
    "load_model": ("scoring.models", "load_model"),
    "predict": ("scoring.scorer", "predict"),
    "RunDir": ("runfolder.rundir", "RunDir"),
    "HorovodRunner": ("driver.runner", "HorovodRunner"),
    "SparkRunner": ("driver.runner", "SparkRunner"),
    "distributed": ("driver.runner", "distributed"),
    "ScalingConfig": ("driver.settings", "ScalingConfig"),
    "LaunchConfig": ("driver.settings", "LaunchConfig"),
    "RunConfig": ("driver.settings", "RunConfig"),
    "SessionConfig": ("driver.settings", "SessionConfig"),
    "ENV_ALLOWLIST": ("common.environment", "ENV_ALLOWLIST"),
    "storage": ("storage", None),
    "keras": ("keras", None),
    "torch": ("torch", None),
    "data": ("data", None),
    "stacks": ("driver.monitor", "request_stacks"),
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
    "SparkRunner", "distributed", "HorovodRunner", "ScalingConfig", "LaunchConfig", "RunConfig", "SessionConfig",
    "TrainingError", "NotEnoughSlotsError", "PayloadError", "EnvironmentMismatchError",
    "SessionError", "SparkhvdError", "RankFailure", "RunDir", "ENV_ALLOWLIST", "StorageError",
    "load_model", "predict", "storage", "DataFrameDataset", "stacks", "StallError",
    "CheckpointError",
    "__version__",
]
