r"""One run -- one call of ``HorovodRunner.run`` or ``run_all`` -- as a state machine of attempts.

Like Ray Train v2's controller: the run is always in one named :class:`State`, and every
transition is made by :meth:`Run._enter` alone, which logs it and writes it to ``run.json``
(``state``, ``states``; ``resizes`` for a change of size) and MLflow::

    placing -> running -> finished
       |         |  \-> failed
       \-> failed (no slots, a launch that cannot start)
                 |-> restarting -> placing -> running ...   (same size: a lost rank, a notice)
                 \-> resizing  -> placing -> running ...   (another size: elastic)

The story of a run, start to end (:meth:`Run.execute`):

1. the run folder is made and checked (remote storage is written to before training), and
   ``run.json`` says what was asked (:class:`~sparkhvd.runfolder.record.RunRecord`);
2. *placing*: how many ranks (:class:`~sparkhvd.elastic.scaling.ScalingPolicy`: ``np``, or for
   an elastic run what the free slots allow within ``min_np``..``max_np``), which launcher,
   where the driver is reached, the Spark task slots;
3. MLflow tracking starts when asked; the resume source is resolved;
4. *running*: an :class:`Attempt` launches the ranks; the driver watches it
   (:class:`~sparkhvd.elastic.watch.AttemptWatch`: executors being decommissioned, slots to
   grow into) and may ask the ranks to stop at their next step;
5. the :class:`~sparkhvd.driver.retry.RetryPolicy` says *finished*, *failed*, or relaunch:
   *restarting* at the same size or *resizing* to another, from the run's newest checkpoint;
6. the run is recorded (status, error, PIDs, curves, where the ranks' time went, the model,
   ``report.html``) and published, and rank 0's
   result -- or the error, naming the run folder -- goes back to the caller.

A rank's end is decoded once, by :func:`sparkhvd.driver.rank_end.classify`, into the
:class:`~sparkhvd.driver.rank_end.Verdict` the policy and the error are made from. The run is
built from a frozen :class:`~sparkhvd.driver.spec.RunSpec`, not from its runner.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import shutil
import time
from typing import Any, Callable, Mapping, Optional

from sparkhvd.common import protocol
from sparkhvd.common.backends import RunTag
from sparkhvd.common.environment import rank_env
from sparkhvd.common.errors import LaunchFailure, StallError, StorageError
from sparkhvd.common.protocol import RankOptions
from sparkhvd.common.redaction import remember_environment
from sparkhvd.driver.installed import check_keras
from sparkhvd.driver.launchers import LaunchSpec, Placement, choose_launcher, get_launcher
from sparkhvd.driver.logs import RankLogRouter
from sparkhvd.driver.monitor import RunMonitor
from sparkhvd.driver.outcome import RunOutcome, merge_epochs
from sparkhvd.driver.rank_end import Verdict, classify
from sparkhvd.driver.retry import RetryPolicy
from sparkhvd.driver.spec import RunSpec
from sparkhvd.elastic import cluster
from sparkhvd.elastic.scaling import ScalingPolicy
from sparkhvd.elastic.watch import AttemptWatch
from sparkhvd.runfolder.record import now
from sparkhvd.runfolder.rundir import RunDir, resolve_resume_source
from sparkhvd.timing.splits import TimeSplits

__side__ = "driver"

log = logging.getLogger(__name__)


class State(enum.Enum):
    """The run's states: each a name, and whether the run ends in it."""

    PLACING = ("placing", False)
    RUNNING = ("running", False)
    RESTARTING = ("restarting", False)
    RESIZING = ("resizing", False)
    FINISHED = ("finished", True)
    FAILED = ("failed", True)

    def __init__(self, label: str, terminal: bool) -> None:
        self.label, self.terminal = label, terminal


def _status_of(exc: BaseException) -> str:
    return ("interrupted" if isinstance(exc, KeyboardInterrupt) else
            "timed out" if isinstance(exc, TimeoutError) else "failed")


