"""What the driver watches while an attempt runs, and when the ranks should stop early.

Two things end an attempt on purpose, each at the ranks' next step (a notice, delivered by
the launcher: the Spark task signals its rank, see :mod:`sparkhvd.elastic.notices`):

- an executor under one of the run's ranks is being **decommissioned** (Spark's graceful
  decommission: ``decommission-worker.sh``/SIGPWR on standalone, a Kubernetes pod's or a YARN
  node's drain) -- looked at every :data:`DECOMMISSION_POLL_S`; running barrier tasks go on
  by themselves, so the run must learn of it here;
- an elastic run below ``max_np`` finds **free slots** -- looked at every ``resize_check_s``,
  and again :data:`GROW_CONFIRM_S` later before it asks -- and grows back.

The watch only looks, and says what it saw (:class:`Sighting`: executors under the ranks being
decommissioned, slots free beside them); the run's step asks the scaling policy what to do
about it (:meth:`~sparkhvd.elastic.scaling.ScalingPolicy.stop_for`: a
:class:`~sparkhvd.elastic.scaling.StopRequest`) and asks the ranks
(:meth:`~sparkhvd.driver.attempt.Attempt.ask_to_stop`); the request says why the run
relaunched. Classic sessions only: a Spark Connect client sees no executors.
A ``local[N]`` master (a notebook on one large machine) grows too -- other jobs of the session
take and give back its slots -- and has no executors to decommission.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

from sparkhvd.elastic import cluster

__side__ = "driver"

#: How often the driver looks for executors being decommissioned under the run's ranks.
DECOMMISSION_POLL_S = 1.0
#: Free slots are looked at again this much later before a grow is asked for: while executors
#: come and go, Spark may list a lost one beside its replacement for a moment.
GROW_CONFIRM_S = 1.0


class SessionView(Protocol):
    """What the watch reads of the run's Spark session (the driver's
    :class:`~sparkhvd.spark.sparkview.SparkView`)."""

    @property
    def connect(self) -> bool: ...

    @property
    def master(self) -> str: ...

    @property
    def sc(self) -> Any: ...


@dataclass(frozen=True)
class Sighting:
    """What a look of the watch saw, as data."""

    #: executor id -> host of the attempt's executors being decommissioned
    decommissioning: Mapping[str, str] = field(default_factory=dict)
    #: slots free beside the run, found by two looks in a row (the smaller count)
    free: Optional[int] = None


class AttemptWatch:
    """The driver's eye on one running attempt (looked through at each poll of a launcher that
    can give its ranks a notice)."""

    def __init__(self, view: Optional[SessionView], job_tag: str, *, slots: bool,
                 resize_check_s: float, free: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``slots``: whether to look for free slots (an elastic run below ``max_np``), every
        ``resize_check_s``; ``free()``: the slots free now, as the run counts them (lost
        executors left out; :func:`sparkhvd.spark.slots.free_slots`)."""
        self.view, self.job_tag, self.free, self.clock = view, job_tag, free, clock
        self.resize_check_s = resize_check_s
        #: partition -> executor id of the attempt's tasks, as last seen running
        self.executors: dict[int, str] = {}
        self._next_decommission = 0.0
        self._next_grow = clock() + resize_check_s
        #: the free slots a first look found, to be confirmed by the next
        self._free_seen: Optional[int] = None
        self.active = view is not None and not view.connect
        self.slots = slots and self.active
        #: a local master's only executor is the driver: nothing to decommission
        self.decommissions = view is not None and self.active and \
            not str(view.master).startswith("local")

    def look(self) -> Optional[Sighting]:
        """Look (at most as often as each look is due): what was seen, or None."""
        if not self.active:
            return None
        now = self.clock()
        going: Mapping[str, str] = {}
        if self.decommissions and now >= self._next_decommission:
            self._next_decommission = now + DECOMMISSION_POLL_S
            going = self._decommissioning()
        free = None
        if self.slots and now >= self._next_grow:
            free = self._free_twice()
            self._next_grow = now + (GROW_CONFIRM_S if self._free_seen is not None
                                     else self.resize_check_s)
        return Sighting(dict(going), free) if going or free else None

    def _decommissioning(self) -> Mapping[str, str]:
        assert self.view is not None  # active
        sc = self.view.sc
        self.executors.update(cluster.safely(
            "where the ranks run", lambda: cluster.task_executors(sc, self.job_tag), {}))
        going = cluster.safely("decommissioning executors", lambda: cluster.decommissioning(sc),
                               {})
        return {e: h for e, h in going.items() if e in set(self.executors.values())}

    def _free_twice(self) -> Optional[int]:
        """Free slots, once two looks in a row found some: while executors come and go, Spark
        may list a lost one beside its replacement for a moment."""
        free = cluster.safely("free slots", self.free, 0)
        seen, self._free_seen = self._free_seen, (free or None)
        if free and seen:
            self._free_seen = None
            return min(free, seen)
        return None
