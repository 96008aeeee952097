"""Inside each rank: where its time goes, sampled at a low rate, with no change to user code.

A daemon thread looks at the main thread's Python stack every :data:`SAMPLE_S`
(``sys._current_frames``: it needs the GIL only briefly, and gets it while the main thread waits
in a collective, in C++ or in a blocking read -- exactly the waits that matter). Each sample is
put in a bucket by :func:`sparkhvd.timing.buckets.bucket_of` and weighs the time since the last
one. Every :data:`REPORT_S` the rank sends the driver a :class:`~sparkhvd.common.protocol.
TimeSplit`: seconds per bucket, where each was spent, and its system metrics
(:mod:`sparkhvd.timing.system`). Turned off with ``time_split=False`` on the runner.
"""
from __future__ import annotations

import collections
import contextlib
import socket
import sys
import threading
import time
from typing import Any, Optional

from sparkhvd.common import protocol
from sparkhvd.common.events import emit, events
from sparkhvd.common.identity import current_rank
from sparkhvd.timing.buckets import bucket_of, dominant
from sparkhvd.timing.collectives import CLOCK, DDP_PLACE, TF_GRAPH, install_ddp_timing

__side__ = "rank"

#: How often the main thread's stack is sampled.
SAMPLE_S = 0.1
#: How often a rank reports its split to the driver.
REPORT_S = 5.0
#: Frames read per sample (the innermost; a deeper stack is cut at its outer end).
MAX_DEPTH = 120


def main_thread_frames(ident: int) -> list[tuple[str, int, str]]:
    """The thread's frames now, innermost first (empty when it has none)."""
    frame: Any = sys._current_frames().get(ident)
    frames: list[tuple[str, int, str]] = []
    while frame is not None and len(frames) < MAX_DEPTH:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    return frames


class Sampler:
    """The sampling thread of one rank (:func:`start`)."""

    def __init__(self, sample_s: float = SAMPLE_S, report_s: float = REPORT_S) -> None:
        self.sample_s, self.report_s = sample_s, report_s
        self.main = threading.main_thread().ident or 0
        self.host = socket.gethostname()
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self._reset(time.time())
        self.system: Any = None
        with contextlib.suppress(Exception):  # psutil missing or /proc hidden: no metrics
            from sparkhvd.timing.system import SystemMetrics

            self.system = SystemMetrics()
        self.thread = threading.Thread(target=self._loop, name="sparkhvd-time-split",
                                       daemon=True)

    def _reset(self, now: float) -> None:
        self.start = now
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.where: dict[str, dict[str, float]] = collections.defaultdict(
            lambda: collections.defaultdict(float))

    def sample(self, weight: float) -> None:
        """Put the main thread's stack now in its bucket, weighing ``weight`` seconds."""
        bucket, where = bucket_of(main_thread_frames(self.main))
        with self.lock:
            self.seconds[bucket] += weight
            if where:
                self.where[bucket][where] += weight

    def report(self) -> Optional[protocol.TimeSplit]:
        """The interval since the last report (None when nothing was sampled)."""
        now = time.time()
        with self.lock:
            seconds, where, start = dict(self.seconds), self.where, self.start
            self._reset(now)
        waited, steps, how = CLOCK.take()
        if not seconds:
            return None
        moved = min(waited, seconds.get("compute", 0.0))
        if moved > 0:  # sampled inside backward(): it was waiting, not computing
            seconds["compute"] -= moved
            seconds["collective"] = seconds.get("collective", 0.0) + moved
            where.setdefault("collective", collections.defaultdict(float))[DDP_PLACE] += moved
        system: dict[str, float] = {}
        with contextlib.suppress(Exception):
            system = self.system.read() if self.system is not None else {}
        return protocol.TimeSplit(
            rank=events.rank, host=self.host, start=round(start, 3), end=round(now, 3),
            seconds={k: round(v, 3) for k, v in seconds.items()},
            where={b: dominant(where, b) for b in where if where[b]},
            system=system, waits=sorted(how), steps=steps, batch=CLOCK.batch,
            unmeasured=sorted(CLOCK.unmeasured))

    def _loop(self) -> None:
        last = last_report = time.monotonic()
        while not self.stop_event.wait(self.sample_s):
            now = time.monotonic()
            with contextlib.suppress(Exception):  # a sample must never hurt the rank
                self.sample(min(now - last, self.report_s))
            last = now
            if now - last_report >= self.report_s:
                last_report = now
                self._send()

    def _send(self) -> None:
        with contextlib.suppress(Exception):
            msg = self.report()
            if msg is not None:
                emit(msg)

    def finish(self) -> None:
        """Stop sampling and send what the last interval holds."""
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(2 * self.sample_s + 1)
        self._send()


_sampler: dict[str, Sampler] = {}


def start(backend: Optional[str] = None) -> None:
    """Start sampling this rank (once per process)."""
    if "rank" not in _sampler:
        sampler = _sampler["rank"] = Sampler()
        sampler.thread.start()
        install_ddp_timing()  # DDP's wait inside backward(), measured where it happens
        if backend == "tf" and current_rank().size > 1:
            CLOCK.note_unmeasured(TF_GRAPH, warn=False)


def finish() -> None:
    """Send the last interval and stop (after the user's function, whatever happened)."""
    sampler = _sampler.pop("rank", None)
    if sampler is not None:
        sampler.finish()
