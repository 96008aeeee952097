"""How many Horovod ranks a Spark cluster can run at once.

Each rank occupies one Spark task slot for the whole run, so ``np`` must not exceed the slots
the cluster can give *at the same time*; otherwise horovod waits out its start timeout (600 s by
default). We count slots up front and fail in seconds instead. An elastic run's free slots --
what it may place or grow into -- are counted here too (:func:`free_slots`), from what
:mod:`sparkhvd.elastic.cluster` reads of the executors.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from sparkhvd.common.errors import NotEnoughSlotsError
from sparkhvd.elastic import cluster
from sparkhvd.spark.sparkview import SparkView

__side__ = "driver"

#: The setting that declares how many tasks a cluster runs at once where sparkhvd cannot see
#: its executors (Spark Connect).
SLOTS_CONF = "spark.sparkhvd.slots"

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
                         "start the session with master local[N] where N >= {tasks} "
                         "(e.g. SparkSession.builder.master('local[{tasks}]')), "
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


#: Settings that say how many slots a cluster has, read where there is no SparkContext.
_CONF_KEYS = ("spark.task.cpus", "spark.executor.instances", "spark.executor.cores",
              "spark.cores.max", "spark.default.parallelism", "spark.task.resource.gpu.amount",
              "spark.executor.resource.gpu.amount", "spark.dynamicAllocation.enabled",
              "spark.dynamicAllocation.maxExecutors")


def _local_cores(view) -> int:
    """``local[*]`` on a Connect server: the cores of the machine its tasks run on (one tiny
    job, since the server need not be this machine)."""
    def cores(_batches):
        import os as _os

        import pyarrow as _pa

        yield _pa.RecordBatch.from_pydict({"n": [_os.cpu_count() or 1]})

    return int(view.spark.range(1).mapInArrow(cores, "n long").collect()[0]["n"])


def slots_without_context(view) -> SlotCount:
    """Count the slots of a session without a SparkContext (Spark Connect) from what it shows:
    its master and settings, or the slots the user declared (``spark.sparkhvd.slots``).

    Raises:
        NotEnoughSlotsError: the count cannot be known (say so, and how to declare it) --
            rather than let Spark's barrier check wait 600 s.
    """
    master = view.master
    conf = {k: v for k in (SLOTS_CONF, *_CONF_KEYS) if (v := view.conf(k)) not in (None, "")}
    if SLOTS_CONF in conf:
        return SlotCount(int(_int_conf(conf, SLOTS_CONF, 0)), master,
                         f"declared with {SLOTS_CONF}={conf[SLOTS_CONF]}", f"raise {SLOTS_CONF}")
    m = _LOCAL.match(master)
    if m:
        cpu = _local_cores(view) if m.group("n") == "*" else 1
        return count_slots(master, conf, cpu_count=cpu)
    if _LOCAL_CLUSTER.match(master):
        return count_slots(master, conf, cpu_count=1)
    cores = int(_int_conf(conf, "spark.executor.cores", 0))
    instances = int(_int_conf(conf, "spark.executor.instances", 0))
    if str(conf.get("spark.dynamicAllocation.enabled", "")).lower() == "true":
        instances = int(_int_conf(conf, "spark.dynamicAllocation.maxExecutors", instances))
    if cores and not instances:  # standalone: spark.cores.max caps the executors
        instances = int(_int_conf(conf, "spark.cores.max", 0)) // cores
    executor_cores = [cores] * instances if cores and instances else None
    parallelism = int(_int_conf(conf, "spark.default.parallelism", 0)) or None
    if executor_cores or parallelism:
        return count_slots(master, conf, cpu_count=1, executor_cores=executor_cores,
                           default_parallelism=parallelism)
    raise NotEnoughSlotsError(
        f"sparkhvd cannot count the task slots of this Spark Connect session "
        f"({master or 'its master is hidden'}): a Connect client sees no executors, and the "
        "session shows neither "
        "spark.executor.instances with spark.executor.cores nor spark.cores.max. Fix: declare "
        f"how many tasks the cluster runs at once, e.g. spark.conf.set('{SLOTS_CONF}', '8') "
        "(or in the cluster's Spark config), then run again.")


@dataclass(frozen=True)
class Shortfall:
    """What one look found missing for ``tasks`` tasks at once: :attr:`missing` slots, and
    the error that says so (raised once waiting no longer helps)."""

    #: ``slots``: the session has fewer slots than the tasks (executors may still be
    #: registering); ``busy``: other jobs hold (or, under FIFO, wait for) the ones missing
    kind: str
    missing: int
    free: int
    error: NotEnoughSlotsError
    #: the jobs that hold them (``busy``), in words
    jobs: tuple = ()


def look_for_slots(target: Any, tasks: int, ranks_per_task: int = 1,
                   waited_s: float = 0.0, ended: Optional[str] = None) -> "SlotCount | Shortfall":
    """One look, no wait: the slots for ``tasks`` tasks at once (each starting
    ``ranks_per_task`` ranks), or what is short (``waited_s``: how long the caller has waited,
    for the error's words; ``ended``: the tag of this run's attempt that just ended, whose
    tasks may still be stopping: not counted as other jobs'). ``target``: a :class:`~sparkhvd.spark.sparkview.SparkView`
    (classic or Connect) or a SparkContext. A Connect client sees no jobs but its own: only its
    slot count is looked at."""
    if isinstance(target, SparkView):
        if target.connect:
            found = slots_without_context(target)
            return found if found.slots >= tasks else \
                Shortfall("slots", tasks - found.slots, found.slots,
                          _too_few(found, tasks, ranks_per_task))
        target = target.sc
    found = slots_of(target)
    if found.slots < tasks:
        return Shortfall("slots", tasks - found.slots, found.slots,
                         _too_few(found, tasks, ranks_per_task))
    ignore = cluster.safely("the ended attempt's jobs", lambda: cluster.job_ids(target, ended),
                            frozenset()) if ended else frozenset()
    busy, jobs = busy_slots(target, ignore)
    busy = min(busy, found.slots)  # a job's waiting tasks may outnumber the slots
    if found.slots - busy >= tasks:
        return found
    return Shortfall("busy", tasks - (found.slots - busy), found.slots - busy, NotEnoughSlotsError(
        f"{_wants(tasks, ranks_per_task)} needs {tasks} free Spark task slots, but {busy} of the "
        f"session's {found.slots} ({found.master}) are busy with other jobs: "
        f"{', '.join(jobs) or '?'}; still after waiting {waited_s:.0f} s. Fix: let those jobs "
        "finish or cancel them (the Spark UI names them), run with a larger slot_wait_s or "
        "start_timeout to wait longer, or lower np."), tuple(jobs))


def check_slots(target, np: int, *, wait_s: float = 0.0, ranks_per_task: int = 1,
                busy_wait_s: float = 0.0) -> SlotCount:
    """Raise :class:`NotEnoughSlotsError` unless the session can run ``np`` tasks at once
    (each starting ``ranks_per_task`` ranks: the message counts both), looking
    (:func:`look_for_slots`) for up to ``wait_s`` while the session has too few slots (a
    cluster's executors may still be registering), and up to ``busy_wait_s`` while other jobs
    hold them -- a barrier stage queued behind other jobs would otherwise wait for them,
    however long they run. For ``sparkhvd doctor`` and the tests; a run looks once a step
    (:class:`~sparkhvd.driver.placing.SparkPlacer`)."""
    began = time.monotonic()
    said = False
    while True:
        waited = time.monotonic() - began
        found = look_for_slots(target, np, ranks_per_task, waited)
        if isinstance(found, SlotCount):
            return found
        if waited >= (wait_s if found.kind == "slots" else busy_wait_s):
            raise found.error
        if found.kind == "busy" and not said:
            said = True
            log.warning("sparkhvd: %d task slot(s) short, busy with other jobs (%s); waiting up "
                        "to %g s", found.missing, ", ".join(found.jobs) or "?", busy_wait_s)
        time.sleep(0.5)


def busy_slots(sc, ignore: frozenset = frozenset()) -> tuple[int, list[str]]:
    """How many task slots other jobs hold or will take first, and those jobs (``job 3
    'description' (1 task(s))``), from Spark's status tracker. ``(0, [])`` where it cannot
    tell. ``ignore``: job ids not to count (a run's own attempt that is ending).

    A running task holds one slot. Under Spark's default FIFO scheduler a task of an earlier
    job's submitted stage that is still waiting for a slot takes the next one freed before any
    stage submitted after it: it is counted too, or a relaunch counted the instant a lost
    attempt's slots come free would see them free, place a barrier stage on them, and wait
    behind that job until ``start_timeout``. Under the FAIR scheduler slots are shared between
    pools, so only running tasks count."""
    try:
        tracker = sc.statusTracker()
        fifo = str(sc.getConf().get("spark.scheduler.mode", "FIFO")).upper() == "FIFO"
        submitted = set(tracker.getActiveStageIds())
        busy, jobs = 0, []
        for job_id in tracker.getActiveJobsIds():
            if job_id in ignore:
                continue
            info = tracker.getJobInfo(job_id)
            running = waiting = 0
            for stage in (info.stageIds if info else []):
                found = tracker.getStageInfo(stage) if stage in submitted else None
                if found is None:
                    continue
                running += found.numActiveTasks or 0
                if fifo:
                    waiting += max(0, (found.numTasks or 0) - (found.numActiveTasks or 0)
                                   - (found.numCompletedTasks or 0))
            if running or waiting:
                busy += running + waiting
                held = f"{running} task(s)" + (f", {waiting} waiting for a slot" if waiting
                                               else "")
                jobs.append(f"job {job_id}{_job_name(sc, job_id)} ({held})")
        return busy, jobs
    except Exception as exc:  # noqa: BLE001 - best effort: a tracker that cannot answer
        log.debug("could not read the running jobs from Spark's status tracker: %s", exc)
        return 0, []


def _job_name(sc, job_id: int) -> str:
    """`` 'description'`` of a job (its job group's, or its call site), where Spark tells."""
    try:
        job = sc._jsc.sc().statusStore().job(job_id)
        description = job.description()
        text = description.get() if description.isDefined() else job.name()
        return f" {str(text)[:80]!r}" if text else ""
    except Exception:  # noqa: BLE001 - the number alone still says which
        return ""


def _wants(tasks: int, ranks_per_task: int) -> str:
    """What the user asked for, as they wrote it."""
    return (f"np={tasks}" if ranks_per_task == 1 else
            f"np={tasks * ranks_per_task} with ranks_per_task={ranks_per_task}")


def _too_few(found: SlotCount, tasks: int, ranks_per_task: int = 1) -> NotEnoughSlotsError:
    return NotEnoughSlotsError(
        f"{_wants(tasks, ranks_per_task)} needs {tasks} Spark task slots running at the same "
        f"time, but the session ({found.master}) has {found.slots}: {found.detail}. "
        f"Fix: {found.fix.format(tasks=tasks)}.")


def task_slots(view: SparkView, fallback: int = 8) -> int:
    """How many tasks the cluster runs at once, as well as it can be told cheaply
    (``defaultParallelism`` on classic; the slot count from settings on Connect) -- a sizing
    hint, never a check."""
    try:
        if not view.connect:
            return max(1, int(view.sc.defaultParallelism))
        return max(1, slots_without_context(view).slots)
    except Exception:  # noqa: BLE001 - only a sizing hint
        return fallback


def free_slots(view: Any, lost: Iterable[str] = (), lost_tasks: int = 0,
               ended: Optional[str] = None) -> int:
    """Task slots free now for a new barrier stage: counted here alone, for a placement and
    for a grow (:class:`~sparkhvd.elastic.watch.AttemptWatch` is handed this count).

    Classic: the slots of the live executors that are neither being decommissioned nor among
    ``lost`` (executor ids this run saw lost, until Spark itself drops them), less the slots
    other jobs hold or wait for (:func:`busy_slots`; ``ended``: the tag of this run's attempt
    that just ended, whose tasks may still be stopping). Connect: the session's slots less ``lost_tasks`` (the
    tasks this run saw vanish with their executor)."""
    if view.connect:
        return max(0, slots_without_context(view).slots - lost_tasks)
    sc = view.sc
    if sc.master.startswith("local"):
        total = slots_of(sc).slots
    else:
        gone = set(lost) | set(cluster.decommissioning(sc))
        total = sum(e.slots for e in cluster.executors(sc) if e.id not in gone)
    ignore = cluster.safely("the ended attempt's jobs", lambda: cluster.job_ids(sc, ended),
                            frozenset()) if ended else frozenset()
    return max(0, total - busy_slots(sc, ignore)[0])
