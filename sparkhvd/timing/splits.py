"""The driver's half of the time split: every rank's reports kept, compared, and recorded.

Each :class:`~sparkhvd.common.protocol.TimeSplit` a rank sends becomes one line of
``timing.jsonl`` in the run folder (the format is documented in the guide "Why is my run
slow?")::

    {"attempt": 1, "rank": 0, "host": "h1", "start": 1764140000.0, "end": 1764140005.0,
     "seconds": {"data": 0.2, "compute": 3.1, "collective": 1.6},
     "where": {"data": "train.py:42 __getitem__", "collective": "all_reduce"},
     "system": {"cpu_utilization_percentage": 97.5, "rss_megabytes": 812.0, ...}}

As reports arrive, :func:`sparkhvd.timing.stragglers.find` compares the ranks of the running
attempt; each finding is said once on the console (``[sparkhvd] rank 1 (host h2) is the
straggler: ...``), kept in ``run.json``'s ``time_split.findings`` and tagged in MLflow. When an
attempt ends without a straggler found, its whole time is compared once more (a short attempt
never fills the window). At the end, ``run.json``'s ``time_split`` holds every rank's totals
and where each bucket went.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from typing import Any, Callable, Optional

from sparkhvd.common import protocol
from sparkhvd.timing.buckets import BUCKETS, dominant, share
from sparkhvd.timing.stragglers import (
    END_MIN_SAMPLED_S,
    MIN_SAMPLED_S,
    WINDOW_S,
    Finding,
    RankWindow,
    find,
    gone,
)

__side__ = "driver"

log = logging.getLogger(__name__)

#: The file in the run folder, one JSON object per report.
TIMING_FILE = "timing.jsonl"


def _add(window: RankWindow, msg: protocol.TimeSplit) -> None:
    window.add(msg.seconds, msg.where, msg.waits, msg.unmeasured, msg.steps)


def _window_of(windows: dict[int, RankWindow], msg: protocol.TimeSplit) -> RankWindow:
    """The rank's entry in ``windows`` (made on its first report; its host the latest)."""
    window = windows.setdefault(msg.rank, RankWindow(msg.rank, msg.host, {}, {}))
    window.host = msg.host
    return window


