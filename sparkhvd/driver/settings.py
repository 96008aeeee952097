"""The runner's settings in four typed, immutable groups -- each validated once, where it is made.

Like Ray Train's ``ScalingConfig``/``RunConfig``: a run is described by *how many ranks*
(:class:`ScalingConfig`), *how they start* (:class:`LaunchConfig`), *what the run keeps*
(:class:`RunConfig`: run folder, logs, resume, tracking) and *which Spark session*
(:class:`SessionConfig`). ``HorovodRunner(np=2, output_dir=..., start_timeout=...)`` keywords still
work: :func:`scaling_config` takes ``np`` by name and :func:`group_keywords` files every other
keyword into its group (:data:`KEYWORD_GROUPS`, the one table); a keyword given both ways is
refused rather than guessed.

Defaults live here only; the runner's signature (``SparkRunner``'s) leaves them unset.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

from sparkhvd.driver.logs import check_verbosity
from sparkhvd.elastic.scaling import RESIZE_CHECK_S

__side__ = "driver"


#: A keyword setting the caller did not give (its default lives in this module).
UNSET: Any = object()

#: What ``HorovodRunner(launcher=...)`` accepts.
LAUNCHERS = ("auto", "barrier", "horovod")

#: What a stall does: warn (the run goes on) or stop the run.
ON_STALL = ("warn", "stop")


def seconds(name: str, value: Any) -> float:
    """``value`` as seconds, or the ValueError every time setting of sparkhvd raises."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds; got {value!r}")
    return float(value)


def _frozen_map(value: Optional[Mapping]) -> Mapping:
    return MappingProxyType(dict(value or {}))


