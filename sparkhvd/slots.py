"""How many Horovod ranks a Spark cluster can run at once.

Each rank occupies one Spark task slot for the whole run, so ``np`` must not exceed the slots
the cluster can give *at the same time*; otherwise horovod waits out its start timeout (600 s by
default). We count slots up front and fail in seconds instead.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .errors import NotEnoughSlotsError

log = logging.getLogger(__name__)

_LOCAL = re.compile(r"^local(?:\[(?P<n>\*|\d+)(?:\s*,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")


@dataclass(frozen=True)
class SlotCount:
    """The task slots a cluster offers, and how that number was found."""

    slots: int
    master: str
    detail: str
    fix: str


def _int_conf(conf: Mapping[str, str], key: str, default: float) -> float:
    raw = conf.get(key)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"Spark setting {key}={raw!r} is not a number; fix the session "
                         "configuration.") from exc


def count_slots(master: str, conf: Mapping[str, str], *, cpu_count: int,
                executor_cores: Optional[Sequence[int]] = None,
                default_parallelism: Optional[int] = None) -> SlotCount:
    """Count task slots from a master URL and Spark settings (pure; no Spark needed).

    Args:
        master: the Spark master URL (``local[2]``, ``spark://host:7077``, ``yarn`` ...).
        conf: the session's Spark settings.
        cpu_count: cores of this machine (for ``local[*]``).
        executor_cores: cores of each registered executor, when known.
        default_parallelism: ``sc.defaultParallelism``, the fallback for total cores.
    """
    task_cpus = max(1.0, _int_conf(conf, "spark.task.cpus", 1))
    m = _LOCAL.match(master)
    if m:
        n = m.group("n")
        cores = 1 if n is None else (cpu_count if n == "*" else int(n))
        slots = int(cores // task_cpus)
        return SlotCount(slots, master,
                         f"local mode with {cores} core(s), spark.task.cpus={task_cpus:g}",
                         f"start the session with master local[N] where N >= np "
                         f"(e.g. SparkSession.builder.master('local[{max(2, cores + 1)}]')), "
                         "or let HorovodRunner create one by stopping the current session")
    m = _LOCAL_CLUSTER.match(master)
    if m:
        executor_cores = [int(m.group(2))] * int(m.group(1))
    fix = ("add executors or cores (numExecutors / spark.executor.cores, or a larger pool), "
           "or lower np")
    if executor_cores:
        n_exec = len(executor_cores)
        cpu_slots = [int(c // task_cpus) for c in executor_cores]
        detail = (f"{n_exec} executor(s) with {sorted(set(executor_cores))} core(s), "
                  f"spark.task.cpus={task_cpus:g}")
    else:
        total = default_parallelism or 0
        n_exec = int(_int_conf(conf, "spark.executor.instances", 0))
        cpu_slots = [int(total // task_cpus)]
        detail = f"{total} core(s) in total (defaultParallelism), spark.task.cpus={task_cpus:g}"
    task_gpu = _int_conf(conf, "spark.task.resource.gpu.amount", 0)
    exec_gpu = _int_conf(conf, "spark.executor.resource.gpu.amount", 0)
    if task_gpu > 0:
        if exec_gpu <= 0:
            return SlotCount(0, master, detail + ", spark.task.resource.gpu.amount set but "
                             "spark.executor.resource.gpu.amount is not",
                             "set spark.executor.resource.gpu.amount (GPUs per executor) and "
                             "spark.executor.resource.gpu.discoveryScript")
        gpu_per_exec = int(exec_gpu // task_gpu)
        if executor_cores:
            per_exec = [min(c, gpu_per_exec) for c in cpu_slots]
        else:
            per_exec = [min(cpu_slots[0], gpu_per_exec * max(n_exec, 1))]
        detail += f", {exec_gpu:g} GPU(s) per executor / {task_gpu:g} per task"
        fix = ("add GPU executors (numExecutors) or lower spark.task.resource.gpu.amount, "
               "or lower np")
        return SlotCount(sum(per_exec), master, detail, fix)
    return SlotCount(sum(cpu_slots), master, detail, fix)


def _registered_executor_cores(sc) -> list[int]:
    """Cores of each live executor (not the driver), read from Spark's status store."""
    try:
        store = sc._jsc.sc().statusStore()
        execs = store.executorList(True)
        cores = []
        for i in range(execs.size()):
            e = execs.apply(i)
            if e.id() != "driver":
                cores.append(int(e.totalCores()))
        return cores
    except Exception as exc:  # noqa: BLE001 - best effort; fall back to defaultParallelism
        log.debug("could not read executors from the status store: %s", exc)
        return []


def slots_of(sc) -> SlotCount:
    """Count the task slots of a live SparkContext."""
    import os

    master = sc.master
    conf = dict(sc.getConf().getAll())
    executor_cores = None if master.startswith("local") else _registered_executor_cores(sc)
    return count_slots(master, conf, cpu_count=os.cpu_count() or 1,
                       executor_cores=executor_cores,
                       default_parallelism=sc.defaultParallelism)


def check_slots(sc, np: int, *, wait_s: float = 0.0) -> SlotCount:
    """Raise :class:`NotEnoughSlotsError` unless ``sc`` can run ``np`` tasks at once.

    On a cluster, executors may still be registering: poll up to ``wait_s`` seconds.
    """
    deadline = time.monotonic() + wait_s
    while True:
        found = slots_of(sc)
        if found.slots >= np or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if found.slots < np:
        raise NotEnoughSlotsError(
            f"np={np} needs {np} Spark task slots running at the same time, but the session "
            f"({found.master}) has {found.slots}: {found.detail}. Fix: {found.fix}.")
    return found
