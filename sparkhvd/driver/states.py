"""The states of a run, each carrying what its next step needs -- the run's one vocabulary.

Like Ray Train v2's controller states (``Scheduling(decision)``, ``Errored(error)``): a
:class:`~sparkhvd.driver.run.Run` is always in one of these, and its step function turns each
into the next (``Run._step``). What a state carries is what ``run.json``'s ``states`` entry
says of it (:meth:`RunState.entry`), and :data:`NEXT` -- which state may follow which -- is
where the diagram in ``run.py`` and ``docs/architecture.md`` comes from (:func:`diagram`; a
test holds both to it)::

    placing -> running | failed | restarting | resizing
    running -> finished | failed | restarting | resizing
    restarting -> placing | failed
    resizing -> placing | failed

``failed`` follows any state but ``finished``: every exception a step raises ends the run in
``failed``, by one transition.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Optional

if TYPE_CHECKING:
    from sparkhvd.driver.attempt import Attempt
    from sparkhvd.driver.rank_end import Verdict

__side__ = "driver"


@dataclass(frozen=True)
class RunState:
    """A state: its ``label`` in ``run.json`` and ``why`` the run entered it (words, for the
    record and the log)."""

    label: ClassVar[str] = "?"
    why: str

    def entry(self) -> dict:
        """What ``run.json``'s ``states`` says of this state besides its label, time and why."""
        return {}


@dataclass(frozen=True)
class Placing(RunState):
    """Choosing the size, the launcher and the slots of the next attempt -- looked at once a
    step, the state kept while it waits for slots (:attr:`began` says since when)."""

    label: ClassVar[str] = "placing"
    #: the ranks asked for (an elastic run's first placing trims it to the free slots)
    size: int = 0
    #: the checkpoints sparkhvd restores from (None on the first placing: resolved there)
    resume: Optional[str] = None
    #: a library's own checkpoint folders, when sparkhvd has none
    library: Optional[str] = None
    #: the size of the attempt before (a relaunch)
    previous_size: Optional[int] = None
    #: a relaunch the driver asked for (a grow): no budget spent
    planned: bool = False
    #: the Spark job tag of the attempt that just ended (its tasks may still be stopping)
    ended_job: Optional[str] = None
    #: when the placing began (``time.monotonic()``): what it waits for is counted from it
    began: float = field(default_factory=time.monotonic, compare=False)

    def entry(self) -> dict:
        return {"size": self.size}


@dataclass(frozen=True)
class Running(RunState):
    """An attempt's ranks run; the driver watches them."""

    label: ClassVar[str] = "running"
    attempt: "Attempt" = None  # type: ignore[assignment]  # always given

    def entry(self) -> dict:
        return {"attempt": self.attempt.number, "size": self.attempt.size}


@dataclass(frozen=True)
class Relaunching(RunState):
    """An attempt ended and the policy said retry: the run relaunches from ``checkpoint``."""

    attempt: "Attempt" = None  # type: ignore[assignment]  # always given
    verdict: Optional["Verdict"] = None
    #: the newest checkpoint the relaunch resumes from (None: the library's, or the start)
    checkpoint: Optional[str] = None
    size_from: int = 0
    size_to: int = 0
    resume: Optional[str] = None
    library: Optional[str] = None
    #: the driver asked the ranks to stop (a grow): no budget spent
    planned: bool = False

    def entry(self) -> dict:
        return {"attempt": self.attempt.number, "checkpoint": self.checkpoint,
                "from": self.size_from, "to": self.size_to}

    def resumes_from(self) -> str:
        """What the relaunch resumes from, in words (the console's retry line)."""
        if self.resume:
            return f"from sparkhvd's checkpoints in {self.resume}"
        if self.library:
            return f"with your library's own checkpoints in {self.library} (it resumes from " \
                   "them where your code asks it to)"
        # The driver sees the run folder's checkpoints only: helpers given their own url
        # (``st.Checkpoints(url="abfss://...")``) resume from it without the driver knowing.
        return "from the start, or from checkpoints the run folder does not have (none are " \
               "in it): in your helpers' own url, or kept on the ranks' hosts"


@dataclass(frozen=True)
class Restarting(Relaunching):
    """Relaunching at the same size (a lost rank, a notice)."""

    label: ClassVar[str] = "restarting"


@dataclass(frozen=True)
class Resizing(Relaunching):
    """Relaunching at another size (an elastic run shrinks or grows)."""

    label: ClassVar[str] = "resizing"


@dataclass(frozen=True)
class Finished(RunState):
    """The last attempt succeeded."""

    label: ClassVar[str] = "finished"
    attempt: "Attempt" = None  # type: ignore[assignment]  # always given


@dataclass(frozen=True)
class Failed(RunState):
    """The run ended without a result: the policy said raise (``attempt``: the last one), or
    a step raised (``attempt`` None)."""

    label: ClassVar[str] = "failed"
    attempt: Optional["Attempt"] = None


#: Which states may follow each (``failed`` also follows any state a step raised in).
NEXT: dict[type[RunState], tuple[type[RunState], ...]] = {
    Placing: (Running, Failed, Restarting, Resizing),
    Running: (Finished, Failed, Restarting, Resizing),
    Restarting: (Placing, Failed),
    Resizing: (Placing, Failed),
}


def diagram() -> str:
    """:data:`NEXT` in words, a line a state: the diagram the docs show."""
    return "\n".join(f"{state.label} -> {' | '.join(n.label for n in nexts)}"
                     for state, nexts in NEXT.items())