@dataclass(frozen=True)
class ScalingConfig:
    """How many ranks, and where.

    Args:
        np: ``N > 0`` runs N ranks in N Spark task slots (checked up front); ``-N`` runs N ranks
            as local processes on the driver, without Spark tasks (quick debugging).
        min_np: an elastic run: it goes on with as few as ``min_np`` ranks. On
            ``backend="torch"``/``"tf"`` a lost rank, executor or host -- or a notice -- relaunches
            the run from its newest checkpoint with the ranks the cluster can give now, within
            ``min_np``..``max_np`` (torchrun's ``--nnodes=MIN:MAX``; classic Spark and Spark
            Connect); on ``backend="horovod"`` it is ``horovod.spark.run_elastic``.
        max_np: the most ranks of an elastic run: it grows back to it when slots come back.
        resize_check_s: how often an elastic run below ``max_np`` looks for free task slots
            (classic sessions); it grows at the ranks' next step.
        ranks_per_task: ranks each Spark task starts (default 1): a node with k GPUs scheduled
            as one task (``spark.task.resource.gpu.amount=k``) runs one rank per GPU, as
            ``torchrun --nproc-per-node k`` would. ``np`` counts ranks, so it must be a multiple.
        local_ranks: what ``LOCAL_RANK`` counts -- ``"host"``: the ranks on the host, numbered
            as ``torchrun --nproc-per-node`` does (the default with one rank per task);
            ``"task"``: the ranks of the Spark task, every task its own node, as Spark's
            ``TorchDistributor`` numbers them (the default, and the only choice, with several
            ranks per task).
    """

    np: int
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    ranks_per_task: int = 1
    local_ranks: Optional[str] = None
    resize_check_s: float = RESIZE_CHECK_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "resize_check_s", seconds("resize_check_s", self.resize_check_s))
        np = self.np
        if isinstance(np, bool) or not isinstance(np, int) or np == 0:
            raise ValueError(
                f"np must be a non-zero int; got {np!r}. Use np=N (N > 0) to run N ranks as Spark "
                "tasks, or np=-N to run N ranks as local processes on the driver (no Spark tasks, "
                "for quick debugging).")
        if self.min_np is not None or self.max_np is not None:
            lo, hi = self.elastic_range(np)
            if np < 0 or not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= np <= hi):
                raise ValueError(f"Elastic training needs 1 <= min_np <= np <= max_np with np > 0; "
                                 f"got min_np={self.min_np}, np={np}, max_np={self.max_np}.")
        k = self.ranks_per_task
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ranks_per_task must be an int >= 1; got {k!r}")
        if abs(np) % k:
            raise ValueError(
                f"np={np} is not a multiple of ranks_per_task={k}: np counts ranks, and every "
                f"Spark task starts {k}. Fix: np={(abs(np) // k + 1) * k * (1 if np > 0 else -1)}"
                f" or ranks_per_task=1.")
        if self.local_ranks not in (None, "host", "task"):
            raise ValueError(f"local_ranks must be 'host' (torchrun's numbering) or 'task' "
                             f"(TorchDistributor's); got {self.local_ranks!r}")
        if self.local_ranks == "host" and k > 1:
            raise ValueError(
                f"local_ranks='host' cannot number ranks_per_task={k}: a task that runs several "
                "ranks is their node (LOCAL_RANK 0..k-1 over the task's GPUs, as torchrun on a "
                "node). Fix: leave local_ranks unset (or 'task').")
        if (k > 1 or self.local_ranks == "task") and self.elastic is not None:
            raise ValueError("Elastic training (min_np/max_np) runs one rank per Spark task, "
                             "numbered by host; drop ranks_per_task/local_ranks='task'.")

    def elastic_range(self, np: int) -> tuple[Any, Any]:
        return (np if self.min_np is None else self.min_np,
                np if self.max_np is None else self.max_np)

    @property
    def size(self) -> int:
        """How many ranks."""
        return abs(self.np)

    @property
    def spark(self) -> bool:
        """Whether the ranks run as Spark tasks (else as local processes on the driver)."""
        return self.np > 0

    @property
    def mode(self) -> str:
        return "spark" if self.spark else "local"

    @property
    def tasks(self) -> int:
        """How many Spark tasks (or, ``np < 0``, groups of local processes) the ranks need."""
        return self.size // self.ranks_per_task

    def resized(self, size: int) -> "ScalingConfig":
        """The same settings for an attempt of ``size`` ranks (an elastic run's), where they
        were asked to run: the sign of the public ``np`` stays the one place that says so."""
        return dataclasses.replace(self, np=size if self.spark else -size)

    @property
    def node_per_task(self) -> bool:
        """Whether every task is its own node (``LOCAL_RANK`` counts within the task): the one
        place that decides the numbering (``local_ranks``, see the class docstring)."""
        return self.local_ranks == "task" or self.ranks_per_task > 1

    @property
    def elastic(self) -> Optional[tuple[int, int]]:
        """``(min_np, max_np)`` for an elastic run, else None."""
        if self.min_np is None and self.max_np is None:
            return None
        return self.elastic_range(self.np)


