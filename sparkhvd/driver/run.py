"""One run -- one call of ``HorovodRunner.run`` or ``run_all`` -- as its attempts, in order.

The story of a run, start to end (:meth:`Run.execute`):

1. the run folder is made and checked (remote storage is written to before training), and
   ``run.json`` says what was asked (:class:`~sparkhvd.runfolder.record.RunRecord`);
2. the ranks are placed: which launcher, where the driver is reached, the Spark task slots;
3. MLflow tracking starts when asked; the resume source is resolved;
4. :class:`Attempt` after attempt launches the ranks, until the :class:`~sparkhvd.driver.retry.
   RetryPolicy` says it is done or the error is raised -- a lost rank, executor or host is
   relaunched from the run's own checkpoints;
5. the run is recorded (status, error, PIDs, curves, the model) and published, and rank 0's
   result -- or the error, naming the run folder -- goes back to the caller.

A rank's end is decoded once, by :func:`sparkhvd.driver.rank_end.classify`, into the
:class:`~sparkhvd.driver.rank_end.Verdict` the policy and the error are made from.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

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
from sparkhvd.runfolder.record import now
from sparkhvd.runfolder.rundir import RunDir, resolve_resume_source

if TYPE_CHECKING:
    from sparkhvd.driver.runner import HorovodRunner

__side__ = "driver"

log = logging.getLogger(__name__)


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
    """One call of ``run``/``run_all``: its run folder, its attempts, its result."""

    def __init__(self, runner: "HorovodRunner", fn: Callable, blob: bytes, spark: Any, *,
                 kwargs: Mapping[str, Any], return_all: bool, timeout: Optional[float]) -> None:
        self.runner, self.fn, self.blob, self.spark = runner, fn, blob, spark
        self.kwargs, self.return_all, self.timeout = kwargs, return_all, timeout
        #: ``run(timeout=...)`` counts from the call: slots, start and every attempt
        self.deadline = None if timeout is None else time.monotonic() + timeout
        config = runner.run_config
        self.policy = RetryPolicy(config.max_retries)
        self.run_dir = RunDir(config.output_dir, storage_options=dict(config.storage_options))
        self.record = self.run_dir.record
        self.attempts: list[Attempt] = []
        self.metrics: list[dict] = []
        launch = runner.launch_config
        #: the ranks' lines: console and logs/rank-N.log (files open as ranks start)
        self.router = RankLogRouter(config.driver_log_verbosity, log_dir=self.run_dir.logs,
                                    verbose=launch.verbose)
        self.tracker: Any = None

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
        runner = self.runner
        self.record.started(np=runner.np, mode=runner.scaling.mode,
                            ranks_per_task=runner.scaling.ranks_per_task,
                            node_per_task=runner.scaling.node_per_task, backend=runner.backend,
                            function=getattr(self.fn, "__qualname__", repr(self.fn)))
        self.router.note(f"run {self.run_dir.run_id}: run folder {self.record['output']} "
                         "(run.json, logs/; runner.last_run_dir)")
        last: Optional[Attempt] = None
        try:
            placement = self._place()
            self._track(placement)
            last = self._attempt_until_done(placement, env, self._resume_source())
            status, error = last.status, last.error
        except BaseException as exc:
            status, error = _status_of(exc), exc
        finally:
            self.router.close()
            self._write_curves()
            settle_dataset_caches()
        if last is None:  # a timeout, an interrupt, a bad setting: recorded, then raised
            self._record_end(status, error)
            raise error  # type: ignore[misc]
        return self._end(status, error, last)

    # -- the steps ---------------------------------------------------------------------------
    def _rank_env(self) -> dict[str, str]:
        """What every rank gets from the driver: the user's ``env=`` and sparkhvd's own."""
        launch = self.runner.launch_config
        remember_environment(os.environ)
        env = rank_env(dict(launch.env), verbose=launch.verbose)
        if self.runner.backend == "horovod":
            check_keras({**os.environ, **env})
        return env

    def _track(self, placement: Placement) -> None:
        config = self.runner.run_config
        if config.mlflow:
            from sparkhvd.ops.tracking import MlflowTracker

            self.tracker = MlflowTracker(config.mlflow)
            self.tracker.start(self.run_dir, {**self.record.params(),
                                              "launcher": placement.launcher}, self.kwargs)

    def _attempt_until_done(self, placement: Placement, env: dict[str, str],
                            resume: Optional[str]) -> "Attempt":
        library: Optional[str] = None
        for number in range(1, self.policy.attempts + 1):
            self.run_dir.remove_torn()  # a retry never trips over a killed writer's leftovers
            attempt = Attempt(self, number, placement, resume, library)
            self.attempts.append(attempt)
            attempt.launch(dict(env))
            self.metrics = merge_epochs(self.metrics, attempt.outcome.metrics)
            self.record.attempt_ended(attempt.entry(), attempt.outcome.resumed)
            decision = self.policy.decide(number, attempt.status != "succeeded", attempt.verdict)
            if decision != "retry":
                return attempt
            assert attempt.verdict is not None
            resume = self.run_dir.own_checkpoints() or resume
            library = None if resume else self._library_checkpoints()
            log.warning("sparkhvd: attempt %d of %d failed because %s; relaunching %s "
                        "(attempt %d, max_retries=%d)", number, self.policy.attempts,
                        attempt.verdict.retryable, _resumes_from(resume, library), number + 1,
                        self.policy.max_retries)
            self.router.line_all(f"---- attempt {number + 1}: relaunched after "
                                 f"{attempt.verdict.retryable} ----")
            placement = self._place()
        raise AssertionError("unreachable: the policy ends every run")

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
        if self.tracker is not None:
            self.tracker.finish(self.run_dir, status)
        if status != "succeeded":
            self.run_dir.publish_quietly()
        log.debug("run %s %s in %.1fs", self.run_dir.run_id, status,
                  self.record["timings"]["total"])

    # -- what the steps ask of Spark and the run folder -------------------------------------
    def _place(self) -> Placement:
        """Which launcher, where the driver is reached, and whether the ranks share its disk."""
        runner = self.runner
        if not runner.scaling.spark:
            self.record.placed("local")
            return Placement("local", nics=frozenset({"lo"}))
        from sparkhvd.driver.session import check_worker_python
        from sparkhvd.driver.slots import check_slots
        from sparkhvd.driver.sparkview import SparkView

        placing = time.monotonic()
        view = SparkView(self.spark)
        name = choose_launcher(runner.launch_facts().with_session(view))
        check_worker_python(view, runner.backend)
        launch = runner.launch_config
        # Waiting for other jobs' slots is part of starting: start_timeout (from here) and the
        # run's own limit bound it too.
        left = self.time_left()
        busy_wait = min(launch.slot_wait_s,
                        launch.start_timeout - (time.monotonic() - placing),
                        math.inf if left is None else left)
        slots = check_slots(view, runner.scaling.tasks,
                            wait_s=0 if view.master.startswith("local") else launch.slot_wait_s,
                            ranks_per_task=runner.scaling.ranks_per_task,
                            busy_wait_s=max(0.0, busy_wait))
        self.record.placed(name, spark_master=view.master, spark_app_id=view.app_id,
                           session=view.kind, slots=slots.slots)
        here = view.executors_here()
        return Placement(name, driver_host=view.driver_host(), executors_here=here,
                         nics=runner.launch_config.nics or (frozenset({"lo"}) if here else None),
                         session=view)

    def _resume_source(self) -> Optional[str]:
        """The checkpoints folder to resume from (or None), recorded as *requested*."""
        config = self.runner.run_config
        if config.resume_from is None or config.resume_from is False:
            return None
        source = resolve_resume_source(config.resume_from, config.output_dir,
                                       dict(config.storage_options),
                                       exclude=self.run_dir.run_id)
        self.record.resume_requested(source)
        return source

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
                 resume: Optional[str], library: Optional[str] = None) -> None:
        """``resume``: the checkpoints sparkhvd restores; ``library``: the folders where a
        library keeps its own (``st.output_dir``), when sparkhvd has none."""
        self.run, self.number, self.placement, self.resume = run, number, placement, resume
        self.library = library
        self.outcome = RunOutcome(run.router)
        if run.tracker is not None:
            self.outcome.listeners.append(run.tracker.metrics)
        launch = run.runner.launch_config
        self.monitor = self.outcome.monitor = RunMonitor(
            self.outcome, run.run_dir.path, stall_timeout=launch.stall_timeout,
            on_stall=launch.on_stall)
        #: the Spark job tag (or group) of this attempt's barrier stage: in ``run.json`` before
        #: the job is submitted, so it can always be found and cancelled
        self.spark_job = f"sparkhvd-{run.run_dir.run_id}-{number}"
        self.status = "running"
        self.results: list = []
        self.verdict: Optional[Verdict] = None
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
            self.verdict = classify(failure, self.outcome.reported(), self.outcome.hosts,
                                    run.router.tail)
            self.status, self.error = "failed", self.verdict.error()
        except StallError as exc:
            self.status, self.error = "stalled", exc
        finally:
            self._clean_up(files)

    def entry(self) -> dict:
        """This attempt's entry in ``run.json``'s ``attempts``."""
        pids = self.outcome.pid_record()
        entry: dict[str, Any] = {
            "attempt": self.number, "status": self.status,
            "resumed_from": self.resume or self.library,
            "resumed_by": "sparkhvd" if self.resume else "library" if self.library else None,
            "ended_at": now(),
            "rank_pids": pids["rank_pids"], "hosts": pids["hosts"]}
        resumed = self.outcome.resumed
        if resumed is not None:
            entry["restored"] = resumed.source
            if resumed.skipped:
                entry["skipped"] = list(resumed.skipped)
        if self.error is not None:
            entry["error"] = str(self.error).split("\n", 1)[0]
            entry["retryable"] = self.verdict.retryable if self.verdict is not None else None
        return entry

    def _spec(self, env: dict[str, str]) -> LaunchSpec:
        run = self.run
        runner, launch = run.runner, run.runner.launch_config
        return LaunchSpec(
            scaling=runner.scaling, launch=launch, backend=runner.backend, payload=run.blob,
            options=RankOptions(verbose=launch.verbose, return_all=run.return_all,
                                elastic=bool(runner.scaling.elastic),
                                env_keep=tuple(sorted(set(launch.env) | set(env)))),
            env=env, placement=self.placement, timeout=run.timeout, deadline=run.deadline,
            job=self.spark_job,
            run=RunTag(run.run_dir.run_id, self.number - 1, run.policy.max_retries))

    def _start_files(self) -> tuple[Any, dict[str, str]]:
        """Start the run-folder service; the variables that tell the ranks where their run
        folder is."""
        from sparkhvd.runfolder.service import RunFileService
        from sparkhvd.storage import public_url

        run_dir, config = self.run.run_dir, self.run.runner.run_config
        options = dict(config.storage_options)
        files = RunFileService(self.placement.driver_host, run_dir.path,
                               (self.resume, options) if self.resume else None).start()
        env = dict(files.env())
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
