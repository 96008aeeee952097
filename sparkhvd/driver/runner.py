"""``SparkRunner`` (and ``HorovodRunner``, its Databricks-compatible subclass): run a training
function data-parallel on Spark task slots.

The runner validates what it is given -- settings when it is made, the function and its
arguments when it runs -- and hands one run to :class:`~sparkhvd.driver.run.Run`, which tells
the rest of the story (attempts, retries, the run record, publishing).
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Mapping, Optional, Union

from sparkhvd.common.backends import BACKENDS
from sparkhvd.common.errors import PayloadError
from sparkhvd.driver import payload as _payload
from sparkhvd.driver.arguments import Prepared
from sparkhvd.driver.launchers import LaunchFacts, check_launch
from sparkhvd.driver.run import Run
from sparkhvd.driver.settings import (
    KEYWORD_GROUPS,
    UNSET,
    LaunchConfig,
    RunConfig,
    ScalingConfig,
    SessionConfig,
    group_keywords,
    scaling_config,
    seconds,
)
from sparkhvd.driver.spec import RunSpec, run_spec
from sparkhvd.runfolder.rundir import RunDir
from sparkhvd.spark.installed import check_horovod_installed

__side__ = "driver"

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
    if run_timeout is not UNSET:
        return run_timeout
    if "timeout" not in kwargs:
        return None
    params: Mapping[str, inspect.Parameter]
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


def _the_function(method: str, args: tuple, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """The training function of ``run(fn, ...)`` or ``run(fn=fn, ...)`` (taken out of
    ``kwargs``); the rest of ``kwargs`` is the function's."""
    if len(args) == 1:
        return args[0]
    if args:
        raise TypeError(f"{method}() takes the training function and its arguments by name, "
                        f"e.g. {method}(train, lr=0.1); got {len(args)} positional arguments.")
    if "fn" not in kwargs:
        raise TypeError(f"{method}() missing the training function: {method}(train, ...) or "
                        f"{method}(fn=train, ...).")
    return kwargs.pop("fn")