def settle_dataset_caches() -> None:
    """The run's end is a safe point to delete the caches of datasets garbage-collected
    meanwhile (never done by the collector itself: :mod:`sparkhvd.data.materialize`)."""
    from sparkhvd.data.materialize import REGISTRY

    REGISTRY.settle()


def _resumes_from(resume: Optional[str], library: Optional[str]) -> str:
    """What a relaunch resumes from, in words (the console's retry line)."""
    if resume:
        return f"from sparkhvd's checkpoints in {resume}"
    if library:
        return f"with your library's own checkpoints in {library} (it resumes from them " \
               "where your code asks it to)"
    return "from the start (no checkpoints)"


class Run:
    """One call of ``run``/``run_all``: its run folder, its states and attempts, its result."""

    def __init__(self, spec: RunSpec, fn: Callable, blob: bytes, spark: Any, *,
                 kwargs: Mapping[str, Any], return_all: bool, timeout: Optional[float]) -> None:
        self.spec, self.fn, self.blob, self.spark = spec, fn, blob, spark
        self.kwargs, self.return_all, self.timeout = kwargs, return_all, timeout
        #: ``run(timeout=...)`` counts from the call: slots, start and every attempt
        self.deadline = None if timeout is None else time.monotonic() + timeout
        config = spec.config
        # horovod's elastic mode resizes inside one attempt (horovod.spark.run_elastic)
        self.scaling = ScalingPolicy.of(spec.scaling) if not spec.facts.horovod_elastic else \
            ScalingPolicy(spec.scaling.size, spec.scaling.size, spec.scaling.size)
        self.policy = RetryPolicy.of(config.max_retries, config.max_preemptions,
                                     self.scaling.elastic)
        self.run_dir = RunDir(config.output_dir, storage_options=dict(config.storage_options))
        self.record = self.run_dir.record
        self.attempts: list[Attempt] = []
        self.metrics: list[dict] = []
        self.state: Optional[State] = None
        #: executor id -> host of the executors this run saw lost (left out of slot counts)
        self.lost_executors: dict[str, str] = {}
        #: tasks this run saw vanish with their executor (Spark Connect's slot count)
        self.lost_tasks = 0
        launch = spec.launch
        #: the ranks' lines: console and logs/rank-N.log (files open as ranks start)
        self.router = RankLogRouter(config.driver_log_verbosity, log_dir=self.run_dir.logs,
                                    verbose=launch.verbose)
        self.tracker: Any = None
        self.view: Any = None
        #: where the ranks' time goes: timing.jsonl, stragglers on the console, report.html
        self.timing: Optional[TimeSplits] = TimeSplits(
            self.run_dir.path, say=self.router.note,
            findings=lambda found: self.record.timed(findings=found)) \
            if config.time_split else None

    def time_left(self) -> Optional[float]:
        """What is left of ``run(timeout=...)`` now (None: no limit)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    @property
    def attempt(self) -> Optional["Attempt"]:
        """The latest attempt (the running one while the run runs)."""
        return self.attempts[-1] if self.attempts else None

    def execute(self) -> list:
        """The run, start to end (see the module docstring); rank 0's result first."""
        env = self._rank_env()
        try:
            self.run_dir.preflight()
        except StorageError as exc:
            self._record_end("failed", exc)
            raise
        spec = self.spec
        elastic = {"min_np": self.scaling.min_np, "max_np": self.scaling.max_np} \
            if self.scaling.elastic else {}
        self.record.started(np=spec.scaling.np, mode=spec.scaling.mode,
                            ranks_per_task=spec.scaling.ranks_per_task,
                            node_per_task=spec.scaling.node_per_task, backend=spec.backend,
                            function=getattr(self.fn, "__qualname__", repr(self.fn)), **elastic)
        self.router.note(f"run {self.run_dir.run_id}: run folder {self.record['output']} "
                         "(run.json, logs/; runner.last_run_dir)")
        last: Optional[Attempt] = None
        try:
            last = self._drive(env)
            # out of preemption budget: the run failed (its last attempt says it was preempted)
            status = "failed" if last.status == "preempted" else last.status
            error = last.error
        except BaseException as exc:
            status, error = _status_of(exc), exc
            if self.state is not None and not self.state.terminal:
                self._enter(State.FAILED, f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            self.router.close()
            self._write_curves()
            if self.timing is not None:
                self.timing.close()
                self.record.timed(**self.timing.summary())
            settle_dataset_caches()
        if last is None:  # a timeout, an interrupt, a bad setting: recorded, then raised
            self._record_end(status, error)
            raise error  # type: ignore[misc]
        return self._end(status, error, last)

    # -- the state machine -----------------------------------------------------------------
    def _enter(self, state: State, why: str, **details: Any) -> None:
        """The one place the run changes state: logged, in ``run.json`` and in MLflow."""
        previous, self.state = self.state, state
        entry = {"state": state.label, "at": now(), "why": why, **details}
        self.record.transition(entry)
        if self.tracker is not None:
            self.tracker.transition(entry)
        log.debug("run %s: %s -> %s (%s)", self.run_dir.run_id,
                  previous.label if previous else "-", state.label, why)

    def _drive(self, env: dict[str, str]) -> "Attempt":
        """placing -> running -> (restarting | resizing -> placing -> running ...) until the
        policy says finished or failed; the last attempt."""
        size, why = self.scaling.np, "the run starts"
        resume: Optional[str] = None
        library: Optional[str] = None
        previous_size: Optional[int] = None
        while True:
            self._enter(State.PLACING, why, size=size)
            if not self.attempts:
                size = self._size_now(size)
            placement = self._place(size)
            if not self.attempts:
                self._track(placement)
                resume = self._resume_source()
            self.run_dir.remove_torn()  # a retry never trips over a killed writer's leftovers
            attempt = Attempt(self, len(self.attempts) + 1, placement, resume, library, size,
                              previous_size)
            self.attempts.append(attempt)
            self._enter(State.RUNNING, f"attempt {attempt.number} launches {size} rank(s)",
                        attempt=attempt.number, size=size)
            attempt.launch(dict(env))
            self.metrics = merge_epochs(self.metrics, attempt.outcome.metrics)
            self.record.attempt_ended(attempt.entry(), attempt.outcome.resumed)
            request = attempt.watch.request if attempt.watch is not None else None
            planned = request is not None and request.kind == "grow" and \
                attempt.verdict is not None and attempt.verdict.preempted
            decision = self.policy.decide(attempt.status != "succeeded", attempt.verdict,
                                          planned=planned)
            if decision == "done":
                self._enter(State.FINISHED, f"attempt {attempt.number} succeeded")
                return attempt
            if decision == "raise":
                self._enter(State.FAILED, attempt.entry().get("error") or attempt.status)
                return attempt
            verdict = attempt.verdict
            assert verdict is not None
            self._note_losses(attempt, verdict)
            resume = self.run_dir.own_checkpoints() or resume
            library = None if resume else self._library_checkpoints()
            why = self._why(attempt, request, verdict)
            new_size = self._size_now(self._relaunch_size(attempt, request), grow=planned)
            checkpoint = self.run_dir.newest_checkpoint() if resume else None
            state = State.RESIZING if new_size != size else State.RESTARTING
            self._enter(state, why, attempt=attempt.number, checkpoint=checkpoint,
                        **{"from": size, "to": new_size})
            budget = "a planned resize" if planned else self.policy.budget(verdict)
            log.warning("sparkhvd: attempt %d ended because %s; relaunching %s with %d rank(s)%s "
                        "(attempt %d; %s)", attempt.number, why, _resumes_from(resume, library),
                        new_size, f" (was {size})" if new_size != size else "",
                        attempt.number + 1, budget)
            self.router.line_all(f"---- attempt {attempt.number + 1}: {state.label} after {why}"
                                 f"{f' ({size} -> {new_size} ranks)' if new_size != size else ''}"
                                 " ----")
            previous_size, size = size, new_size
            why = f"relaunch after attempt {attempt.number}"

    @staticmethod
    def _why(attempt: "Attempt", request: Any, verdict: Verdict) -> str:
        """Why an attempt is relaunched, in words: the driver's request, the rank that got the
        notice, or the loss."""
        if request is not None:
            return str(request.reason)
        noticed = {rank: msg.reason for rank, msg in attempt.outcome.preempted.items()
                   if msg.reason != protocol.NOTICE_SPREAD}
        if verdict.preempted and noticed:
            rank = min(noticed)
            host = attempt.outcome.hosts.get(rank)
            return (f"rank {rank}{f' on host {host}' if host else ''} got a notice "
                    f"({noticed[rank]}) and every rank stopped after its checkpoint")
        return verdict.retryable or "?"

    def _note_losses(self, attempt: "Attempt", verdict: Verdict) -> None:
        """The executors (or, on Connect, the tasks) an attempt lost: left out of the next
        slot count until Spark drops them itself."""
        failure = attempt.failure
        if failure is None or not (failure.vanished or failure.lost):
            return
        self.lost_tasks += 1
        watch = attempt.watch
        if failure.lost and watch is not None and failure.host:
            hosts = dict(cluster.safely("executors", lambda: {
                e.id: e.host for e in cluster.executors(self.view.sc)}, {}))
            for exec_id in set(watch.executors.values()):
                if hosts.get(exec_id) == failure.host:
                    self.lost_executors[exec_id] = failure.host

    def _free_slots(self, ended: Optional[str] = None) -> int:
        return cluster.free_slots(self.view, self.lost_executors, self.lost_tasks, ended)

    def _size_now(self, size: int, grow: bool = False) -> int:
        """An elastic run's size for this placement: ``size`` if that many slots are free, else
        what is free within ``min_np``..``max_np`` (waiting up to ``slot_wait_s`` for
        ``min_np``; a planned ``grow`` to ``size`` waits a moment for its slots). Other runs
        keep ``size`` (the slot check names a shortfall)."""
        if not self.scaling.elastic or not self.spec.scaling.spark:
            return size
        self._ensure_view()
        ended = self.attempt.spark_job if self.attempt is not None else None
        free = self.scaling.relaunch_size(
            lambda: self._free_slots(ended), self.spec.launch.slot_wait_s,
            lambda n: cluster.describe_lost(self.lost_executors), want=size if grow else None)
        return min(size, free)

    def _relaunch_size(self, attempt: "Attempt", request: Any) -> int:
        """The size a relaunch asks for: a grow's target, else ``max_np`` for an elastic run
        (placing trims it to the free slots), else the same size."""
        if not self.scaling.elastic:
            return attempt.size
        if request is not None and request.grow_to:
            return int(request.grow_to)
        return self.scaling.max_np

    def _ensure_view(self) -> None:
        if self.view is None and self.spark is not None:
            from sparkhvd.driver.sparkview import SparkView

            self.view = SparkView(self.spark)

    # -- the steps ---------------------------------------------------------------------------
    def _rank_env(self) -> dict[str, str]:
        """What every rank gets from the driver: the user's ``env=`` and sparkhvd's own."""
        launch = self.spec.launch
        remember_environment(os.environ)
        env = rank_env(dict(launch.env), verbose=launch.verbose)
        if self.spec.backend == "horovod":
            check_keras({**os.environ, **env})
        return env

    def _track(self, placement: Placement) -> None:
        config = self.spec.config
        if config.mlflow:
            from sparkhvd.ops.tracking import MlflowTracker

            self.tracker = MlflowTracker(config.mlflow)
            self.tracker.start(self.run_dir, {**self.record.params(),
                                              "launcher": placement.launcher}, self.kwargs)
            if self.timing is not None:
                self.timing.tracker = self.tracker

    def _library_checkpoints(self) -> Optional[str]:
        """The ``st.output_dir`` folders of this run that hold files -- a library's own
        checkpoints (Lightning, HF ``Trainer``), which it resumes from when the user's code
        asks it to -- as ``<run folder>/<name>``, or None."""
        names = sorted({name for attempt in self.attempts
                        for name in attempt.outcome.output_dirs})
        found = [self.run_dir.file(name) for name in names
                 if any(files for _, _, files in os.walk(self.run_dir.file(name)))]
        return ", ".join(found) or None

    def _end(self, status: str, error: Optional[BaseException], last: "Attempt") -> list:
        """Record, track and publish the run; return the results or raise its error."""
        model: Optional[str] = None
        if error is None:
            self.record.mark("finished")
            saved = self.run_dir.save_result(last.results[0]) if last.results else None
            model = os.path.basename(saved) if saved else None
        self._record_end(status, error, model=model)
        if last.verdict is not None:
            # Now that the run folder is where it stays (published if remote), say where.
            raise last.verdict.error(self.run_dir.location) from None
        if error is not None:
            raise error
        try:
            self.run_dir.publish()
        except StorageError as exc:
            exc.result = last.results if self.return_all else last.results[0]
            raise
        return last.results

    def _record_end(self, status: str, error: Optional[BaseException],
                    model: Optional[str] = None) -> None:
        last = self.attempt
        outcome = last.outcome if last is not None else None
        self.record.finished(status, error=error,
                             pids=outcome.pid_record() if outcome is not None else {},
                             resumed=outcome.resumed if outcome is not None else None,
                             model=model)
        self._write_report()
        if self.tracker is not None:
            self.tracker.finish(self.run_dir, status)
        if status != "succeeded":
            self.run_dir.publish_quietly()
        log.debug("run %s %s in %.1fs", self.run_dir.run_id, status,
                  self.record["timings"]["total"])

    # -- what the steps ask of Spark and the run folder -------------------------------------
    def _place(self, size: int) -> Placement:
        """Which launcher, where the driver is reached, and whether the ranks share its disk;
        the task slots for ``size`` ranks checked."""
        spec = self.spec
        if not spec.scaling.spark:
            self.record.placed("local")
            return Placement("local", nics=frozenset({"lo"}))
        from sparkhvd.driver.session import check_worker_python
        from sparkhvd.driver.slots import check_slots

        placing = time.monotonic()
        self._ensure_view()
        view = self.view
        name = choose_launcher(spec.facts.with_session(view))
        if not self.attempts:
            check_worker_python(view, spec.backend)
        launch = spec.launch
        # Waiting for other jobs' slots is part of starting: start_timeout (from here) and the
        # run's own limit bound it too.
        left = self.time_left()
        busy_wait = min(launch.slot_wait_s,
                        launch.start_timeout - (time.monotonic() - placing),
                        math.inf if left is None else left)
        slots = check_slots(view, size // spec.scaling.ranks_per_task,
                            wait_s=0 if view.master.startswith("local") else launch.slot_wait_s,
                            ranks_per_task=spec.scaling.ranks_per_task,
                            busy_wait_s=max(0.0, busy_wait))
        self.record.placed(name, spark_master=view.master, spark_app_id=view.app_id,
                           session=view.kind, slots=slots.slots)
        here = view.executors_here()
        return Placement(name, driver_host=view.driver_host(), executors_here=here,
                         nics=launch.nics or (frozenset({"lo"}) if here else None),
                         session=view)

    def _resume_source(self) -> Optional[str]:
        """The checkpoints folder to resume from (or None), recorded as *requested*."""
        config = self.spec.config
        if config.resume_from is None or config.resume_from is False:
            return None
        source = resolve_resume_source(config.resume_from, config.output_dir,
                                       dict(config.storage_options),
                                       exclude=self.run_dir.run_id)
        self.record.resume_requested(source)
        return source

    def _write_report(self) -> None:
        """``report.html``: the run at a glance, one offline file (:mod:`sparkhvd.timing.
        report`); never in the way of the run's outcome."""
        from sparkhvd.timing.report import write_report

        try:
            write_report(self.run_dir.path)
            self.record.reported("report.html")
        except Exception as exc:  # noqa: BLE001 - a report must never hide the run's outcome
            log.warning("could not write report.html: %s", exc)

    def _write_curves(self) -> None:
        """``metrics.csv`` always; ``curves.png`` where matplotlib is installed (the ``plots``
        extra): nobody asked for a picture, so its absence is no warning."""
        if not self.metrics:
            return
        from sparkhvd.runfolder.curves import can_plot, plot_curves, write_metrics_csv

        try:
            write_metrics_csv(self.run_dir.file("metrics.csv"), self.metrics)
            if can_plot():
                plot_curves(self.run_dir.file("curves.png"), self.metrics)
            else:
                log.debug("curves.png not drawn: matplotlib is not installed")
        except Exception as exc:  # noqa: BLE001 - curves must never hide the run's outcome
            log.warning("could not write the training curves: %s", exc)


class Attempt:
    """One launch of the ranks: how it ended (``status``), the ranks' results, and -- when a
    rank failed -- the :class:`~sparkhvd.driver.rank_end.Verdict`."""

    def __init__(self, run: Run, number: int, placement: Placement,
                 resume: Optional[str], library: Optional[str] = None, size: int = 0,
                 previous_size: Optional[int] = None) -> None:
        """``resume``: the checkpoints sparkhvd restores; ``library``: the folders where a
        library keeps its own (``st.output_dir``), when sparkhvd has none; ``size``: the
        ranks it launches (``previous_size``: the attempt before, after a resize)."""
        self.run, self.number, self.placement, self.resume = run, number, placement, resume
        self.library = library
        self.size = size or run.scaling.np
        self.previous_size = previous_size
        self.outcome = RunOutcome(run.router)
        if run.tracker is not None:
            self.outcome.listeners.append(run.tracker.metrics)
        if run.timing is not None:
            run.timing.begin(number, self.size)
            self.outcome.time_splits = run.timing.add
        launch = run.spec.launch
        self.monitor = self.outcome.monitor = RunMonitor(
            self.outcome, run.run_dir.path, stall_timeout=launch.stall_timeout,
            on_stall=launch.on_stall)
        #: the Spark job tag (or group) of this attempt's barrier stage: in ``run.json`` before
        #: the job is submitted, so it can always be found and cancelled
        self.spark_job = f"sparkhvd-{run.run_dir.run_id}-{number}"
        #: the driver's eye on the running attempt (decommission, slots to grow into)
        self.watch: Optional[AttemptWatch] = None
        if placement.launcher == "barrier":
            outcome = self.outcome
            self.watch = self.monitor.watch = AttemptWatch(
                placement.session, self.spark_job, run.scaling, self.size,
                listening=lambda: len(outcome.listening) >= self.size,
                lost=lambda: run.lost_executors)
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
            log.info("Launching %d rank(s) %s; logs in %s", spec.np,
                     f"on Spark ({spec.session.describe()})" if spec.session else
                     "as local processes", run.run_dir.logs)
            self.results = get_launcher(self.placement.launcher).launch(spec, self.outcome)
            run.record.launched(control=self.outcome.channel)
            self.status = "succeeded"
        except LaunchFailure as failure:
            self.failure = failure
            self.verdict = classify(failure, self.outcome.reported(), self.outcome.hosts,
                                    run.router.tail)
            self.status = "preempted" if self.verdict.preempted else "failed"
            self.error = self.verdict.error()
        except StallError as exc:
            self.status, self.error = "stalled", exc
        finally:
            self._clean_up(files)

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
            scaling = dataclasses.replace(scaling, np=self.size if scaling.np > 0 else -self.size)
        env[protocol.ATTEMPT_ENV] = str(self.number)
        if run.scaling.elastic:
            env[protocol.ELASTIC_ENV] = "1"
        if self.previous_size is not None and self.previous_size != self.size:
            env[protocol.PREVIOUS_SIZE_ENV] = str(self.previous_size)
        return LaunchSpec(
            scaling=scaling, launch=launch, backend=spec.backend, payload=run.blob,
            options=RankOptions(verbose=launch.verbose, return_all=run.return_all,
                                elastic=spec.facts.horovod_elastic,
                                time_split=run.timing is not None,
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
