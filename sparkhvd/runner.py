"""``HorovodRunner``: run a training function data-parallel on Spark task slots with Horovod."""
from __future__ import annotations

import datetime as _dt
import logging
import os
from typing import Any, Callable, Mapping, Optional

from . import payload as _payload
from .barrier import LAUNCHERS, choose_launcher, driver_host, launch_barrier
from .compat import check_keras
from .errors import RankFailure, TrainingError
from .launch import LaunchFailure, launch_local, launch_spark
from .logs import VERBOSITIES, RankLogRouter
from .rundir import RunDir, latest_checkpointed_run
from .storage import StorageError
from .session import check_worker_python, get_or_create_session, is_loopback_master, rank_env
from .slots import check_slots

log = logging.getLogger(__name__)

RUN_URL_ENV = "SPARKHVD_RUN_URL"  # read by sparkhvd.keras.KerasDistributed
RESUME_URL_ENV = "SPARKHVD_RESUME_URL"

DEFAULT_START_TIMEOUT = 120


def _prepared_arguments(kwargs: Mapping[str, Any]) -> list[Any]:
    """Call ``_sparkhvd_prepare()`` on arguments that need driver-side work before pickling
    (e.g. a DataFrameDataset materialising its Parquet); return them for clean-up."""
    prepared = []
    try:
        for value in kwargs.values():
            if hasattr(type(value), "_sparkhvd_prepare"):
                value._sparkhvd_prepare()
                prepared.append(value)
    except BaseException:
        for value in prepared:
            value._sparkhvd_cleanup()
        raise
    return prepared


def _validate_np(np: Any) -> int:
    if isinstance(np, bool) or not isinstance(np, int) or np == 0:
        raise ValueError(
            f"np must be a non-zero int; got {np!r}. Use np=N (N > 0) to run N ranks as Spark "
            "tasks, or np=-N to run N ranks as local processes on the driver (no Spark tasks, "
            "for quick debugging).")
    return np


