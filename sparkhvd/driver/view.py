"""What the run's recorders see of it: frozen snapshots of the run and its attempts, each
transition as data, and the hub they subscribe to the ranks' reports through.

:mod:`sparkhvd.driver.recording` is handed these, never :class:`~sparkhvd.driver.run.Run` or
:class:`~sparkhvd.driver.attempt.Attempt` themselves -- as Ray Train v2's controller callbacks
see the controller's state: a recorder reads what the run did at that moment and writes it
down (its ``record`` and ``run_dir`` are where it writes), and cannot reach the policies, the
placer, the launchers or a live attempt to change what the run does next. What the ranks send
while they run -- rank 0's epoch metrics, the time splits -- a recorder subscribes to through
the run's :class:`RunHub`. It also keeps the imports one way: the run imports its recorders,
never the reverse.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from sparkhvd.common import protocol
from sparkhvd.driver.launchers import Placement
from sparkhvd.driver.spec import RunSpec
from sparkhvd.elastic.scaling import ScalingPolicy
from sparkhvd.runfolder.record import RunRecord
from sparkhvd.runfolder.rundir import RunDir

__side__ = "driver"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transition:
    """The run entered a state: from which (``before``: its label, None for the first), which
    (``after``), and ``entry`` -- the state as ``run.json``'s ``states`` keeps it (``state``,
    ``at``, ``why``: the decision, in words, and what the state carries: sizes, checkpoint)."""

    before: Optional[str]
    after: str
    entry: Mapping[str, Any]


@dataclass(frozen=True)
class AttemptSnapshot:
    """An attempt as it was when a recorder was called."""

    number: int
    size: int
    #: ``placed``, ``running``, then how it ended (``succeeded``, ``failed``, ...)
    status: str
    placement: Placement
    resume: Optional[str]
    spark_job: str
    #: how its Spark job is named: ``tag`` or ``group`` (None: no Spark job)
    job_kind: Optional[str]
    #: its entry in ``run.json``'s ``attempts``
    entry: Mapping[str, Any]
    #: the stack dumps the driver saved while it ran (paths in the run folder)
    stack_files: tuple[str, ...]
    #: how the ranks' reports came (``live``, ``rows``; None: not known)
    channel: Optional[str]
    #: rank 0's epoch records
    metrics: tuple[Mapping[str, Any], ...]
    #: what its ranks restored (None: nothing)
    resumed: Optional[protocol.Resumed]
    #: ``rank_pids``, ``pids``, ``hosts``
    pids: Mapping[str, Any]
    #: rank -> how its start went (:mod:`sparkhvd.timing.start_times`)
    start_times: Mapping[int, protocol.StartTimes] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSnapshot:
    """The run as it was when a recorder was called (``record``, ``run_dir``: where
    recorders write; ``hub``: what they subscribe through)."""

    spec: RunSpec
    #: the training function's name
    function: str
    kwargs: Mapping[str, Any]
    scaling: ScalingPolicy
    run_dir: RunDir
    record: RunRecord
    hub: "RunHub"
    #: the state the run is in (None before its first)
    state: Optional[str]
    attempts: tuple[AttemptSnapshot, ...]
    #: a line on the driver's console (and its log)
    say: Callable[[str], None]

    @property
    def attempt(self) -> Optional[AttemptSnapshot]:
        """The latest attempt."""
        return self.attempts[-1] if self.attempts else None


class RunHub:
    """What the ranks send while the run runs, to whoever subscribed: rank 0's epoch records
    (MLflow) and the ranks' time splits. Owned by the run; every attempt's inbox delivers here
    (from its launcher's threads)."""

    def __init__(self) -> None:
        self._metrics: list[Callable[[dict], None]] = []
        self._splits: list[Callable[[protocol.TimeSplit], None]] = []
        self._lock = threading.Lock()

    def on_metrics(self, subscriber: Callable[[dict], None]) -> None:
        with self._lock:
            self._metrics.append(subscriber)

    def on_time_split(self, subscriber: Callable[[protocol.TimeSplit], None]) -> None:
        with self._lock:
            self._splits.append(subscriber)

    @property
    def wants_time_splits(self) -> bool:
        return bool(self._splits)

    def metrics(self, record: dict) -> None:
        """One of rank 0's epoch records (a subscriber may be slow: a server)."""
        with self._lock:
            subscribers = list(self._metrics)
        for subscriber in subscribers:
            subscriber(record)

    def time_split(self, split: protocol.TimeSplit) -> None:
        with self._lock:
            subscribers = list(self._splits)
        for subscriber in subscribers:
            subscriber(split)
