"""What the run's recorders see of it: a read-only view of the run and its attempts, and each
transition as data.

:mod:`sparkhvd.driver.recording` types its callbacks with these, not with
:class:`~sparkhvd.driver.run.Run` and :class:`~sparkhvd.driver.attempt.Attempt` themselves,
as Ray Train v2's controller callbacks see the controller's state: a recorder reads what the
run did and writes it down, and cannot reach the policies, the placer or the launchers to
change what it does next. It also keeps the imports one way: the run imports its recorders,
never the reverse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from sparkhvd.driver.inbox import AttemptInbox
from sparkhvd.driver.launchers import Placement
from sparkhvd.driver.logs import RankLogRouter
from sparkhvd.driver.spec import RunSpec
from sparkhvd.elastic.scaling import ScalingPolicy
from sparkhvd.runfolder.record import RunRecord
from sparkhvd.runfolder.rundir import RunDir

__side__ = "driver"


@dataclass(frozen=True)
class Transition:
    """The run entered a state: from which (``before``: its label, None for the first), which
    (``after``), and ``entry`` -- the state as ``run.json``'s ``states`` keeps it (``state``,
    ``at``, ``why``: the decision, in words, and what the state carries: sizes, checkpoint)."""

    before: Optional[str]
    after: str
    entry: Mapping[str, Any]


class AttemptView(Protocol):
    """What a recorder reads of an attempt."""

    @property
    def number(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def status(self) -> str:
        """``placed``, ``running``, then how it ended (``succeeded``, ``failed``, ...)."""

    @property
    def placement(self) -> Placement: ...

    @property
    def resume(self) -> Optional[str]: ...

    @property
    def spark_job(self) -> str: ...

    @property
    def outcome(self) -> AttemptInbox:
        """The ranks' reports (a recorder may listen: ``listeners``, ``time_splits``)."""

    def entry(self) -> dict:
        """Its entry in ``run.json``'s ``attempts``."""

    def stack_files(self) -> list[str]:
        """The stack dumps the driver saved while it ran (paths in the run folder)."""


class RunView(Protocol):
    """What a recorder -- and an attempt -- reads of the run."""

    @property
    def spec(self) -> RunSpec: ...

    @property
    def fn(self) -> Callable: ...

    @property
    def blob(self) -> bytes: ...

    @property
    def kwargs(self) -> Mapping[str, Any]: ...

    @property
    def return_all(self) -> bool: ...

    @property
    def timeout(self) -> Optional[float]: ...

    @property
    def scaling(self) -> ScalingPolicy: ...

    @property
    def restarts(self) -> int:
        """How many relaunches the retry policy allows (the ranks' rendezvous tag)."""

    @property
    def run_dir(self) -> RunDir: ...

    @property
    def record(self) -> RunRecord: ...

    @property
    def router(self) -> RankLogRouter: ...

    @property
    def state_label(self) -> Optional[str]:
        """The state the run is in (None before its first)."""

    @property
    def attempts(self) -> Sequence[AttemptView]: ...

    @property
    def attempt(self) -> Optional[AttemptView]:
        """The latest attempt (the running one while the run runs)."""
