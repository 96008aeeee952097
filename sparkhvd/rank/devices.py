"""How a rank uses the machine it shares with its local peers: GPU pinning, thread counts.

Pure planning (:func:`plan_rank`, unit-tested) apart from applying it (:func:`apply_plan`), which
imports TensorFlow only on a GPU host.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from sparkhvd.common.protocol import TASK_GPUS_ENV

__side__ = "rank"

#: HOROVOD_CYCLE_TIME for ranks without a GPU (see :func:`plan_rank`).
CPU_CYCLE_TIME_MS = "5"


@dataclass
class RankPlan:
    """How one rank process should use the machine it shares with its local peers."""

    env: dict[str, str] = field(default_factory=dict)
    gpu_index: Optional[int] = None
    memory_growth: bool = False


def plan_rank(local_rank: int, local_size: int, cpu_count: int, gpus: list[str],
              environ: Optional[Mapping[str, str]] = None, threads_shared_by: Optional[int] = None) -> RankPlan:
    """Decide GPU pinning and thread counts for one rank (pure; unit-tested).

    - GPUs present: the rank is pinned to the GPU Spark assigned to its task (``spark.task.
      resource.gpu.amount``, passed as :data:`~sparkhvd.common.protocol.TASK_GPUS_ENV`), else to GPU
      ``local_rank % len(gpus)``; TF memory growth is turned on, so local ranks do not grab
      each other's memory.
    - CPU only: the cores are shared among the local ranks through TF's intra/inter-op thread
      pools and OpenMP, so two ranks on a 2-core executor do not each spawn 2+ threads; and
      Horovod's fusion cycle is 5 ms instead of 1 (:data:`CPU_CYCLE_TIME_MS`, measured in B3).
    ``threads_shared_by``: the ranks that share this host's cores (default ``local_size``;
    more when every Spark task is its own node). Settings the user already exported are never
    overridden.
    """
    environ = os.environ if environ is None else environ
    local_size = max(1, local_size)
    plan = RankPlan()

    def setdefault(key: str, value: str) -> None:
        if key not in environ:
            plan.env[key] = value

    threads = max(1, cpu_count // max(1, threads_shared_by or local_size))
    if gpus:
        assigned = [a.strip() for a in environ.get(TASK_GPUS_ENV, "").split(",") if a.strip()]
        plan.gpu_index = (gpus.index(assigned[0]) if assigned and assigned[0] in gpus
                          else local_rank % len(gpus))
        plan.memory_growth = True
        setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        setdefault("OMP_NUM_THREADS", str(threads))
    else:
        setdefault("TF_NUM_INTRAOP_THREADS", str(threads))
        setdefault("TF_NUM_INTEROP_THREADS", str(min(2, threads)))
        setdefault("OMP_NUM_THREADS", str(threads))
        # Horovod's background loop fuses tensors every HOROVOD_CYCLE_TIME ms (default 1): on
        # CPU ranks that share their cores it competes with the compute; 5 ms measured +8 %
        # samples/s at batch 256 per rank and the same at 64 (bench/RESULTS.md, B3).
        setdefault("HOROVOD_CYCLE_TIME", CPU_CYCLE_TIME_MS)
    return plan


def detect_gpus(environ: Optional[Mapping[str, str]] = None) -> list[str]:
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


def configure_torch(torch: Any, plan: RankPlan) -> Optional[str]:
    """Make the plan's GPU the rank's current CUDA device (``torch.device("cuda")``); all GPUs
    stay visible, so code written for torchrun (``cuda:{LOCAL_RANK}``) keeps working."""
    if plan.gpu_index is None or not torch.cuda.is_available():
        return None
    index = plan.gpu_index % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def apply_plan(plan: RankPlan, backend: Optional[str] = None) -> None:
    """Export the plan's environment and pin the GPU with the rank's framework (imported only on
    GPU hosts: torch for ``backend="torch"``, else TensorFlow)."""
    os.environ.update(plan.env)
    if plan.gpu_index is None:
        return
    try:
        if backend == "torch":
            import torch

            configure_torch(torch, plan)
            return
        import tensorflow as tf
    except ImportError:
        return
    configure_tensorflow(tf, plan)
