"""``launcher="horovod"``: ``horovod.spark.run`` / ``run_elastic``, adapted to the seam.

Used for elastic runs and sessions with dynamic allocation (which barrier stages cannot use),
or on request. horovod has no channel of ours: the rank prints its events as marker lines
(:func:`sparkhvd.common.protocol.as_text`) and :class:`HorovodOutput` -- the thin adapter -- maps
horovod's ``[index]<stdout>:text`` output back onto :mod:`sparkhvd.common.protocol` messages. The
private parts of horovod it relies on are patched in :mod:`sparkhvd.common.patches`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import re
import sys
import threading
import time
from typing import Any, Optional

from sparkhvd.common import protocol
from sparkhvd.driver.launchers.base import SPARK_TIMEOUT, BlockingCall, kill_local_ranks
from sparkhvd.driver.launchers.seam import GroupStatus, LaunchSpec, RankFact, Sink
from sparkhvd.spark.sparkview import cancel_job_group, session_stopped, stopped_session_error

__side__ = "driver"

log = logging.getLogger(__name__)

_LINE = re.compile(r"^(?:[^\[]*?)\[(?P<idx>\d+)\]<(?P<tag>stdout|stderr)(?P<flag>[+~]?)>:"
                   r"(?P<text>.*)$", re.S)
_PROCESS_FAILED = re.compile(r"Process name: (?P<name>\S+)\s+Exit code: (?P<code>-?\d+|None)")


class _Channel:
    """A write()-able text stream for one of horovod's outputs.

    horovod writes each rank's stream from its own thread, in chunks that need not end at a
    line: lines are assembled per writing thread, or two ranks' lines would interleave.
    """

    def __init__(self, owner: "HorovodOutput", tag: str) -> None:
        self._owner, self._tag = owner, tag
        self._buffers: dict[int, str] = {}

    def write(self, text: str) -> int:
        key = threading.get_ident()
        with self._owner.lock:
            buffer = self._buffers.pop(key, "") + text
            *lines, rest = buffer.split("\n")
            if rest:
                self._buffers[key] = rest
            for line in lines:
                self._owner.route(line, self._tag)
        return len(text)

    def flush(self) -> None:
        pass

    def drain(self) -> None:
        with self._owner.lock:
            for key in list(self._buffers):
                self._owner.route(self._buffers.pop(key), self._tag)


class HorovodOutput:
    """horovod's rank output -> :mod:`sparkhvd.common.protocol` messages for the sink.

    horovod numbers output by its launch index; each rank's :class:`~sparkhvd.common.protocol.Started`
    event maps that index to the rank (again after an elastic reset).
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.lock = threading.RLock()
        self.index_to_rank: dict[int, int] = {}
        self.stdout = _Channel(self, "stdout")
        self.stderr = _Channel(self, "stderr")

    def route(self, raw: str, channel_tag: str) -> None:
        m = _LINE.match(raw.rstrip("\r"))
        if m:
            idx, tag, text = int(m.group("idx")), m.group("tag"), m.group("text")
            partial, update = m.group("flag") == "+", m.group("flag") == "~"
        else:
            idx, tag, text, partial, update = -1, channel_tag, raw.rstrip("\r"), False, False
        msg = protocol.from_text(text)
        if msg is not None:
            if isinstance(msg, protocol.Started):
                self.index_to_rank[idx] = msg.rank
            self.sink.receive(msg)
            return
        self.sink.receive(protocol.Line(self.index_to_rank.get(idx, idx), tag, text, partial,
                                        update))

    def drain(self) -> None:
        self.stdout.drain()
        self.stderr.drain()


def parse_failure(exc: BaseException) -> Optional[RankFact]:
    """horovod's "Process name: N Exit code: C" error as the fact it states (rank unknown when
    the process name is an elastic host slot such as ``h2-93fc[0]``)."""
    m = _PROCESS_FAILED.search(str(exc))
    if not m:
        return None
    code = None if m.group("code") == "None" else int(m.group("code"))
    name = m.group("name")
    rank = int(name) if name.isdigit() else None
    return RankFact(rank, "exited", time.monotonic(), exit_code=code,
                    detail=f"horovod process {name} exited with status {code}")


_quiet = {"installed": False}


def quiet_cancelled_spark_thread() -> None:
    """Silence horovod's Spark thread when *we* cancelled its job group (installed once).

    When a rank fails (or the driver is interrupted), the Spark job is cancelled and horovod's
    ``run_spark`` thread dies with a Py4JJavaError ("... cancelled ...") and a Java stack trace
    -- possibly after ``run()`` already returned; the user gets the real error from us instead.
    Any other thread exception is reported as usual.
    """
    if _quiet["installed"]:
        return
    previous = threading.excepthook

    def hook(args: Any) -> None:
        name = getattr(args.thread, "name", "") or ""
        if name.endswith("(run_spark)") and "cancel" in str(args.exc_value):
            log.debug("horovod's Spark job group was cancelled: %s", args.exc_value)
            return
        previous(args)

    threading.excepthook = hook
    _quiet["installed"] = True


def whole_seconds(seconds: float) -> int:
    """horovod takes whole seconds: round up, so 0.5 s is 1 s, never 0 (no time at all)."""
    return max(1, math.ceil(seconds))


