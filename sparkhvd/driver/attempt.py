"""One attempt of a run: one launch of the ranks, watched until they end, and how it ended.

The run (:class:`~sparkhvd.driver.run.Run`) makes an :class:`Attempt` in each *placing* and
launches it in *running*; the attempt starts the run folder's service for the ranks, builds the
launch spec (the size, the resume source, the rendezvous tag), hands it to the launcher and
turns a failure into the :class:`~sparkhvd.driver.rank_end.Verdict` the run's policy decides
from. ``run.json``'s ``attempts`` entry is :meth:`Attempt.entry`.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Optional

from sparkhvd.common import protocol
from sparkhvd.common.backends import RunTag
from sparkhvd.common.errors import LaunchFailure, StallError
from sparkhvd.common.protocol import RankOptions
from sparkhvd.driver.inbox import AttemptInbox
from sparkhvd.driver.launchers import LaunchSpec, Placement, RankGroup
from sparkhvd.driver.monitor import RunMonitor
from sparkhvd.driver.rank_end import Verdict, verdict_of
from sparkhvd.elastic.watch import AttemptWatch
from sparkhvd.runfolder.record import now

if TYPE_CHECKING:
    from sparkhvd.driver.run import Run

__side__ = "driver"

log = logging.getLogger(__name__)

#: How often the controller polls a running attempt's ranks.
POLL_S = 0.1


class Attempt:
    """One launch of the ranks: how it ended (``status``), the ranks' results, and -- when a
    rank failed -- the :class:`~sparkhvd.driver.rank_end.Verdict`."""

    def __init__(self, run: "Run", number: int, placement: Placement,
                 resume: Optional[str], library: Optional[str] = None, size: int = 0,
                 previous_size: Optional[int] = None) -> None:
        """``resume``: the checkpoints sparkhvd restores; ``library``: the folders where a
        library keeps its own (``st.output_dir``), when sparkhvd has none; ``size``: the
        ranks it launches (``previous_size``: the attempt before, after a resize)."""
        self.run, self.number, self.placement, self.resume = run, number, placement, resume
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
                free=run.placer.free_slots)
        self.status = "running"
        self.results: list = []
        self.verdict: Optional[Verdict] = None
        self.failure: Optional[LaunchFailure] = None
        self.error: Optional[BaseException] = None

    def launch(self, env: dict[str, str]) -> None:
        """Start the ranks and wait for them. A rank's failure and a stall end the attempt
        (``status``, ``verdict``, ``error``); anything else -- a timeout, an interrupt, a bad
        setting -- propagates."""
        run, files = self.run, None
        try:
            files, files_env = self._start_files()
            env.update(files_env)
            spec = self._spec(env)
            if self.placement.launcher == "barrier":
                run.record.submitting(self.spark_job, self.placement.session.job_kind,
                                      self.number)
            run.record.mark("launch")
            log.info("Launching %d rank(s) %s; logs in %s", spec.size,
                     f"on Spark ({spec.session.describe()})" if spec.session else
                     "as local processes", run.run_dir.logs)
            self.results = self._await(run.launchers(self.placement.launcher)
                                       .start(spec, self.outcome), spec.time_left())
            run.record.launched(control=self.outcome.channel)
            self.status = "succeeded"
        except LaunchFailure as failure:
            self.failure = failure
            self.verdict = verdict_of(failure, self.outcome.reported(), self.outcome.hosts,
                                    run.router.tail)
            self.status = "preempted" if self.verdict.preempted else "failed"
            self.error = self.verdict.error()
        except StallError as exc:
            self.status, self.error = "stalled", exc
        finally:
            self._clean_up(files)

    def _await(self, group: RankGroup, timeout: Optional[float]) -> list[Any]:
        """The poll loop: until the ranks end, check them (the launcher raises a rank's
        failure), answer stack requests and detect a stall (the monitor), look for executors
        being decommissioned and slots to grow into (the watch), and keep ``timeout``. Whatever
        ends it early stops the ranks first (:meth:`RankGroup.fail`)."""
        self.monitor.reach_ranks(group.ask_stacks)
        if self.watch is not None and group.notify is not None:
            self.watch.reach(group.notify)
        started = time.monotonic()
        try:
            try:
                while not group.poll(POLL_S, time.monotonic() - started):
                    if self.watch is not None:
                        self.watch.tick()
                    self.monitor.tick()
                    if timeout is not None and time.monotonic() - started > timeout:
                        raise TimeoutError(group.timeout_message +
                                           self.monitor.explain_timeout())
                return group.results()
            except BaseException as exc:
                failure = group.fail(exc)
                if failure is exc:
                    raise
                raise failure from exc
        finally:
            group.close()

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
                                  "requested": self.watch.request.reason
                                  if self.watch is not None and self.watch.request else None}
        return entry

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
            env=env, placement=self.placement, timeout=run.timeout, deadline=run.deadline,
            job=self.spark_job,
            run=RunTag(run.run_dir.run_id, self.number - 1, run.policy.restarts))

    def _start_files(self) -> tuple[Any, dict[str, str]]:
        """Start the run-folder service; the variables that tell the ranks where their run
        folder is."""
        from sparkhvd.runfolder.service import RunFileService
        from sparkhvd.storage import public_url

        run_dir, config = self.run.run_dir, self.run.spec.config
        options = dict(config.storage_options)
        files = RunFileService(self.placement.driver_host, run_dir.path,
                               (self.resume, options) if self.resume else None).start()
        env = {**files.env(), protocol.RUN_ID_ENV: run_dir.run_id}
        if self.placement.executors_here:
            env[protocol.RUN_URL_ENV] = run_dir.path
        if self.resume:
            env[protocol.RESUME_URL_ENV] = public_url(self.resume)
        if config.timeline:
            env[protocol.TIMELINE_ENV] = (
                run_dir.file("timeline.json") if self.placement.executors_here else
                os.path.join("/tmp", f"sparkhvd-timeline-{run_dir.run_id}.json"))
            run_dir.record.launched(timeline="timeline.json")
        return files, env

    def _clean_up(self, files: Any) -> None:
        run_dir = self.run.run_dir
        run_dir.record.stacks_saved([os.path.relpath(r.path, run_dir.path)
                                     for r in self.monitor.reports if r.path])
        if files is not None:
            files.stop()
        # the stack requests polling ranks read: the run's business only while it runs
        shutil.rmtree(run_dir.file(os.path.dirname(protocol.STACKS_REQUEST_FILE)),
                      ignore_errors=True)
