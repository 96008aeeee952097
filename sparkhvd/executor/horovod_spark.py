"""The executor side of ``launcher="horovod"``: horovod's own Spark task, patched first."""
from __future__ import annotations

from typing import Any, Optional

__side__ = "executor"


def spark_task_mapper(driver_python: Optional[str], driver_addresses: Any, key: Any,
                      settings: Any, use_gloo: bool, is_elastic: bool, index: int,
                      _rows: Any) -> Any:
    """horovod's Spark task (``horovod.spark.runner._task_fn``) after the task-side patches of
    :func:`sparkhvd.common.patches.patch_horovod_task` (lifetime, forwarder, the executor's Python)."""
    from sparkhvd.common.patches import patch_horovod_task

    patch_horovod_task(driver_python)
    import horovod.spark.runner as hvd_runner

    yield hvd_runner._task_fn(index, driver_addresses, key, settings, use_gloo, is_elastic)


def rank_in_task(payload: bytes, options: dict) -> Any:
    """What horovod runs in its task process: the rank, in that same process."""
    from sparkhvd.rank.bootstrap import rank_main

    return rank_main(payload, options)
