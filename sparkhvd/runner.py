"""``HorovodRunner``: run a training function data-parallel on Spark task slots with Horovod.

The runner is the driver's whole story of a run, in order: validate, serialise, check the
cluster, prepare the run folder, build one :class:`~sparkhvd.launchers.LaunchSpec`, hand it to
a launcher, collect the :class:`~sparkhvd.outcome.RunOutcome`, record and publish.
"""
from __future__ import annotations

import datetime as _dt
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from . import payload as _payload
from . import protocol
from .compat import check_horovod, check_keras
from .environment import rank_env
from .errors import LaunchFailure, PayloadError, StorageError
from .backends import BACKENDS
from .launchers import LAUNCHERS, LaunchSpec, choose_launcher, get_launcher
from .logs import RankLogRouter, check_verbosity
from .outcome import RunOutcome
from .redaction import remember_environment
from .rundir import RunDir, resolve_resume_source

log = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT = 120
#: Keyword arguments of ``run()``/``run_all()`` themselves: a training function cannot take them.
RESERVED_KWARGS = ("timeout",)


@dataclass(frozen=True)
class Mode:
    """``np`` decoded once, at the boundary: how many ranks, and where they run."""

    size: int
    spark: bool

    @classmethod
    def from_np(cls, np: Any) -> "Mode":
        if isinstance(np, bool) or not isinstance(np, int) or np == 0:
            raise ValueError(
                f"np must be a non-zero int; got {np!r}. Use np=N (N > 0) to run N ranks as Spark "
                "tasks, or np=-N to run N ranks as local processes on the driver (no Spark tasks, "
                "for quick debugging).")
        return cls(size=abs(np), spark=np > 0)

    @property
    def name(self) -> str:
        return "spark" if self.spark else "local"


