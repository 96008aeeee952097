"""A rank's end, decoded once: which rank failed first, why, and whether a retry can help.

A launcher reports how a rank ended as a :class:`~sparkhvd.common.errors.LaunchFailure` (rank,
host, exit code -- or vanished, or its host lost); the ranks themselves report the exceptions
they raised (:class:`~sparkhvd.common.errors.RankFailure`, collected by
:class:`~sparkhvd.driver.inbox.AttemptInbox`). :func:`verdict_of` turns both into one
:class:`Verdict`: the rank to name first, every failure, the message, and whether the attempt
may be retried. Nothing else in sparkhvd reads an exit code.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from sparkhvd.common.errors import LaunchFailure, RankFailure, TrainingError

__side__ = "driver"

#: Errors that are the cause of a run's failure wherever they were raised: a rank that raised
#: one is named first even when a peer's consequence ("Horovod has been shut down") came first.
CAUSES = frozenset({"CheckpointError"})

#: What a collective says when a *peer* went away under it (gloo, NCCL, horovod): a rank whose
#: error reads like this is not named first while another rank raised an error of its own.
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Horovod has been shut down"
    r"|remote process exited or there was a network error|NCCL communicator was aborted"
    r"|ProcessGroupGloo.*(?:Timed out|closed)", re.IGNORECASE)

#: Signals that end a process from outside (SIGHUP, SIGINT, SIGKILL, SIGTERM); a rank dying of
#: another one (SIGSEGV, SIGABRT) crashed by itself, which a retry would only repeat.
EXTERNAL_SIGNALS = frozenset({1, 2, 9, 15})


def signal_of(exit_code: Optional[int]) -> Optional[int]:
    """The signal that ended a process: ``-N`` (Python's ``returncode``) or ``128 + N`` (a
    shell's exit status), else None."""
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    return exit_code - 128 if exit_code > 128 else None


@dataclass(frozen=True)
class Verdict:
    """How an attempt's ranks ended, decided once (see :func:`verdict_of`)."""

    #: The failure to name first: the cause, not its consequences.
    first: RankFailure
    #: Every failure reported, ``first`` first.
    failures: tuple[RankFailure, ...]
    #: Why a retry may help (the rank, executor or host was lost, or the ranks stopped on a
    #: notice), or None: retrying would repeat the same error.
    retryable: Optional[str]
    #: The ranks stopped on a notice after their checkpoint (a preemption, not a loss: it has
    #: its own budget, :class:`~sparkhvd.driver.retry.RetryPolicy`).
    preempted: bool = False

    def error(self, run_folder: Optional[str] = None) -> TrainingError:
        """The user's error, naming the run folder's logs when it is known."""
        return TrainingError(self.first, list(self.failures), run_dir=run_folder)

    @property
    def summary(self) -> str:
        """The error's first line (what ``run.json`` and MLflow keep)."""
        return str(self.error()).split("\n", 1)[0]


def verdict_of(failure: LaunchFailure, reported: Sequence[RankFailure],
             hosts: Mapping[int, str], tail: Callable[[int], str]) -> Verdict:
    """The verdict on a failed launch.

    A rank's own exception is the best explanation -- unless the launcher saw a rank or its host
    *disappear* (vanished, lost, killed by a signal): then the others' errors are consequences
    (a peer vanished under their collectives), and the vanished rank is named first. An error
    in :data:`CAUSES` is named first wherever it was raised, and a rank whose collective only
    saw a peer go away (:data:`PEER_LOST`) yields to a rank that raised an error of its own --
    with several ranks per task, which of a task's ranks is seen exiting first is a race.

    ``reported``: the ranks' exceptions, oldest first; ``hosts``: rank -> host; ``tail``: the
    last lines rank N printed (the message of a rank that died without raising).
    """
    host = failure.host or (hosts.get(failure.rank) if failure.rank is not None else None)
    if failure.preempted:
        rank = failure.rank if failure.rank is not None else -1
        first = RankFailure(rank=rank, exc_type=None, exit_code=failure.exit_code, host=host,
                            message=failure.detail, traceback="")
        where = f"rank {rank}" + (f" on host {host}" if host else "")
        return Verdict(first, (first,), f"{where} stopped on a notice after its checkpoint",
                       preempted=True)
    own = next((f for f in reported if f.rank == failure.rank), None)
    cause = next((f for f in reported if f.exc_type in CAUSES), None)
    gone = failure.vanished or failure.lost or signal_of(failure.exit_code) is not None
    if cause is None and (own is not None or not gone) and (own is None or peer_lost(own)):
        cause = next((f for f in reported if not peer_lost(f)), None)
    if cause is not None:  # whichever rank exited first, this explains the others
        cause.host = cause.host or hosts.get(cause.rank)
        first = cause
    elif own is not None:
        own.exit_code = failure.exit_code
        own.host = own.host or host
        first = own
    elif reported and not gone:
        first = reported[0]
    else:
        rank = failure.rank if failure.rank is not None else -1
        first = RankFailure(rank=rank, exc_type=None, exit_code=failure.exit_code, host=host,
                            message=_how(failure),
                            traceback=tail(failure.rank) if failure.rank is not None else "")
    others = tuple(f for f in reported if f is not first)
    return Verdict(first, (first, *others), retry_reason(failure, host))


def peer_lost(failure: RankFailure) -> bool:
    """Whether a rank's error only says that a peer went away under its collective."""
    return bool(PEER_LOST.search(failure.message or ""))


def retry_reason(failure: LaunchFailure, host: Optional[str] = None) -> Optional[str]:
    """Why a failed attempt may be retried, or None.

    Retried: a rank, executor or host was *lost* -- its process vanished, its Spark task stopped
    answering, or it was killed from outside (SIGKILL, SIGTERM). Not retried: anything the
    training function raised, a crash of its own (SIGSEGV), a timeout, an interrupt.
    """
    host = failure.host or host
    where = f"rank {failure.rank}" + (f" on host {host}" if host else "")
    if failure.lost:
        return f"the Spark task of {where} stopped answering (host lost)"
    if failure.vanished:
        return f"{where} vanished (its executor or host was lost)"
    signum = signal_of(failure.exit_code)
    if signum in EXTERNAL_SIGNALS:
        return f"the process of {where} was killed by signal {signum}"
    return None


def _how(failure: LaunchFailure) -> str:
    """What happened to a rank that raised nothing."""
    code = failure.exit_code
    if failure.lost:
        return failure.detail
    if code is None:
        return ("the rank process vanished without an exit status (its executor or host was "
                "lost, or the connection to it broke)")
    signum = signal_of(code)
    if signum is None:
        how = f"exited with status {code}"
    elif code > 128:
        how = f"was killed by signal {signum} (exit status {code})"
    else:
        how = f"was killed by signal {signum}"
    return f"the rank process {how} without raising a Python exception"