class TimeSplits:
    """Every rank's reports of one run (any attempt), as they arrive (any thread)."""

    def __init__(self, folder: str, *, say: Callable[[str], None],
                 findings: Callable[[list[dict]], None],
                 tracker: Optional[Any] = None) -> None:
        """``say``: a console line; ``findings``: every finding so far, for ``run.json``;
        ``tracker``: the run's MLflow tracker (system metrics and findings), if any."""
        self.path = os.path.join(folder, TIMING_FILE)
        self.say, self.on_findings, self.tracker = say, findings, tracker
        self.attempt, self.size = 0, 0
        self.findings: list[Finding] = []
        self._said: set[tuple] = set()
        #: the stragglers the window shows now (said when they appear and when they go)
        self._stragglers: dict[tuple, Finding] = {}
        #: rank -> its time over the whole run (ranks renumber after a resize)
        self.totals: dict[int, RankWindow] = {}
        #: rank -> its time in the running attempt, and whether a straggler was named in it
        self._attempt_totals: dict[int, RankWindow] = {}
        self._named_in_attempt = False
        self.reports = 0
        self._recent: list[protocol.TimeSplit] = []
        self._lock = threading.Lock()
        self._file: Any = None

    def begin(self, attempt: int, size: int) -> None:
        """A new attempt with ``size`` ranks: the last one judged as a whole if it needs it
        (:meth:`_settle`), then comparisons start over."""
        with self._lock:
            new, every = self._settle()
            self.attempt, self.size, self._recent = attempt, size, []
            self._stragglers = {}
            self._attempt_totals, self._named_in_attempt = {}, False
        self._tell(new, every)

    def _settle(self) -> tuple[list[Finding], list[dict]]:
        """The attempt that ends, compared over its whole time when its window never named a
        straggler (each rank at least ``END_MIN_SAMPLED_S`` sampled): what it shows that was
        not said yet. Under the lock."""
        if self._named_in_attempt or not self._attempt_totals:
            return [], []
        totals = [self._attempt_totals[r] for r in sorted(self._attempt_totals)]
        new = []
        for finding in find(totals, self.size, END_MIN_SAMPLED_S):
            if finding.key in self._said or (finding.kind == "straggler"
                                             and finding.key in self._stragglers):
                continue
            self._said.add(finding.key)
            finding.text += f" (over attempt {self.attempt} as a whole)"
            new.append(finding)
        self.findings += new
        return new, [f.as_dict() for f in self.findings]

    def _tell(self, new: list[Finding], every: list[dict]) -> None:
        """Say each new finding, record them all (outside the lock)."""
        for finding in new:
            self.say(finding.text)
            self.on_findings(every)
            if self.tracker is not None:
                self.tracker.finding(len(every), finding.text)

    def add(self, msg: protocol.TimeSplit) -> None:
        """One rank's report: written, counted, compared."""
        new: list[Finding] = []
        with self._lock:
            self._write(msg)
            self.reports += 1
            _add(_window_of(self.totals, msg), msg)
            _add(_window_of(self._attempt_totals, msg), msg)
            self._recent = [m for m in self._recent if m.end >= msg.end - WINDOW_S] + [msg]
            windows = self._windows()
            found = find(windows, self.size)
            for finding in found:
                if finding.kind == "straggler":
                    self._named_in_attempt = True
                    if finding.key not in self._stragglers:
                        self._stragglers[finding.key] = finding
                        new.append(finding)
                elif finding.key not in self._said:
                    self._said.add(finding.key)
                    new.append(finding)
            if len(windows) >= self.size and all(w.total >= MIN_SAMPLED_S for w in windows):
                now = {f.key for f in found if f.kind == "straggler"}
                for key in [k for k in self._stragglers if k not in now]:
                    new.append(gone(self._stragglers.pop(key), windows))
            self.findings += new
            every = [f.as_dict() for f in self.findings]
        if self.tracker is not None and msg.system:
            self.tracker.system_metrics(msg.rank, msg.system, self.reports)
        self._tell(new, every)

    def _windows(self) -> list[RankWindow]:
        windows: dict[int, RankWindow] = {}
        for m in self._recent:
            _add(_window_of(windows, m), m)
        return [windows[rank] for rank in sorted(windows)]

    def _write(self, msg: protocol.TimeSplit) -> None:
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            line = {"attempt": self.attempt, **dataclasses.asdict(msg)}
            self._file.write(json.dumps(line, default=str) + "\n")
            self._file.flush()
        except OSError as exc:
            log.debug("timing.jsonl: %s", exc)

    def summary(self) -> dict:
        """``run.json``'s ``time_split``: the file, each rank's seconds, shares and places."""
        with self._lock:
            ranks = {}
            for rank in sorted(self.totals):
                total = self.totals[rank]
                seconds = {b: round(total.seconds.get(b, 0.0), 2) for b in BUCKETS}
                ranks[str(rank)] = {
                    "host": total.host, "seconds": seconds,
                    "share": {b: round(v, 4) for b, v in share(seconds).items()},
                    "where": {b: dominant(total.where, b) for b in total.where},
                    "waits_measured": sorted(total.waits), "steps_measured": total.steps,
                    "unmeasured": sorted(total.unmeasured)}
            return {"file": TIMING_FILE, "ranks": ranks,
                    "findings": [f.as_dict() for f in self.findings]}

    def close(self) -> None:
        """The ranks are done: the last attempt judged as a whole if it needs it, the file
        closed."""
        with self._lock:
            new, every = self._settle()
            self._attempt_totals = {}
            if self._file is not None:
                self._file.close()
                self._file = None
        self._tell(new, every)
