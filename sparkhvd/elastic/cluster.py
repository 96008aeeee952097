"""What an elastic run reads of the cluster: executors and their slots, those being
decommissioned, where this run's tasks run (the free slots are counted from these by
:func:`sparkhvd.spark.slots.free_slots`).

Classic sessions answer from the driver's JVM (Spark's status store and task scheduler, through
py4j: ``getExecutorDecommissionState`` is how Spark itself tracks graceful decommissioning on
standalone, Kubernetes and YARN). A Spark Connect client sees none of it: its slots come from
the session's settings (:func:`sparkhvd.spark.slots.slots_without_context`), less the executors
the run saw lost; decommissioning is not visible there (a notice reaches Connect ranks as
SIGTERM only).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

__side__ = "driver"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Executor:
    """One live executor: its id, host and task slots."""

    id: str
    host: str
    slots: int


def _seq(java_seq: Any) -> list:
    return [java_seq.apply(i) for i in range(java_seq.size())]


def executors(sc: Any) -> list[Executor]:
    """The live executors (not the driver), from Spark's status store."""
    task_cpus = max(1, int(float(sc.getConf().get("spark.task.cpus", "1"))))
    found = []
    for e in _seq(sc._jsc.sc().statusStore().executorList(True)):
        if e.id() != "driver":
            host = str(e.hostPort()).rsplit(":", 1)[0]
            found.append(Executor(str(e.id()), host, int(e.totalCores()) // task_cpus))
    return found


def decommissioning(sc: Any) -> dict[str, str]:
    """Executor id -> host of every executor Spark is decommissioning now."""
    scheduler = sc._jsc.sc().taskScheduler()
    hosts = {e.id: e.host for e in executors(sc)}
    out = {}
    for exec_id in _seq(sc._jsc.sc().schedulerBackend().getExecutorIds()):
        state = scheduler.getExecutorDecommissionState(exec_id)
        if state.isDefined():
            out[str(exec_id)] = hosts.get(str(exec_id), "?")
    return out


def task_executors(sc: Any, tag: str) -> dict[int, str]:
    """Partition -> executor id of the running tasks of the jobs tagged (or grouped) ``tag``."""
    tracker, store = sc._jsc.sc().statusTracker(), sc._jsc.sc().statusStore()
    out: dict[int, str] = {}
    for job_id in job_ids(sc, tag):
        job = tracker.getJobInfo(job_id)  # Scala Options
        if not job.isDefined():
            continue
        for stage_id in job.get().stageIds():
            stage = tracker.getStageInfo(stage_id)
            if not stage.isDefined():
                continue
            attempt = stage.get().currentAttemptId()
            for task in _seq(store.taskList(stage_id, attempt, 100_000)):
                if str(task.status()) == "RUNNING":
                    out[int(task.index())] = str(task.executorId())
    return out


def job_ids(sc: Any, tag: str) -> frozenset:
    """The ids of the jobs tagged (or grouped) ``tag``."""
    tracker = sc._jsc.sc().statusTracker()
    try:
        return frozenset(int(j) for j in tracker.getJobIdsForTag(tag))
    except Exception:  # noqa: BLE001 - Spark 3.4-: job groups
        return frozenset(int(j) for j in tracker.getJobIdsForGroup(tag))


def safely(what: str, fn: Any, default: Any) -> Any:
    """``fn()``, or ``default`` where this session cannot tell (logged at debug)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a session that cannot answer: go on without
        log.debug("could not read %s: %s", what, exc)
        return default


def describe_lost(lost: dict[str, str], decommissioned: Optional[dict[str, str]] = None) -> str:
    """``executor 1 on 10.0.0.3 lost, executor 2 on 10.0.0.4 decommissioned`` (or "none lost")."""
    parts = [f"executor {e} on {h} lost" for e, h in sorted(lost.items())]
    parts += [f"executor {e} on {h} decommissioned" for e, h in sorted((decommissioned or {}).items())]
    return ", ".join(parts) or "no executor of this run was lost"
