"""What one attempt's ranks report, kept for the verdict, the monitor and the record.

:class:`AttemptInbox` is the sink every launcher delivers :mod:`sparkhvd.common.protocol`
messages to. Output lines go on to the :class:`~sparkhvd.driver.logs.RankLogRouter` (console
and rank logs); every other message is kept here: which process each rank is and where it
ran, the exceptions ranks raised, rank 0's per-epoch metrics, what a resume restored, exit
statuses.

When a launcher reports a failure (:class:`~sparkhvd.common.errors.LaunchFailure`),
:func:`sparkhvd.driver.rank_end.verdict_of` turns it and these reports into the verdict.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from sparkhvd.common import protocol
from sparkhvd.common.errors import LaunchFailure, RankFailure
from sparkhvd.driver.logs import RankLogRouter

__side__ = "driver"

#: A rank that reported an exception but has not exited after this long is stopped anyway
#: (e.g. multiprocessing's exit handler waiting on a child, or a hung collective).
ERROR_EXIT_GRACE_S = 5.0


class AttemptInbox:
    """Collects every non-line message of one attempt (see the module docstring)."""

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
        #: ``<run folder>/<name>`` folders the ranks asked for (``sparkhvd.torch.output_dir``)
        self.output_dirs: set[str] = set()
        #: ranks whose checkpoint helper listens for notices
        self.listening: set[int] = set()
        #: rank -> how it stopped on a notice (its checkpoint)
        self.preempted: dict[int, protocol.Preempted] = {}
        #: called with each of rank 0's epoch records as it arrives (e.g. MLflow)
        self.listeners: list = []
        #: how the ranks' reports came (barrier launcher, :meth:`reported_by`): "live" over the
        #: control channel, or "rows" in the Spark job's result rows when the executors could
        #: not reach the driver
        self.channel: Optional[str] = None
        #: when a rank last showed progress (any output line or report but stacks)
        self.last_progress = time.monotonic()
        #: rank -> (when it arrived, its latest Stacks)
        self.stacks: dict[int, tuple[float, protocol.Stacks]] = {}
        #: takes each rank's :class:`~sparkhvd.common.protocol.TimeSplit` (None: not sampled)
        self.time_splits: Optional[Callable[[protocol.TimeSplit], None]] = None
        self._error_seen: dict[int, float] = {}
        self._lock = threading.Lock()

    def receive(self, msg: Any) -> None:
        """Take one message from a launcher (any thread)."""
        if isinstance(msg, protocol.Stacks):
            with self._lock:
                self.stacks[msg.rank] = (time.monotonic(), msg)
            return
        if isinstance(msg, protocol.TimeSplit):  # sampled on a timer: never progress
            if self.time_splits is not None:
                self.time_splits(msg)
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
            elif isinstance(msg, protocol.OutputDir):
                self.output_dirs.add(msg.name)
            elif isinstance(msg, protocol.Listening):
                self.listening.add(msg.rank)
            elif isinstance(msg, protocol.Preempted):
                self.preempted[msg.rank] = msg
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

    def reported_by(self, channel: str) -> None:
        """How the launcher got the ranks' reports (``"live"`` or ``"rows"``)."""
        self.channel = channel

    def reported(self) -> list[RankFailure]:
        """The exceptions ranks raised, oldest first."""
        with self._lock:
            return sorted(self.failures.values(), key=lambda f: f.time)


def merge_epochs(earlier: list[dict], later: list[dict]) -> list[dict]:
    """Rank 0's per-epoch records over attempts: a retried epoch's newer record wins."""
    by_epoch: dict[Any, dict] = {}
    for record in [*earlier, *later]:
        by_epoch[record.get("epoch", len(by_epoch))] = record
    return [by_epoch[k] for k in sorted(by_epoch, key=lambda e: (not isinstance(e, int), e))]
