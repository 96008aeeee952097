"""The seam between the controller and a launcher: what an attempt's launch is given
(:class:`LaunchSpec`, :class:`Placement`), where the ranks' messages go (:class:`Sink`), and
what a launcher hands back for the controller to poll (:class:`RankGroup`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Protocol

from sparkhvd.common.backends import RunTag
from sparkhvd.common.protocol import RankOptions
from sparkhvd.driver.settings import LaunchConfig, ScalingConfig

__side__ = "driver"


def left_until(deadline: Optional[float]) -> Optional[float]:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` time), never below 0; None
    without one -- what is left of ``run(timeout=...)``."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


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
    #: When that limit ends (``time.monotonic()``); None without a limit.
    deadline: Optional[float] = None
    #: The run and attempt, for backends that tell their ranks (torchrun's variables).
    run: RunTag = RunTag()
    #: The Spark job tag (or group) the attempt's jobs run under: recorded in ``run.json``
    #: before submission, so the job can always be found and cancelled.
    job: str = "sparkhvd"

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    def time_left(self) -> Optional[float]:
        """What is left of the run's limit now (None: no limit)."""
        return left_until(self.deadline)

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

    def stale_error(self) -> Optional[Any]:
        """A LaunchFailure for a rank that reported an exception but has not exited in time."""


class RankGroup(Protocol):
    """One attempt's ranks, started: what each of the run's polls asks of them
    (:meth:`sparkhvd.driver.attempt.Attempt.poll`; every launcher's is a
    :class:`~sparkhvd.driver.launchers.base.ThreadedGroup`)."""

    #: The ``TimeoutError``'s text when the run's ``timeout`` passes.
    timeout_message: str
    #: The launcher's own way to ask its ranks for their stacks (None: signals on this machine).
    ask_stacks: Optional[Callable[[], None]]
    #: The launcher's own way to give its ranks a notice (None: it has none).
    notify: Optional[Callable[[str], None]]

    def poll(self, wait_s: float, elapsed_s: float) -> bool:
        """Wait up to ``wait_s``; raise a rank's failure; whether the ranks have ended."""

    def results(self) -> list[Any]:
        """Once :meth:`poll` said so: the ranks' results in rank order, or their error."""

    def fail(self, exc: BaseException) -> BaseException:
        """Stop the ranks after ``exc``; the exception to raise (the rank behind it, when the
        launcher can tell)."""

    def close(self) -> None:
        """Release what the launch holds (servers, ports, processes), however it ended."""


class Launcher(Protocol):
    """Starts the ranks of one attempt; the controller polls them (:class:`RankGroup`)."""

    name: str

    def start(self, spec: LaunchSpec, sink: Sink) -> RankGroup: ...
