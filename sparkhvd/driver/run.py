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
   (:class:`~sparkhvd.driver.attempt.AttemptStatus`) -- still running; what the
   :class:`~sparkhvd.elastic.watch.AttemptWatch` saw (executors being decommissioned, slots
   free: the scaling policy decides whether the ranks stop at their next step to move or
   grow); a stall with ``on_stall="stop"`` or the run's ``timeout`` (the step stops the
   ranks); the ranks ended (their facts judged once, :func:`~sparkhvd.driver.rank_end.judge`);
5. once the ranks ended, the :class:`~sparkhvd.driver.retry.RetryPolicy` says *finished*,
   *failed*, or relaunch: *restarting* at the same size or *resizing* to another, from the
   run's newest checkpoint;
6. the run is recorded (status, error, PIDs, curves, where the ranks' time went, the model,
   ``report.html``) and published; then its services are told it ended
   (:mod:`sparkhvd.driver.services`: row copies removed, dataset caches settled, and -- a run
   that succeeded -- the host copies earlier attempts kept on hosts its last attempt did not
   use swept); rank 0's result -- or the error, naming the run folder -- goes back to the
   caller.

What the run leaves behind -- ``run.json``, MLflow, time splits, ``report.html``, curves -- is
written by callbacks on these moments (:mod:`sparkhvd.driver.recording`), which are handed
frozen snapshots of the run and the attempt (:class:`~sparkhvd.driver.view.RunSnapshot`) and
each transition as data, and subscribe to what the ranks send through the run's hub: this
module decides and acts, and writes nothing of its record itself. An attempt is given an
explicit context (:class:`~sparkhvd.driver.attempt.AttemptContext`), never the run.

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
from sparkhvd.common.errors import StorageError
from sparkhvd.common.redaction import remember_environment
from sparkhvd.driver.attempt import Attempt, AttemptContext, status_of
from sparkhvd.driver.launchers import get_launcher
from sparkhvd.driver.logs import RankLogRouter
from sparkhvd.driver.placing import SLOT_POLL_S, LocalPlacer, Placer, Short, SparkPlacer
from sparkhvd.driver.recording import RunCallback, recorders
from sparkhvd.driver.retry import RetryPolicy, Spent
from sparkhvd.driver.services import RunService, ended_quietly, run_services
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
from sparkhvd.driver.view import RunHub, RunSnapshot, Transition
from sparkhvd.elastic.scaling import ScalingPolicy, not_enough_slots
from sparkhvd.elastic.watch import Sighting
from sparkhvd.runfolder.record import now
from sparkhvd.runfolder.rundir import RunDir
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
        #: attempts told of a decommission their ranks could not hear (said once each)
        self._unheard: set[int] = set()
        #: the placing that said it waits for other jobs' slots
        self._said_busy: Optional[Placing] = None
        self.state: Optional[RunState] = None
        self.callbacks = callbacks if callbacks is not None else recorders(config)
        #: what the ranks send while they run, to the recorders that subscribed
        self.hub = RunHub()
        #: the features' parts in its lifecycle (:mod:`sparkhvd.driver.services`)
        self.services: list[RunService] = run_services(spec, self.run_dir, self.placer)
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
        self._tell("on_run_start")
        self.router.note(f"run {self.run_dir.run_id}: run folder {self.record['output']} "
                         "(run.json, logs/; runner.last_run_dir)")
        last: Optional[Attempt] = None
        status, error = "failed", None
        try:
            last = self._drive(env)
            # out of preemption budget: the run failed (its last attempt says it was preempted)
            status = "failed" if last.status == "preempted" else last.status
            error = last.error
        except BaseException as exc:
            status, error = status_of(exc), exc
        finally:
            self.router.close()
            self._tell("on_ranks_done")
        try:
            if last is None:  # a timeout, an interrupt, a bad setting: recorded, then raised
                self._record_end(status, error)
                raise error  # type: ignore[misc]
            return self._end(status, error, last)
        finally:  # once the outcome is recorded: the services clean up after the run
            ended_quietly(self.services, status == "succeeded" and error is None,
                          [frozenset(a.inbox.hosts.values()) for a in self.attempts])

    def snapshot(self) -> RunSnapshot:
        """The run as it is now, frozen (what recorders are handed)."""
        return RunSnapshot(self.spec, getattr(self.fn, "__qualname__", repr(self.fn)),
                           dict(self.kwargs), self.scaling, self.run_dir, self.record,
                           self.hub, self.state_label,
                           tuple(attempt.snapshot() for attempt in self.attempts),
                           self.router.note)

    def _tell(self, moment: str, *args: Any) -> None:
        """Tell every recorder of a moment (:mod:`sparkhvd.driver.recording`), each with the
        same frozen snapshot of the run -- never the run itself."""
        if not self.callbacks:
            return
        snapshot = self.snapshot()
        for callback in self.callbacks:
            getattr(callback, moment)(snapshot, *args)

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
        self._tell("on_state", transition)
        log.debug("run %s: %s -> %s (%s)", self.run_dir.run_id,
                  previous.label if previous else "-", state.label, state.why)

    def _drive(self, env: dict[str, str]) -> "Attempt":
        """From *placing*, one step at a time until the run finishes or fails; the last
        attempt. A step that keeps its state (*running*, while the ranks run) is no
        transition. A step that raises (an interrupt, an error that is no rank's) ends the run
        in *failed*, its running ranks stopped, and the error goes on."""
        state: RunState = Placing("the run starts", size=self.scaling.size)
        while True:
            waiting = state is self.state
            if not waiting:
                self._enter(state)
            if isinstance(state, (Finished, Failed)):
                assert state.attempt is not None  # a failed step raised above, not here
                return state.attempt
            try:
                if waiting and isinstance(state, Placing):  # for slots: look again in a moment
                    time.sleep(SLOT_POLL_S)
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
        """The next attempt: its size (an elastic run's from the free slots), launcher and
        slots, looked at once; the first also starts tracking and resolves what to resume
        from. While slots are short and waiting may help, the state stays (the next step looks
        again; the run's deadline bounds it); an elastic relaunch whose slots went between
        their count and its placement is resized to the slots there are."""
        waited, time_left = time.monotonic() - state.began, self.time_left()
        size = self._size_now(state, waited, time_left)
        if size is None:
            return state
        if self.attempts and size < state.size:
            return self._resized_to_the_slots(state, size)
        placed = self.placer.place(size, not self.attempts, time_left, waited, state.ended_job)
        if isinstance(placed, Short):
            if waited < placed.wait_s and (time_left is None or time_left > 0):
                if placed.jobs and self._said_busy is not state:
                    self._said_busy = state  # said once a placing, however long it waits
                    log.warning("sparkhvd: %d task slot(s) short, held by other jobs (%s); "
                                "waiting up to %.0f s for them", placed.missing,
                                ", ".join(placed.jobs), placed.wait_s)
                return state
            fewer = size - placed.missing
            if self.attempts and self.scaling.elastic and self.scaling.min_np <= fewer < size:
                return self._resized_to_the_slots(state, fewer)
            raise placed.error
        resume = state.resume
        if not self.attempts:
            config = self.spec.config
            resume = None if config.resume_from is None or config.resume_from is False else \
                resolve_resume_source(config.resume_from, config.output_dir,
                                      dict(config.storage_options), exclude=self.run_dir.run_id)
        self.run_dir.remove_torn()  # a retry never trips over a killed writer's leftovers
        attempt = Attempt(self._attempt_context(), len(self.attempts) + 1, placed, resume,
                          state.library, size,
                          state.previous_size, launcher=self.launchers(placed.launcher),
                          free_slots=self.placer.free_slots)
        self.attempts.append(attempt)
        self._tell("on_attempt_start", attempt.snapshot())
        return Running(f"attempt {attempt.number} launches {size} rank(s)", attempt=attempt)

    def _attempt_context(self) -> AttemptContext:
        """What an attempt is given of the run (never the run itself)."""
        return AttemptContext(self.spec, self.blob, self.return_all, self.timeout, self.run_dir,
                              self.router, self.restarts, self.policy.graces,
                              tuple(self.services), self.hub)

    def _size_now(self, state: Placing, waited: float, time_left: Optional[float]
                  ) -> Optional[int]:
        """An elastic run's size for this placement from the free slots counted now
        (:meth:`~sparkhvd.elastic.scaling.ScalingPolicy.size_now`): ``state.size`` if that
        many are free, else what is free within ``min_np``..``max_np``; None while it waits
        (for ``min_np`` up to ``slot_wait_s``, for a planned grow's slots a moment). Other
        runs place ``state.size`` (the slot look names a shortfall)."""
        if not self.scaling.elastic or not self.placer.counts_slots:
            return state.size
        free = self.placer.free_slots(state.ended_job)
        wait_s = self.spec.launch.slot_wait_s
        if time_left is not None:
            wait_s = min(wait_s, waited + time_left)
        decision = self.scaling.size_now(free, waited, wait_s,
                                         want=state.size if state.planned else None)
        if decision.action == "wait":
            return None
        if decision.action == "short":
            raise not_enough_slots(self.scaling.min_np, free, waited,
                                   self.placer.describe_lost())
        return min(state.size, decision.size)

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
        stays; what the watch saw is decided on (:meth:`_decide_on`); a stall
        (``on_stall="stop"``) or the run's timeout stops them. Once they ended,
        :meth:`_ended` decides."""
        attempt = state.attempt
        if attempt.status == "placed":
            attempt.prepare(dict(env))
            self._tell("on_attempt_launch", attempt.snapshot())
            attempt.start()
        if attempt.status == "running":
            found = attempt.poll(self.time_left())
            if found.kind == "running":
                return state
            if found.kind == "seen":
                assert found.seen is not None
                self._decide_on(attempt, found.seen)
                return state
            if found.kind in ("stalled", "timed out"):
                attempt.stop(found)
        return self._ended(attempt)

    def _decide_on(self, attempt: Attempt, seen: Sighting) -> None:
        """What the watch saw: the scaling policy says whether the ranks stop at their next
        step (a decommission, a grow), and they are asked -- where they listen for notices."""
        request = self.scaling.stop_for(attempt.size, seen)
        if request is None:
            return
        if attempt.listening:
            attempt.ask_to_stop(request)
        elif request.kind == "decommission" and attempt.number not in self._unheard:
            self._unheard.add(attempt.number)
            log.warning("sparkhvd: %s, but the ranks have no checkpoint helper that listens "
                        "for notices (sparkhvd.torch.Checkpoints/ShardedCheckpoints, "
                        "sparkhvd.keras.KerasDistributed): the run loses the work since its "
                        "last checkpoint when it goes", request.reason)

    def _ended(self, attempt: Attempt) -> RunState:
        """The attempt's ranks ended: the policy decides what follows (a relaunch is sized
        here, from the free slots)."""
        self._tell("on_attempt_end", attempt.snapshot())
        request = attempt.stop_request
        planned = request is not None and request.kind == "grow" and \
            attempt.verdict is not None and attempt.verdict.preempted
        decision = self.policy.decide(attempt.status != "succeeded", attempt.verdict,
                                      planned=planned, spent=self.spent)
        if decision == "retry" and self.time_left() == 0:
            decision = "raise"  # run(timeout=...) has passed: nothing is launched after it
        if decision == "done":
            return Finished(f"attempt {attempt.number} succeeded", attempt=attempt)
        if decision == "raise":
            return Failed(attempt.entry().get("error") or attempt.status, attempt=attempt)
        verdict = attempt.verdict
        assert verdict is not None
        if not planned:
            self.spent = self.spent.charged(verdict)
        watch = attempt.watch
        self.placer.note_losses(attempt.lost,
                                lambda: dict(watch.executors) if watch is not None else {})
        resume = resumable(self.run_dir.file("checkpoints")) or attempt.resume
        library = None if resume else self.run_dir.library_checkpoints(
            {name for earlier in self.attempts for name in earlier.inbox.output_dirs})
        size = attempt.size
        grow_to = request.grow_to if request is not None else None
        new_size = self._relaunch_size(self.scaling.relaunch_size(size, grow_to),
                                       attempt.spark_job, planned)
        kind = Resizing if new_size != size else Restarting
        return kind(attempt.relaunch_reason(request, verdict), attempt=attempt, verdict=verdict,
                    checkpoint=self._newest_checkpoint() if resume else None,
                    size_from=size, size_to=new_size, resume=resume, library=library,
                    planned=planned)

    def _relaunch_size(self, size: int, ended_job: str, planned: bool) -> int:
        """The size a relaunch asks for: ``size`` trimmed to the free slots counted now (one
        look: *placing* waits, and resizes again if they went)."""
        if not self.scaling.elastic or not self.placer.counts_slots:
            return size
        decision = self.scaling.size_now(self.placer.free_slots(ended_job), 0.0,
                                         self.spec.launch.slot_wait_s,
                                         want=size if planned else None)
        return min(size, decision.size) if decision.action == "place" else size

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
                       planned=state.planned, ended_job=attempt.spark_job)

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
        try:
            self.run_dir.publish()
        except StorageError as exc:
            exc.result = last.results if self.return_all else last.results[0]
            raise
        return last.results

    def _record_end(self, status: str, error: Optional[BaseException],
                    model: Optional[str] = None) -> None:
        self._tell("on_run_end", status, error, model)
        if status != "succeeded":
            self.run_dir.publish_quietly()
        log.debug("run %s %s in %.1fs", self.run_dir.run_id, status,
                  time.monotonic() - self.began)