class SparkRunner:
    """Runs a training function on ``np`` ranks and returns rank 0's result:
    ``SparkRunner(np=2, backend="torch")``.

    Settings come in four groups (:mod:`sparkhvd.driver.settings`), given as objects or -- as
    always -- as keywords, each filed into its group:

    - ``scaling=ScalingConfig(np, min_np, max_np, ranks_per_task, local_ranks, resize_check_s)``:
      how many ranks (``np > 0``: Spark task slots, checked up front; ``np < 0``: local
      processes on the driver); ``min_np``/``max_np`` make an elastic run (torch and tf:
      relaunched from the newest checkpoint with the slots there are, grown back every
      ``resize_check_s``; horovod: ``horovod.spark.run_elastic``; see docs/guides/spot.md);
      ``ranks_per_task`` ranks in each Spark task (one per GPU of a node), and
      what ``LOCAL_RANK`` counts (``local_ranks``: ``"host"``, torchrun's, or ``"task"``,
      TorchDistributor's).
    - ``launch=LaunchConfig(launcher, start_timeout, heartbeat_timeout, slot_wait_s, nics, env,
      verbose, warm_start)``: how ranks start (``warm_start``: from a process per executor that
      already imported the framework, after the first run; see docs/guides/warm.md). ``launcher="auto"`` is one Spark barrier stage unless the
      run is elastic or the session uses dynamic allocation (then ``horovod.spark.run``);
      ``env`` adds variables for the ranks (the driver's environment is never copied
      wholesale, see :mod:`sparkhvd.common.environment`).
    - ``run_config=RunConfig(output_dir, storage_options, resume_from, timeline, time_split,
      mlflow, driver_log_verbosity, max_retries, max_preemptions)``: the run folder (local,
      ``abfss://``, ``az://``, ``file://``; ``storage_options`` are used on the driver only,
      never recorded), resuming from a run's checkpoints (``True``: the latest run under
      ``output_dir``), a Horovod timeline, where the ranks' time goes (``report.html``),
      MLflow tracking, and which ranks' output the console shows (``"rank0"`` or ``"all"``).
    - ``session=SessionConfig(spark, preset)``: the SparkSession (classic or Spark Connect;
      default the active one, else ``local[np]``) and a ``conf/`` preset to check ``np``
      against and start a session from.

    ``backend``, always said (nothing about the name picks one; :class:`HorovodRunner` is the
    Databricks-compatible name, ``"horovod"`` by default): ``"horovod"`` (Horovod with Gloo;
    plain Horovod code runs unchanged), ``"tf"``: ``tf.distribute.MultiWorkerMirroredStrategy``
    from a ``TF_CONFIG`` each rank gets -- no horovod at all, so current TensorFlow, Keras 3 and
    numpy 2 work -- or ``"torch"``: torchrun's variables for ``torch.distributed``
    (``init_process_group()`` unchanged; helpers in :mod:`sparkhvd.torch`).
    ``launcher="horovod"`` and ``timeline`` are Horovod-only.

    Example::

        runner = SparkRunner(np=2, backend="torch", output_dir="abfss://...")   # keywords, or
        runner = SparkRunner(scaling=ScalingConfig(np=2), backend="torch",
                             run_config=RunConfig(output_dir=...))
        result = runner.run(train_fn, lr=0.1, epochs=3)
    """

    def __init__(self, np: int = UNSET, *, backend: str,
                 scaling: Optional[ScalingConfig] = None, launch: Optional[LaunchConfig] = None,
                 run_config: Optional[RunConfig] = None, session: Optional[SessionConfig] = None,
                 spark: Any = UNSET, driver_log_verbosity: str = UNSET,
                 start_timeout: float = UNSET, env: Optional[Mapping[str, str]] = UNSET,
                 output_dir: str = UNSET, storage_options: Optional[Mapping[str, Any]] = UNSET,
                 resume_from: Any = UNSET, timeline: bool = UNSET, preset: Any = UNSET,
                 min_np: Optional[int] = UNSET, max_np: Optional[int] = UNSET,
                 ranks_per_task: int = UNSET, local_ranks: Optional[str] = UNSET,
                 launcher: str = UNSET, verbose: bool = UNSET,
                 nics: Optional[set[str]] = UNSET, slot_wait_s: float = UNSET,
                 heartbeat_timeout: float = UNSET,
                 mlflow: Union[None, bool, str] = UNSET,
                 stall_timeout: Optional[float] = UNSET, on_stall: str = UNSET,
                 max_retries: Optional[int] = UNSET, max_preemptions: Optional[int] = UNSET,
                 resize_check_s: float = UNSET, time_split: bool = UNSET,
                 warm_start: bool = UNSET) -> None:
        given = {k: v for k, v in locals().items()
                 if v is not UNSET and k in KEYWORD_GROUPS and k != "np"}
        self.scaling = scaling_config(scaling, np, given, type(self).__name__)
        groups = group_keywords({LaunchConfig: launch, RunConfig: run_config,
                                 SessionConfig: session}, given)
        self.launch_config: LaunchConfig = groups[LaunchConfig]
        self.run_config: RunConfig = groups[RunConfig]
        self.session_config: SessionConfig = groups[SessionConfig]
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
        self.backend = backend
        facts = self.launch_facts()
        check_launch(facts)  # the rules a session cannot change, now
        #: what every run of this runner is: the settings and the policies decided from them
        self.spec: RunSpec = run_spec(backend, self.scaling, self.launch_config,
                                      self.run_config, facts)
        preset = self.session_config.preset
        if preset is not None and self.scaling.spark:
            preset.check_np(self.scaling.size)
        if self.run_config.mlflow:
            from sparkhvd.driver.tracking import _import_mlflow

            _import_mlflow()  # a missing extra is said now, not after training
        self.last_run_dir: Optional[RunDir] = None
        #: the running :class:`~sparkhvd.driver.run.Run` (for dump_stacks from another thread)
        self._run: Optional[Run] = None

    @property
    def np(self) -> int:
        return self.scaling.np

    @property
    def elastic(self) -> Optional[tuple[int, int]]:
        return self.scaling.elastic

    def launch_facts(self) -> LaunchFacts:
        """What decides the launcher, as far as the settings alone tell."""
        return LaunchFacts(self.backend, self.launch_config.launcher, bool(self.elastic),
                           bool(self.run_config.timeline), self.scaling.node_per_task)

    # -- public API ----------------------------------------------------------------------
    def run(self, *args: Any, run_timeout: Optional[float] = UNSET, **kwargs: Any) -> Any:
        """Run ``fn(**kwargs)`` on every rank and return rank 0's return value:
        ``run(fn, **kwargs)``, or ``run(fn=fn, **kwargs)`` as Databricks' HorovodRunner allows
        (a function with its own ``fn`` parameter gets it when ``fn`` itself is passed first).

        ``run_timeout`` (seconds): stop the ranks, cancel the Spark job and raise
        ``TimeoutError`` -- with every rank's stack (``logs/stacks-*.txt``) and which rank was
        where -- if the run takes longer, counted from this call (waiting for slots, the
        start and retries included). ``timeout=`` means the same when ``fn`` has no
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
        fn = _the_function("run", args, kwargs)
        timeout = split_run_limit(fn, kwargs, run_timeout)
        return self._execute(fn, kwargs, return_all=False, timeout=timeout)[0]

    def run_all(self, *args: Any, run_timeout: Optional[float] = UNSET,
                **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, but return every rank's return value, in rank order."""
        fn = _the_function("run_all", args, kwargs)
        timeout = split_run_limit(fn, kwargs, run_timeout)
        return self._execute(fn, kwargs, return_all=True, timeout=timeout)

    # -- internals -----------------------------------------------------------------------
    def _execute(self, fn: Callable, kwargs: Mapping[str, Any], *, return_all: bool,
                 timeout: Optional[float] = None) -> list:
        if timeout is not None:
            timeout = seconds("run_timeout (or timeout=)", timeout)
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
            run = Run(self.spec, fn, blob, spark, kwargs=kwargs, return_all=return_all,
                      timeout=timeout)
            self.last_run_dir, self._run = run.run_dir, run
            try:
                results = run.execute()
            finally:
                self._run = None
            succeeded = True
            return results
        finally:
            prepared.finish(succeeded=succeeded)

    def _session(self) -> Any:
        from sparkhvd.spark.installed import check_spark
        from sparkhvd.spark.session import get_or_create_session

        check_spark()  # a missing or unsupported pyspark is named with the fix, before any import
        return get_or_create_session(self.scaling.size, self.session_config.spark,
                                     self.session_config.preset)

    def dump_stacks(self) -> str:
        """Every rank's stacks now, from another thread while :meth:`run` runs: the report's
        text (also saved as ``logs/stacks-<time>.txt``). ``sparkhvd stacks <run folder>`` does
        the same from another process."""
        run = self._run
        monitor = run.attempt.monitor if run is not None and run.attempt is not None else None
        if monitor is None:
            raise RuntimeError(f"No run of this {type(self).__name__} is running: dump_stacks() "
                               "asks a running run's ranks (call it from another thread, or "
                               "use `sparkhvd stacks <run folder>` from a terminal).")
        return monitor.collect("requested from Python").text()


