"""Whether a failed attempt is retried: decided here alone.

Like Ray Train's ``FailurePolicy``: the run hands the policy how an attempt ended, and the policy
answers ``"retry"`` or ``"raise"`` (``"done"`` for an attempt that succeeded). Only a *lost*
rank, executor or host is worth another attempt (:attr:`Verdict.retryable
<sparkhvd.driver.rank_end.Verdict.retryable>`): what the training function raised, a crash of
its own, a stall, a timeout or an interrupt would only happen again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from sparkhvd.driver.rank_end import Verdict

__side__ = "driver"

Decision = Literal["done", "retry", "raise"]


@dataclass(frozen=True)
class RetryPolicy:
    """Relaunch a run whose rank, executor or host was lost, at most ``max_retries`` times."""

    max_retries: int = 0

    @property
    def attempts(self) -> int:
        """The most attempts a run makes."""
        return self.max_retries + 1

    def decide(self, attempt: int, failed: bool, verdict: Optional[Verdict]) -> Decision:
        """What follows attempt number ``attempt`` (1-based): ``failed`` says whether it failed,
        ``verdict`` how its ranks ended (None when no rank failed: a stall, say)."""
        if not failed:
            return "done"
        if verdict is None or verdict.retryable is None or attempt >= self.attempts:
            return "raise"
        return "retry"
