"""How an attempt's ranks ended, decided in this one place: from facts to a verdict.

A launcher only says what it saw of each rank (:class:`~sparkhvd.driver.launchers.seam.RankFact`:
an exit status, a process or connection gone, a task gone silent), and the ranks themselves
report the exceptions they raised (:class:`~sparkhvd.common.errors.RankFailure`, collected by
:class:`~sparkhvd.driver.inbox.AttemptInbox`). :func:`judge` reads one poll's facts and says
whether the attempt goes on, waits a moment longer, or ended -- and then the :class:`Verdict`:
the rank to name first (the cause, not its consequences), every failure, the message, whether
the ranks were preempted, and whether a retry can help. The graces it waits are the retry
policy's (:class:`Graces`). Nothing else in sparkhvd reads an exit code.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

from sparkhvd.common.errors import RankFailure, TrainingError
from sparkhvd.driver.facts import GroupStatus, RankFact

__side__ = "driver"

#: Errors that are the cause of a run's failure wherever they were raised: a rank that raised
#: one is named first even when a peer's consequence ("Horovod has been shut down") came first.
CAUSES = frozenset({"CheckpointError"})

#: What a collective says when a *peer* went away under it (gloo, NCCL, horovod, TF's gRPC
#: collectives -- "Collective ops is aborted by: failed to connect to all addresses" when the
#: peer's server is gone): a rank whose error reads like this is not named first while another
#: rank raised an error of its own or was killed.
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Horovod has been shut down"
    r"|remote process exited or there was a network error|NCCL communicator was aborted"
    r"|ProcessGroupGloo.*(?:Timed out|closed)|Collective ops is aborted by"
    r"|failed to connect to all addresses", re.IGNORECASE)

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

    def listing(self, reported: Sequence[RankFailure]) -> "Verdict":
        """The same verdict (the same rank first), listing every failure in ``reported`` --
        what the other ranks said while they were stopped."""
        others = tuple(f for f in reported if f is not self.first and f not in self.failures)
        return dataclasses.replace(self, failures=(*self.failures, *others)) if others else self

    @property
    def summary(self) -> str:
        """The error's first line (what ``run.json`` and MLflow keep)."""
        return str(self.error()).split("\n", 1)[0]


@dataclass(frozen=True)
class Graces:
    """How long :func:`judge` waits before it decides (a retry policy's setting:
    :attr:`sparkhvd.driver.retry.RetryPolicy.graces`)."""

    #: after a rank stopped on a notice, how long the others get to stop the same way (they
    #: finish the same step and checkpoint) before the attempt ends without them
    notice_s: float = 60.0
    #: a rank that raised but has not exited this long after is ended anyway (multiprocessing's
    #: exit handler waiting on a child, a hung collective)
    raised_s: float = 5.0
    #: a rank whose error only says a peer went away (:data:`PEER_LOST`) names no cause: the
    #: cause -- a lost rank, a peer's own error -- gets this long to show before it is named
    cause_s: float = 5.0


@dataclass(frozen=True)
class Judgement:
    """What one poll's facts say: ``running`` (nothing ended the attempt), ``waiting`` (a
    failure was seen, but its cause or the others' notices may still come: do not end yet),
    ``failed`` (:attr:`verdict`), ``error`` (:attr:`error`, which is no rank's) or ``done``
    (every rank returned)."""

    kind: Literal["running", "waiting", "failed", "error", "done"]
    verdict: Optional["Verdict"] = None
    error: Optional[Exception] = None
    #: the fact the verdict names first (``failed``)
    fact: Optional[RankFact] = None


RUNNING = Judgement("running")


