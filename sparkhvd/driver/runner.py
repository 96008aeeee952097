"""``HorovodRunner``: run a training function data-parallel on Spark task slots with Horovod.

The runner is the driver's whole story of a run, in order: validate, serialise, check the
cluster, prepare the run folder, build one :class:`~sparkhvd.driver.launchers.LaunchSpec`, hand it to
a launcher, collect the :class:`~sparkhvd.driver.outcome.RunOutcome`, record and publish.
"""
from __future__ import annotations

import datetime as _dt
import inspect
import logging
import os
import shutil
from typing import Any, Callable, Mapping, Optional, Union

from sparkhvd.common import protocol
from sparkhvd.common.backends import BACKENDS, RunTag
from sparkhvd.common.environment import rank_env
from sparkhvd.common.errors import LaunchFailure, PayloadError, StallError, StorageError
from sparkhvd.common.protocol import RankOptions
from sparkhvd.common.redaction import remember_environment
from sparkhvd.driver import payload as _payload
from sparkhvd.driver.arguments import Prepared
from sparkhvd.driver.launchers import (LaunchFacts, LaunchSpec, Placement, check_launch,
                                       choose_launcher, get_launcher)
from sparkhvd.driver.logs import RankLogRouter
from sparkhvd.driver.outcome import RunOutcome, attempt_record, merge_epochs, retry_reason
from sparkhvd.driver.rundir import RunDir, resolve_resume_source
from sparkhvd.driver.settings import (LaunchConfig, RunConfig, ScalingConfig, SessionConfig,
                                      group_keywords)
from sparkhvd.driver.stack import check_horovod_installed, check_keras

log = logging.getLogger(__name__)

