"""What one attempt's ranks report, kept for the verdict, the monitor and the record.

:class:`AttemptInbox` is the sink every launcher delivers :mod:`sparkhvd.common.protocol`
messages to. Output lines go on to the :class:`~sparkhvd.driver.logs.RankLogRouter` (console
and rank logs); every other message is kept here: which process each rank is and where it
ran, the exceptions ranks raised, rank 0's per-epoch metrics, what a resume restored, exit
statuses.

What the ranks raised is one half of what :func:`sparkhvd.driver.rank_end.judge` decides from
(:meth:`AttemptInbox.raised`, :meth:`AttemptInbox.reported`); the launcher's facts are the other.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

from sparkhvd.common import protocol
from sparkhvd.common.errors import RankFailure
from sparkhvd.driver.logs import RankLogRouter

__side__ = "driver"


class AttemptInbox:
    """Collects every non-line message of one attempt (see the module docstring)."""

    def __init__(self, router: RankLogRouter, hub: Optional[Any] = None) -> None:
        """``hub``: the run's :class:`~sparkhvd.driver.view.RunHub`, which rank 0's epoch
        records and the time splits go on to."""
        self.router, self.hub = router, hub
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
        #: how the ranks' reports came (barrier launcher, :meth:`reported_by`): "live" over the
        #: control channel, or "rows" in the Spark job's result rows when the executors could
        #: not reach the driver
        self.channel: Optional[str] = None
        #: when a rank last showed progress (any output line or report but stacks)
        self.last_progress = time.monotonic()
        #: rank -> (when it arrived, its latest Stacks)
        self.stacks: dict[int, tuple[float, protocol.Stacks]] = {}
        #: rank -> how its start went (:mod:`sparkhvd.timing.start_times`)
        self.start_times: dict[int, protocol.StartTimes] = {}
        self._error_seen: dict[int, float] = {}
        self._lock = threading.Lock()

    def receive(self, msg: Any) -> None:
        """Take one message from a launcher (any thread)."""
        if isinstance(msg, protocol.Stacks):
            with self._lock:
                self.stacks[msg.rank] = (time.monotonic(), msg)
            return
        if isinstance(msg, protocol.TimeSplit):  # sampled on a timer: never progress
            if self.hub is not None:
                self.hub.time_split(msg)
            return
        self.last_progress = time.monotonic()
        if isinstance(msg, protocol.Line):
            self.router.line(msg)
            return
        record: Optional[dict] = None
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
                    record = dict(msg.record)
                    self.metrics.append(record)
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
            elif isinstance(msg, protocol.StartTimes):
                self.start_times[msg.rank] = msg
        if record is not None and self.hub is not None:  # outside the lock: may be slow
            self.hub.metrics(dict(record))

    def raised(self) -> dict[int, float]:
        """rank -> when it reported an exception (``time.monotonic()``), for the verdict."""
        with self._lock:
            return dict(self._error_seen)

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
