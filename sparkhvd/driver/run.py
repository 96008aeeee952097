"""One run -- one call of ``HorovodRunner.run`` or ``run_all`` -- as a state machine of attempts.

Like Ray Train v2's controller: the run is always in one state of
:mod:`sparkhvd.driver.states`, which carries what its next step needs; ``Run._step`` turns it
into the next, and :meth:`Run._enter` alone makes each transition -- logs it and writes it to
``run.json`` (``state``, ``states``; ``resizes`` for a change of size) and MLflow through the
run's callbacks. The states that may follow each (``failed`` also follows any step that
raised)::

    placing -> running | failed | restarting | resizing
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
4. *running*: an :class:`~sparkhvd.driver.attempt.Attempt` launches the ranks, and each step
   polls them once: what the poll finds comes back as data
   (:class:`~sparkhvd.driver.attempt.AttemptStatus`) -- still running; a stop due (the
   :class:`~sparkhvd.elastic.watch.AttemptWatch` saw executors being decommissioned or slots
   to grow into: the step asks the ranks to stop at their next step); a stall with
   ``on_stall="stop"`` or the run's ``timeout`` (the step stops the ranks); the ranks ended;
5. once the ranks ended, the :class:`~sparkhvd.driver.retry.RetryPolicy` says *finished*,
   *failed*, or relaunch: *restarting* at the same size or *resizing* to another, from the
   run's newest checkpoint;
6. the run is recorded (status, error, PIDs, curves, where the ranks' time went, the model,
   ``report.html``); a run that succeeded deletes the host copies earlier attempts kept on
   hosts its last attempt did not use (:mod:`sparkhvd.driver.host_sweep`) and is published;
   rank 0's result -- or the error, naming the run folder -- goes back to the caller.

What the run leaves behind -- ``run.json``, MLflow, time splits, ``report.html``, curves -- is
written by callbacks on these moments (:mod:`sparkhvd.driver.recording`), which see the run
read-only (:class:`~sparkhvd.driver.view.RunView`) and each transition as data: this module
decides and acts, and writes nothing of its record itself.

A rank's end is decoded once, by :func:`sparkhvd.driver.rank_end.verdict_of`, into the
:class:`~sparkhvd.driver.rank_end.Verdict` the policy and the error are made from. The run is
built from a frozen :class:`~sparkhvd.driver.spec.RunSpec`, not from its runner.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Optional

from sparkhvd.checkpoint.lineage import newest_checkpoint, resumable
from sparkhvd.checkpoint.sources import resolve_resume_source
from sparkhvd.common.environment import rank_env
from sparkhvd.common.errors import NotEnoughSlotsError, StorageError
from sparkhvd.common.redaction import remember_environment
from sparkhvd.driver.attempt import Attempt, status_of
from sparkhvd.driver.launchers import get_launcher
from sparkhvd.driver.logs import RankLogRouter
from sparkhvd.driver.placing import LocalPlacer, Placer, SparkPlacer, wait_for_size
from sparkhvd.driver.recording import RunCallback, recorders
from sparkhvd.driver.retry import RetryPolicy, Spent
from sparkhvd.driver.spec import RunSpec
from sparkhvd.driver.states import (
    NEXT,
    Failed,
    Finished,
    Placing,
    Relaunching,
    Resizing,
    Restarting,
    Running,
    RunState,
)
from sparkhvd.driver.view import Transition
from sparkhvd.elastic.scaling import ScalingPolicy
from sparkhvd.runfolder.record import now
from sparkhvd.runfolder.rundir import RunDir
from sparkhvd.runfolder.service import remove_row_copies
from sparkhvd.spark.installed import check_keras

__side__ = "driver"

log = logging.getLogger(__name__)

class Run:
    """One call of ``run``/``run_all``: its run folder, its states and attempts, its result."""

    def __init__(self, spec: RunSpec, fn: Callable, blob: bytes, spark: Any, *,
                 kwargs: Mapping[str, Any], return_all: bool, timeout: Optional[float],
                 placer: Optional[Placer] = None,
                 launchers: Callable[[str], Any] = get_launcher,
                 callbacks: Optional[list[RunCallback]] = None) -> None:
        """``placer``: where the attempts go (default: the Spark session, or local processes
        without one); ``launchers``: a launcher by its name -- the seams the controller's unit
        tests fill with scripted ones; ``callbacks``: what records the run (default:
        :func:`~sparkhvd.driver.recording.recorders` of its settings)."""
        self.spec, self.fn, self.blob, self.spark = spec, fn, blob, spark
        self.placer: Placer = placer if placer is not None else \
            SparkPlacer(spark, spec) if spec.scaling.spark else LocalPlacer()
        self.launchers = launchers
        self.kwargs, self.return_all, self.timeout = kwargs, return_all, timeout
        #: ``run(timeout=...)`` counts from the call: slots, start and every attempt
        self.began = time.monotonic()
        self.deadline = None if timeout is None else self.began + timeout
        config = spec.config
        #: the policies decide (sizes, relaunches); the run acts and counts what it spent
        self.scaling: ScalingPolicy = spec.scaling_policy
        self.policy: RetryPolicy = spec.retry_policy
        self.spent = Spent()
        self.run_dir = RunDir(config.output_dir, storage_options=dict(config.storage_options))
        self.record = self.run_dir.record
        self.attempts: list[Attempt] = []
        self.state: Optional[RunState] = None
        self.callbacks = callbacks if callbacks is not None else recorders(config)
        launch = spec.launch
        #: the ranks' lines: console and logs/rank-N.log (files open as ranks start)
        self.router = RankLogRouter(config.driver_log_verbosity, log_dir=self.run_dir.logs,
                                    verbose=launch.verbose)

    @property
    def restarts(self) -> int:
        """How many relaunches the retry policy allows (the ranks' rendezvous tag)."""
        return self.policy.restarts

    @property
    def state_label(self) -> Optional[str]:
        """The state the run is in (None before its first)."""
        return self.state.label if self.state is not None else None

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
        for callback in self.callbacks:
            callback.on_run_start(self)
        self.router.note(f"run {self.run_dir.run_id}: run folder {self.record['output']} "
                         "(run.json, logs/; runner.last_run_dir)")
        last: Optional[Attempt] = None
        try:
            last = self._drive(env)
            # out of preemption budget: the run failed (its last attempt says it was preempted)
            status = "failed" if last.status == "preempted" else last.status
            error = last.error
        except BaseException as exc:
            status, error = status_of(exc), exc
        finally:
            self.router.close()
            for callback in self.callbacks:
                callback.on_ranks_done(self)
            self._settle_dataset_caches()
            remove_row_copies(self.run_dir.run_id)
        if last is None:  # a timeout, an interrupt, a bad setting: recorded, then raised
            self._record_end(status, error)
            raise error  # type: ignore[misc]
        return self._end(status, error, last)

    # -- the state machine -----------------------------------------------------------------
    def _enter(self, state: RunState) -> None:
        """The one place the run changes state: checked against
        :data:`~sparkhvd.driver.states.NEXT` (``failed`` may follow any), logged, and told to
        the callbacks (``run.json``, MLflow)."""
        previous, self.state = self.state, state
        if previous is not None and not isinstance(state, Failed) and \
                type(state) not in NEXT[type(previous)]:
            raise RuntimeError(f"sparkhvd bug: the run went from {previous.label} to "
                               f"{state.label}, which NEXT does not allow")
        entry = {"state": state.label, "at": now(), "why": state.why, **state.entry()}
        transition = Transition(previous.label if previous else None, state.label, entry)
        for callback in self.callbacks:
            callback.on_state(self, transition)
        log.debug("run %s: %s -> %s (%s)", self.run_dir.run_id,
                  previous.label if previous else "-", state.label, state.why)

    def _drive(self, env: dict[str, str]) -> "Attempt":
        """From *placing*, one step at a time until the run finishes or fails; the last
        attempt. A step that keeps its state (*running*, while the ranks run) is no
        transition. A step that raises (an interrupt, an error that is no rank's) ends the run
        in *failed*, its running ranks stopped, and the error goes on."""
        state: RunState = Placing("the run starts", size=self.scaling.size)
        while True:
            if state is not self.state:
                self._enter(state)
            if isinstance(state, (Finished, Failed)):
                assert state.attempt is not None  # a failed step raised above, not here
                return state.attempt
            try:
                state = self._step(state, env)
            except BaseException as exc:
                if isinstance(self.state, Running):
                    self.state.attempt.abort(exc)
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

    def _placing(self, state: Placing) -> RunState:
        """The next attempt: its size (an elastic run's first, from the free slots), launcher
        and slots; the first also starts tracking and resolves what to resume from. An elastic
        relaunch whose slots went between their count and its placement is resized to the
        slots there are."""
        size, resume = state.size, state.resume
        if not self.attempts:  # an elastic run's first size: what the free slots allow
            size = wait_for_size(self.placer, self.scaling, size, self.spec.launch.slot_wait_s)
        try:
            placement = self.placer.place(size, not self.attempts, self.time_left())
        except NotEnoughSlotsError:
            fewer = self._fewer_slots(size)
            if fewer is None:
                raise
            return self._resized_to_the_slots(state, fewer)
        if not self.attempts:
            config = self.spec.config
            resume = None if config.resume_from is None or config.resume_from is False else \
                resolve_resume_source(config.resume_from, config.output_dir,
                                      dict(config.storage_options), exclude=self.run_dir.run_id)
        self.run_dir.remove_torn()  # a retry never trips over a killed writer's leftovers
        attempt = Attempt(self, len(self.attempts) + 1, placement, resume, state.library, size,
                          state.previous_size, launcher=self.launchers(placement.launcher),
                          free_slots=self.placer.free_slots)
        self.attempts.append(attempt)
        for callback in self.callbacks:
            callback.on_attempt_start(self, attempt)
        return Running(f"attempt {attempt.number} launches {size} rank(s)", attempt=attempt)

    def _fewer_slots(self, size: int) -> Optional[int]:
        """What an elastic relaunch can place when its ``size`` slots, counted free, were not
        there to place it on (a lost host's executor counted until Spark dropped it, or a
        returning one gone again): the size the free slots allow now (waiting for ``min_np``
        as a relaunch does); None where the run does not resize (its first placement, a run
        that is not elastic, or a count that still says ``size``)."""
        if not self.attempts or not self.scaling.elastic:
            return None
        fewer = wait_for_size(self.placer, self.scaling, size, self.spec.launch.slot_wait_s)
        return fewer if fewer < size else None

    def _resized_to_the_slots(self, state: Placing, size: int) -> Relaunching:
        """The relaunch again, at ``size``: from the last attempt's size, for its reason."""
        last = self.attempts[-1]
        assert last.verdict is not None  # it was relaunched
        kind = Resizing if size != last.size else Restarting
        return kind(f"{last.relaunch_reason(last.stop_request, last.verdict)}; only {size} of the "
                    f"{state.size} task slots counted free were there to place it on",
                    attempt=last, verdict=last.verdict,
                    checkpoint=self._newest_checkpoint() if state.resume else None,
                    size_from=last.size, size_to=size, resume=state.resume,
                    library=state.library, planned=state.planned)

    def _running(self, state: Running, env: dict[str, str]) -> RunState:
        """One poll of the attempt (launched at the first): while its ranks run, the state
        stays; a stop the watch found due is asked of the ranks; a stall (``on_stall="stop"``)
        or the run's timeout stops them. Once they ended, :meth:`_ended` decides."""
        attempt = state.attempt
        if attempt.status == "placed":
            attempt.prepare(dict(env))
            for callback in self.callbacks:
                callback.on_attempt_launch(self, attempt)
            attempt.start()
        if attempt.status == "running":
            found = attempt.poll(self.time_left())
            if found.kind == "running":
                return state
            if found.kind == "stop due":
                assert found.stop is not None
                attempt.ask_to_stop(found.stop)
                return state
            if found.kind in ("stalled", "timed out"):
                attempt.stop(found)
        return self._ended(attempt)

    def _ended(self, attempt: Attempt) -> RunState:
        """The attempt's ranks ended: the policy decides what follows (a relaunch is sized
        here, from the free slots)."""
        for callback in self.callbacks:
            callback.on_attempt_end(self, attempt)
        request = attempt.stop_request
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
        resume = resumable(self.run_dir.file("checkpoints")) or attempt.resume
        library = None if resume else self.run_dir.library_checkpoints(
            {name for earlier in self.attempts for name in earlier.outcome.output_dirs})
        size = attempt.size
        grow_to = request.grow_to if request is not None else None
        new_size = wait_for_size(self.placer, self.scaling,
                                 self.scaling.relaunch_size(size, grow_to),
                                 self.spec.launch.slot_wait_s, attempt.spark_job, grow=planned)
        kind = Resizing if new_size != size else Restarting
        return kind(attempt.relaunch_reason(request, verdict), attempt=attempt, verdict=verdict,
                    checkpoint=self._newest_checkpoint() if resume else None,
                    size_from=size, size_to=new_size, resume=resume, library=library,
                    planned=planned)

    def _newest_checkpoint(self) -> Optional[str]:
        """The file of this run's newest complete checkpoint (for the relaunch's line)."""
        return newest_checkpoint(self.run_dir.file("checkpoints"))

    def _relaunching(self, state: Relaunching) -> Placing:
        """Say why the run relaunches, from what and at which size; then place again."""
        attempt, size, new_size = state.attempt, state.size_from, state.size_to
        assert state.verdict is not None
        budget = "a planned resize" if state.planned else \
            self.policy.budget(state.verdict, self.spent)
        log.warning("sparkhvd: attempt %d ended because %s; relaunching %s with %d rank(s)%s "
                    "(attempt %d; %s)", attempt.number, state.why,
                    state.resumes_from(), new_size,
                    f" (was {size})" if new_size != size else "", attempt.number + 1, budget)
        self.router.line_all(f"---- attempt {attempt.number + 1}: {state.label} after "
                             f"{state.why}"
                             f"{f' ({size} -> {new_size} ranks)' if new_size != size else ''}"
                             " ----")
        return Placing(f"relaunch after attempt {attempt.number}", size=new_size,
                       resume=state.resume, library=state.library, previous_size=size,
                       planned=state.planned)

    # -- the steps ---------------------------------------------------------------------------
    def _rank_env(self) -> dict[str, str]:
        """What every rank gets from the driver: the user's ``env=`` and sparkhvd's own."""
        launch = self.spec.launch
        remember_environment(os.environ)
        env = rank_env(dict(launch.env), verbose=launch.verbose)
        if self.spec.backend == "horovod":
            check_keras({**os.environ, **env})
        return env

    def _end(self, status: str, error: Optional[BaseException], last: "Attempt") -> list:
        """Record, track and publish the run; return the results or raise its error."""
        model: Optional[str] = None
        if error is None:
            saved = self.run_dir.save_result(last.results[0]) if last.results else None
            model = os.path.basename(saved) if saved else None
        self._record_end(status, error, model=model)
        if last.verdict is not None:
            # Now that the run folder is where it stays (published if remote), say where.
            raise last.verdict.error(self.run_dir.location) from None
        if error is not None:
            raise error
        self._sweep_host_copies()
        try:
            self.run_dir.publish()
        except StorageError as exc:
            exc.result = last.results if self.return_all else last.results[0]
            raise
        return last.results

    @staticmethod
    def _settle_dataset_caches() -> None:
        """No rank runs: a safe point to delete the caches of datasets garbage-collected
        meanwhile (never done by the collector itself: :mod:`sparkhvd.data.materialize`)."""
        from sparkhvd.data.materialize import REGISTRY

        REGISTRY.settle()

    def _sweep_host_copies(self) -> None:
        """The run succeeded: the host copies earlier attempts kept on hosts the last attempt
        did not use are deleted (the last attempt's ranks deleted theirs)."""
        from sparkhvd.driver.host_sweep import hosts_to_sweep

        hosts = hosts_to_sweep([set(attempt.outcome.hosts.values())
                                for attempt in self.attempts])
        if hosts:
            self.placer.sweep_host_copies(self.run_dir.run_id, hosts, self.spec.launch.env or {})

    def _record_end(self, status: str, error: Optional[BaseException],
                    model: Optional[str] = None) -> None:
        for callback in self.callbacks:
            callback.on_run_end(self, status, error, model)
        if status != "succeeded":
            self.run_dir.publish_quietly()
        log.debug("run %s %s in %.1fs", self.run_dir.run_id, status,
                  time.monotonic() - self.began)