def judge(status: GroupStatus, raised: Mapping[int, float], reported: Sequence[RankFailure],
          hosts: Mapping[int, str], tail: Callable[[int], str], *, now: float,
          error_since: Optional[float], recovers: bool = False, graces: Graces = Graces(),
          stopping: bool = False) -> Judgement:
    """The attempt's state from one poll: ``status`` (the launcher's facts), ``raised`` (rank
    -> when it reported an exception), ``reported`` (those exceptions, oldest first),
    ``hosts`` (rank -> host), ``tail`` (the last lines rank N printed), ``now`` and
    ``error_since`` (when :attr:`status.error <GroupStatus.error>` was first seen) on
    ``time.monotonic()``; ``recovers``: a rank that raised may go on (horovod elastic);
    ``stopping``: the driver is stopping the ranks (a stall, the time up): decide now, wait for
    nothing.

    The rules, in order: ranks that all stopped on a notice are preempted once the others
    stopped too (or :attr:`Graces.notice_s` passed); a rank that raised an error of its own
    and ended is named; where no rank raised an error of its own, a rank *gone* without a word
    (its host silent first, then vanished or ended by a signal) is the cause; otherwise the
    first rank to fail -- and where every error only says a peer
    went away, the cause gets :attr:`Graces.cause_s` (or the launcher's
    ``silent_after_s``: a heartbeat timeout for a host gone silent) to show; an error that
    is no rank's is given ``explained_within_s`` for a rank's fact to explain it. A rank's
    exception is read in :func:`verdict_of`."""
    exited = {fact.rank for fact in status.facts if fact.kind != "silent"}
    facts = [fact for fact in status.facts if fact.failed]
    if not recovers:  # a rank that raised and never exited ends the attempt after a grace
        facts += [RankFact(rank, "raised", at, host=hosts.get(rank),
                           detail=f"rank {rank} raised an exception and did not exit within "
                           f"{graces.raised_s:g} s")
                  for rank, at in raised.items()
                  if rank not in exited and (stopping or now - at > graces.raised_s)]
    if not facts:
        if status.error is not None:
            since = now if error_since is None else error_since
            if not stopping and now - since < status.explained_within_s:
                return Judgement("waiting")
            return Judgement("error", error=status.error)
        return Judgement("done") if status.done else RUNNING
    if all(fact.noticed for fact in facts):
        first = min(facts, key=lambda f: f.at)
        if status.running and not stopping and now - first.at < graces.notice_s:
            return Judgement("waiting")  # the others are finishing the same step
        return Judgement("failed", verdict=_preempted(first, hosts), fact=first)
    facts = [fact for fact in facts if not fact.noticed]
    gone = [fact for fact in facts if is_gone(fact)]
    own = {f.rank for f in reported if not peer_lost(f)}  # ranks that raised their own error
    theirs = [fact for fact in facts if fact.rank in own]
    if theirs:  # a rank's own error explains the rest (a sibling its task stopped after it)
        first = min(theirs, key=lambda f: f.at)
    elif gone and all(peer_lost(failure) for failure in reported):
        # a host lost (silent) first: the tasks Spark killed for it vanish as consequences
        first = min(gone, key=lambda f: (f.kind != "silent", f.at))
    else:
        first = min(facts, key=lambda f: f.at)
        said = next((f for f in reported if f.rank == first.rank), None)
        wait_s = max(graces.cause_s, status.silent_after_s)
        if not gone and said is not None and peer_lost(said) and status.running and \
                not stopping and now - first.at < wait_s:
            return Judgement("waiting")  # the peer it saw go may be about to show
    return Judgement("failed", verdict=verdict_of(first, reported, hosts, tail), fact=first)


def is_gone(fact: RankFact) -> bool:
    """Whether a rank ended without a word of its own: vanished, silent, or ended by a signal
    (from outside, or a crash of its own) -- a cause, never the consequence of a peer."""
    return fact.kind in ("vanished", "silent") or signal_of(fact.exit_code) is not None


