"""Inside each rank: prepare the process, run the user's function, report failures.

This module is what executes on the Spark executors (or the driver's local processes). It must
stay cheap to import: TensorFlow is imported only when a GPU has to be pinned.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

#: First line each rank prints on stdout and stderr, so the driver maps output to ranks.
RANK_MARKER = "@@sparkhvd-rank@@"
#: Line a failing rank prints on stderr with a JSON record of its exception.
ERROR_MARKER = "@@sparkhvd-error@@"
#: Line rank 0 prints per epoch with the (averaged) metrics (see sparkhvd.keras).
METRICS_MARKER = "@@sparkhvd-metrics@@"

_NOISY_MODULES = r"(petastorm|pyarrow|tensorflow|keras|horovod|numpy|pandas|google|absl)(\..*)?"


#: GPU addresses Spark assigned to the rank's task (set by the barrier launcher).
TASK_GPUS_ENV = "SPARKHVD_TASK_GPUS"


@dataclass
class RankPlan:
    """How one rank process should use the machine it shares with its local peers."""

    env: dict[str, str] = field(default_factory=dict)
    gpu_index: Optional[int] = None
    memory_growth: bool = False


def plan_rank(local_rank: int, local_size: int, cpu_count: int, gpus: list[str],
              environ: Optional[dict] = None) -> RankPlan:
    """Decide GPU pinning and thread counts for one rank (pure; unit-tested).

    - GPUs present: the rank is pinned to the GPU Spark assigned to its task (``spark.task.
      resource.gpu.amount``, passed as :data:`TASK_GPUS_ENV`), else to GPU
      ``local_rank % len(gpus)``; TF memory growth is turned on, so local ranks do not grab
      each other's memory.
    - CPU only: the cores are shared among the local ranks through TF's intra/inter-op thread
      pools and OpenMP, so two ranks on a 2-core executor do not each spawn 2+ threads.
    Settings the user already exported are never overridden.
    """
    environ = os.environ if environ is None else environ
    local_size = max(1, local_size)
    plan = RankPlan()

    def setdefault(key: str, value: str) -> None:
        if key not in environ:
            plan.env[key] = value

    if gpus:
        # The GPU Spark assigned to this rank's task (barrier launcher), else by local rank.
        assigned = [a.strip() for a in environ.get(TASK_GPUS_ENV, "").split(",") if a.strip()]
        plan.gpu_index = (gpus.index(assigned[0]) if assigned and assigned[0] in gpus
                          else local_rank % len(gpus))
        plan.memory_growth = True
        setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        threads = max(1, cpu_count // local_size)
        setdefault("OMP_NUM_THREADS", str(threads))
    else:
        threads = max(1, cpu_count // local_size)
        setdefault("TF_NUM_INTRAOP_THREADS", str(threads))
        setdefault("TF_NUM_INTEROP_THREADS", str(min(2, threads)))
        setdefault("OMP_NUM_THREADS", str(threads))
    return plan


def detect_gpus(environ: Optional[dict] = None) -> list[str]:
    """GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() not in ("", "-1")]
    if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/proc/driver/nvidia"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def configure_tensorflow(tf: Any, plan: RankPlan) -> Optional[str]:
    """Apply a plan's GPU pinning to an imported ``tensorflow`` module; return the pinned GPU name.

    Uses ``tf.config`` rather than ``CUDA_VISIBLE_DEVICES`` so that user code written for plain
    Horovod (``set_visible_devices(gpus[hvd.local_rank()], 'GPU')``) keeps working unchanged.
    """
    if plan.gpu_index is None:
        return None
    gpus = tf.config.experimental.list_physical_devices("GPU")
    if not gpus:
        return None
    for gpu in gpus:
        if plan.memory_growth:
            tf.config.experimental.set_memory_growth(gpu, True)
    chosen = gpus[plan.gpu_index % len(gpus)]
    tf.config.experimental.set_visible_devices(chosen, "GPU")
    return chosen.name


def apply_plan(plan: RankPlan) -> None:
    """Export the plan's environment and pin the GPU (imports TensorFlow only on GPU hosts)."""
    os.environ.update(plan.env)
    if plan.gpu_index is not None:
        try:
            import tensorflow as tf
        except ImportError:
            return
        configure_tensorflow(tf, plan)


