"""What a run's ranks report -- and the one place that decides what went wrong.

:class:`RunOutcome` is the sink every launcher delivers :mod:`sparkhvd.common.protocol` messages to.
Output lines go on to the :class:`~sparkhvd.driver.logs.RankLogRouter` (console and rank logs); every
other message is kept here: which process each rank is and where it ran, the exceptions ranks
raised, rank 0's per-epoch metrics, what a resume restored, exit statuses.

When a launcher reports a failure (:class:`~sparkhvd.common.errors.LaunchFailure`),
:meth:`RunOutcome.training_error` turns it and the reports into the user's
:class:`~sparkhvd.common.errors.TrainingError`; :func:`load_result` turns a rank's pickled return value
into the driver's object, or a clear error.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

from sparkhvd.common import protocol
from sparkhvd.common.errors import LaunchFailure, PayloadError, RankFailure, TrainingError
from sparkhvd.driver.launchers.base import ERROR_EXIT_GRACE_S
from sparkhvd.driver.logs import RankLogRouter


class RunOutcome:
    """Collects every non-line message of one run (see the module docstring)."""

    def __init__(self, router: RankLogRouter) -> None:
        self.router = router
        self.failures: dict[int, RankFailure] = {}
        self.metrics: list[dict] = []
        self.pids: dict[int, int] = {}  # rank -> pid, as each rank last announced
        self.all_pids: set[int] = set()  # every rank process (elastic ranks renumber)
        self.pid_hosts: dict[int, str] = {}  # pid -> host
        self.hosts: dict[int, str] = {}  # rank -> host
        self.exits: dict[int, Optional[int]] = {}
        self.resumed: Optional[protocol.Resumed] = None
        #: called with each of rank 0's epoch records as it arrives (e.g. MLflow)
        self.listeners: list = []
        #: how the ranks' reports came (barrier launcher): "live" over the control channel, or
        #: "rows" in the Spark job's result rows when the executors could not reach the driver
        self.channel: Optional[str] = None
        #: when a rank last showed progress (any output line or report but stacks)
        self.last_progress = time.monotonic()
        #: rank -> (when it arrived, its latest Stacks)
        self.stacks: dict[int, tuple[float, protocol.Stacks]] = {}
        #: the run's :class:`~sparkhvd.driver.stacks.RunMonitor` (stalls, stack requests)
        self.monitor: Any = None
        self._error_seen: dict[int, float] = {}
        self._lock = threading.Lock()

    def receive(self, msg: Any) -> None:
        """Take one message from a launcher (any thread)."""
        if isinstance(msg, protocol.Stacks):
            with self._lock:
                self.stacks[msg.rank] = (time.monotonic(), msg)
            return
        self.last_progress = time.monotonic()
        if isinstance(msg, protocol.Line):
            self.router.line(msg)
            return
        listeners: list = []
        with self._lock:
            if isinstance(msg, protocol.Started):
                self.pids[msg.rank] = msg.pid
                self.all_pids.add(msg.pid)
                self.pid_hosts[msg.pid] = msg.host
                self.hosts[msg.rank] = msg.host
                self.router.open(msg.rank)  # every rank gets its log file, even a silent one
            elif isinstance(msg, protocol.Error):
                self._error_seen.setdefault(msg.rank, time.monotonic())
                self.failures.setdefault(msg.rank, RankFailure(
                    rank=msg.rank, exc_type=msg.exc_type, message=msg.message,
                    traceback=msg.traceback, time=msg.time,
                    host=self.hosts.get(msg.rank)))
            elif isinstance(msg, protocol.Metrics):
                if msg.rank == 0:
                    self.metrics.append(dict(msg.record))
                    listeners = list(self.listeners)
            elif isinstance(msg, protocol.Resumed):
                self.resumed = msg
            elif isinstance(msg, protocol.Exit):
                self.exits[msg.rank] = msg.code
        for listener in listeners:  # outside the lock: a listener may be slow (a server)
            listener(msg.record)

    def stale_error(self, grace_s: float = ERROR_EXIT_GRACE_S) -> Optional[LaunchFailure]:
        """A rank that raised but has not exited ``grace_s`` later (it must not hold the run)."""
        now = time.monotonic()
        with self._lock:
            for rank, seen in sorted(self._error_seen.items(), key=lambda kv: kv[1]):
                if rank not in self.exits and now - seen > grace_s:
                    return LaunchFailure(rank, None, f"rank {rank} raised an exception and did "
                                         f"not exit within {grace_s:g} s",
                                         host=self.hosts.get(rank))
        return None

    def stacks_after(self, since: float) -> dict[int, protocol.Stacks]:
        """The stacks that arrived after ``since`` (monotonic time), per rank."""
        with self._lock:
            return {rank: msg for rank, (at, msg) in self.stacks.items() if at >= since}

    def stacks_since(self, since: float, ranks: list[int]) -> bool:
        """Whether every one of ``ranks`` sent its stacks after ``since``."""
        got = self.stacks_after(since)
        return all(rank in got for rank in ranks)

    def pid_record(self) -> dict:
        """For ``run.json``: ``rank_pids`` (rank -> pid), all ``pids``, ``hosts`` (rank -> host)."""
        with self._lock:
            return {"rank_pids": dict(self.pids), "pids": sorted(self.all_pids),
                    "hosts": dict(self.hosts)}

    def training_error(self, failure: LaunchFailure, run_dir: Optional[str]) -> TrainingError:
        """The error the user gets for a failed launch.

        A rank's own exception is the best explanation -- unless the launcher saw a rank or its
        host *disappear*: then the others' errors are consequences (a peer vanished under their
        collectives), and the vanished rank is named first.
        """
        with self._lock:
            reported = sorted(self.failures.values(), key=lambda f: f.time)
        host = failure.host or (self.hosts.get(failure.rank) if failure.rank is not None else None)
        own = next((f for f in reported if f.rank == failure.rank), None)
        cause = next((f for f in reported if f.exc_type in CAUSES), None)
        if cause is not None:  # whichever rank exited first, this explains the others
            cause.host = cause.host or self.hosts.get(cause.rank)
            first = cause
        elif own is not None:
            own.exit_code = failure.exit_code
            own.host = own.host or host
            first = own
        elif reported and not (failure.vanished or failure.lost or killed(failure)):
            first = reported[0]
        else:
            first = RankFailure(rank=failure.rank if failure.rank is not None else -1,
                                exc_type=None, exit_code=failure.exit_code, host=host,
                                message=_how(failure),
                                traceback=self.router.tail(failure.rank)
                                if failure.rank is not None else "")
        others = [f for f in reported if f is not first]
        return TrainingError(first, [first, *others], run_dir=run_dir)


#: Errors that are the cause of a run's failure wherever they were raised: a rank that raised
#: one is named first even when a peer's consequence ("Horovod has been shut down") came first.
CAUSES = frozenset({"CheckpointError"})


def killed(failure: LaunchFailure) -> bool:
    """Whether the failed rank's process was killed by a signal (SIGKILL from the OOM killer, a
    lost container, an operator) -- then the other ranks' errors are consequences."""
    code = failure.exit_code
    return code is not None and (code < 0 or code > 128)