class HorovodRunner(SparkRunner):
    """:class:`SparkRunner` under the Databricks-compatible name: its only difference is
    ``backend="horovod"`` by default, so ``HorovodRunner(np=2).run(train)`` runs plain Horovod
    code as Databricks' ``HorovodRunner`` does. Every setting (``backend="tf"`` or ``"torch"``
    too), ``run``, ``run_all``, ``last_run_dir`` and ``dump_stacks`` are :class:`SparkRunner`'s.

    Example::

        hr = HorovodRunner(np=2, output_dir="abfss://...")        # keywords, or
        hr = HorovodRunner(scaling=ScalingConfig(np=2), run_config=RunConfig(output_dir=...))
        model_bytes = hr.run(train_fn, lr=0.1, epochs=3)
    """

    def __init__(self, np: int = UNSET, *, backend: str = "horovod", **settings: Any) -> None:
        super().__init__(np, backend=backend, **settings)


def distributed(np: int = UNSET, *, backend: str, **settings: Any
                ) -> Callable[[Callable[..., Any]], Any]:
    """Mark a training function to run on ``np`` ranks, in the shape Databricks' serverless GPU
    API uses::

        @sparkhvd.distributed(np=2, backend="torch")
        def train(lr, epochs):
            ...

        result = train.distributed(0.1, epochs=3)   # rank 0's return value
        train.runner.last_run_dir                     # the run's folder, run.json, logs
        train(0.1, epochs=1)                          # still a plain function, here

    The settings are checked when the function is decorated (every keyword of
    :class:`SparkRunner`); ``.distributed(...)`` takes the function's own
    arguments, positional or by name, and ``.distributed_all(...)`` returns every rank's value.
    """
    runner = SparkRunner(np, backend=backend, **settings)

    def decorate(fn: Callable[..., Any]) -> Any:
        def by_name(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
            if not args:
                return kwargs
            try:
                return dict(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)
            except TypeError as exc:
                raise PayloadError(f"{getattr(fn, '__name__', 'fn')}.distributed() cannot "
                                   f"take these arguments: {exc}.") from None

        @functools.wraps(fn)
        def local(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        local.distributed = lambda *a, **k: runner.run(fn, **by_name(a, k))  # type: ignore
        local.distributed_all = lambda *a, **k: runner.run_all(fn, **by_name(a, k))  # type: ignore
        local.runner = runner  # type: ignore[attr-defined]
        return local

    return decorate
