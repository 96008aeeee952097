"""Exceptions raised by sparkhvd.

Every error names the problem and the fix; none of them carries a secret.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class SparkhvdError(Exception):
    """Base class of every error sparkhvd raises on purpose."""


@dataclass
class RankFailure:
    """What one rank reported (or what the launcher saw) when it failed."""

    rank: int
    exc_type: Optional[str]
    message: str
    traceback: str = ""
    exit_code: Optional[int] = None
    time: float = 0.0


class TrainingError(SparkhvdError, RuntimeError):
    """The training function failed on at least one rank.

    Attributes:
        rank: the first rank that failed.
        exc_type: the remote exception's type name (``None`` when the process died
            without raising, e.g. ``os._exit`` or a signal).
        remote_message: the remote exception's message.
        remote_traceback: the traceback printed on that rank.
        exit_code: the rank process' exit status, when known.
        failures: every rank failure that was reported, first one first.
    """

    def __init__(self, failure: RankFailure, failures: Optional[list[RankFailure]] = None,
                 run_dir: Optional[str] = None):
        self.rank = failure.rank
        self.exc_type = failure.exc_type
        self.remote_message = failure.message
        self.remote_traceback = failure.traceback
        self.exit_code = failure.exit_code
        self.failures = failures or [failure]
        self.run_dir = run_dir
        super().__init__(self._compose())

    def _compose(self) -> str:
        if self.exc_type:
            head = f"Training failed on rank {self.rank}: {self.exc_type}: {self.remote_message}"
        else:
            head = f"Training failed on rank {self.rank}: {self.remote_message}"
        parts = [head]
        others = sorted({f.rank for f in self.failures} - {self.rank})
        if others:
            parts.append(f"(ranks {', '.join(map(str, others))} failed after it)")
        if self.remote_traceback:
            parts.append(f"\nRemote traceback (rank {self.rank}):\n{self.remote_traceback.rstrip()}")
        if self.run_dir:
            parts.append(f"\nRank logs: {self.run_dir}/logs/")
        return "\n".join(parts)


class NotEnoughSlotsError(SparkhvdError, RuntimeError):
    """The cluster has fewer Spark task slots than the requested number of ranks."""


class PayloadError(SparkhvdError, TypeError):
    """The training function or one of its arguments cannot be sent to the ranks."""


class EnvironmentMismatchError(SparkhvdError, RuntimeError):
    """The installed stack cannot run Horovod training (e.g. Keras 3, horovod without Gloo)."""