#: Signals that end a process from outside; a rank dying of another one (SIGSEGV, SIGABRT)
#: crashed by itself, which a retry would only repeat.
_EXTERNAL_SIGNALS = {9, 15, 1, 2}


def retry_reason(error: Any) -> Optional[str]:
    """Why a failed attempt may be retried (``max_retries``), or None.

    Retried: a rank, executor or host was *lost* -- its process vanished, its Spark task stopped
    answering, or it was killed from outside (SIGKILL, SIGTERM). Not retried: anything the
    training function raised, a crash of its own (SIGSEGV), a timeout, an interrupt.
    """
    if not isinstance(error, LaunchFailure):
        return None
    where = f"rank {error.rank}" + (f" on host {error.host}" if error.host else "")
    if error.lost:
        return f"the Spark task of {where} stopped answering (host lost)"
    if error.vanished:
        return f"{where} vanished (its executor or host was lost)"
    code = error.exit_code
    signum = -code if code is not None and code < 0 else \
        (code - 128 if code is not None and code > 128 else None)
    if signum in _EXTERNAL_SIGNALS:
        return f"the process of {where} was killed by signal {signum}"
    return None


def attempt_record(attempt: int, status: str, error: Any, resume: Optional[str],
                   retry: Optional[str], outcome: Optional["RunOutcome"] = None) -> dict:
    """One entry of ``run.json``'s ``attempts``: how it ended, what it resumed from and what it
    restored, and its ranks' PIDs and hosts."""
    import datetime as _dt

    entry: dict[str, Any] = {"attempt": attempt, "status": status, "resumed_from": resume,
                             "ended_at": _dt.datetime.now().isoformat(timespec="seconds")}
    if outcome is not None:
        pids = outcome.pid_record()
        entry["rank_pids"], entry["hosts"] = pids["rank_pids"], pids["hosts"]
        if outcome.resumed is not None:
            entry["restored"] = outcome.resumed.source
            if outcome.resumed.skipped:
                entry["skipped"] = list(outcome.resumed.skipped)
    if error is not None:
        entry["error"] = str(error).split("\n", 1)[0]
        entry["retryable"] = retry
    return entry


def merge_epochs(earlier: list[dict], later: list[dict]) -> list[dict]:
    """Rank 0's per-epoch records over attempts: a retried epoch's newer record wins."""
    by_epoch: dict[Any, dict] = {}
    for record in [*earlier, *later]:
        by_epoch[record.get("epoch", len(by_epoch))] = record
    return [by_epoch[k] for k in sorted(by_epoch, key=lambda e: (not isinstance(e, int), e))]


def _how(failure: LaunchFailure) -> str:
    code = failure.exit_code
    if failure.lost:
        return failure.detail
    if code is None:
        return ("the rank process vanished without an exit status (its executor or host was "
                "lost, or the connection to it broke)")
    if code < 0:
        how = f"was killed by signal {-code}"
    elif code > 128:  # a shell's way of reporting a signal
        how = f"was killed by signal {code - 128} (exit status {code})"
    else:
        how = f"exited with status {code}"
    return f"the rank process {how} without raising a Python exception"


def load_result(rank: int, blob: bytes) -> Any:
    """A rank's pickled return value as the driver's object, or a PayloadError with the fix."""
    import cloudpickle

    try:
        return cloudpickle.loads(blob)
    except (ImportError, AttributeError) as exc:
        module = getattr(exc, "name", None)
        where = f"module {module!r}" if module else "a module or class"
        raise PayloadError(
            f"rank {rank} returned an object the driver cannot load: it needs {where}, which "
            f"the ranks have and this driver ({socket.gethostname()}) does not "
            f"({type(exc).__name__}: {exc}). Fix: install {module or 'that module'} on the "
            "driver too, or return plain data (numbers, strings, lists, dicts, numpy arrays) "
            "or bytes.") from None