@dataclass(frozen=True)
class LaunchConfig:
    """How the ranks start and are watched.

    Args:
        launcher: ``"auto"`` (default: ``"barrier"`` -- one Spark barrier stage -- unless the run
            is elastic or the session uses dynamic allocation, then ``"horovod"``).
        start_timeout: seconds the ranks may take to start -- waiting for task slots other jobs
            hold included; past it the run's Spark job is cancelled and never runs.
        heartbeat_timeout: (barrier launcher) a Spark task silent this long -- its host lost or
            cut off the network -- fails the run, naming the rank and host.
        slot_wait_s: on a cluster, how long to wait for executors to register before the slot
            check fails; on classic sessions, also the most to wait for slots other jobs hold
            (within ``start_timeout``).
        nics: network interfaces for Gloo; default: ``{"lo"}`` when every executor is local,
            else each task uses the interface that reaches the driver.
        env: extra environment variables for the ranks (see :mod:`sparkhvd.common.environment`).
        verbose: show TensorFlow/Gloo start-up noise and horovod's own debug output.
        stall_timeout: when no rank has shown progress (an output line, metrics, any report)
            for this long, collect every rank's stacks (``logs/stacks-*.txt``) and warn, naming
            which rank is where; ``None`` turns it off.
        on_stall: ``"warn"`` (the run goes on) or ``"stop"`` (the stall ends the run with a
            ``StallError``).
        warm_start: start ranks from a process per executor that already imported the
            backend's framework (torch; for tf and horovod, Python and sparkhvd: TensorFlow's
            import starts a thread), left by the executor's first ranks: the second run, a
            retry and an elastic relaunch skip the import (default ``True``; see
            docs/guides/warm.md). The barrier and local launchers; ``False`` starts every rank
            as a fresh process, as does ``SPARKHVD_WARM_START=0`` on an executor.
    """

    launcher: str = "auto"
    start_timeout: float = 120.0
    heartbeat_timeout: float = 15.0
    slot_wait_s: float = 30.0
    nics: Optional[frozenset] = None
    env: Mapping[str, str] = field(default_factory=dict)
    verbose: bool = False
    stall_timeout: Optional[float] = 600.0
    on_stall: str = "warn"
    warm_start: bool = True

    def __post_init__(self) -> None:
        from sparkhvd.common.environment import rank_env

        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}; got {self.launcher!r}")
        set_ = object.__setattr__
        set_(self, "start_timeout", seconds("start_timeout", self.start_timeout))
        set_(self, "heartbeat_timeout", seconds("heartbeat_timeout", self.heartbeat_timeout))
        wait = self.slot_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
            raise ValueError(f"slot_wait_s must be a number of seconds >= 0; "
                             f"got {self.slot_wait_s!r}")
        if self.stall_timeout is not None:
            set_(self, "stall_timeout", seconds("stall_timeout", self.stall_timeout))
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"warm_start must be True or False; got {self.warm_start!r}")
        if self.on_stall not in ON_STALL:
            raise ValueError(f"on_stall must be one of {ON_STALL}; got {self.on_stall!r}")
        set_(self, "nics", frozenset(self.nics) if self.nics else None)
        rank_env(dict(self.env or {}))  # validates names and values now rather than at run()
        set_(self, "env", _frozen_map(self.env))


@dataclass(frozen=True)
class RunConfig:
    """What a run keeps: its folder, logs, resume source and tracking.

    Args:
        output_dir: folder or storage URL (``abfss://...``, ``az://``, ``file://``) that receives
            one ``<run-id>/`` folder per run (default ``runs``); remote ones are checked by a
            pre-flight write, staged locally and published at the end.
        storage_options: credentials and options for ``output_dir`` (adlfs keywords; sparkhvd's
            retry budget, see :mod:`sparkhvd.storage`). Used on the driver only, never recorded.
        resume_from: ``True`` for the latest run under ``output_dir`` with checkpoints, or a run
            folder / checkpoints URL.
        timeline: record a Horovod timeline as ``timeline.json`` in the run folder.
        time_split: sample where every rank's time goes (data loading, computing, collectives,
            checkpoint I/O), name stragglers as the run goes, keep system metrics, and write
            ``report.html`` (default ``True``; costs about 1 % of throughput, see
            docs/guides/slow.md).
        mlflow: ``True`` or an experiment name: track the run in MLflow.
        driver_log_verbosity: ``"rank0"`` (rank 0's output and every rank's errors on the
            console) or ``"all"``.
        max_retries: relaunch a run that failed because an executor, host or rank process was
            lost -- not because the training function raised -- up to this many times, each
            attempt resuming from the run's own latest checkpoint (``run.json`` records them).
            Default 0, or 3 for an elastic run (``min_np``/``max_np``).
        max_preemptions: relaunch a run whose ranks stopped on a notice (SIGTERM to a rank, a
            decommissioned executor, a resize) after their checkpoint up to this many times,
            counted apart from ``max_retries`` (default 10: each costs at most a step).
    """

    output_dir: str = "runs"
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    resume_from: Any = None
    timeline: bool = False
    time_split: bool = True
    mlflow: Union[None, bool, str] = None
    driver_log_verbosity: str = "rank0"
    max_retries: Optional[int] = None
    max_preemptions: Optional[int] = None

    def __post_init__(self) -> None:
        check_verbosity(self.driver_log_verbosity)
        for name in ("max_retries", "max_preemptions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name} must be an int >= 0 (or None: the default); "
                                 f"got {value!r}")
        object.__setattr__(self, "storage_options", _frozen_map(self.storage_options))

    def __repr__(self) -> str:  # storage_options hold credentials: never shown
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                          if f.name != "storage_options")
        return f"RunConfig({shown}, storage_options=<{len(self.storage_options)} keys>)"