def check_arguments(fn: Callable, kwargs: Mapping[str, Any]) -> None:
    """Bind ``kwargs`` to ``fn``'s signature on the driver, before anything starts.

    Raises:
        PayloadError: naming the missing/unexpected argument, or a required parameter whose
            name ``run()`` reserves for itself.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables: nothing to check
        return
    name = getattr(fn, "__qualname__", repr(fn))
    for param in signature.parameters.values():
        if param.name in RESERVED_KWARGS and param.default is param.empty and \
                param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise PayloadError(
                f"{name}() has a required parameter {param.name!r}, but run() reserves that "
                f"keyword for itself (run(fn, {param.name}=...) is run()'s own "
                f"{param.name}). Fix: rename the parameter, or give it a default. Reserved: "
                f"{', '.join(RESERVED_KWARGS)}.")
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
                f"{unexpected[0]!r}{hint}. Fix: pass the function's own parameter names. "
                f"Reserved by run(): {', '.join(RESERVED_KWARGS)}.")
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise PayloadError(
            f"run() cannot call {name}{signature} with the arguments given "
            f"({', '.join(kwargs) or 'none'}): {exc}. Fix: pass the function's parameters by "
            f"name, e.g. run({getattr(fn, '__name__', 'fn')}, "
            f"{', '.join(f'{p}=...' for p in list(signature.parameters)[:2])}). "
            f"Reserved by run(): {', '.join(RESERVED_KWARGS)}.") from None


def _prepared_arguments(kwargs: Mapping[str, Any]) -> list[Any]:
    """Call ``_sparkhvd_prepare()`` on arguments that need driver-side work before pickling
    (a DataFrameDataset materialises its Parquet); return them for :func:`_finish_arguments`."""
    prepared = []
    try:
        for value in kwargs.values():
            if hasattr(type(value), "_sparkhvd_prepare"):
                value._sparkhvd_prepare()
                prepared.append(value)
    except BaseException:
        _finish_arguments(prepared, succeeded=False)
        raise
    return prepared


def _finish_arguments(prepared: list[Any], *, succeeded: bool) -> None:
    for value in prepared:
        try:
            value._sparkhvd_finish(succeeded)
        except Exception as exc:  # noqa: BLE001 - clean-up must not hide the run's outcome
            log.warning("could not clean up %r: %s", value, exc)


class HorovodRunner:
    """Runs a training function on ``np`` Horovod ranks and returns rank 0's result.

    Args:
        np: ``N > 0`` runs N ranks in N Spark task slots of the session (checked up front);
            ``-N`` runs N ranks as local processes on the driver without Spark tasks.
        spark: the SparkSession to use, classic or Spark Connect (``remote("sc://...")``);
            default the active one, else a new ``local[np]`` one.
        driver_log_verbosity: ``"rank0"`` (default) shows rank 0's output and every rank's
            errors on the driver; ``"all"`` shows every rank's output. Each line is prefixed
            ``[rank N]``; all lines are kept in the run folder's ``logs/rank-N.log``.
        start_timeout: seconds the ranks may take to start.
        env: extra environment variables for the ranks (added to the rank's own machine basics
            and the driver's ``TF_*``/``HOROVOD_*``/... settings; the driver's environment is
            never copied wholesale, see :mod:`sparkhvd.environment`).
        output_dir: folder or storage URL (``abfss://container@account.dfs.core.windows.net/
            path``, ``az://``, ``file://``) that receives one ``<run-id>/`` folder per run
            (default ``runs``). A remote destination is checked by a pre-flight write before
            training; the run is staged locally and published at the end.
        storage_options: credentials and options for ``output_dir`` (adlfs keywords such as
            ``connection_string``, ``account_key``, ``sas_token``; and sparkhvd's retry budget,
            see :mod:`sparkhvd.storage`); default: the ``AZURE_STORAGE_*`` environment
            variables, then adlfs' credential chain. Used on the driver only, never recorded.
        resume_from: continue Keras training from a run's checkpoints: ``True`` for the latest
            run under ``output_dir`` that has checkpoints, or a run folder / checkpoints URL.
            ``sparkhvd.keras.KerasDistributed`` then restores them (unless ``resume=False``);
            a run asked to resume that restores nothing says so (warning, ``run.json``).
        min_np, max_np: elastic training (``horovod.spark.run_elastic``): the run goes on while
            between ``min_np`` and ``max_np`` ranks are alive; the function must keep its
            progress in ``hvd.elastic`` state (see the README).
        launcher: how ranks start on Spark: ``"auto"`` (default: ``"barrier"`` -- one Spark
            barrier stage, about a second to start -- unless the run is elastic or the session
            uses dynamic allocation, then ``"horovod"``: ``horovod.spark.run``/``run_elastic``).
        preset: a session preset name (``conf/<name>.json``) or :class:`~sparkhvd.presets.Preset`:
            ``np`` is checked against it at once, and a session is created from it when none is
            active.
        timeline: record a Horovod timeline into the run folder as ``timeline.json`` (open it
            in chrome://tracing or Perfetto), wherever rank 0 runs.
        verbose: show TensorFlow/Gloo start-up noise and horovod's own debug output.
        nics: network interfaces for Gloo; default: ``{"lo"}`` when every executor is local,
            else each task uses the interface that reaches the driver.
        slot_wait_s: on a cluster, how long to wait for executors to register before the
            slot check fails.
        heartbeat_timeout: (barrier launcher) a Spark task silent this long -- its host lost or
            cut off the network -- fails the run, naming the rank and host.
        mlflow: ``True`` or an experiment name: track the run in MLflow (params, per-epoch
            metrics, the model and the run folder's records; see :mod:`sparkhvd.tracking`).
            Needs the ``mlflow`` extra.
        backend: ``"horovod"`` (default: Horovod with Gloo; plain Horovod code runs unchanged)
            or ``"tf"``: ``tf.distribute.MultiWorkerMirroredStrategy`` from a ``TF_CONFIG`` each
            rank gets -- no horovod at all, so current TensorFlow, Keras 3 and numpy 2 work.
            Elastic runs, ``launcher="horovod"`` and ``timeline`` are Horovod-only.

    Example::

        hr = HorovodRunner(np=2)
        model_bytes = hr.run(train_fn, lr=0.1, epochs=3)
    """

    def __init__(self, np: int, *, spark=None, driver_log_verbosity: str = "rank0",
                 start_timeout: int = DEFAULT_START_TIMEOUT,
                 env: Optional[Mapping[str, str]] = None, output_dir: str = "runs",
                 storage_options: Optional[Mapping[str, Any]] = None,
                 resume_from: Any = None, timeline: bool = False, preset: Any = None,
                 min_np: Optional[int] = None, max_np: Optional[int] = None,
                 launcher: str = "auto", verbose: bool = False, nics: Optional[set[str]] = None,
                 slot_wait_s: float = 30.0, heartbeat_timeout: float = 15.0,
                 mlflow: Union[None, bool, str] = None, backend: str = "horovod") -> None:
        self.mode = Mode.from_np(np)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
        self.backend = backend
        self.np = np
        self.elastic = None
        if min_np is not None or max_np is not None:
            lo = np if min_np is None else min_np
            hi = np if max_np is None else max_np
            if not self.mode.spark or not (isinstance(lo, int) and isinstance(hi, int)
                                           and 1 <= lo <= np <= hi):
                raise ValueError(f"Elastic training needs 1 <= min_np <= np <= max_np with np > 0; "
                                 f"got min_np={min_np}, np={np}, max_np={max_np}.")
            self.elastic = (lo, hi)
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}; got {launcher!r}")
        if backend == "tf":
            horovod_only = [name for name, used in (("min_np/max_np (elastic)", self.elastic),
                                                    ("launcher='horovod'", launcher == "horovod"),
                                                    ("timeline=True", timeline)) if used]
            if horovod_only:
                raise ValueError(f"{' and '.join(horovod_only)} need backend='horovod'; "
                                 "backend='tf' runs on sparkhvd's barrier launcher with "
                                 "tf.distribute (see the README's 'Choosing a backend').")
        if launcher == "barrier" and self.elastic:
            raise ValueError("Elastic training (min_np/max_np) runs on horovod.spark.run_elastic; "
                             "use launcher='auto' or 'horovod'.")
        self.launcher = launcher
        self.driver_log_verbosity = check_verbosity(driver_log_verbosity)
        for name, value in (("start_timeout", start_timeout),
                            ("heartbeat_timeout", heartbeat_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds; got {value!r}")
        self.spark = spark
        self.start_timeout = int(start_timeout)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.env = dict(env or {})
        rank_env(self.env)  # validates types now rather than at run()
        self.output_dir = output_dir
        self.storage_options = dict(storage_options or {})
        self.resume_from = resume_from
        if isinstance(preset, str):
            from .presets import load_preset

            preset = load_preset(preset)
        if preset is not None and self.mode.spark:
            preset.check_np(self.mode.size)
        self.preset = preset
        self.timeline = timeline
        self.verbose = verbose
        self.nics = set(nics) if nics else None
        self.slot_wait_s = slot_wait_s
        if mlflow:
            from .tracking import _import_mlflow

            _import_mlflow()  # a missing extra is said now, not after training
        self.mlflow = mlflow
        self.last_run_dir: Optional[RunDir] = None

    # -- public API ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """Run ``fn(**kwargs)`` on every rank and return rank 0's return value.

        ``timeout`` (seconds, reserved keyword): stop the ranks, cancel the Spark job and raise
        ``TimeoutError`` if the training runs longer. ``KeyboardInterrupt`` (a notebook's stop
        button) likewise stops everything and propagates; the session stays usable.

        Raises:
            PayloadError: ``fn`` or an argument cannot be sent to the ranks, or ``kwargs`` do not
                fit ``fn``'s parameters (before launch).
            NotEnoughSlotsError: the session has fewer task slots than ``np`` (in seconds).
            TrainingError: a rank failed; names the rank, its host, the exception and traceback.
            TimeoutError: ``timeout`` passed.
        """
        return self._execute(fn, kwargs, return_all=False, timeout=timeout)[0]

    def run_all(self, fn: Callable[..., Any], *, timeout: Optional[float] = None,
                **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, but return every rank's return value, in rank order."""
        return self._execute(fn, kwargs, return_all=True, timeout=timeout)

    # -- internals -----------------------------------------------------------------------
    def _execute(self, fn: Callable, kwargs: Mapping[str, Any], *, return_all: bool,
                 timeout: Optional[float] = None) -> list:
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        if not callable(fn):
            _payload.dumps(fn, {})  # raises the PayloadError that explains it
        check_arguments(fn, kwargs)
        if self.backend == "horovod":
            check_horovod()  # before a session starts or data is materialised
        spark = self._session() if self.mode.spark else None
        prepared = _prepared_arguments(kwargs)
        succeeded = False
        try:
            blob = _payload.dumps(fn, kwargs)
            results = self._launch(fn, blob, spark, return_all=return_all, timeout=timeout,
                                   kwargs=kwargs)
            succeeded = True
            return results
        finally:
            _finish_arguments(prepared, succeeded=succeeded)

    def _session(self) -> Any:
        from .compat import check_spark
        from .session import get_or_create_session

        check_spark()  # a missing or unsupported pyspark is named with the fix, before any import

        return get_or_create_session(self.mode.size, self.spark, self.preset)

    def _launch(self, fn: Callable, blob: bytes, spark: Any, *, return_all: bool,
                timeout: Optional[float], kwargs: Mapping[str, Any]) -> list:
        remember_environment(os.environ)
        env = rank_env(self.env, verbose=self.verbose)
        if self.backend == "horovod":
            check_keras({**os.environ, **env})
        run_dir = RunDir(self.output_dir, storage_options=self.storage_options)
        self.last_run_dir = run_dir
        tracker = None
        try:
            run_dir.preflight()
        except StorageError as exc:
            self._finish(run_dir, "failed", exc)
            raise
        run_dir.update(status="starting", np=self.np, mode=self.mode.name, backend=self.backend,
                       function=getattr(fn, "__qualname__", repr(fn)),
                       started_at=_dt.datetime.now().isoformat(timespec="seconds"))
        router = RankLogRouter(self.driver_log_verbosity, log_dir=run_dir.logs,
                               verbose=self.verbose)
        outcome = RunOutcome(router)
        files = None
        results: list = []
        status, error, raise_as = "succeeded", None, None
        try:
            spec = LaunchSpec(np=self.mode.size, payload=blob, env=env,
                              options={"verbose": self.verbose, "return_all": return_all,
                                       "elastic": bool(self.elastic)},
                              start_timeout=self.start_timeout, timeout=timeout,
                              verbose=self.verbose, elastic=self.elastic,
                              heartbeat_timeout=self.heartbeat_timeout, backend=self.backend)
            launcher_name, shared_disk = self._place(spec, spark, run_dir)
            if self.mlflow:
                from .tracking import MlflowTracker

                tracker = MlflowTracker(self.mlflow)
                tracker.start(run_dir, {**run_dir.record_params(), "launcher": launcher_name},
                              kwargs)
                outcome.listeners.append(tracker.metrics)
            resume = self._resume_source(run_dir)
            files = self._start_files(spec, run_dir, resume, shared_disk)
            spec.options["env_keep"] = sorted(set(self.env) | set(spec.env))
            run_dir.mark("launch")
            log.info("Launching %d rank(s) %s; logs in %s", spec.np,
                     f"on Spark ({spec.session.describe()})" if spark else "as local processes",
                     run_dir.logs)
            results = get_launcher(launcher_name).launch(spec, outcome)
            if outcome.channel:
                run_dir.update(control=outcome.channel)
        except LaunchFailure as failure:
            status, raise_as = "failed", failure
            error = outcome.training_error(failure, None)
        except BaseException as exc:
            status = ("interrupted" if isinstance(exc, KeyboardInterrupt) else
                      "timed out" if isinstance(exc, TimeoutError) else "failed")
            error = raise_as = exc
        finally:
            if files is not None:
                files.stop()
            router.close()
            self._write_curves(run_dir, outcome.metrics)
        extra: dict[str, Any] = {}
        if error is None:
            run_dir.mark("finished")
            saved = run_dir.save_result(results[0]) if results else None
            extra["model"] = os.path.basename(saved) if saved else None
        self._finish(run_dir, status, error, outcome, **extra)
        if tracker is not None:
            tracker.finish(run_dir, status)
        if isinstance(raise_as, LaunchFailure):
            # Built again now that the run folder is where it stays (published if remote).
            raise outcome.training_error(raise_as, run_dir.location) from None
        if raise_as is not None:
            raise raise_as
        try:
            run_dir.publish()
        except StorageError as exc:
            exc.result = results[0] if not return_all else results
            raise
        return results

    def _place(self, spec: LaunchSpec, spark: Any, run_dir: RunDir) -> tuple[str, bool]:
        """Which launcher, where the driver is reached, and whether the ranks share its disk."""
        if not self.mode.spark:
            run_dir.update(launcher="local")
            return "local", True
        from .session import check_worker_python
        from .slots import check_slots
        from .sparkview import SparkView

        view = SparkView(spark)
        run_dir.update(spark_master=view.master, spark_app_id=view.app_id, session=view.kind)
        name = choose_launcher(self.launcher, view, self.elastic, self.backend)
        check_worker_python(view, self.backend)
        slots = check_slots(view, spec.np, wait_s=0 if view.master.startswith("local")
                            else self.slot_wait_s)
        run_dir.update(slots=slots.slots)
        shared = view.executors_here()
        spec.nics = self.nics or ({"lo"} if shared else None)
        spec.driver_host = view.driver_host()
        spec.session = view
        run_dir.update(launcher=name)
        return name, shared

    def _resume_source(self, run_dir: RunDir) -> Optional[str]:
        """The checkpoints folder to resume from (or None), recorded as *requested*."""
        if self.resume_from is None or self.resume_from is False:
            return None
        source = resolve_resume_source(self.resume_from, self.output_dir, self.storage_options,
                                       exclude=run_dir.run_id)
        run_dir.update(resume={"requested": source, "restored": None})
        return source

    def _start_files(self, spec: LaunchSpec, run_dir: RunDir, resume: Optional[str],
                     shared_disk: bool) -> Any:
        """Start the run-folder service and tell the ranks where their run folder is."""
        from .fileservice import RunFileService
        from .storage import public_url

        files = RunFileService(spec.driver_host, run_dir.path,
                               (resume, self.storage_options) if resume else None).start()
        spec.env.update(files.env())
        if shared_disk:
            spec.env[protocol.RUN_URL_ENV] = run_dir.path
        if resume:
            spec.env[protocol.RESUME_URL_ENV] = public_url(resume)
        if self.timeline:
            spec.env[protocol.TIMELINE_ENV] = (
                run_dir.file("timeline.json") if shared_disk else
                os.path.join("/tmp", f"sparkhvd-timeline-{run_dir.run_id}.json"))
            run_dir.update(timeline="timeline.json")
        return files

    @staticmethod
    def _write_curves(run_dir: RunDir, records: list) -> None:
        if not records:
            return
        from .curves import plot_curves, write_metrics_csv

        try:
            write_metrics_csv(run_dir.file("metrics.csv"), records)
            plot_curves(run_dir.file("curves.png"), records)
        except Exception as exc:  # noqa: BLE001 - curves must never hide the run's outcome
            log.warning("could not write the training curves: %s", exc)

    @staticmethod
    def _resume_record(run_dir: RunDir, outcome: Optional[RunOutcome]) -> dict:
        requested = (run_dir.record.get("resume") or {}).get("requested")
        if not requested:
            return {}
        resumed = outcome.resumed if outcome is not None else None
        if resumed is not None and resumed.source:
            return {"resume": {"requested": requested, "restored": resumed.source,
                               "epoch": resumed.epoch}, "resumed_from": requested}
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
