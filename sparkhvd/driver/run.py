"""One run -- one call of ``HorovodRunner.run`` or ``run_all`` -- as a state machine of attempts.

Like Ray Train v2's controller: the run is always in one state of
:mod:`sparkhvd.driver.states`, which carries what its next step needs; ``Run._step`` turns it
into the next, and :meth:`Run._enter` alone makes each transition -- logs it and writes it to
``run.json`` (``state``, ``states``; ``resizes`` for a change of size) and MLflow. The states
that may follow each (``failed`` also follows any step that raised)::

    placing -> running | failed
    running -> finished | failed | restarting | resizing
    restarting -> placing | failed
    resizing -> placing | failed

The story of a run, start to end (:meth:`Run.execute`):

1. the run folder is made and checked (remote storage is written to before training), and
   ``run.json`` says what was asked (:class:`~sparkhvd.runfolder.record.RunRecord`);
2. *placing*: how many ranks (:class:`~sparkhvd.elastic.scaling.ScalingPolicy`: ``np``, or for
   an elastic run what the free slots allow within ``min_np``..``max_np``), which launcher,
   where the driver is reached, the Spark task slots;
3. MLflow tracking starts when asked; the resume source is resolved;
4. *running*: an :class:`~sparkhvd.driver.attempt.Attempt` launches the ranks; the driver
   watches it (:class:`~sparkhvd.elastic.watch.AttemptWatch`: executors being decommissioned,
   slots to grow into) and may ask the ranks to stop at their next step;
5. the :class:`~sparkhvd.driver.retry.RetryPolicy` says *finished*, *failed*, or relaunch:
   *restarting* at the same size or *resizing* to another, from the run's newest checkpoint;
6. the run is recorded (status, error, PIDs, curves, where the ranks' time went, the model,
   ``report.html``) and published, and rank 0's
   result -- or the error, naming the run folder -- goes back to the caller.

A rank's end is decoded once, by :func:`sparkhvd.driver.rank_end.verdict_of`, into the
:class:`~sparkhvd.driver.rank_end.Verdict` the policy and the error are made from. The run is
built from a frozen :class:`~sparkhvd.driver.spec.RunSpec`, not from its runner.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Optional

from sparkhvd.common import protocol
from sparkhvd.common.environment import rank_env
from sparkhvd.common.errors import StorageError
from sparkhvd.common.redaction import remember_environment
from sparkhvd.driver.attempt import Attempt
from sparkhvd.driver.installed import check_keras
from sparkhvd.driver.launchers import Placement, get_launcher, left_until
from sparkhvd.driver.logs import RankLogRouter
from sparkhvd.driver.outcome import merge_epochs
from sparkhvd.driver.placing import LocalPlacer, Placer, SparkPlacer
from sparkhvd.driver.rank_end import Verdict
from sparkhvd.driver.retry import RetryPolicy, Spent
from sparkhvd.driver.spec import RunSpec
from sparkhvd.driver.states import (
    Failed,
    Finished,
    Placing,
    Relaunching,
    Resizing,
    Restarting,
    Running,
    RunState,
)
from sparkhvd.elastic.scaling import ScalingPolicy, not_enough_slots
from sparkhvd.runfolder.record import now
from sparkhvd.runfolder.rundir import RunDir, resolve_resume_source
from sparkhvd.timing.splits import TimeSplits

__side__ = "driver"

log = logging.getLogger(__name__)

#: How often a placement below ``min_np`` counts the free slots again while it waits.
SLOT_POLL_S = 0.5


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
                 kwargs: Mapping[str, Any], return_all: bool, timeout: Optional[float],
                 placer: Optional[Placer] = None,
                 launchers: Callable[[str], Any] = get_launcher) -> None:
        """``placer``: where the attempts go (default: the Spark session, or local processes
        without one); ``launchers``: a launcher by its name -- the seams the controller's unit
        tests fill with scripted ones."""
        self.spec, self.fn, self.blob, self.spark = spec, fn, blob, spark
        self.placer: Placer = placer if placer is not None else \
            SparkPlacer(spark, spec) if spec.scaling.spark else LocalPlacer()
        self.launchers = launchers
        self.kwargs, self.return_all, self.timeout = kwargs, return_all, timeout
        #: ``run(timeout=...)`` counts from the call: slots, start and every attempt
        self.deadline = None if timeout is None else time.monotonic() + timeout
        config = spec.config
        #: the policies decide (sizes, relaunches); the run acts and counts what it spent
        self.scaling: ScalingPolicy = spec.scaling_policy
        self.policy: RetryPolicy = spec.retry_policy
        self.spent = Spent()
        self.run_dir = RunDir(config.output_dir, storage_options=dict(config.storage_options))
        self.record = self.run_dir.record
        self.attempts: list[Attempt] = []
        self.metrics: list[dict] = []
        self.state: Optional[RunState] = None
        launch = spec.launch
        #: the ranks' lines: console and logs/rank-N.log (files open as ranks start)
        self.router = RankLogRouter(config.driver_log_verbosity, log_dir=self.run_dir.logs,
                                    verbose=launch.verbose)
        self.tracker: Any = None
        #: where the ranks' time goes: timing.jsonl, stragglers on the console, report.html
        self.timing: Optional[TimeSplits] = TimeSplits(
            self.run_dir.path, say=self.router.note,
            findings=lambda found: self.record.timed(findings=found)) \
            if config.time_split else None

    def time_left(self) -> Optional[float]:
        """What is left of ``run(timeout=...)`` now (None: no limit)."""
        return left_until(self.deadline)

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
    def _enter(self, state: RunState) -> None:
        """The one place the run changes state: logged, in ``run.json`` and in MLflow."""
        previous, self.state = self.state, state
        entry = {"state": state.label, "at": now(), "why": state.why, **state.entry()}
        self.record.transition(entry)
        if self.tracker is not None:
            self.tracker.transition(entry)
        log.debug("run %s: %s -> %s (%s)", self.run_dir.run_id,
                  previous.label if previous else "-", state.label, state.why)

    def _drive(self, env: dict[str, str]) -> "Attempt":
        """From *placing*, one step at a time until the run finishes or fails; the last
        attempt. A step that raises ends the run in *failed*, and the error goes on."""
        state: RunState = Placing("the run starts", size=self.scaling.np)
        while True:
            self._enter(state)
            if isinstance(state, (Finished, Failed)):
                return state.attempt
            try:
                state = self._step(state, env)
            except BaseException as exc:
                self._enter(Failed(f"{type(exc).__name__}: {str(exc)[:200]}"))
                raise

    def _step(self, state: RunState, env: dict[str, str]) -> RunState:
        """The state that follows ``state`` (its work done): the run's only decisions of what
        comes next (:data:`~sparkhvd.driver.states.NEXT`)."""
        if isinstance(state, Placing):
            return self._placing(state)
        if isinstance(state, Running):
            return self._running(state, env)
        assert isinstance(state, Relaunching), state
        return self._relaunching(state)

    def _placing(self, state: Placing) -> Running:
        """The next attempt: its size (an elastic run's first, from the free slots), launcher
        and slots; the first also starts tracking and resolves what to resume from."""
        size, resume = state.size, state.resume
        if not self.attempts:
            size = self._size_now(size)
        placement = self.placer.place(size, not self.attempts, self.time_left(), self.record)
        if not self.attempts:
            self._track(placement)
            resume = self._resume_source()
        self.run_dir.remove_torn()  # a retry never trips over a killed writer's leftovers
        attempt = Attempt(self, len(self.attempts) + 1, placement, resume, state.library, size,
                          state.previous_size)
        self.attempts.append(attempt)
        return Running(f"attempt {attempt.number} launches {size} rank(s)", attempt=attempt)

    def _running(self, state: Running, env: dict[str, str]) -> RunState:
        """Launch the attempt and wait for its end; the policy decides what follows (a relaunch
        is sized here, from the free slots)."""
        attempt = state.attempt
        attempt.launch(dict(env))
        self.metrics = merge_epochs(self.metrics, attempt.outcome.metrics)
        self.record.attempt_ended(attempt.entry(), attempt.outcome.resumed)
        request = attempt.watch.request if attempt.watch is not None else None
        planned = request is not None and request.kind == "grow" and \
            attempt.verdict is not None and attempt.verdict.preempted
        decision = self.policy.decide(attempt.status != "succeeded", attempt.verdict,
                                      planned=planned, spent=self.spent)
        if decision == "done":
            return Finished(f"attempt {attempt.number} succeeded", attempt=attempt)
        if decision == "raise":
            return Failed(attempt.entry().get("error") or attempt.status, attempt=attempt)
        verdict = attempt.verdict
        assert verdict is not None
        if not planned:
            self.spent = self.spent.charged(verdict)
        watch = attempt.watch
        self.placer.note_losses(attempt.failure, lambda: set(watch.executors.values())
                                if watch is not None else set())
        resume = self.run_dir.own_checkpoints() or attempt.resume
        library = None if resume else self._library_checkpoints()
        size = attempt.size
        new_size = self._size_now(self._relaunch_size(attempt, request), grow=planned)
        kind = Resizing if new_size != size else Restarting
        return kind(self._why(attempt, request, verdict), attempt=attempt, verdict=verdict,
                    checkpoint=self.run_dir.newest_checkpoint() if resume else None,
                    size_from=size, size_to=new_size, resume=resume, library=library,
                    planned=planned)

    def _relaunching(self, state: Relaunching) -> Placing:
        """Say why the run relaunches, from what and at which size; then place again."""
        attempt, size, new_size = state.attempt, state.size_from, state.size_to
        assert state.verdict is not None
        budget = "a planned resize" if state.planned else \
            self.policy.budget(state.verdict, self.spent)
        log.warning("sparkhvd: attempt %d ended because %s; relaunching %s with %d rank(s)%s "
                    "(attempt %d; %s)", attempt.number, state.why,
                    _resumes_from(state.resume, state.library), new_size,
                    f" (was {size})" if new_size != size else "", attempt.number + 1, budget)
        self.router.line_all(f"---- attempt {attempt.number + 1}: {state.label} after "
                             f"{state.why}"
                             f"{f' ({size} -> {new_size} ranks)' if new_size != size else ''}"
                             " ----")
        return Placing(f"relaunch after attempt {attempt.number}", size=new_size,
                       resume=state.resume, library=state.library, previous_size=size)

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

    def _free_slots(self, ended: Optional[str] = None) -> int:
        return self.placer.free_slots(ended)

    def _size_now(self, size: int, grow: bool = False) -> int:
        """An elastic run's size for this placement: ``size`` if that many slots are free, else
        what is free within ``min_np``..``max_np`` (waiting up to ``slot_wait_s`` for
        ``min_np``; a planned ``grow`` to ``size`` waits a moment for its slots). Other runs
        keep ``size`` (the slot check names a shortfall)."""
        if not self.scaling.elastic or not self.placer.counts_slots:
            return size
        ended = self.attempt.spark_job if self.attempt is not None else None
        wait_s, began = self.spec.launch.slot_wait_s, time.monotonic()
        while True:
            free = self._free_slots(ended)
            decision = self.scaling.size_now(free, time.monotonic() - began, wait_s,
                                             want=size if grow else None)
            if decision.action == "place":
                return min(size, decision.size)
            if decision.action == "short":
                raise not_enough_slots(self.scaling.min_np, free, wait_s,
                                       self.placer.describe_lost())
            time.sleep(SLOT_POLL_S)

    def _relaunch_size(self, attempt: "Attempt", request: Any) -> int:
        """The size a relaunch asks for: a grow's target, else ``max_np`` for an elastic run
        (placing trims it to the free slots), else the same size."""
        if not self.scaling.elastic:
            return attempt.size
        if request is not None and request.grow_to:
            return int(request.grow_to)
        return self.scaling.max_np

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

    # -- what the steps ask of the run folder ---------------------------------------------
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