class HorovodSparkGroup:
    """``spec.size`` ranks through ``horovod.spark.run`` (or ``run_elastic``): the launcher users
    pick with ``launcher="horovod"`` -- not the horovod *backend*
    (:mod:`sparkhvd.common.backends.horovod`, Gloo through horovod's rendezvous), which the
    barrier launcher runs too. It has no way of its own to reach the ranks (no ``reach``);
    what it sees of them is horovod's error when its run fails (:func:`parse_failure`)."""

    reach = None

    def __init__(self, spec: LaunchSpec, sink: Sink) -> None:
        self.spec, self.sink = spec, sink
        self.timeout_message = SPARK_TIMEOUT.format(timeout=spec.timeout or 0)
        #: horovod's elastic ranks reset and recover after a peer raised
        self.recovers = bool(spec.elastic)
        self._sc: Any = None
        self._stop_event = threading.Event()
        self._output = HorovodOutput(sink)
        self._held = contextlib.ExitStack()  # horovod's hooks, for as long as its run lasts
        self._hooks: dict = {}
        self._common: dict[str, Any] = {}
        self._call: Optional[BlockingCall] = None
        self._session_lost = False
        self._released = False

    def start(self) -> None:
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise
        self._call = BlockingCall(self._run, "sparkhvd-horovod")

    def _launch(self) -> None:
        from pyspark import SparkContext

        from sparkhvd.driver.launchers.horovod_hooks import horovod_driver_hooks
        from sparkhvd.executor.horovod_spark import spark_task_mapper

        spec = self.spec
        self._sc = SparkContext._active_spark_context
        # horovod pickles the result itself: the rank checks it can be (a clear error if not).
        options = dataclasses.replace(spec.options, check_result=True).as_dict()
        self._common = dict(
            args=(spec.payload, options), num_proc=spec.size,
            start_timeout=whole_seconds(spec.start_timeout), env=dict(spec.env),
            stdout=self._output.stdout, stderr=self._output.stderr,
            verbose=2 if spec.verbose else 0, nics=set(spec.nics) if spec.nics else None,
            prefix_output_with_timestamp=False)
        remote = not spec.placement.executors_here
        if remote and not spec.nics:  # each rank picks the interface that reaches the driver
            self._common["env"][protocol.GLOO_AUTO_ENV] = "1"
        if remote:  # no channel of ours to ranks on other hosts: they look for stack requests
            self._common["env"][protocol.STACKS_POLL_ENV] = "1"
        quiet_cancelled_spark_thread()
        self._hooks = self._held.enter_context(horovod_driver_hooks(
            self._stop_event, elastic=bool(spec.elastic),
            mapper=functools.partial(spark_task_mapper, sys.executable),
            driver_host=spec.driver_host if remote else None))

    def _run(self) -> list:
        import horovod.spark

        from sparkhvd.executor.horovod_spark import rank_in_task

        spec = self.spec
        if spec.elastic:
            return horovod.spark.run_elastic(
                rank_in_task, min_num_proc=spec.elastic[0], max_num_proc=spec.elastic[1],
                elastic_timeout=whole_seconds(spec.start_timeout), **self._common)
        return horovod.spark.run(rank_in_task, use_gloo=True, **self._common)

    def poll(self, wait_s: float, elapsed_s: float) -> GroupStatus:
        """Wait up to ``wait_s`` for horovod's run; once it failed, the process it names."""
        assert self._call is not None, "the group was not started"
        call = self._call
        call.wait(wait_s)
        if session_stopped(self._sc):
            self._session_lost = True
            return GroupStatus(running=False, error=stopped_session_error(during=True))
        if not call.done:
            return GroupStatus()
        error = call.error
        if error is None:
            results = elastic_result(call.value) if self.spec.elastic else list(call.value or [])
            return GroupStatus(running=False, done=True, results=tuple(results))
        if not isinstance(error, Exception):
            raise error
        fact = parse_failure(error) if isinstance(error, RuntimeError) else None
        return GroupStatus((fact,) if fact is not None else (), running=False, error=error)

    def shutdown(self, stop: bool = False) -> None:
        """``stop``: stop horovod's run, cancel its Spark job group, kill what is left here;
        then wait for its output and release its hooks."""
        try:
            if stop:
                self._stop()
                if self._call is not None and not self._call.done:
                    # a stopped session leaves horovod's Spark call in its retries
                    self._call.wait(2.0 if self._session_lost else 60.0)
                    self._stop()
        finally:
            if not self._released:
                self._released = True
                try:
                    if "streams" in self._hooks:
                        self._hooks["streams"].wait_until_done()  # horovod returns first
                    self._output.drain()
                finally:
                    self._held.close()

    def _stop(self) -> None:
        self._stop_event.set()
        with contextlib.suppress(Exception):
            if self._hooks.get("job_group"):
                cancel_job_group(self._sc, self._hooks["job_group"])
        with contextlib.suppress(Exception):
            kill_local_ranks(self.sink)


LAUNCHER = HorovodSparkGroup


def elastic_result(results: list[Any]) -> list[Any]:
    """The driver's view of elastic ranks' returns: values in final-rank order.

    Spark tasks return in launch order, and a task of a lost executor may have been retried
    as an empty task; each elastic rank tags its return with the rank it ended as.
    """
    tagged = [r for r in results if isinstance(r, tuple) and len(r) == 3
              and r[0] == protocol.ELASTIC_RESULT]
    return [value for _, _, value in sorted(tagged, key=lambda r: r[1])]