@dataclass(frozen=True)
class SessionConfig:
    """Which Spark session.

    Args:
        spark: the SparkSession, classic or Spark Connect; default the active one, else a new
            ``local[np]`` one.
        preset: a preset name (``conf/<name>.json``) or :class:`~sparkhvd.spark.presets.Preset`:
            ``np`` is checked against it, and a session is created from it when none is active.
    """

    spark: Any = None
    preset: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.preset, str):
            from sparkhvd.spark.presets import load_preset

            object.__setattr__(self, "preset", load_preset(self.preset))


#: Which group each of the runner's keyword settings belongs to (the one table).
KEYWORD_GROUPS: Mapping[str, type] = MappingProxyType({
    **{f.name: ScalingConfig for f in dataclasses.fields(ScalingConfig)},
    **{f.name: LaunchConfig for f in dataclasses.fields(LaunchConfig)},
    **{f.name: RunConfig for f in dataclasses.fields(RunConfig)},
    **{f.name: SessionConfig for f in dataclasses.fields(SessionConfig)},
})
#: The runner's argument that takes each group.
GROUP_ARGUMENT = {ScalingConfig: "scaling", LaunchConfig: "launch", RunConfig: "run_config",
                  SessionConfig: "session"}


def group_keywords(groups: Mapping[type, Any], keywords: Mapping[str, Any]) -> dict[type, Any]:
    """One object for each group in ``groups``: the one given, or one made from the keywords
    of that group (the scaling group, which holds ``np``, is :func:`scaling_config`'s).

    Raises:
        ValueError: a keyword was given together with the group object it belongs to.
    """
    return {cls: _one_group(cls, given,
                            {k: v for k, v in keywords.items() if KEYWORD_GROUPS[k] is cls})
            for cls, given in groups.items()}


def scaling_config(given: Optional[ScalingConfig], np: Any, keywords: Mapping,
                   runner: str = "SparkRunner") -> ScalingConfig:
    """The scaling group, with ``np`` -- the runner's one required setting -- handed on by name.

    ``np`` is the number every later step reads (the spec's scaling policy, the placing, the
    launchers, each rank's ``WORLD_SIZE``), so it comes here as itself, not in a bag of
    keywords: ``HorovodRunner(np=2)`` is ``ScalingConfig(np=2)``. ``np`` is ``UNSET`` when the
    caller did not give it (``scaling=`` then says how many ranks); ``runner``, the class that
    asks (named in the error).

    Raises:
        TypeError: neither ``np`` nor ``scaling=`` was given.
        ValueError: ``np`` (or another scaling keyword) was given together with ``scaling=``.
    """
    mine = {k: v for k, v in keywords.items() if KEYWORD_GROUPS[k] is ScalingConfig}
    if np is not UNSET:
        mine = {"np": np, **mine}
    elif given is None:
        raise TypeError(f"{runner} needs np ({runner}(np=2, ...)) or "
                        "scaling=ScalingConfig(np=2).")
    return _one_group(ScalingConfig, given, mine)


def _one_group(cls: type, given: Any, mine: Mapping[str, Any]) -> Any:
    if given is None:
        return cls(**mine)
    if not isinstance(given, cls):
        raise TypeError(f"{GROUP_ARGUMENT[cls]}= takes a {cls.__name__}; "
                        f"got {type(given).__name__}")
    if mine:
        raise ValueError(
            f"{', '.join(sorted(mine))} given both as keyword(s) and in "
            f"{GROUP_ARGUMENT[cls]}={cls.__name__}(...): set each once. Fix: move them "
            f"into the {cls.__name__}, or drop {GROUP_ARGUMENT[cls]}=.")
    return given
