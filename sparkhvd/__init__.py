"""sparkhvd: run single-node TensorFlow/Keras training data-parallel with Horovod on Spark.

Public API::

    from sparkhvd import HorovodRunner, TrainingError
    model_bytes = HorovodRunner(np=2).run(train_fn, lr=0.1, epochs=3)
"""
from .errors import (EnvironmentMismatchError, NotEnoughSlotsError, PayloadError, RankFailure,
                     SparkhvdError, TrainingError)
from . import storage
from .data import DataFrameDataset
from .models import load_model
from .rundir import RunDir
from .runner import HorovodRunner
from .session import ENV_ALLOWLIST
from .storage import StorageError

__version__ = "0.1.0"

__all__ = [
    "HorovodRunner", "TrainingError", "NotEnoughSlotsError", "PayloadError",
    "EnvironmentMismatchError", "SparkhvdError", "RankFailure", "RunDir", "ENV_ALLOWLIST",
    "StorageError", "load_model", "storage", "DataFrameDataset",
    "__version__",
]