def _preempted(first: RankFact, hosts: Mapping[int, str]) -> "Verdict":
    host = first.host or (hosts.get(first.rank) if first.rank is not None else None)
    rank = first.rank if first.rank is not None else -1
    where = f"rank {rank}" + (f" on host {host}" if host else "")
    failure = RankFailure(rank=rank, exc_type=None, exit_code=first.exit_code, host=host,
                          message=f"{where} stopped on a notice after its checkpoint",
                          traceback="")
    return Verdict(failure, (failure,), f"{where} stopped on a notice after its checkpoint",
                   preempted=True)


def verdict_of(failure: RankFact, reported: Sequence[RankFailure],
               hosts: Mapping[int, str], tail: Callable[[int], str]) -> Verdict:
    """The verdict on the rank :func:`judge` names first.

    An error in :data:`CAUSES` is named first wherever it was raised; else the rank's own
    exception, where it raised one of its own; else -- unless the rank was taken from outside
    (vanished, its host silent, killed by a signal that ends a process from outside: then the
    others' errors are its consequences) -- the first exception any rank raised of its own (a
    crash under a broken collective, a rank whose collective only saw a peer go away
    (:data:`PEER_LOST`) yield to it; with several ranks per task, which of a task's ranks is
    seen exiting first is a race); else what the rank's end says, with its last lines.

    ``reported``: the ranks' exceptions, oldest first; ``hosts``: rank -> host; ``tail``: the
    last lines rank N printed (the message of a rank that died without raising).
    """
    host = failure.host or (hosts.get(failure.rank) if failure.rank is not None else None)
    own = next((f for f in reported if f.rank == failure.rank), None) \
        if failure.rank is not None else None
    cause = next((f for f in reported if f.exc_type in CAUSES), None)
    if cause is None and own is not None and not peer_lost(own):
        cause = own
    if cause is None and not taken_from_outside(failure):
        cause = next((f for f in reported if not peer_lost(f)), None)
    if own is not None:
        own.exit_code = failure.exit_code
        own.host = own.host or host
    if cause is not None:  # whichever rank exited first, this explains the others
        cause.host = cause.host or hosts.get(cause.rank)
        first = cause
    elif own is not None:
        first = own
    else:
        rank = failure.rank if failure.rank is not None else -1
        first = RankFailure(rank=rank, exc_type=None, exit_code=failure.exit_code, host=host,
                            message=_how(failure),
                            traceback=tail(failure.rank) if failure.rank is not None else "")
    others = tuple(f for f in reported if f is not first)
    return Verdict(first, (first, *others), retry_reason(failure, host))


def taken_from_outside(fact: RankFact) -> bool:
    """Whether a rank was taken from outside: vanished, its host silent, or killed by a signal
    that ends a process from outside (not a crash of its own)."""
    return fact.kind in ("vanished", "silent") or signal_of(fact.exit_code) in EXTERNAL_SIGNALS


def peer_lost(failure: RankFailure) -> bool:
    """Whether a rank's error only says that a peer went away under its collective."""
    return bool(PEER_LOST.search(failure.message or ""))


def retry_reason(failure: RankFact, host: Optional[str] = None) -> Optional[str]:
    """Why a failed attempt may be retried, or None.

    Retried: a rank, executor or host was *lost* -- its process vanished, its Spark task stopped
    answering, or it was killed from outside (SIGKILL, SIGTERM). Not retried: anything the
    training function raised, a crash of its own (SIGSEGV), a timeout, an interrupt.
    """
    host = failure.host or host
    where = f"rank {failure.rank}" + (f" on host {host}" if host else "")
    if failure.kind == "silent":
        return f"the Spark task of {where} stopped answering (host lost)"
    if failure.kind == "vanished":
        return f"{where} vanished (its executor or host was lost)"
    signum = signal_of(failure.exit_code)
    if signum in EXTERNAL_SIGNALS:
        return f"the process of {where} was killed by signal {signum}"
    return None


def _how(failure: RankFact) -> str:
    """What happened to a rank that raised nothing."""
    code = failure.exit_code
    if failure.kind == "silent":
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
