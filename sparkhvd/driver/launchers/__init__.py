"""How ranks are started: one :class:`LaunchSpec`, one small protocol, three launchers, and the
one table of rules that decides which launcher a run may use (:data:`RULES`).

Every launcher takes the same :class:`LaunchSpec` and a *sink* (the attempt's
:class:`~sparkhvd.driver.inbox.AttemptInbox`, which receives every
:mod:`sparkhvd.common.protocol` message the ranks send), starts the ranks and returns their
:class:`RankGroup`, which the controller polls until it gives the ranks' return values in rank
order -- or raises :class:`~sparkhvd.common.errors.LaunchFailure` (a rank failed); whatever
ends the polling early (a failure, ``TimeoutError``, ``KeyboardInterrupt``) stops every rank
first:

============  ==================================================================================
``barrier``   the default on Spark: one barrier stage, a control connection per task, one
              supervised rank process per task (:mod:`sparkhvd.driver.launchers.barrier`)
``horovod``   ``horovod.spark.run`` / ``run_elastic``: elastic runs, and sessions with dynamic
              allocation, which barrier stages cannot use (:mod:`~.launchers.horovod_spark`); horovod
              starts the ranks itself, in its own task processes
``local``     ``np < 0``: supervised rank processes on the driver (:mod:`~.launchers.local`)
============  ==================================================================================

The shared lifecycle -- the launch's blocking call in a helper thread the controller polls,
aborting, cancelling the Spark job, killing what is left -- lives in
:mod:`sparkhvd.driver.launchers.base`; the barrier and
local launchers start each rank as a :class:`sparkhvd.common.rankprocess.RankProcess`.
"""
from __future__ import annotations

import dataclasses
import importlib
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
    #: The session's :class:`~sparkhvd.driver.sparkview.SparkView` (Spark launchers).
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
    def np(self) -> int:
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
    """One attempt's ranks, started: what the controller's poll loop asks of them
    (:meth:`sparkhvd.driver.attempt.Attempt.launch`; every launcher's is a
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


#: Launcher name -> its module: ``horovod`` is horovod's Spark launcher (``horovod.spark.run``),
#: not the horovod *backend* (which the barrier launcher runs too).
MODULES = {"barrier": "barrier", "horovod": "horovod_spark", "local": "local"}


def get_launcher(name: str) -> Launcher:
    """The launcher called ``name`` (``barrier``, ``horovod`` or ``local``)."""
    if name not in MODULES:
        raise ValueError(f"unknown launcher {name!r}")
    return importlib.import_module(f"{__name__}.{MODULES[name]}").LAUNCHER


@dataclass(frozen=True)
class LaunchFacts:
    """What decides the launcher: the user's settings, and (once known) the session's."""

    backend: str
    requested: str = "auto"
    elastic: bool = False
    timeline: bool = False
    #: ``ranks_per_task > 1`` or ``local_ranks="task"``: ranks numbered per task.
    per_task: bool = False
    #: None until a session is known.
    connect: Optional[bool] = None
    dynamic: Optional[bool] = None

    def with_session(self, view: Any) -> "LaunchFacts":
        """These facts plus the session's (``view``: a :class:`~sparkhvd.driver.sparkview.
        SparkView`)."""
        dynamic = str(view.conf("spark.dynamicAllocation.enabled", "false")).lower() == "true"
        return dataclasses.replace(self, connect=bool(view.connect), dynamic=dynamic)

    @property
    def not_horovod(self) -> bool:
        """Settings horovod's rendezvous cannot number (it counts local ranks per host)."""
        return self.per_task and (self.backend == "horovod" or self.requested == "horovod")

    @property
    def horovod_only(self) -> list[str]:
        return [name for name, used in (("launcher='horovod'", self.requested == "horovod"),
                                        ("timeline=True", self.timeline)) if used]

    @property
    def horovod_elastic(self) -> bool:
        """An elastic run on horovod's own elastic mode (``horovod.spark.run_elastic``); the
        other backends' elastic runs relaunch on the barrier launcher."""
        return self.elastic and self.backend == "horovod"


def _dynamic_why(f: LaunchFacts) -> str:
    why = (f"backend={f.backend!r} runs" if f.backend != "horovod" else
           "On a Spark Connect session (no SparkContext for horovod.spark.run) ranks run")
    return (f"{why} in a Spark barrier stage, which Spark refuses with "
            "spark.dynamicAllocation.enabled=true. Fix: turn dynamic allocation off for this "
            "cluster or session" + (", or use backend='horovod'." if not f.connect else "."))


#: Every launcher/backend/session rule, in the order they are checked: (applies?, message).
RULES: tuple[tuple[Callable[[LaunchFacts], bool], Callable[[LaunchFacts], str]], ...] = (
    (lambda f: f.not_horovod,
     lambda f: "ranks_per_task > 1 and local_ranks='task' number ranks per Spark task, which "
               "horovod's rendezvous cannot (it counts local ranks per host). Fix: "
               "backend='torch' or 'tf' on the barrier launcher, or one rank per task."),
    (lambda f: f.backend != "horovod" and bool(f.horovod_only),
     lambda f: f"{' and '.join(f.horovod_only)} need backend='horovod'; backend={f.backend!r} "
               "runs on sparkhvd's barrier launcher (see docs/guides/backends.md)."),
    (lambda f: f.requested == "barrier" and f.horovod_elastic,
     lambda f: "Elastic training (min_np/max_np) on backend='horovod' runs on "
               "horovod.spark.run_elastic; use launcher='auto' or 'horovod' (or backend='torch'/"
               "'tf', whose elastic runs relaunch on the barrier launcher)."),
    (lambda f: bool(f.connect) and (f.requested == "horovod" or f.horovod_elastic),
     lambda f: f"{'Elastic horovod training' if f.horovod_elastic else 'launcher=' + repr(f.requested)}"
               " runs on horovod.spark.run, which needs a SparkContext; this is a Spark Connect "
               "session, which has none. Fix: launcher='auto' (sparkhvd's barrier stage works on "
               "Connect), with backend='torch' or 'tf' for an elastic run, or a classic "
               "session."),
    (lambda f: bool(f.dynamic) and (f.backend != "horovod" or bool(f.connect)), _dynamic_why),
    (lambda f: bool(f.dynamic) and f.requested == "barrier",
     lambda f: "launcher='barrier' cannot run with spark.dynamicAllocation.enabled=true (Spark "
               "refuses barrier stages then); use launcher='auto' or 'horovod'."),
)


def check_launch(facts: LaunchFacts) -> None:
    """Raise the first rule ``facts`` break (ValueError naming the fix)."""
    for applies, message in RULES:
        if applies(facts):
            raise ValueError(message(facts))


def choose_launcher(facts: LaunchFacts) -> str:
    """``"barrier"`` or ``"horovod"`` for a Spark run whose session is known (after
    :func:`check_launch`, which this runs first)."""
    check_launch(facts)
    if facts.backend != "horovod" or facts.connect:
        return "barrier"  # the barrier stage is the only way
    if facts.requested in ("barrier", "horovod"):
        return facts.requested
    return "horovod" if (facts.horovod_elastic or facts.dynamic) else "barrier"
