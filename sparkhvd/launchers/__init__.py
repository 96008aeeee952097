"""How ranks are started: one :class:`LaunchSpec`, one small protocol, three launchers.

Every launcher takes the same :class:`LaunchSpec` and a *sink* (the run's
:class:`~sparkhvd.outcome.RunOutcome`, which receives every :mod:`sparkhvd.protocol` message the
ranks send) and returns the ranks' return values in rank order -- or raises
:class:`~sparkhvd.errors.LaunchFailure` (a rank failed), ``TimeoutError`` or
``KeyboardInterrupt``, always after every rank was stopped:

============  ==================================================================================
``barrier``   the default on Spark: one barrier stage, a control connection per task, one
              supervised rank process per task (:mod:`sparkhvd.launchers.barrier`)
``horovod``   ``horovod.spark.run`` / ``run_elastic``: elastic runs, and sessions with dynamic
              allocation, which barrier stages cannot use (:mod:`sparkhvd.launchers.horovod`)
``local``     ``np < 0``: supervised rank processes on the driver (:mod:`sparkhvd.launchers.local`)
============  ==================================================================================

The shared lifecycle -- watching a launch from an interruptible thread, aborting, cancelling the
Spark job group, killing what is left -- lives in :mod:`sparkhvd.launchers.base`; the one place a
rank process is started is :class:`sparkhvd.task.process.RankProcess`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

#: What ``HorovodRunner(launcher=...)`` accepts.
LAUNCHERS = ("auto", "barrier", "horovod")


@dataclass
class LaunchSpec:
    """Everything a launcher needs to start ``np`` ranks (built once by the runner)."""

    np: int
    payload: bytes
    options: dict
    env: dict
    start_timeout: float
    timeout: Optional[float] = None
    verbose: bool = False
    nics: Optional[set] = None
    driver_host: str = "127.0.0.1"
    elastic: Optional[tuple[int, int]] = None
    backend: str = "horovod"
    #: A Spark task silent for this long is a lost host (barrier launcher).
    heartbeat_timeout: float = 15.0
    #: The session's :class:`~sparkhvd.sparkview.SparkView` (Spark launchers).
    session: Any = None
    extra: dict = field(default_factory=dict)


class Sink(Protocol):
    """Where a launcher delivers what the ranks send (see :class:`sparkhvd.outcome.RunOutcome`)."""

    def receive(self, msg: Any) -> None: ...


class Launcher(Protocol):
    """Starts the ranks of one run and returns their results in rank order."""

    name: str

    def launch(self, spec: LaunchSpec, sink: Sink) -> list[Any]: ...


def get_launcher(name: str) -> Launcher:
    """The launcher called ``name`` (``barrier``, ``horovod`` or ``local``)."""
    if name not in ("barrier", "horovod", "local"):
        raise ValueError(f"unknown launcher {name!r}")
    return importlib.import_module(f".{name}", __name__).LAUNCHER


def choose_launcher(requested: str, view: Any, elastic: Optional[tuple[int, int]] = None,
                    backend: str = "horovod") -> str:
    """``"barrier"`` or ``"horovod"`` for a Spark run (see ``HorovodRunner(launcher=...)``);
    ``view`` is the session's :class:`~sparkhvd.sparkview.SparkView`."""
    dynamic = str(view.conf("spark.dynamicAllocation.enabled", "false")).lower() == "true"
    if view.connect and (requested == "horovod" or elastic):
        raise ValueError(
            f"{'Elastic training' if elastic else 'launcher=' + repr(requested)} runs on "
            "horovod.spark.run, which needs a SparkContext; this is a Spark Connect session, "
            "which has none. Fix: launcher='auto' (sparkhvd's barrier stage works on Connect) "
            "without min_np/max_np, or a classic session.")
    if backend != "horovod" or view.connect:  # the barrier stage is the only way
        if dynamic:
            why = (f"backend={backend!r} runs" if backend != "horovod" else
                   "On a Spark Connect session (no SparkContext for horovod.spark.run) ranks run")
            raise ValueError(f"{why} in a Spark barrier stage, which Spark refuses with "
                             "spark.dynamicAllocation.enabled=true. Fix: turn dynamic allocation "
                             "off for this cluster or session"
                             + (", or use backend='horovod'." if not view.connect else "."))
        return "barrier"
    if requested == "barrier" and dynamic:
        raise ValueError("launcher='barrier' cannot run with spark.dynamicAllocation.enabled=true "
                         "(Spark refuses barrier stages then); use launcher='auto' or 'horovod'.")
    if requested in ("barrier", "horovod"):
        return requested
    return "horovod" if (elastic or dynamic) else "barrier"
