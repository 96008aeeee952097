"""What the driver watches while an attempt runs, and when the ranks should stop early.

Two things end an attempt on purpose, each at the ranks' next step (a notice, delivered by
the launcher: the Spark task signals its rank, see :mod:`sparkhvd.elastic.notices`):

- an executor under one of the run's ranks is being **decommissioned** (Spark's graceful
  decommission: ``decommission-worker.sh``/SIGPWR on standalone, a Kubernetes pod's or a YARN
  node's drain) -- looked at every :data:`DECOMMISSION_POLL_S`; running barrier tasks go on
  by themselves, so the run must learn of it here;
- an elastic run below ``max_np`` finds **free slots** -- looked at every ``resize_check_s``,
  and again :data:`GROW_CONFIRM_S` later before it asks -- and grows back.

The watch only looks and proposes: :meth:`AttemptWatch.tick` returns a :class:`StopRequest`
when one is due, and the run's step asks the ranks
(:meth:`~sparkhvd.driver.attempt.Attempt.ask_to_stop`); the request says why the run
relaunched. Only ranks whose checkpoint helper listens are proposed for (a notice would
otherwise kill them, and a grow would cost the work since their last checkpoint). Classic sessions only: a Spark Connect client sees no executors.
A ``local[N]`` master (a notebook on one large machine) grows too -- other jobs of the session
take and give back its slots -- and has no executors to decommission.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from sparkhvd.elastic import cluster
from sparkhvd.elastic.scaling import ScalingPolicy

__side__ = "driver"

log = logging.getLogger(__name__)

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
class StopRequest:
    """Why the driver asked an attempt's ranks to stop at their next step."""

    #: ``decommission`` or ``grow``
    kind: str
    reason: str
    #: the size to relaunch with (``grow``)
    grow_to: Optional[int] = None
    #: executor id -> host being decommissioned (``decommission``)
    executors: Optional[dict] = None


class AttemptWatch:
    """The driver's eye on one running attempt (ticked at each poll of a launcher that can give
    its ranks a notice)."""

    def __init__(self, view: Optional[SessionView], job_tag: str, policy: ScalingPolicy, size: int,
                 listening: Callable[[], bool], free: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view, self.job_tag, self.policy, self.size = view, job_tag, policy, size
        #: ``free()``: the slots free now, as the run counts them (lost executors left out;
        #: :func:`sparkhvd.spark.slots.free_slots`)
        self.listening, self.free, self.clock = listening, free, clock
        #: the stop this watch proposed (it proposes one, then only keeps the executors' record)
        self.request: Optional[StopRequest] = None
        #: partition -> executor id of the attempt's tasks, as last seen running
        self.executors: dict[int, str] = {}
        self._next_decommission = 0.0
        self._next_grow = clock() + policy.resize_check_s
        #: the size a first look found room for, confirmed by the next look
        self._grow_seen: Optional[int] = None
        self._warned = False
        self.active = view is not None and not view.connect
        #: a local master's only executor is the driver: nothing to decommission
        self.decommissions = view is not None and self.active and \
            not str(view.master).startswith("local")

    def tick(self) -> Optional[StopRequest]:
        """Look (at most as often as each look is due): a stop now due, once; else None."""
        if self.request is not None or not self.active:
            return None
        now = self.clock()
        if self.decommissions and now >= self._next_decommission:
            self._next_decommission = now + DECOMMISSION_POLL_S
            self._look_for_decommission()
        if self.request is None and self.policy.elastic and self.size < self.policy.max_np \
                and now >= self._next_grow:
            self._look_for_slots()
            self._next_grow = now + (GROW_CONFIRM_S if self._grow_seen is not None
                                     else self.policy.resize_check_s)
        return self.request

    def _look_for_decommission(self) -> None:
        assert self.view is not None  # active
        sc = self.view.sc
        self.executors.update(cluster.safely(
            "where the ranks run", lambda: cluster.task_executors(sc, self.job_tag), {}))
        going = cluster.safely("decommissioning executors", lambda: cluster.decommissioning(sc),
                               {})
        ours = {e: h for e, h in going.items() if e in set(self.executors.values())}
        if not ours:
            return
        where = ", ".join(f"executor {e} on {h}" for e, h in sorted(ours.items()))
        if not self.listening():
            if not self._warned:
                self._warned = True
                log.warning("sparkhvd: %s is being decommissioned, but the ranks have no "
                            "checkpoint helper that listens for notices (sparkhvd.torch."
                            "Checkpoints/ShardedCheckpoints, sparkhvd.keras.KerasDistributed): "
                            "the run loses the work since its last checkpoint when it goes",
                            where)
            return
        self.request = StopRequest("decommission", f"{where} is being decommissioned",
                                   executors=ours)

    def _look_for_slots(self) -> None:
        if not self.listening():
            return
        free = cluster.safely("free slots", self.free, 0)
        grow_to = self.policy.grow_to(self.size, free)
        seen, self._grow_seen = self._grow_seen, grow_to
        if grow_to is not None and seen is not None:  # two looks agree
            grow_to = min(grow_to, seen)
            self.request = StopRequest("grow", f"{grow_to - self.size} Spark task slot(s) "
                                       f"free: growing from {self.size} to {grow_to} ranks",
                                       grow_to=grow_to)
