"""Which launcher a run may use: the facts that decide it (:class:`LaunchFacts`), the one
table of rules (:data:`RULES`), and each launcher by its name (:func:`get_launcher`)."""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

__side__ = "driver"


from sparkhvd.driver.launchers.seam import Launcher

#: Launcher name -> its module: ``horovod`` is horovod's Spark launcher (``horovod.spark.run``),
#: not the horovod *backend* (which the barrier launcher runs too).
MODULES = {"barrier": "barrier", "horovod": "horovod_spark", "local": "local"}


def get_launcher(name: str) -> Launcher:
    """The launcher called ``name`` (``barrier``, ``horovod`` or ``local``)."""
    if name not in MODULES:
        raise ValueError(f"unknown launcher {name!r}")
    return importlib.import_module(f"sparkhvd.driver.launchers.{MODULES[name]}").LAUNCHER


@dataclass(frozen=True)
class LaunchFacts:
    """What decides the launcher: the user's settings, and (once known) the session's."""

    backend: str
    requested: str = "auto"
    elastic: bool = False
    timeline: bool = False
    #: ``ranks_per_task > 1`` or ``local_ranks="task"``: ranks numbered per task.
    per_task: bool = False
    #: None until a session is known.
    connect: Optional[bool] = None
    dynamic: Optional[bool] = None

    def with_session(self, view: Any) -> "LaunchFacts":
        """These facts plus the session's (``view``: a :class:`~sparkhvd.spark.sparkview.
        SparkView`)."""
        dynamic = str(view.conf("spark.dynamicAllocation.enabled", "false")).lower() == "true"
        return dataclasses.replace(self, connect=bool(view.connect), dynamic=dynamic)

    @property
    def not_horovod(self) -> bool:
        """Settings horovod's rendezvous cannot number (it counts local ranks per host)."""
        return self.per_task and (self.backend == "horovod" or self.requested == "horovod")

    @property
    def horovod_only(self) -> list[str]:
        return [name for name, used in (("launcher='horovod'", self.requested == "horovod"),
                                        ("timeline=True", self.timeline)) if used]

    @property
    def horovod_elastic(self) -> bool:
        """An elastic run on horovod's own elastic mode (``horovod.spark.run_elastic``); the
        other backends' elastic runs relaunch on the barrier launcher."""
        return self.elastic and self.backend == "horovod"


def _dynamic_why(f: LaunchFacts) -> str:
    why = (f"backend={f.backend!r} runs" if f.backend != "horovod" else
           "On a Spark Connect session (no SparkContext for horovod.spark.run) ranks run")
    return (f"{why} in a Spark barrier stage, which Spark refuses with "
            "spark.dynamicAllocation.enabled=true. Fix: turn dynamic allocation off for this "
            "cluster or session" + (", or use backend='horovod'." if not f.connect else "."))


#: Every launcher/backend/session rule, in the order they are checked: (applies?, message).
RULES: tuple[tuple[Callable[[LaunchFacts], bool], Callable[[LaunchFacts], str]], ...] = (
    (lambda f: f.not_horovod,
     lambda f: "ranks_per_task > 1 and local_ranks='task' number ranks per Spark task, which "
               "horovod's rendezvous cannot (it counts local ranks per host). Fix: "
               "backend='torch' or 'tf' on the barrier launcher, or one rank per task."),
    (lambda f: f.backend != "horovod" and bool(f.horovod_only),
     lambda f: f"{' and '.join(f.horovod_only)} need backend='horovod'; backend={f.backend!r} "
               "runs on sparkhvd's barrier launcher (see docs/guides/backends.md)."),
    (lambda f: f.requested == "barrier" and f.horovod_elastic,
     lambda f: "Elastic training (min_np/max_np) on backend='horovod' runs on "
               "horovod.spark.run_elastic; use launcher='auto' or 'horovod' (or backend='torch'/"
               "'tf', whose elastic runs relaunch on the barrier launcher)."),
    (lambda f: bool(f.connect) and (f.requested == "horovod" or f.horovod_elastic),
     lambda f: f"{'Elastic horovod training' if f.horovod_elastic else 'launcher=' + repr(f.requested)}"
               " runs on horovod.spark.run, which needs a SparkContext; this is a Spark Connect "
               "session, which has none. Fix: launcher='auto' (sparkhvd's barrier stage works on "
               "Connect), with backend='torch' or 'tf' for an elastic run, or a classic "
               "session."),
    (lambda f: bool(f.dynamic) and (f.backend != "horovod" or bool(f.connect)), _dynamic_why),
    (lambda f: bool(f.dynamic) and f.requested == "barrier",
     lambda f: "launcher='barrier' cannot run with spark.dynamicAllocation.enabled=true (Spark "
               "refuses barrier stages then); use launcher='auto' or 'horovod'."),
)


def check_launch(facts: LaunchFacts) -> None:
    """Raise the first rule ``facts`` break (ValueError naming the fix)."""
    for applies, message in RULES:
        if applies(facts):
            raise ValueError(message(facts))


def choose_launcher(facts: LaunchFacts) -> str:
    """``"barrier"`` or ``"horovod"`` for a Spark run whose session is known (after
    :func:`check_launch`, which this runs first)."""
    check_launch(facts)
    if facts.backend != "horovod" or facts.connect:
        return "barrier"  # the barrier stage is the only way
    if facts.requested in ("barrier", "horovod"):
        return facts.requested
    return "horovod" if (facts.horovod_elastic or facts.dynamic) else "barrier"
