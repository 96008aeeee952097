"""The seam between the controller and a launcher: what an attempt's launch is given
(:class:`LaunchSpec`, :class:`Placement`), where the ranks' messages go (:class:`Sink`), and
what a launcher hands back for the run to poll (:class:`WorkerGroup`, and what a poll finds:
:class:`GroupStatus`).

The launchers, each its group's class (``LAUNCHER`` in its module):

============  ==================================================================================
``barrier``   the default on Spark: one barrier stage, a control connection per task
              (:mod:`~sparkhvd.driver.launchers.control`), one supervised rank process per task
              (:mod:`sparkhvd.driver.launchers.barrier`)
``horovod``   ``horovod.spark.run`` / ``run_elastic``: sessions with dynamic allocation, which
              barrier stages cannot use (:mod:`~sparkhvd.driver.launchers.horovod_spark`);
              horovod starts the ranks itself, in its own task processes
``local``     ``np < 0``: supervised rank processes on the driver
              (:mod:`~sparkhvd.driver.launchers.local`)
============  ==================================================================================

A launcher is start, poll and shutdown over its ranks. Its poll says what it *saw* of each rank
-- :class:`RankFact`\ s: an exit status, a process or connection gone, a task gone silent -- and
never decides: which rank failed first, whether it was preempted, whether the others' errors
are consequences, is decided from the facts in one place (:func:`sparkhvd.driver.rank_end.judge`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Protocol

from sparkhvd.common.backends import RunTag
from sparkhvd.common.protocol import RankOptions
from sparkhvd.driver.facts import RUNNING, GroupStatus, RankFact
from sparkhvd.driver.settings import LaunchConfig, ScalingConfig

__side__ = "driver"

__all__ = ["RUNNING", "GroupStatus", "LaunchSpec", "Launcher", "Placement", "RankFact",
           "RankReach", "Sink", "WorkerGroup"]


@dataclass(frozen=True)
class Placement:
    """Where an attempt's ranks go, decided for each attempt when it is placed
    (:meth:`sparkhvd.driver.placing.Placer.place`: an elastic run's size, and so its slots,
    may change between attempts)."""

    #: ``barrier``, ``horovod`` or ``local``.
    launcher: str
    #: Whether every rank runs on this machine (a local master, or ``np < 0``): the driver is
    #: reached on the loopback and the ranks share its disk.
    executors_here: bool = True
    #: The address the ranks reach this process at.
    driver_host: str = "127.0.0.1"
    #: Network interfaces for the collectives (None: each task picks the one to the driver).
    nics: Optional[frozenset] = None
    #: The session's :class:`~sparkhvd.spark.sparkview.SparkView` (Spark launchers).
    session: Any = None
    #: What ``run.json`` keeps of the placement beside the launcher (the Spark session's
    #: master, app id, kind and slots).
    recorded: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launcher needs to start the ranks: built once per attempt by the run, then
    read. Each setting is carried once: the user's groups as they were validated
    (:class:`~sparkhvd.driver.settings.ScalingConfig`, :class:`~sparkhvd.driver.settings.
    LaunchConfig`), and what the run decided (payload, options, environment, placement)."""

    scaling: ScalingConfig
    launch: LaunchConfig
    backend: str
    payload: bytes
    options: RankOptions
    #: Variables every rank gets (the rank's own are added per task).
    env: Mapping[str, str]
    placement: Placement
    #: The run's time limit (``run(timeout=...)``), counted from the call.
    timeout: Optional[float] = None
    #: The run and attempt, for backends that tell their ranks (torchrun's variables).
    run: RunTag = RunTag()
    #: The Spark job tag (or group) the attempt's jobs run under: recorded in ``run.json``
    #: before submission, so the job can always be found and cancelled.
    job: str = "sparkhvd"

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    # -- read through to the one place each setting lives ---------------------------------
    @property
    def size(self) -> int:
        """How many ranks the launch starts (never signed, unlike the public ``np``)."""
        return self.scaling.size

    @property
    def tasks(self) -> int:
        """How many tasks (groups of ``ranks_per_task`` ranks) the launch starts."""
        return self.scaling.tasks

    @property
    def ranks_per_task(self) -> int:
        return self.scaling.ranks_per_task

    @property
    def node_per_task(self) -> bool:
        return self.scaling.node_per_task

    @property
    def elastic(self) -> Optional[tuple[int, int]]:
        return self.scaling.elastic

    @property
    def start_timeout(self) -> float:
        return self.launch.start_timeout

    @property
    def heartbeat_timeout(self) -> float:
        """A Spark task silent for this long is a lost host (barrier launcher)."""
        return self.launch.heartbeat_timeout

    @property
    def verbose(self) -> bool:
        return self.launch.verbose

    @property
    def driver_host(self) -> str:
        return self.placement.driver_host

    @property
    def nics(self) -> Optional[frozenset]:
        return self.placement.nics

    @property
    def session(self) -> Any:
        return self.placement.session


class Sink(Protocol):
    """Where a launcher delivers what the ranks send
    (:class:`sparkhvd.driver.inbox.AttemptInbox`)."""

    #: PID -> host of every rank process that started (so a launcher kills only its own).
    pid_hosts: dict[int, str]

    def receive(self, msg: Any) -> None:
        """One message from a rank (output line or event)."""

    def reported_by(self, channel: str) -> None:
        """How the reports came (barrier launcher): ``"live"`` or ``"rows"``."""


class RankReach(Protocol):
    """A launcher's own way to reach its running ranks (the barrier launcher's control channel,
    the local launcher's processes): without one, stacks are asked for with signals on this
    machine and no notice can be given (no elastic watch)."""

    def ask_stacks(self) -> None:
        """Ask every rank for its stacks (they land in the run folder)."""

    def notify(self, reason: str) -> None:
        """Give every rank a notice: they checkpoint after their step, then stop."""


class WorkerGroup(Protocol):
    """One attempt's ranks, as the run sees them: started once, polled once a step
    (:meth:`sparkhvd.driver.attempt.Attempt.poll`), shut down once however they ended. One
    class per launcher, made for one attempt from its :class:`LaunchSpec` and :class:`Sink`."""

    #: The ``TimeoutError``'s text when the run's ``timeout`` passes.
    timeout_message: str
    #: The launcher's own way to reach the running ranks (None: it has none).
    reach: Optional[RankReach]
    #: Whether a rank that raised may go on (horovod's elastic ranks reset and recover): then
    #: a raised exception alone does not end the attempt.
    recovers: bool

    def start(self) -> None:
        """Start the ranks (what the group held is released if this raises)."""

    def poll(self, wait_s: float, elapsed_s: float) -> GroupStatus:
        """Wait up to ``wait_s`` for the ranks to end; what was seen of them, as data."""

    def shutdown(self, stop: bool = False) -> None:
        """Release what the launch holds (servers, ports, processes), once; ``stop``: end the
        ranks first (a failed rank, a stall, the time up, an interrupt)."""


class Launcher(Protocol):
    """A launcher is its worker group's class: called with one attempt's spec and sink, it
    makes the (not yet started) :class:`WorkerGroup`."""

    def __call__(self, spec: LaunchSpec, sink: Sink) -> WorkerGroup: ...
