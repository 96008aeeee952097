"""One attempt of a run: one launch of the ranks, what a look at them finds, and how it ended.

The run (:class:`~sparkhvd.driver.run.Run`) makes an :class:`Attempt` in each *placing* and
drives it in *running*, one step a poll: the attempt starts the run folder's service for the
ranks and builds the launch spec (the size, the resume source, the rendezvous tag:
:meth:`Attempt.prepare`), then hands it to its launcher (:meth:`Attempt.start`); each
:meth:`Attempt.poll` looks at the ranks once and returns what it found as data (:class:`AttemptStatus`: running, ended, a stop due, a stall, the
time up) -- the run's step decides what to do about it, as Ray Train v2's controller decides
from its worker group's ``poll_status``. A rank's failure becomes the
:class:`~sparkhvd.driver.rank_end.Verdict` the run's policy decides from. ``run.json``'s
``attempts`` entry is :meth:`Attempt.entry`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sparkhvd.common import protocol
from sparkhvd.common.backends import RunTag
from sparkhvd.common.errors import LaunchFailure
from sparkhvd.common.protocol import RankOptions
from sparkhvd.driver.inbox import AttemptInbox
from sparkhvd.driver.launchers import Launcher, LaunchSpec, Placement, WorkerGroup
from sparkhvd.driver.monitor import RunMonitor
from sparkhvd.driver.rank_end import Verdict, verdict_of
from sparkhvd.driver.view import RunView
from sparkhvd.elastic.watch import AttemptWatch, StopRequest
from sparkhvd.runfolder.record import now

__side__ = "driver"

log = logging.getLogger(__name__)

#: How long one poll of a running attempt waits for its ranks to end.
POLL_S = 0.1


def status_of(exc: BaseException) -> str:
    """How a run or attempt that ``exc`` ended is recorded."""
    return ("interrupted" if isinstance(exc, KeyboardInterrupt) else
            "timed out" if isinstance(exc, TimeoutError) else "failed")


@dataclass(frozen=True)
class AttemptStatus:
    """What one :meth:`Attempt.poll` found, as data (the run's step decides from it)."""

    #: ``running``; ``ended`` (the ranks ended: the attempt's ``status`` says how); ``stop
    #: due`` (the elastic watch found executors being decommissioned or slots to grow into:
    #: :attr:`stop`); ``stalled`` (``on_stall="stop"``) or ``timed out`` (``run(timeout=...)``),
    #: the ranks still running (:attr:`error`: what ends the attempt if the run stops it)
    kind: str
    stop: Optional[StopRequest] = None
    error: Optional[BaseException] = None


class Attempt:
    """One launch of the ranks: where it is (``status``: ``placed``, ``running``, then how it
    ended), the ranks' results, and -- when a rank failed -- the
    :class:`~sparkhvd.driver.rank_end.Verdict`."""

    def __init__(self, run: RunView, number: int, placement: Placement,
                 resume: Optional[str], library: Optional[str] = None, size: int = 0,
                 previous_size: Optional[int] = None, *, launcher: Launcher,
                 free_slots: Callable[[], int]) -> None:
        """``resume``: the checkpoints sparkhvd restores; ``library``: the folders where a
        library keeps its own (``st.output_dir``), when sparkhvd has none; ``size``: the
        ranks it launches (``previous_size``: the attempt before, after a resize);
        ``launcher``: what starts them (the placement's); ``free_slots``: the count an elastic
        attempt's watch grows into."""
        self.run, self.number, self.placement, self.resume = run, number, placement, resume
        self.launcher = launcher
        self.library = library
        self.size = size or run.scaling.size
        self.previous_size = previous_size
        #: this attempt's inbox (recorders listen to it: :mod:`sparkhvd.driver.recording`)
        self.outcome = AttemptInbox(run.router)
        launch = run.spec.launch
        self.monitor = RunMonitor(
            self.outcome, run.run_dir.path, stall_timeout=launch.stall_timeout,
            on_stall=launch.on_stall)
        #: the Spark job tag (or group) of this attempt's barrier stage: in ``run.json`` before
        #: the job is submitted, so it can always be found and cancelled
        self.spark_job = f"sparkhvd-{run.run_dir.run_id}-{number}"
        #: the driver's eye on the running attempt (decommission, slots to grow into)
        self.watch: Optional[AttemptWatch] = None
        if placement.launcher == "barrier":
            outcome = self.outcome
            self.watch = AttemptWatch(
                placement.session, self.spark_job, run.scaling, self.size,
                listening=lambda: len(outcome.listening) >= self.size,
                free=free_slots)
        #: why the run asked the ranks to stop at their next step (a grow, a decommission)
        self.stop_request: Optional[StopRequest] = None
        #: the started ranks (None before :meth:`start` and once they ended)
        self.group: Optional[WorkerGroup] = None
        self._files: Any = None
        self._launch_spec: Optional[LaunchSpec] = None
        self._started = 0.0
        self.status = "placed"
        self.results: list = []
        self.verdict: Optional[Verdict] = None
        self.failure: Optional[LaunchFailure] = None
        self.error: Optional[BaseException] = None

    def prepare(self, env: dict[str, str]) -> None:
        """Everything but the launch: the run folder's service started, the launch spec built
        (the run's recorders then write down what is about to be submitted). Anything that
        fails here propagates, the service stopped."""
        try:
            self._files, files_env = self._start_files()
            env.update(files_env)
            self._launch_spec = self._spec(env)
        except BaseException:
            self._clean_up()
            raise

    def start(self) -> None:
        """Start the ranks (:meth:`prepare` first). A launch that fails at once ends the
        attempt as a rank failure does (:attr:`status`); anything else -- a bad setting, an
        interrupt -- propagates, with the run folder's service stopped."""
        spec = self._launch_spec
        assert spec is not None, "the attempt was not prepared"
        try:
            log.info("Launching %d rank(s) %s; logs in %s", spec.size,
                     f"on Spark ({spec.session.describe()})" if spec.session else
                     "as local processes", self.run.run_dir.logs)
            group = self.launcher(spec, self.outcome)
            group.start()
            self.group = group
        except LaunchFailure as failure:
            self._failed(failure)
            self._clean_up()
            return
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
        Waits up to :data:`POLL_S` for the ranks. A failed rank ends the attempt here (the
        others stopped); an error that is no rank's propagates, the ranks stopped first."""
        group = self._group()
        try:
            found = group.poll(POLL_S, time.monotonic() - self._started)
        except BaseException as exc:  # an interrupt while waiting
            self._end_by(exc)
            return AttemptStatus("ended")
        if found.kind == "ended":
            self.results = list(found.results)
            self.status = "succeeded"
            self._clean_up()
            return AttemptStatus("ended")
        if found.kind == "failed":
            assert found.error is not None
            self._end_by(found.error)
            return AttemptStatus("ended")
        if self.watch is not None and group.reach is not None and self.stop_request is None:
            stop = self.watch.tick()
            if stop is not None:
                return AttemptStatus("stop due", stop=stop)
        stall = self.monitor.tick()
        if stall is not None:
            return AttemptStatus("stalled", error=stall)
        if time_left is not None and time_left <= 0:
            return AttemptStatus("timed out", error=TimeoutError(
                group.timeout_message + self.monitor.explain_timeout()))
        return AttemptStatus("running")

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
        """End the running attempt for what a poll found (a stall, the time up): the ranks are
        stopped; where the launcher finds a rank that failed meanwhile, that failure is how the
        attempt ended."""
        assert status.error is not None, status
        self._end_by(status.error, status.kind)

    def abort(self, exc: BaseException) -> None:
        """The controller itself stopped (an interrupt, an error): stop the ranks, if they run."""
        if self.status == "running":
            with contextlib.suppress(Exception):
                self._group().shutdown(exc)
            self.status, self.error = status_of(exc), exc
        self._clean_up()  # a prepared attempt's run-folder service too

    def _end_by(self, exc: BaseException, kind: Optional[str] = None) -> None:
        """The ranks are stopped after ``exc``: a rank's failure (the launcher's, or what it
        names behind its own error) ends the attempt as failed or preempted; ``kind`` (a stall,
        the time up) ends it so; anything else propagates once the ranks are stopped."""
        try:
            failure = self._group().shutdown(exc) or exc
            if isinstance(failure, LaunchFailure):
                self._failed(failure)
                return
            if kind is not None and failure is exc:
                self.status, self.error = kind, exc
                return
            self.status, self.error = status_of(failure), failure
        finally:
            self._clean_up()
        if failure is exc:
            raise exc
        raise failure from exc

    def _failed(self, failure: LaunchFailure) -> None:
        self.failure = failure
        self.verdict = verdict_of(failure, self.outcome.reported(), self.outcome.hosts,
                                  self.run.router.tail)
        self.status = "preempted" if self.verdict.preempted else "failed"
        self.error = self.verdict.error()

    def _group(self) -> WorkerGroup:
        assert self.group is not None, "the attempt was not started"
        return self.group

    def relaunch_reason(self, request: Any, verdict: Verdict) -> str:
        """Why this attempt is relaunched, in words: the driver's request (a grow), the rank
        that got the notice, or the loss."""
        if request is not None:
            return str(request.reason)
        noticed = {rank: msg.reason for rank, msg in self.outcome.preempted.items()
                   if msg.reason != protocol.NOTICE_SPREAD}
        if verdict.preempted and noticed:
            rank = min(noticed)
            host = self.outcome.hosts.get(rank)
            return (f"rank {rank}{f' on host {host}' if host else ''} got a notice "
                    f"({noticed[rank]}) and every rank stopped after its checkpoint")
        return verdict.retryable or "?"

    def entry(self) -> dict:
        """This attempt's entry in ``run.json``'s ``attempts``."""
        pids = self.outcome.pid_record()
        entry: dict[str, Any] = {
            "attempt": self.number, "status": self.status, "size": self.size,
            "resumed_from": self.resume or self.library,
            "resumed_by": "sparkhvd" if self.resume else "library" if self.library else None,
            "ended_at": now(),
            "rank_pids": pids["rank_pids"], "hosts": pids["hosts"]}
        resumed = self.outcome.resumed
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
            stopped = self.outcome.preempted
            entry["preempted"] = {"checkpoint": next((m.checkpoint for m in stopped.values()
                                                      if m.checkpoint), None),
                                  "reasons": sorted({m.reason for m in stopped.values()}),
                                  "notice_to_stop_s": max((m.seconds for m in stopped.values()
                                                           if m.seconds is not None),
                                                          default=None),
                                  "requested": self.stop_request.reason
                                  if self.stop_request is not None else None}
        return entry

    def stack_files(self) -> list[str]:
        """The stack dumps the driver saved while the ranks ran, relative to the run folder."""
        root = self.run.run_dir.path
        return [os.path.relpath(report.path, root) for report in self.monitor.reports
                if report.path]

    def _spec(self, env: dict[str, str]) -> LaunchSpec:
        run = self.run
        spec, launch = run.spec, run.spec.launch
        scaling = spec.scaling
        if self.size != scaling.size:  # an elastic run's attempt at another size
            scaling = scaling.resized(self.size)
        env[protocol.ATTEMPT_ENV] = str(self.number)
        if run.scaling.elastic:
            env[protocol.ELASTIC_ENV] = "1"
        if self.previous_size is not None and self.previous_size != self.size:
            env[protocol.PREVIOUS_SIZE_ENV] = str(self.previous_size)
        return LaunchSpec(
            scaling=scaling, launch=launch, backend=spec.backend, payload=run.blob,
            options=RankOptions(verbose=launch.verbose, return_all=run.return_all,
                                elastic=spec.facts.horovod_elastic,
                                time_split=spec.config.time_split,
                                env_keep=tuple(sorted(set(launch.env) | set(env)))),
            env=env, placement=self.placement, timeout=run.timeout,
            job=self.spark_job,
            run=RunTag(run.run_dir.run_id, self.number - 1, run.restarts))

    def _start_files(self) -> tuple[Any, dict[str, str]]:
        """Start the run-folder service; the variables that tell the ranks where their run
        folder is."""
        from sparkhvd.runfolder.service import (
            RunFileService,
            connections_for,
            row_copies_folder,
        )
        from sparkhvd.storage import public_url

        run_dir, config = self.run.run_dir, self.run.spec.config
        options = dict(config.storage_options)
        files = RunFileService(self.placement.driver_host, run_dir.path,
                               (self.resume, options) if self.resume else None,
                               row_copies=row_copies_folder(run_dir.run_id),
                               copies_budget=self._copies_budget(),
                               max_connections=connections_for(self.size)).start()
        env = {**files.env(), protocol.RUN_ID_ENV: run_dir.run_id}
        if self.placement.executors_here:
            env[protocol.RUN_URL_ENV] = run_dir.path
        if self.resume:
            env[protocol.RESUME_URL_ENV] = public_url(self.resume)
        if config.timeline:
            env[protocol.TIMELINE_ENV] = (
                run_dir.file("timeline.json") if self.placement.executors_here else
                os.path.join("/tmp", f"sparkhvd-timeline-{run_dir.run_id}.json"))
        return files, env

    def _copies_budget(self) -> int:
        """The bytes of row-group copies the driver keeps: what the ranks are told, or the
        default."""
        return protocol.row_copies_bytes(self.run.spec.launch.env or {})

    def _clean_up(self) -> None:
        """Release what the launch holds, once, however the attempt ended: the worker group, the
        run folder's service, the stack requests polling ranks read."""
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()
        files, self._files = self._files, None
        if files is None:
            return
        files.stop()
        # the stack requests polling ranks read: the run's business only while it runs
        shutil.rmtree(self.run.run_dir.file(os.path.dirname(protocol.STACKS_REQUEST_FILE)),
                      ignore_errors=True)