def _quiet_warnings() -> None:
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def current_rank() -> tuple[int, int, int, int]:
    """(rank, size, local_rank, local_size) from the launcher's environment."""
    return (_env_int("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"),
            _env_int("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1),
            _env_int("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
            _env_int("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", default=1))


def error_record(rank: int, exc: BaseException) -> str:
    """The one-line JSON record a failing rank prints after :data:`ERROR_MARKER`."""
    return json.dumps({
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "time": time.time(),
    })


#: What an elastic rank returns: (ELASTIC_RESULT, final rank, value-or-None).
ELASTIC_RESULT = "@@sparkhvd-elastic-result@@"
_elastic_rank: dict[str, int] = {}


def announce_rank(rank: int) -> None:
    """Tell the driver which rank this process is (again, after an elastic reset)."""
    _elastic_rank["rank"] = rank
    for stream in (sys.stdout, sys.stderr):
        print(f"{RANK_MARKER} {rank} {os.getpid()}", file=stream, flush=True)


def _follow_elastic_resets() -> None:
    """Re-announce the rank after each elastic reset (horovod renumbers the survivors)."""
    try:
        from horovod.common.elastic import State
    except ImportError:  # pragma: no cover - horovod is there wherever ranks run
        return
    if getattr(State.on_reset, "_sparkhvd", False):
        return
    original = State.on_reset

    def on_reset(self: Any) -> None:
        original(self)
        announce_rank(int(self._rank()))

    on_reset._sparkhvd = True  # type: ignore[attr-defined]
    State.on_reset = on_reset


def elastic_result(results: list[Any]) -> list[Any]:
    """The driver's view of elastic ranks' returns: values in final-rank order.

    Spark tasks return in launch order, and a task of a lost executor may have been retried
    as an empty task; each elastic rank tags its return with the rank it ended as.
    """
    tagged = [r for r in results if isinstance(r, tuple) and len(r) == 3
              and r[0] == ELASTIC_RESULT]
    return [value for _, _, value in sorted(tagged, key=lambda r: r[1])]


def rank_main(payload: bytes, options: dict) -> Any:
    """Entry point executed once per rank by horovod (Spark tasks or local processes).

    Args:
        payload: :func:`sparkhvd.payload.dumps` of the user's function and kwargs.
        options: ``verbose`` (bool), ``return_all`` (bool), ``elastic`` (bool).
    Returns:
        The function's return value on rank 0 (every rank with ``return_all``), else ``None``;
        elastic ranks tag it with their final rank (see :func:`elastic_result`).
    """
    rank, size, local_rank, local_size = current_rank()
    announce_rank(rank)
    if options.get("elastic"):
        _follow_elastic_resets()
    if not options.get("verbose"):
        _quiet_warnings()
    try:
        cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        apply_plan(plan_rank(local_rank, local_size, cpu_count, detect_gpus()))
        from .payload import loads

        fn, kwargs = loads(payload)
        result = fn(**kwargs)
    except BaseException as exc:
        print(f"{ERROR_MARKER} {error_record(rank, exc)}", file=sys.stderr, flush=True)
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if options.get("elastic"):
        rank = _elastic_rank.get("rank", rank)
        keep = rank == 0 or options.get("return_all")
        return (ELASTIC_RESULT, rank, result if keep else None)
    if rank == 0 or options.get("return_all"):
        return result
    return None


#: How long a Spark task keeps a finished rank's command around for the driver to collect its
#: exit code; horovod uses 3 s from the command's start, which a short run pays in full. The
#: driver is already waiting for the exit code while the command runs, so 1 s is ample.
COMMAND_LIFETIME_S = 1.0


def spark_task_mapper(driver_addresses: Any, key: Any, settings: Any, use_gloo: bool,
                      is_elastic: bool, index: int, _rows: Any) -> Any:
    """horovod's Spark task (``horovod.spark.runner._task_fn``) with a shorter command lifetime."""
    import horovod.spark.runner as hvd_runner

    hvd_runner.MINIMUM_COMMAND_LIFETIME_S = COMMAND_LIFETIME_S
    yield hvd_runner._task_fn(index, driver_addresses, key, settings, use_gloo, is_elastic)
