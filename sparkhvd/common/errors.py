"""Every exception sparkhvd raises on purpose, in one place.

Every error names the problem and the fix; none of them carries a secret (messages that may
quote a rank's output or a storage failure go through :func:`sparkhvd.common.redaction.redact`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from sparkhvd.common.redaction import redact

__side__ = "common"


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
    host: Optional[str] = None


class TrainingError(SparkhvdError, RuntimeError):
    """The training function failed on at least one rank.

    Attributes:
        rank: the first rank that failed.
        exc_type: the remote exception's type name (``None`` when the process died
            without raising, e.g. ``os._exit`` or a signal).
        remote_message: the remote exception's message.
        remote_traceback: the traceback printed on that rank.
        exit_code: the rank process' exit status, when known.
        host: the host the rank ran on, when known.
        failures: every rank failure that was reported, first one first.
    """

    def __init__(self, failure: RankFailure, failures: Optional[list[RankFailure]] = None,
                 run_dir: Optional[str] = None):
        # The one place a rank's message and traceback are redacted for the user.
        given = list(failures or [failure])
        if not any(f is failure for f in given):
            given.insert(0, failure)
        self.failures = [dataclasses.replace(f, message=redact(f.message),
                                             traceback=redact(f.traceback)) for f in given]
        first = self.failures[next(i for i, f in enumerate(given) if f is failure)]
        self.rank = first.rank
        self.exc_type = first.exc_type
        self.remote_message = first.message
        self.remote_traceback = first.traceback
        self.exit_code = first.exit_code
        self.host = first.host
        self.run_dir = run_dir
        super().__init__(self._compose())

    def _compose(self) -> str:
        # The host is on the first line: it is the line run.json, MLflow and a notebook's
        # error summary keep, and for a lost host it is the whole story.
        where = f"rank {self.rank} (host {self.host})" if self.host else f"rank {self.rank}"
        if self.exc_type:
            head = f"Training failed on {where}: {self.exc_type}: {self.remote_message}"
        else:
            head = f"Training failed on {where}: {self.remote_message}"
        parts = [head]
        others = sorted({f.rank for f in self.failures} - {self.rank})
        if others:
            parts.append(f"(ranks {', '.join(map(str, others))} failed after it)")
        if self.remote_traceback:
            parts.append(f"\nRemote traceback (rank {self.rank}):\n{self.remote_traceback.rstrip()}")
        if self.run_dir:
            parts.append(f"\nRank logs: {self.run_dir}/logs/")
        return "\n".join(parts)


class StallError(SparkhvdError, TimeoutError):
    """No rank made progress for ``stall_timeout`` and ``on_stall="stop"`` was asked; the
    message says where each rank was (their stacks are in ``logs/stacks-*.txt``)."""


class NotEnoughSlotsError(SparkhvdError, RuntimeError):
    """The cluster has fewer Spark task slots than the requested number of ranks."""


class PayloadError(SparkhvdError, TypeError):
    """The training function, one of its arguments, or a rank's return value cannot travel."""


class EnvironmentMismatchError(SparkhvdError, RuntimeError):
    """The installed stack cannot run the chosen backend (e.g. Keras 3 under Horovod)."""


class SessionError(SparkhvdError, RuntimeError):
    """The SparkSession cannot be used (stopped before or during the run)."""


class CheckpointError(SparkhvdError, RuntimeError):
    """No checkpoint to resume from is usable (every one truncated, missing or unreadable): the
    message names the folder, each file and why, and the fix. Raised before training."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file holds objects whose loading could run code (a pickled global no one
    allowed): it was not loaded. Whoever can write a checkpoint folder can plant such a file,
    and its record beside it, so nothing in the file is trusted beyond tensors and plain
    containers -- and the types its user named."""


class DataChanged(SparkhvdError, ValueError):
    """A saved data position cannot be continued with this dataset (another table, another
    partition count, an order that cannot be drawn again): the message says what changed and
    how to start that epoch over. Raised when the position is restored, before training."""


class StorageError(SparkhvdError, OSError):
    """Storage could not be reached or written; the message names the URL and the likely cause.

    Attributes:
        spilled_to: the local path that keeps what could not be written, when there is one.
        result: (publishing a run) rank 0's return value, so that nothing is lost.
    """

    def __init__(self, message: str, *, spilled_to: Optional[str] = None) -> None:
        super().__init__(redact(message))
        self.spilled_to = spilled_to
        self.result: Any = None
