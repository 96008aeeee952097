"""One attempt of a run: one launch of the ranks, what a look at them finds, and how it ended.

The run (:class:`~sparkhvd.driver.run.Run`) makes an :class:`Attempt` in each *placing* --
giving it an :class:`AttemptContext`, never itself -- and drives it in *running*, one step a
poll: the attempt starts the run's services for it (the run folder's service for the ranks:
:mod:`sparkhvd.driver.services`) and builds the launch spec (the size, the resume source, the
rendezvous tag: :meth:`Attempt.prepare`), then hands it to its launcher
(:meth:`Attempt.start`); each :meth:`Attempt.poll` looks at the ranks once and returns what it
found as data (:class:`AttemptStatus`: running, ended, what the watch saw, a stall, the time
up) -- the run's step decides what to do about it, as Ray Train v2's controller decides from
its worker group's ``poll_status``. What the launcher saw of the ranks (their facts) is judged
in :func:`sparkhvd.driver.rank_end.judge`: a failure becomes the
:class:`~sparkhvd.driver.rank_end.Verdict` the run's policy decides from. ``run.json``'s
``attempts`` entry is :meth:`Attempt.entry`; recorders get :meth:`Attempt.snapshot`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sparkhvd.common import protocol
from sparkhvd.common.backends import RunTag
from sparkhvd.common.protocol import RankOptions
from sparkhvd.driver.inbox import AttemptInbox
from sparkhvd.driver.launchers import (
    GroupStatus,
    Launcher,
    LaunchSpec,
    Placement,
    RankFact,
    WorkerGroup,
)
from sparkhvd.driver.logs import RankLogRouter
from sparkhvd.driver.monitor import RunMonitor
from sparkhvd.driver.rank_end import Graces, Judgement, Verdict, judge
from sparkhvd.driver.services import AttemptStart
from sparkhvd.driver.spec import RunSpec
from sparkhvd.driver.view import AttemptSnapshot, RunHub
from sparkhvd.elastic.scaling import StopRequest
from sparkhvd.elastic.watch import AttemptWatch, Sighting
from sparkhvd.runfolder.record import now
from sparkhvd.runfolder.rundir import RunDir

__side__ = "driver"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttemptContext:
    """What an attempt is given by its run -- explicitly, never the run itself: the run's
    spec and payload, its folder and log router, what the launch spec tells the ranks, and the
    graces its verdict waits."""

    spec: RunSpec
    payload: bytes
    return_all: bool
    #: ``run(timeout=...)``, counted from the call
    timeout: Optional[float]
    run_dir: RunDir
    router: RankLogRouter
    #: how many relaunches the retry policy allows (the ranks' rendezvous tag)
    restarts: int
    graces: Graces
    #: the features' parts in each attempt (:mod:`sparkhvd.driver.services`)
    services: tuple = ()
    #: where the ranks' metrics and time splits go on to (the run's
    #: :class:`~sparkhvd.driver.view.RunHub`)
    hub: Optional[RunHub] = None

#: How long one poll of a running attempt waits for its ranks to end.
POLL_S = 0.1


def status_of(exc: BaseException) -> str:
    """How a run or attempt that ``exc`` ended is recorded."""
    return ("interrupted" if isinstance(exc, KeyboardInterrupt) else
            "timed out" if isinstance(exc, TimeoutError) else "failed")


@dataclass(frozen=True)
class AttemptStatus:
    """What one :meth:`Attempt.poll` found, as data (the run's step decides from it)."""

    #: ``running``; ``ended`` (the ranks ended: the attempt's ``status`` says how); ``seen``
    #: (the watch saw executors being decommissioned or slots free: :attr:`seen`, the run's
    #: policy decides); ``stalled`` (``on_stall="stop"``) or ``timed out``
    #: (``run(timeout=...)``), the ranks still running (:attr:`error`: what ends the attempt
    #: if the run stops it)
    kind: str
    seen: Optional[Sighting] = None
    error: Optional[BaseException] = None


class Attempt:
    """One launch of the ranks: where it is (``status``: ``placed``, ``running``, then how it
    ended), the ranks' results, and -- when a rank failed -- the
    :class:`~sparkhvd.driver.rank_end.Verdict`."""

    def __init__(self, context: AttemptContext, number: int, placement: Placement,
                 resume: Optional[str], library: Optional[str] = None, size: int = 0,
                 previous_size: Optional[int] = None, *, launcher: Launcher,
                 free_slots: Callable[[], int]) -> None:
        """``resume``: the checkpoints sparkhvd restores; ``library``: the folders where a
        library keeps its own (``st.output_dir``), when sparkhvd has none; ``size``: the
        ranks it launches (``previous_size``: the attempt before, after a resize);
        ``launcher``: what starts them (the placement's); ``free_slots``: the count an elastic
        attempt's watch grows into."""
        self.context, self.number, self.placement = context, number, placement
        self.resume = resume
        self.launcher = launcher
        run = context
        self.library = library
        self.size = size or run.spec.scaling_policy.size
        self.previous_size = previous_size
        #: this attempt's inbox (recorders listen to it: :mod:`sparkhvd.driver.recording`)
        self.inbox = AttemptInbox(run.router, run.hub)
        launch = run.spec.launch
        self.monitor = RunMonitor(
            self.inbox, run.run_dir.path, stall_timeout=launch.stall_timeout,
            on_stall=launch.on_stall)
        #: the Spark job tag (or group) of this attempt's barrier stage: in ``run.json`` before
        #: the job is submitted, so it can always be found and cancelled
        self.spark_job = f"sparkhvd-{run.run_dir.run_id}-{number}"
        #: the driver's eye on the running attempt (decommission, slots to grow into)
        self.watch: Optional[AttemptWatch] = None
        if placement.launcher == "barrier":
            policy = run.spec.scaling_policy
            self.watch = AttemptWatch(
                placement.session, self.spark_job,
                slots=policy.elastic and self.size < policy.max_np,
                resize_check_s=policy.resize_check_s, free=free_slots)
        #: why the run asked the ranks to stop at their next step (a grow, a decommission)
        self.stop_request: Optional[StopRequest] = None
        #: the started ranks (None before :meth:`start` and once they ended)
        self.group: Optional[WorkerGroup] = None
        #: the services started for this attempt (stopped at its end, last first)
        self._services: list = []
        self._launch_spec: Optional[LaunchSpec] = None
        self._started = 0.0
        self.status = "placed"
        self.results: list = []
        self.verdict: Optional[Verdict] = None
        #: what the launcher saw of the ranks at the last poll
        self.facts: tuple[RankFact, ...] = ()
        #: the fact the verdict named first (a failed attempt)
        self.cause: Optional[RankFact] = None
        self.error: Optional[BaseException] = None
        #: when the launcher first said an error that is no rank's (its grace counts from it)
        self._error_since: Optional[float] = None

    def prepare(self, env: dict[str, str]) -> None:
        """Everything but the launch: the run's services started for this attempt (what the
        ranks reach: the run folder's service), the launch spec built (the run's recorders then
        write down what is about to be submitted). Anything that fails here propagates, the
        services stopped."""
        start = AttemptStart(self.context.run_dir.run_id, self.number, self.size,
                             self.placement, self.resume)
        try:
            for service in self.context.services:
                self._services.append(service)
                env.update(service.attempt_starts(start))
            self._launch_spec = self._spec(env)
        except BaseException:
            self._clean_up()
            raise

    def start(self) -> None:
        """Start the ranks (:meth:`prepare` first); anything that fails here -- a bad setting,
        an interrupt -- propagates, with the run folder's service stopped."""
        spec = self._launch_spec
        assert spec is not None, "the attempt was not prepared"
        try:
            log.info("Launching %d rank(s) %s; logs in %s", spec.size,
                     f"on Spark ({spec.session.describe()})" if spec.session else
                     "as local processes", self.context.run_dir.logs)
            group = self.launcher(spec, self.inbox)
            group.start()
            self.group = group
        except BaseException:
            self._clean_up()
            raise
        self.status = "running"
        self._started = time.monotonic()
        self.monitor.reach_ranks(group.reach.ask_stacks if group.reach is not None else None)

    def poll(self, time_left: Optional[float]) -> AttemptStatus:
        """One look at the running ranks, as data: whether they ended (then :attr:`status`,
        :attr:`results`, :attr:`verdict` say how), or what the driver's watches found -- a
        stop due (executors being decommissioned, slots to grow into), a stall
        (``on_stall="stop"``), the run's time up (``time_left`` of ``run(timeout=...)``).
        Waits up to :data:`POLL_S` for the ranks. The launcher's facts are judged in
        :func:`~sparkhvd.driver.rank_end.judge`: a failed rank ends the attempt here (the
        others stopped); an error that is no rank's propagates, the ranks stopped first."""
        group = self._group()
        try:
            found = group.poll(POLL_S, time.monotonic() - self._started)
        except BaseException as exc:  # an interrupt while waiting
            self._end_by(exc)
            raise
        judged = self._judge(found)
        if judged.kind == "done":
            self.results = list(found.results)
            self.status = "succeeded"
            self._clean_up()
            return AttemptStatus("ended")
        if judged.kind == "failed":
            self._failed(judged)
            return AttemptStatus("ended")
        if judged.kind == "error":
            assert judged.error is not None
            self._end_by(judged.error)
            raise judged.error
        if judged.kind == "running" and self.watch is not None and group.reach is not None \
                and self.stop_request is None:
            seen = self.watch.look()
            if seen is not None:
                return AttemptStatus("seen", seen=seen)
        stall = self.monitor.tick()
        if stall is not None:
            return AttemptStatus("stalled", error=stall)
        if time_left is not None and time_left <= 0:
            return AttemptStatus("timed out", error=TimeoutError(
                group.timeout_message + self.monitor.explain_timeout()))
        return AttemptStatus("running")

    def _judge(self, found: GroupStatus, stopping: bool = False) -> Judgement:
        """What the poll's facts and the ranks' reports mean (:func:`~sparkhvd.driver.rank_end.
        judge`, with the retry policy's graces)."""
        now = time.monotonic()
        self.facts = found.facts
        if found.error is not None and self._error_since is None:
            self._error_since = now
        inbox = self.inbox
        return judge(found, inbox.raised(), inbox.reported(), inbox.hosts,
                     self.context.router.tail, now=now, error_since=self._error_since,
                     recovers=self._group().recovers, graces=self.context.graces,
                     stopping=stopping)

    @property
    def listening(self) -> bool:
        """Whether every rank's checkpoint helper listens for notices (a notice would
        otherwise kill them, and a grow cost the work since their last checkpoint)."""
        return len(self.inbox.listening) >= self.size

    def ask_to_stop(self, request: StopRequest) -> None:
        """Give the ranks a notice: they stop after their current step and checkpoint (the run
        relaunches; :attr:`stop_request` says why)."""
        self.stop_request = request
        log.warning("sparkhvd: %s; the ranks checkpoint after their current step and the run "
                    "relaunches", request.reason)
        reach = self._group().reach
        assert reach is not None  # the watch is ticked only where the launcher can notify
        reach.notify(request.reason)

    def stop(self, status: AttemptStatus) -> None:
        """End the running attempt for what a poll found (a stall, the time up); the ranks are
        stopped. A stall behind which a rank failed (not on a notice) ends as that failure;
        the time up is always the time up (nothing is relaunched after the run's deadline)."""
        assert status.error is not None, status
        if status.kind == "stalled":
            judged = self._judge(self._group().poll(0.0, time.monotonic() - self._started),
                                 stopping=True)
            if judged.kind == "failed" and judged.verdict is not None and \
                    not judged.verdict.preempted:
                self._failed(judged)
                return
        self._end_by(status.error)
        self.status, self.error = status.kind, status.error

    def abort(self, exc: BaseException) -> None:
        """The controller itself stopped (an interrupt, an error): stop the ranks, if they run."""
        if self.status == "running":
            with contextlib.suppress(Exception):
                self._group().shutdown(stop=True)
            self.status, self.error = status_of(exc), exc
        self._clean_up()  # a prepared attempt's run-folder service too

    def _end_by(self, exc: BaseException) -> None:
        """The ranks are stopped after ``exc`` (an interrupt, an error that is no rank's), and
        the attempt ends so; the caller raises it."""
        try:
            self._group().shutdown(stop=True)
            self.status, self.error = status_of(exc), exc
        finally:
            self._clean_up()

    def _failed(self, judged: Judgement) -> None:
        """A rank failed (or every rank stopped on a notice): the others are stopped; the
        verdict names the rank the judgement named, and lists every error reported until the
        others stopped."""
        assert judged.verdict is not None
        try:
            self._group().shutdown(stop=True)
        finally:
            self._clean_up()
        self.cause = judged.fact
        verdict = judged.verdict.listing(self.inbox.reported())
        self.verdict = verdict
        self.status = "preempted" if verdict.preempted else "failed"
        self.error = verdict.error()

    @property
    def lost(self) -> list[RankFact]:
        """Where the attempt lost executors or hosts, for the next placement's count: the rank
        its verdict named, and every rank whose host went silent (never a consequence)."""
        cause = [self.cause] if self.cause is not None else []
        return cause + [fact for fact in self.facts
                        if fact.kind == "silent" and fact is not self.cause]

    def _group(self) -> WorkerGroup:
        assert self.group is not None, "the attempt was not started"
        return self.group

    def relaunch_reason(self, request: Any, verdict: Verdict) -> str:
        """Why this attempt is relaunched, in words: the driver's request (a grow), the rank
        that got the notice, or the loss."""
        if request is not None:
            return str(request.reason)
        noticed = {rank: msg.reason for rank, msg in self.inbox.preempted.items()
                   if msg.reason != protocol.NOTICE_SPREAD}
        if verdict.preempted and noticed:
            rank = min(noticed)
            host = self.inbox.hosts.get(rank)
            return (f"rank {rank}{f' on host {host}' if host else ''} got a notice "
                    f"({noticed[rank]}) and every rank stopped after its checkpoint")
        return verdict.retryable or "?"

    def entry(self) -> dict:
        """This attempt's entry in ``run.json``'s ``attempts``."""
        pids = self.inbox.pid_record()
        entry: dict[str, Any] = {
            "attempt": self.number, "status": self.status, "size": self.size,
            "resumed_from": self.resume or self.library,
            "resumed_by": "sparkhvd" if self.resume else "library" if self.library else None,
            "ended_at": now(),
            "rank_pids": pids["rank_pids"], "hosts": pids["hosts"]}
        resumed = self.inbox.resumed
        if resumed is not None:
            entry["restored"] = resumed.source
            if not resumed.uploaded:
                entry["uploaded"] = False  # restored from the hosts; not in the folder
            if resumed.skipped:
                entry["skipped"] = list(resumed.skipped)
        if self.error is not None and self.status != "preempted":
            entry["error"] = str(self.error).split("\n", 1)[0]
            entry["retryable"] = self.verdict.retryable if self.verdict is not None else None
        if self.verdict is not None and self.verdict.preempted:
            stopped = self.inbox.preempted
            entry["preempted"] = {"checkpoint": next((m.checkpoint for m in stopped.values()
                                                      if m.checkpoint), None),
                                  "reasons": sorted({m.reason for m in stopped.values()}),
                                  "notice_to_stop_s": max((m.seconds for m in stopped.values()
                                                           if m.seconds is not None),
                                                          default=None),
                                  "requested": self.stop_request.reason
                                  if self.stop_request is not None else None}
        return entry

    def snapshot(self) -> AttemptSnapshot:
        """This attempt as it is now, frozen (what recorders are handed)."""
        session = self.placement.session
        return AttemptSnapshot(
            self.number, self.size, self.status, self.placement, self.resume, self.spark_job,
            getattr(session, "job_kind", None) if session is not None else None,
            self.entry(), tuple(self.stack_files()), self.inbox.channel,
            tuple(dict(m) for m in self.inbox.metrics), self.inbox.resumed,
            self.inbox.pid_record(), dict(self.inbox.start_times))

    def stack_files(self) -> list[str]:
        """The stack dumps the driver saved while the ranks ran, relative to the run folder."""
        root = self.context.run_dir.path
        return [os.path.relpath(report.path, root) for report in self.monitor.reports
                if report.path]

    def _spec(self, env: dict[str, str]) -> LaunchSpec:
        run = self.context
        spec, launch = run.spec, run.spec.launch
        scaling = spec.scaling
        if self.size != scaling.size:  # an elastic run's attempt at another size
            scaling = scaling.resized(self.size)
        env[protocol.ATTEMPT_ENV] = str(self.number)
        if spec.scaling_policy.elastic:
            env[protocol.ELASTIC_ENV] = "1"
        if self.previous_size is not None and self.previous_size != self.size:
            env[protocol.PREVIOUS_SIZE_ENV] = str(self.previous_size)
        return LaunchSpec(
            scaling=scaling, launch=launch, backend=spec.backend, payload=run.payload,
            options=RankOptions(verbose=launch.verbose, return_all=run.return_all,
                                elastic=spec.facts.horovod_elastic,
                                time_split=spec.config.time_split,
                                warm_start=launch.warm_start,
                                env_keep=tuple(sorted(set(launch.env) | set(env)))),
            env=env, placement=self.placement, timeout=run.timeout,
            job=self.spark_job,
            run=RunTag(run.run_dir.run_id, self.number - 1, run.restarts))

    def _clean_up(self) -> None:
        """Release what the launch holds, once, however the attempt ended: the worker group,
        then the services started for it (told the hosts its ranks ran on)."""
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()
        services, self._services = self._services, []
        hosts = frozenset(self.inbox.hosts.values())
        for service in reversed(services):
            try:
                service.attempt_ended(hosts)
            except Exception as exc:  # noqa: BLE001 - the attempt's end is what matters
                log.warning("sparkhvd: %s could not stop after attempt %d: %s",
                            type(service).__name__, self.number, exc)