def check_arguments(fn: Callable, kwargs: Mapping[str, Any]) -> None:
    """Bind ``kwargs`` to ``fn``'s signature on the driver, before anything starts.

    Raises:
        PayloadError: naming the missing/unexpected argument.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables: nothing to check
        return
    name = getattr(fn, "__qualname__", repr(fn))
    params = signature.parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unexpected = [k for k in kwargs if k not in params or
                      params[k].kind in (params[k].POSITIONAL_ONLY, params[k].VAR_POSITIONAL)]
        if unexpected:
            import difflib

            close = difflib.get_close_matches(unexpected[0], list(params), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PayloadError(
                f"run() cannot call {name}{signature}: unexpected keyword argument "
                f"{unexpected[0]!r}{hint}. Fix: pass the function's own parameter names.")
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise PayloadError(
            f"run() cannot call {name}{signature} with the arguments given "
            f"({', '.join(kwargs) or 'none'}): {exc}. Fix: pass the function's parameters by "
            f"name, e.g. run({getattr(fn, '__name__', 'fn')}, "
            f"{', '.join(f'{p}=...' for p in list(signature.parameters)[:2])}).") from None


def split_run_limit(fn: Callable, kwargs: dict[str, Any], run_timeout: Any) -> Optional[float]:
    """The run's own time limit, taken out of ``kwargs`` -- never guessed.

    ``run_timeout=`` is always the run's limit, and then every other keyword is ``fn``'s
    (``timeout`` too). Without it, ``timeout=`` is the run's limit -- unless ``fn`` has a
    parameter called ``timeout``: then it could mean either, and a PayloadError says how to say
    which.
    """
    if run_timeout is not _UNSET:
        return run_timeout
    if "timeout" not in kwargs:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    own = params.get("timeout")
    if own is not None and own.kind in (own.POSITIONAL_OR_KEYWORD, own.KEYWORD_ONLY):
        name = getattr(fn, "__name__", "fn")
        value = kwargs["timeout"]
        raise PayloadError(
            f"run({name}, timeout={value!r}) is ambiguous: {name}() has its own 'timeout' "
            f"parameter, so timeout= could be the run's time limit or {name}'s argument. Say "
            f"which: run({name}, run_timeout=600, timeout={value!r}) passes timeout={value!r} "
            f"to {name} and stops the run after 600 s; run({name}, run_timeout=None, "
            f"timeout={value!r}) passes it with no limit on the run.")
    return kwargs.pop("timeout")


#: A keyword setting the caller did not give (its default lives in sparkhvd.driver.settings).
_UNSET: Any = object()


class HorovodRunner:
    """Runs a training function on ``np`` ranks and returns rank 0's result.

    Settings come in four groups (:mod:`sparkhvd.driver.settings`), given as objects or -- as
    always -- as keywords, each filed into its group:

    - ``scaling=ScalingConfig(np, min_np, max_np, ranks_per_task, local_ranks)``: how many
      ranks (``np > 0``: Spark task slots, checked up front; ``np < 0``: local processes on the
      driver); ``min_np``/``max_np`` make an elastic run (``horovod.spark.run_elastic``, see
      the README); ``ranks_per_task`` ranks in each Spark task (one per GPU of a node), and
      what ``LOCAL_RANK`` counts (``local_ranks``: ``"host"``, torchrun's, or ``"task"``,
      TorchDistributor's).
    - ``launch=LaunchConfig(launcher, start_timeout, heartbeat_timeout, slot_wait_s, nics, env,
      verbose)``: how ranks start. ``launcher="auto"`` is one Spark barrier stage unless the
      run is elastic or the session uses dynamic allocation (then ``horovod.spark.run``);
      ``env`` adds variables for the ranks (the driver's environment is never copied
      wholesale, see :mod:`sparkhvd.common.environment`).
    - ``run_config=RunConfig(output_dir, storage_options, resume_from, timeline, mlflow,
      driver_log_verbosity)``: the run folder (local, ``abfss://``, ``az://``, ``file://``;
      ``storage_options`` are used on the driver only, never recorded), resuming from a run's
      checkpoints (``True``: the latest run under ``output_dir``), a Horovod timeline, MLflow
      tracking, and which ranks' output the console shows (``"rank0"`` or ``"all"``).
    - ``session=SessionConfig(spark, preset)``: the SparkSession (classic or Spark Connect;
      default the active one, else ``local[np]``) and a ``conf/`` preset to check ``np``
      against and start a session from.

    ``backend``: ``"horovod"`` (default: Horovod with Gloo; plain Horovod code runs unchanged),
    ``"tf"``: ``tf.distribute.MultiWorkerMirroredStrategy`` from a ``TF_CONFIG`` each rank
    gets -- no horovod at all, so current TensorFlow, Keras 3 and numpy 2 work -- or
    ``"torch"``: torchrun's variables for ``torch.distributed`` (``init_process_group()``
    unchanged; helpers in :mod:`sparkhvd.torch`). Elastic runs, ``launcher="horovod"`` and
    ``timeline`` are Horovod-only.

    Example::

        hr = HorovodRunner(np=2, output_dir="abfss://...")        # keywords, or
        hr = HorovodRunner(scaling=ScalingConfig(np=2), run_config=RunConfig(output_dir=...))
        model_bytes = hr.run(train_fn, lr=0.1, epochs=3)
    """

    def __init__(self, np: int = _UNSET, *, backend: str = "horovod",
                 scaling: Optional[ScalingConfig] = None, launch: Optional[LaunchConfig] = None,
                 run_config: Optional[RunConfig] = None, session: Optional[SessionConfig] = None,
                 spark: Any = _UNSET, driver_log_verbosity: str = _UNSET,
                 start_timeout: float = _UNSET, env: Optional[Mapping[str, str]] = _UNSET,
                 output_dir: str = _UNSET, storage_options: Optional[Mapping[str, Any]] = _UNSET,
                 resume_from: Any = _UNSET, timeline: bool = _UNSET, preset: Any = _UNSET,
                 min_np: Optional[int] = _UNSET, max_np: Optional[int] = _UNSET,
                 ranks_per_task: int = _UNSET, local_ranks: Optional[str] = _UNSET,
                 launcher: str = _UNSET, verbose: bool = _UNSET,
                 nics: Optional[set[str]] = _UNSET, slot_wait_s: float = _UNSET,
                 heartbeat_timeout: float = _UNSET,
                 mlflow: Union[None, bool, str] = _UNSET,
                 stall_timeout: Optional[float] = _UNSET, on_stall: str = _UNSET,
                 max_retries: int = _UNSET) -> None:
        given = {k: v for k, v in locals().items()
                 if v is not _UNSET and k not in ("self", "backend", "scaling", "launch",
                                                   "run_config", "session", "__class__")}
        if "np" not in given and scaling is None:
            raise TypeError("HorovodRunner needs np (HorovodRunner(np=2)) or "
                            "scaling=ScalingConfig(np=2).")
        groups = group_keywords({ScalingConfig: scaling, LaunchConfig: launch,
                                 RunConfig: run_config, SessionConfig: session}, given)
        self.scaling: ScalingConfig = groups[ScalingConfig]
        self.launch_config: LaunchConfig = groups[LaunchConfig]
        self.run_config: RunConfig = groups[RunConfig]
        self.session_config: SessionConfig = groups[SessionConfig]
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
        self.backend = backend
        check_launch(self._launch_facts())  # the rules a session cannot change, now
        preset = self.session_config.preset
        if preset is not None and self.scaling.spark:
            preset.check_np(self.scaling.size)
        if self.run_config.mlflow:
            from sparkhvd.driver.tracking import _import_mlflow

            _import_mlflow()  # a missing extra is said now, not after training
        self.last_run_dir: Optional[RunDir] = None
        #: the running attempt's RunMonitor (for dump_stacks from another thread)
        self._monitor: Any = None

    @property
    def np(self) -> int:
        return self.scaling.np

    @property
    def elastic(self) -> Optional[tuple[int, int]]:
        return self.scaling.elastic

    def _launch_facts(self) -> LaunchFacts:
        return LaunchFacts(self.backend, self.launch_config.launcher, bool(self.elastic),
                           bool(self.run_config.timeline), self.scaling.node_per_task)

    # -- public API ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], /, *, run_timeout: Optional[float] = _UNSET,
            **kwargs: Any) -> Any:
        """Run ``fn(**kwargs)`` on every rank and return rank 0's return value.

        ``run_timeout`` (seconds): stop the ranks, cancel the Spark job and raise
        ``TimeoutError`` -- with every rank's stack (``logs/stacks-*.txt``) and which rank was
        where -- if the training runs longer. ``timeout=`` means the same when ``fn`` has no
        ``timeout`` parameter of its own; when it has one, ``timeout=`` alone is refused as
        ambiguous (:func:`split_run_limit`). ``KeyboardInterrupt`` (a notebook's stop button)
        likewise stops everything and propagates; the session stays usable.

        Raises:
            PayloadError: ``fn`` or an argument cannot be sent to the ranks, or ``kwargs`` do not
                fit ``fn``'s parameters (before launch).
            NotEnoughSlotsError: the session has fewer task slots than ``np`` (in seconds).
            TrainingError: a rank failed; names the rank, its host, the exception and traceback.
            TimeoutError: the run's time limit passed.
        """
        timeout = split_run_limit(fn, kwargs, run_timeout)
        return self._execute(fn, kwargs, return_all=False, timeout=timeout)[0]

    def run_all(self, fn: Callable[..., Any], /, *, run_timeout: Optional[float] = _UNSET,
                **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, but return every rank's return value, in rank order."""
        timeout = split_run_limit(fn, kwargs, run_timeout)
        return self._execute(fn, kwargs, return_all=True, timeout=timeout)

    # -- internals -----------------------------------------------------------------------
    def _execute(self, fn: Callable, kwargs: Mapping[str, Any], *, return_all: bool,
                 timeout: Optional[float] = None) -> list:
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"run_timeout (or timeout=) must be a positive number of seconds; "
                             f"got {timeout!r}")
        if not callable(fn):
            _payload.dumps(fn, {})  # raises the PayloadError that explains it
        check_arguments(fn, kwargs)
        if self.backend == "horovod":
            check_horovod_installed()  # before a session starts or data is materialised
        spark = self._session() if self.scaling.spark else None
        prepared = Prepared(kwargs)
        succeeded = False
        try:
            blob = _payload.dumps(fn, prepared.kwargs)
            results = self._launch(fn, blob, spark, return_all=return_all, timeout=timeout,
                                   kwargs=kwargs)
            succeeded = True
            return results
        finally:
            prepared.finish(succeeded=succeeded)

    def _session(self) -> Any:
        from sparkhvd.driver.session import get_or_create_session
        from sparkhvd.driver.stack import check_spark

        check_spark()  # a missing or unsupported pyspark is named with the fix, before any import
        return get_or_create_session(self.scaling.size, self.session_config.spark,
                                     self.session_config.preset)

    def _launch(self, fn: Callable, blob: bytes, spark: Any, *, return_all: bool,
                timeout: Optional[float], kwargs: Mapping[str, Any]) -> list:
        launch, config = self.launch_config, self.run_config
        remember_environment(os.environ)
        env = rank_env(dict(launch.env), verbose=launch.verbose)
        if self.backend == "horovod":
            check_keras({**os.environ, **env})
        run_dir = RunDir(config.output_dir, storage_options=dict(config.storage_options))
        self.last_run_dir = run_dir
        tracker = None
        try:
            run_dir.preflight()
        except StorageError as exc:
            self._finish(run_dir, "failed", exc)
            raise
        run_dir.update(status="starting", np=self.np, mode=self.scaling.mode,
                       ranks_per_task=self.scaling.ranks_per_task,
                       local_ranks="task" if self.scaling.node_per_task else "host",
                       backend=self.backend, function=getattr(fn, "__qualname__", repr(fn)),
                       started_at=_dt.datetime.now().isoformat(timespec="seconds"))
        router = RankLogRouter(config.driver_log_verbosity, log_dir=run_dir.logs,
                               verbose=launch.verbose)
        outcome = RunOutcome(router)
        metrics: list[dict] = []
        attempts: list[dict] = []
        results: list = []
        status, error, raise_as = "succeeded", None, None
        try:
            placement = self._place(spark, run_dir)
            if config.mlflow:
                from sparkhvd.driver.tracking import MlflowTracker

                tracker = MlflowTracker(config.mlflow)
                tracker.start(run_dir, {**run_dir.record_params(),
                                        "launcher": placement.launcher}, kwargs)
            resume = self._resume_source(run_dir)
            for attempt in range(1, config.max_retries + 2):
                run_dir.remove_torn()  # a retry never trips over a killed writer's leftovers
                outcome = RunOutcome(router)
                if tracker is not None:
                    outcome.listeners.append(tracker.metrics)
                results, status, error, raise_as = self._attempt(
                    outcome, placement, run_dir, resume, dict(env), blob,
                    return_all=return_all, timeout=timeout,
                    run=RunTag(run_dir.run_id, attempt - 1, config.max_retries))
                metrics = merge_epochs(metrics, outcome.metrics)
                reason = retry_reason(raise_as)
                attempts.append(attempt_record(attempt, status, error, resume, reason, outcome))
                run_dir.update(attempts=attempts, **self._resume_record(run_dir, outcome,
                                                                        warn=False))
                if reason is None or attempt > config.max_retries:
                    break
                resume = run_dir.own_checkpoints() or resume
                log.warning("sparkhvd: attempt %d of %d failed because %s; relaunching %s "
                            "(attempt %d, max_retries=%d)", attempt, config.max_retries + 1,
                            reason, f"from {resume}" if resume else "from the start",
                            attempt + 1, config.max_retries)
                router.line_all(f"---- attempt {attempt + 1}: relaunched after {reason} ----")
                placement = self._place(spark, run_dir)
        except BaseException as exc:
            status = ("interrupted" if isinstance(exc, KeyboardInterrupt) else
                      "timed out" if isinstance(exc, TimeoutError) else "failed")
            error = raise_as = exc
        finally:
            router.close()
            self._write_curves(run_dir, metrics)
        extra: dict[str, Any] = {}
        if error is None:
            run_dir.mark("finished")
            saved = run_dir.save_result(results[0]) if results else None
            extra["model"] = os.path.basename(saved) if saved else None
        self._finish(run_dir, status, error, outcome, **extra)
        if tracker is not None:
            tracker.finish(run_dir, status)
        if isinstance(raise_as, LaunchFailure):
            # Now that the run folder is where it stays (published if remote), say where.
            raise error.located(run_dir.location) from None
        if raise_as is not None:
            raise raise_as
        try:
            run_dir.publish()
        except StorageError as exc:
            exc.result = results[0] if not return_all else results
            raise
        return results

    def _attempt(self, outcome: RunOutcome, placement: Placement, run_dir: RunDir,
                 resume: Optional[str], env: dict[str, str], blob: bytes, *, return_all: bool,
                 timeout: Optional[float], run: RunTag) -> tuple[list, str, Any, Any]:
        """One launch of the ranks: ``(results, status, error, raise_as)`` -- a rank's failure
        is returned (the caller may retry), anything else propagates."""
        from sparkhvd.driver.stacks import RunMonitor

        launch = self.launch_config
        self._monitor = outcome.monitor = RunMonitor(
            outcome, run_dir.path, stall_timeout=launch.stall_timeout, on_stall=launch.on_stall)
        files = None
        try:
            files, files_env = self._start_files(placement, run_dir, resume)
            env.update(files_env)
            spec = LaunchSpec(
                np=self.scaling.size, payload=blob, env=env, placement=placement,
                options=RankOptions(verbose=launch.verbose, return_all=return_all,
                                    elastic=bool(self.elastic),
                                    env_keep=tuple(sorted(set(launch.env) | set(env)))),
                start_timeout=launch.start_timeout, timeout=timeout, verbose=launch.verbose,
                elastic=self.elastic, heartbeat_timeout=launch.heartbeat_timeout,
                backend=self.backend, ranks_per_task=self.scaling.ranks_per_task,
                node_per_task=self.scaling.node_per_task, run=run)
            run_dir.mark("launch")
            log.info("Launching %d rank(s) %s; logs in %s", spec.np,
                     f"on Spark ({spec.session.describe()})" if spec.session else
                     "as local processes", run_dir.logs)
            results = get_launcher(placement.launcher).launch(spec, outcome)
            if outcome.channel:
                run_dir.update(control=outcome.channel)
            return results, "succeeded", None, None
        except LaunchFailure as failure:
            return [], "failed", outcome.training_error(failure, None), failure
        except StallError as exc:
            return [], "stalled", exc, exc
        finally:
            self._monitor = None
            if outcome.monitor is not None and outcome.monitor.reports:
                saved = [os.path.relpath(r.path, run_dir.path) for r in outcome.monitor.reports
                         if r.path]
                run_dir.update(stacks=[*(run_dir.record.get("stacks") or []), *saved])
            if files is not None:
                files.stop()
            # the stack requests polling ranks read: the run's business only while it runs
            shutil.rmtree(run_dir.file(os.path.dirname(protocol.STACKS_REQUEST_FILE)),
                          ignore_errors=True)

    def dump_stacks(self) -> str:
        """Every rank's stacks now, from another thread while :meth:`run` runs: the report's
        text (also saved as ``logs/stacks-<time>.txt``). ``sparkhvd stacks <run folder>`` does
        the same from another process."""
        monitor = getattr(self, "_monitor", None)
        if monitor is None:
            raise RuntimeError("No run of this HorovodRunner is running: dump_stacks() asks a "
                               "running run's ranks (call it from another thread, or use "
                               "`sparkhvd stacks <run folder>` from a terminal).")
        return monitor.collect("requested from Python").text()

    def _place(self, spark: Any, run_dir: RunDir) -> Placement:
        """Which launcher, where the driver is reached, and whether the ranks share its disk."""
        if not self.scaling.spark:
            run_dir.update(launcher="local")
            return Placement("local", nics=frozenset({"lo"}))
        from sparkhvd.driver.session import check_worker_python
        from sparkhvd.driver.slots import check_slots
        from sparkhvd.driver.sparkview import SparkView

        view = SparkView(spark)
        run_dir.update(spark_master=view.master, spark_app_id=view.app_id, session=view.kind)
        name = choose_launcher(self._launch_facts().with_session(view))
        check_worker_python(view, self.backend)
        slots = check_slots(view, self.scaling.tasks, wait_s=0 if view.master.startswith("local")
                            else self.launch_config.slot_wait_s,
                            ranks_per_task=self.scaling.ranks_per_task)
        run_dir.update(slots=slots.slots, launcher=name)
        here = view.executors_here()
        return Placement(name, driver_host=view.driver_host(), executors_here=here,
                         nics=self.launch_config.nics or (frozenset({"lo"}) if here else None),
                         session=view)

    def _resume_source(self, run_dir: RunDir) -> Optional[str]:
        """The checkpoints folder to resume from (or None), recorded as *requested*."""
        config = self.run_config
        if config.resume_from is None or config.resume_from is False:
            return None
        source = resolve_resume_source(config.resume_from, config.output_dir,
                                       dict(config.storage_options), exclude=run_dir.run_id)
        run_dir.update(resume={"requested": source, "restored": None})
        return source

    def _start_files(self, placement: Placement, run_dir: RunDir,
                     resume: Optional[str]) -> tuple[Any, dict[str, str]]:
        """Start the run-folder service; the variables that tell the ranks where their run
        folder is."""
        from sparkhvd.driver.fileservice import RunFileService
        from sparkhvd.storage import public_url

        options = dict(self.run_config.storage_options)
        files = RunFileService(placement.driver_host, run_dir.path,
                               (resume, options) if resume else None).start()
        env = dict(files.env())
        if placement.executors_here:
            env[protocol.RUN_URL_ENV] = run_dir.path
        if resume:
            env[protocol.RESUME_URL_ENV] = public_url(resume)
        if self.run_config.timeline:
            env[protocol.TIMELINE_ENV] = (
                run_dir.file("timeline.json") if placement.executors_here else
                os.path.join("/tmp", f"sparkhvd-timeline-{run_dir.run_id}.json"))
            run_dir.update(timeline="timeline.json")
        return files, env

    @staticmethod
    def _write_curves(run_dir: RunDir, records: list) -> None:
        if not records:
            return
        from sparkhvd.driver.curves import plot_curves, write_metrics_csv

        try:
            write_metrics_csv(run_dir.file("metrics.csv"), records)
            plot_curves(run_dir.file("curves.png"), records)
        except Exception as exc:  # noqa: BLE001 - curves must never hide the run's outcome
            log.warning("could not write the training curves: %s", exc)

    @staticmethod
    def _resume_record(run_dir: RunDir, outcome: Optional[RunOutcome], warn: bool = True) -> dict:
        """``run.json``'s ``resume``: what was asked, and what the (latest) attempt restored --
        with the checkpoints it skipped, and why."""
        requested = (run_dir.record.get("resume") or {}).get("requested")
        if not requested and outcome is not None and outcome.resumed is not None and \
                outcome.resumed.source:
            requested = run_dir.file("checkpoints")  # a retry resumed from the run's own
        if not requested:
            return {}
        resumed = outcome.resumed if outcome is not None else None
        if resumed is not None and resumed.source:
            restored = {"requested": requested, "restored": resumed.source,
                        "epoch": resumed.epoch}
            if resumed.skipped:
                restored["skipped"] = list(resumed.skipped)
            return {"resume": restored, "resumed_from": requested}
        if not warn:
            return {}
        warning = (f"resume_from asked to resume from {requested}, but no checkpoint was "
                   "restored: the ranks trained from scratch. Use "
                   "sparkhvd.keras.KerasDistributed in the training function (it restores "
                   "unless resume=False), or restore the checkpoint yourself.")
        log.warning(warning)
        return {"resume": {"requested": requested, "restored": None, "warning": warning}}

    def _finish(self, run_dir: RunDir, status: str, error: Optional[BaseException],
                outcome: Optional[RunOutcome] = None, **extra: Any) -> None:
        run_dir.mark("total")
        fields: dict[str, Any] = {"status": status,
                                  "finished_at": _dt.datetime.now().isoformat(timespec="seconds")}
        if error is not None:
            message = str(error).split("\n", 1)[0]
            fields["error"] = {"type": type(error).__name__, "message": message}
        if outcome is not None:
            fields.update(outcome.pid_record())
            if status == "succeeded":
                fields.update(self._resume_record(run_dir, outcome))
        run_dir.update(**fields, **extra)
        if status != "succeeded":
            run_dir.publish_quietly()
        log.debug("run %s %s in %.1fs", run_dir.run_id, status, run_dir.record["timings"]["total"])
