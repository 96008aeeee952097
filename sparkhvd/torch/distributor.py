"""``sparkhvd.torch.TorchDistributor``: Spark's ``TorchDistributor``, run by sparkhvd.

The same constructor (``num_processes``, ``local_mode``, ``use_gpu``) and the same
``run(main, *args)`` as ``pyspark.ml.torch.distributor.TorchDistributor``: ``main`` is a function
(called with ``*args, **kwargs`` on every rank; rank 0's return value comes back) or the path of a
script (run as ``__main__`` with ``args`` as its command line; ``None`` comes back). Ranks are
numbered as Spark's class numbers them -- ``local_mode=False`` makes every Spark task its own node
(``LOCAL_RANK`` counts within the task, ``NODE_RANK`` is the task's index, ``CUDA_VISIBLE_DEVICES``
the task's GPUs); ``local_mode=True`` runs the processes on the driver, as ``torchrun
--standalone`` would -- so code written for it runs unchanged, Lightning's included.

What sparkhvd adds comes with it: the slot check before launch, typed errors naming the rank and
host, the run folder (``.last_run_dir``), live ``[rank N]`` logs, stacks on a hang, retries. Any
:class:`~sparkhvd.driver.runner.SparkRunner` keyword (``output_dir=``, ``max_retries=``,
``spark=``, ...) may be added to the constructor.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional, Union

from sparkhvd.common.errors import PayloadError
from sparkhvd.common.script import read_script, run_script
from sparkhvd.driver.runner import SparkRunner

__side__ = "driver"

log = logging.getLogger(__name__)

#: The Spark setting that says how many GPUs each task gets (and so how many ranks it runs).
TASK_GPUS = "spark.task.resource.gpu.amount"


def call_with(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` in a rank: how a TorchDistributor function is called."""
    return fn(*args, **kwargs)


class TorchDistributor:
    """Spark's ``TorchDistributor`` on sparkhvd (module docstring).

    Args:
        num_processes: ranks in all (with ``use_gpu`` on a cluster: a multiple of
            ``spark.task.resource.gpu.amount``; each task runs that many, one per GPU).
        local_mode: run the ranks as processes on the driver (``True``, Spark's default) or in
            Spark tasks on the executors.
        use_gpu: give each rank a GPU; ``False`` hides every GPU (``CUDA_VISIBLE_DEVICES=""``).
        **settings: any ``SparkRunner`` keyword (``output_dir``, ``max_retries``, ``spark``,
            ``mlflow``, ...).
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 _ssl_conf: Optional[str] = None, **settings: Any) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or \
                num_processes <= 0:
            raise ValueError(f"num_processes must be an int > 0; got {num_processes!r}")
        self.num_processes, self.local_mode, self.use_gpu = num_processes, local_mode, use_gpu
        ranks_per_task = 1
        if use_gpu and local_mode:
            self.num_processes = self._driver_gpus(num_processes)
        elif use_gpu:
            ranks_per_task = self._task_gpus(settings.get("spark"), num_processes)
        env = dict(settings.pop("env", None) or {})
        if not use_gpu:
            env.setdefault("CUDA_VISIBLE_DEVICES", "")  # as Spark's class: no GPU at all
        self.runner = SparkRunner(
            np=-self.num_processes if local_mode else self.num_processes, backend="torch",
            local_ranks=None if local_mode else "task", ranks_per_task=ranks_per_task, env=env,
            **settings)

    @property
    def last_run_dir(self) -> Any:
        """The last run's folder (``run.json``, ``logs/``, the model): the run's handle."""
        return self.runner.last_run_dir

    def run(self, train_object: Union[Callable[..., Any], str], *args: Any,
            **kwargs: Any) -> Optional[Any]:
        """Run ``train_object`` on every rank: a function with ``*args, **kwargs`` (rank 0's
        return value comes back), or a script path with ``args`` as its command line
        (``None`` comes back, as from Spark's class)."""
        if isinstance(train_object, str):
            if kwargs:
                raise ValueError("Running pytorch file does not support key-word type arguments.")
            self.runner.run(run_script, source=read_script(train_object), path=train_object,
                            argv=[str(a) for a in args])
            return None
        if not callable(train_object):
            raise TypeError(f"train_object must be a function or a script path; got "
                            f"{type(train_object).__name__}")
        try:
            inspect.signature(train_object).bind(*args, **kwargs)
        except TypeError as exc:
            raise PayloadError(f"run() cannot call {getattr(train_object, '__qualname__', '?')}"
                               f" with these arguments: {exc}. Fix: pass what its signature "
                               "takes.") from None
        except ValueError:  # no signature to check (a builtin)
            pass
        return self.runner.run(call_with, fn=train_object, args=tuple(args), kwargs=dict(kwargs))

    # -- GPUs, as Spark's class counts them ---------------------------------------------------
    @staticmethod
    def _driver_gpus(num_processes: int) -> int:
        try:
            import torch

            count = torch.cuda.device_count()
        except ImportError:
            count = 0
        if count == 0:
            raise RuntimeError(
                "GPUs were unable to be found on the driver (use_gpu=True, local_mode=True). "
                "Fix: TorchDistributor(..., use_gpu=False) to train on CPUs, or run where the "
                "driver has a GPU.")
        if num_processes > count:
            log.warning("'num_processes' cannot be set to a value greater than the number of "
                        "available GPUs on the driver, which is %d. 'num_processes' was reset "
                        "to be equal to the number of available GPUs.", count)
            return count
        return num_processes

    @staticmethod
    def _task_gpus(spark: Any, num_processes: int) -> int:
        from sparkhvd.spark.session import get_or_create_session
        from sparkhvd.spark.sparkview import SparkView

        session = get_or_create_session(num_processes, spark)
        amount = int(float(SparkView(session).conf(TASK_GPUS, "0") or 0))
        if amount < 1:
            raise RuntimeError(
                f"'{TASK_GPUS}' was unset, so gpu usage is unavailable (use_gpu=True, "
                f"local_mode=False). Fix: set {TASK_GPUS} (GPUs per task) in the cluster's Spark "
                "config, or TorchDistributor(..., use_gpu=False) to train on CPUs.")
        if num_processes % amount:
            raise RuntimeError(
                f"TorchDistributor 'num_processes' value ({num_processes}) must be a multiple "
                f"of '{TASK_GPUS}' ({amount}) value: each task runs one rank per GPU.")
        return amount