class HorovodRunner:
    """Runs a training function on ``np`` Horovod ranks and returns rank 0's result.

    Args:
        np: ``N > 0`` runs N ranks in N Spark task slots of the session (checked up front);
            ``-N`` runs N ranks as local processes on the driver without Spark tasks.
        spark: the SparkSession to use; default the active one, else a new ``local[np]`` one.
        driver_log_verbosity: ``"rank0"`` (default) shows rank 0's output and every rank's
            errors on the driver; ``"all"`` shows every rank's output. Each line is prefixed
            ``[rank N]``; all lines are kept in the run folder's ``logs/rank-N.log``.
        start_timeout: seconds horovod may take to start the ranks.
        env: extra environment variables for the ranks (added to a small allowlist of the
            driver's variables; the driver's environment is never copied wholesale).
        output_dir: folder or storage URL (``abfss://container@account.dfs.core.windows.net/
            path``, ``az://``, ``file://``) that receives one ``<run-id>/`` folder per run
            (default ``runs``). A remote destination is checked by a pre-flight write before
            training; the run is staged locally and published at the end.
        storage_options: credentials and options for ``output_dir`` (adlfs keywords such as
            ``connection_string``, ``account_key``, ``sas_token``); default: the
            ``AZURE_STORAGE_*`` environment variables, then adlfs' credential chain. They are
            used on the driver only and never recorded.
        resume_from: resume Keras training (``sparkhvd.keras.KerasDistributed(resume=True)``)
            from a run's checkpoints: ``True`` for the latest run under ``output_dir`` that has
            checkpoints, or a run folder / checkpoints URL.
        min_np, max_np: elastic training (``horovod.spark.run_elastic``): the run goes on while
            between ``min_np`` and ``max_np`` ranks are alive; the function must keep its
            progress in ``hvd.elastic`` state (see the README).
        launcher: how ranks start on Spark. ``"auto"`` (default): ``"barrier"`` -- sparkhvd's
            own launcher, one Spark barrier stage with a Gloo rank process per task (about a
            second to start, see ``sparkhvd.barrier``) -- unless the run is elastic or the
            session uses dynamic allocation (barrier stages cannot), then ``"horovod"``:
            ``horovod.spark.run`` / ``run_elastic``.
        preset: a session preset name (``conf/<name>.json``) or :class:`~sparkhvd.presets.Preset`:
            ``np`` is checked against it at once, and a session is created from it when none is
            active.
        timeline: record a Horovod timeline (``HOROVOD_TIMELINE``) into the run folder as
            ``timeline.json`` (open it in chrome://tracing or Perfetto).
        verbose: show TensorFlow/Gloo start-up noise and horovod's own debug output.
        nics: network interfaces for Gloo; default ``{"lo"}`` when every executor is local.
        slot_wait_s: on a cluster, how long to wait for executors to register before the
            slot check fails.

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
                 slot_wait_s: float = 30.0) -> None:
        self.np = _validate_np(np)
        self.elastic = None
        if min_np is not None or max_np is not None:
            lo = np if min_np is None else min_np
            hi = np if max_np is None else max_np
            if np < 0 or not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= np <= hi):
                raise ValueError(f"Elastic training needs 1 <= min_np <= np <= max_np with np > 0; "
                                 f"got min_np={min_np}, np={np}, max_np={max_np}.")
            self.elastic = (lo, hi)
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}; got {launcher!r}")
        if launcher == "barrier" and self.elastic:
            raise ValueError("Elastic training (min_np/max_np) runs on horovod.spark.run_elastic; "
                             "use launcher='auto' or 'horovod'.")
        self.launcher = launcher
        if driver_log_verbosity not in VERBOSITIES:
            raise ValueError(f"driver_log_verbosity must be one of {VERBOSITIES}; "
                             f"got {driver_log_verbosity!r}")
        if not isinstance(start_timeout, (int, float)) or start_timeout <= 0:
            raise ValueError(f"start_timeout must be a positive number of seconds; "
                             f"got {start_timeout!r}")
        self.spark = spark
        self.driver_log_verbosity = driver_log_verbosity
        self.start_timeout = int(start_timeout)
        self.env = dict(env or {})
        rank_env(self.env)  # validates types now rather than at run()
        self.output_dir = output_dir
        self.storage_options = dict(storage_options or {})
        self.resume_from = resume_from
        if isinstance(preset, str):
            from .presets import load_preset

            preset = load_preset(preset)
        if preset is not None:
            preset.check_np(self.np)
        self.preset = preset
        self.timeline = timeline
        self.verbose = verbose
        self.nics = set(nics) if nics else None
        self.slot_wait_s = slot_wait_s
        self.last_run_dir: Optional[RunDir] = None

    # -- public API ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """Run ``fn(**kwargs)`` on every rank and return rank 0's return value.

        ``timeout`` (seconds, reserved keyword): stop the ranks, cancel the Spark job and raise
        ``TimeoutError`` if the training runs longer. ``KeyboardInterrupt`` (a notebook's stop
        button) likewise stops everything and propagates; the session stays usable.

        Raises:
            PayloadError: ``fn`` or an argument cannot be sent to the ranks (before launch).
            NotEnoughSlotsError: the session has fewer task slots than ``np`` (in seconds).
            TrainingError: a rank failed; names the rank, the exception and its traceback.
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
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        if not callable(fn):
            _payload.dumps(fn, {})  # raises the PayloadError that explains it
        prepared = _prepared_arguments(kwargs)
        try:
            blob = _payload.dumps(fn, kwargs)
            return self._launch(fn, blob, return_all=return_all, timeout=timeout)
        finally:
            for value in prepared:
                value._sparkhvd_cleanup()

    def _launch(self, fn: Callable, blob: bytes, *, return_all: bool,
                timeout: Optional[float]) -> list:
        env = rank_env(self.env, verbose=self.verbose)
        check_keras({**os.environ, **env})
        run_dir = RunDir(self.output_dir, storage_options=self.storage_options)
        self.last_run_dir = run_dir
        try:
            run_dir.preflight()
        except StorageError as exc:
            self._finish(run_dir, "failed", exc)
            raise
        size = abs(self.np)
        run_dir.update(status="starting", np=self.np, mode="spark" if self.np > 0 else "local",
                       function=getattr(fn, "__qualname__", repr(fn)),
                       started_at=_dt.datetime.now().isoformat(timespec="seconds"))
        router = RankLogRouter(self.driver_log_verbosity, log_dir=run_dir.logs,
                               verbose=self.verbose)
        options = {"verbose": self.verbose, "return_all": return_all,
                   "elastic": bool(self.elastic)}
        try:
            self._resume_env(env, run_dir)
            if self.np > 0:
                spark = get_or_create_session(size, self.spark, self.preset)
                sc = spark.sparkContext
                run_dir.update(spark_master=sc.master, spark_app_id=sc.applicationId)
                self._run_dir_env(env, run_dir, shared=is_loopback_master(sc.master))
                check_worker_python(sc)
                slots = check_slots(sc, size, wait_s=0 if sc.master.startswith("local")
                                    else self.slot_wait_s)
                run_dir.update(slots=slots.slots)
                nics = self.nics or ({"lo"} if is_loopback_master(sc.master) else None)
                run_dir.mark("launch")
                log.info("Launching %d rank(s) on Spark (%s); logs in %s", size, sc.master,
                         run_dir.logs)
                launcher = choose_launcher(self.launcher, sc, self.elastic)
                run_dir.update(launcher=launcher)
                if launcher == "barrier":
                    results = launch_barrier(
                        size, blob, options, env=env, router=router,
                        start_timeout=self.start_timeout, nics=nics, verbose=self.verbose,
                        timeout=timeout, driver_host=driver_host(sc))
                else:
                    results = launch_spark(size, blob, options, env=env, router=router,
                                           start_timeout=self.start_timeout, nics=nics,
                                           verbose=self.verbose, timeout=timeout,
                                           elastic=self.elastic)
            else:
                self._run_dir_env(env, run_dir, shared=True)
                run_dir.mark("launch")
                log.info("Launching %d local rank process(es); logs in %s", size, run_dir.logs)
                results = launch_local(size, blob, options, env=env, router=router,
                                       start_timeout=self.start_timeout, verbose=self.verbose,
                                       timeout=timeout)
        except LaunchFailure as failure:
            error = self._training_error(failure, router, run_dir)
            self._finish(run_dir, "failed", error, **router.pid_record())
            raise error from None
        except BaseException as exc:
            status = ("interrupted" if isinstance(exc, KeyboardInterrupt) else
                      "timed out" if isinstance(exc, TimeoutError) else "failed")
            self._finish(run_dir, status, exc, **router.pid_record())
            raise
        finally:
            router.close()
            self._write_curves(run_dir, router.metrics)
        run_dir.mark("finished")
        saved = run_dir.save_result(results[0]) if results else None
        self._finish(run_dir, "succeeded", None, model=os.path.basename(saved) if saved else None,
                     **router.pid_record())
        try:
            run_dir.publish()
        except StorageError as exc:
            exc.result = results[0] if not return_all else results  # type: ignore[attr-defined]
            raise
        return results

    def _run_dir_env(self, env: dict, run_dir: RunDir, *, shared: bool) -> None:
        """Tell the ranks where the run folder is (for checkpoints) and where the timeline goes.

        When the ranks run on this machine they write into the local (staged) folder, which is
        published with the rest; on a cluster they write to the run's URL directly.
        """
        env[RUN_URL_ENV] = run_dir.path if shared else run_dir.url
        if self.timeline:
            if shared:
                env["HOROVOD_TIMELINE"] = run_dir.file("timeline.json")
            else:
                env["HOROVOD_TIMELINE"] = f"/tmp/sparkhvd-timeline-{run_dir.run_id}.json"
                log.warning("timeline=True on a cluster: rank 0 writes the timeline to %s on its "
                            "executor host", env["HOROVOD_TIMELINE"])
            run_dir.update(timeline=env["HOROVOD_TIMELINE"])

    def _resume_env(self, env: dict, run_dir: RunDir) -> None:
        if self.resume_from is None or self.resume_from is False:
            return
        if self.resume_from is True:
            source = latest_checkpointed_run(self.output_dir, self.storage_options,
                                             exclude=run_dir.run_id)
            if source is None:
                raise FileNotFoundError(
                    f"resume_from=True, but no earlier run under {self.output_dir} has "
                    "checkpoints (checkpoints/latest.json). Train with "
                    "sparkhvd.keras.KerasDistributed(checkpoint=True) first, or pass "
                    "resume_from=<run folder URL>.")
        else:
            source = str(self.resume_from).rstrip("/")
        env[RESUME_URL_ENV] = source
        run_dir.update(resumed_from=source)

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
    def _training_error(failure: LaunchFailure, router: RankLogRouter,
                        run_dir: RunDir) -> TrainingError:
        reported = sorted(router.failures.values(), key=lambda f: f.time)
        if reported:
            first = reported[0]
            if failure.rank == first.rank:
                first.exit_code = failure.exit_code
            return TrainingError(first, reported, run_dir=run_dir.path)
        rank = failure.rank if failure.rank is not None else -1
        code = failure.exit_code
        if code is None:
            how = ("vanished without an exit status (its executor or worker was lost, or the "
                   "connection to it broke)")
        elif code < 0:
            how = f"was killed by signal {-code}"
        elif code is not None and code > 128:  # a shell's way of reporting a signal
            how = f"was killed by signal {code - 128} (exit status {code})"
        else:
            how = f"exited with status {code}"
        return TrainingError(RankFailure(
            rank=rank, exc_type=None, exit_code=failure.exit_code,
            message=f"the rank process {how} without raising a Python exception",
            traceback=router.tail(rank)), run_dir=run_dir.path)

    @staticmethod
    def _finish(run_dir: RunDir, status: str, error: Optional[BaseException], **extra: Any) -> None:
        run_dir.mark("total")
        fields: dict[str, Any] = {"status": status,
                                  "finished_at": _dt.datetime.now().isoformat(timespec="seconds")}
        if error is not None:
            message = str(error).split("\n", 1)[0]
            fields["error"] = {"type": type(error).__name__, "message": message}
        run_dir.update(**fields, **extra)
        log.debug("run %s %s in %.1fs", run_dir.run_id, status, run_dir.record["timings"]["total"])
