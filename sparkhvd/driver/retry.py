"""Whether a failed attempt is relaunched: decided here alone.

Modelled on Ray Train v2's ``FailurePolicy`` (``max_failures`` and ``max_preemption_failures``),
as one frozen class the run is handed (:class:`~sparkhvd.driver.spec.RunSpec`): the run hands
the policy how an attempt ended and what it has spent (:class:`Spent`), and the policy answers
``"retry"`` or ``"raise"`` (``"done"`` for an attempt that succeeded) -- it decides only; the
run counts and relaunches. Two budgets, counted apart:

- ``max_retries``: attempts that *lost* a rank, executor or host (:attr:`Verdict.retryable
  <sparkhvd.driver.rank_end.Verdict.retryable>`) -- default 0, or :data:`ELASTIC_RETRIES` for an
  elastic run, which exists to go on after a loss;
- ``max_preemptions``: attempts whose ranks stopped on a notice after their checkpoint (a node
  reclaimed, an executor decommissioned, a resize) -- default :data:`MAX_PREEMPTIONS`: each
  costs at most a step, and spot clusters see many.

What the training function raised, a crash of its own, a stall, a timeout or an interrupt would
only happen again: never retried.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from sparkhvd.driver.rank_end import Graces, Verdict

__side__ = "driver"

Decision = Literal["done", "retry", "raise"]

#: ``max_retries`` of an elastic run (``min_np``/``max_np``) that does not set it.
ELASTIC_RETRIES = 3
#: ``max_preemptions`` when not set.
MAX_PREEMPTIONS = 10


@dataclass(frozen=True)
class Spent:
    """The relaunches a run has used so far, each budget apart (kept by the run, not the
    policy: the policy only decides)."""

    retries: int = 0
    preemptions: int = 0

    def charged(self, verdict: Verdict) -> "Spent":
        """One more relaunch for ``verdict``'s budget."""
        if verdict.preempted:
            return Spent(self.retries, self.preemptions + 1)
        return Spent(self.retries + 1, self.preemptions)


@dataclass(frozen=True)
class RetryPolicy:
    """Relaunch a run whose rank, executor or host was lost, at most ``max_retries`` times, and
    one whose ranks stopped on a notice, at most ``max_preemptions`` times."""

    max_retries: int = 0
    max_preemptions: int = MAX_PREEMPTIONS
    #: how long the verdict waits for the others' notices, a raised rank's exit and a
    #: consequence's cause before it decides (:func:`sparkhvd.driver.rank_end.judge`)
    graces: Graces = Graces()

    @classmethod
    def of(cls, max_retries: Optional[int], max_preemptions: Optional[int],
           elastic: bool) -> "RetryPolicy":
        """The policy for a run's settings (None: the defaults above)."""
        return cls(ELASTIC_RETRIES if max_retries is None and elastic else max_retries or 0,
                   MAX_PREEMPTIONS if max_preemptions is None else max_preemptions)

    @property
    def restarts(self) -> int:
        """The most relaunches a run makes (torchrun's ``TORCHELASTIC_MAX_RESTARTS``)."""
        return self.max_retries + self.max_preemptions

    def decide(self, failed: bool, verdict: Optional[Verdict], planned: bool = False,
               spent: Spent = Spent()) -> Decision:
        """What follows an attempt: ``failed`` says whether it failed, ``verdict`` how its ranks
        ended (None when no rank failed: a stall, say); ``planned``: the driver itself asked
        the ranks to stop (a grow), which uses no budget; ``spent``: the relaunches used so
        far. A retry costs its budget one (the run charges it: :meth:`Spent.charged`)."""
        if not failed:
            return "done"
        if verdict is None or verdict.retryable is None:
            return "raise"
        if planned:
            return "retry"
        if verdict.preempted:
            return "retry" if spent.preemptions < self.max_preemptions else "raise"
        return "retry" if spent.retries < self.max_retries else "raise"

    def budget(self, verdict: Verdict, spent: Spent) -> str:
        """``retry 2 of max_retries=3`` -- the budget a retry used (``spent`` with it charged),
        for the console."""
        if verdict.preempted:
            return f"preemption {spent.preemptions} of max_preemptions={self.max_preemptions}"
        return f"retry {spent.retries} of max_retries={self.max_retries}"
