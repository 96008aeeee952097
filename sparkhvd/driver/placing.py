"""Where a run's attempts go: what the run asks of the machines it runs on, in one seam.

The run (:class:`~sparkhvd.driver.run.Run`) never reads Spark itself. It asks a
:class:`Placer` four things: *place* an attempt of ``size`` ranks (launcher, driver address,
slots checked, recorded), count the *free slots* an elastic run may place or grow into, and
*note the losses* of an attempt that lost an executor or host (left out of later counts), and
say what was lost. :func:`wait_for_size` counts the slots until the scaling policy says how many
ranks to place. Two
placers run real ranks -- :class:`SparkPlacer` (a classic or Connect session) and
:class:`LocalPlacer` (``np < 0`` without Spark: local processes) -- and the unit tests hand the
run a scripted one, as Ray Train v2's controller tests swap in a dummy worker group.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol

from sparkhvd.common.errors import LaunchFailure
from sparkhvd.driver.launchers import Placement, choose_launcher
from sparkhvd.driver.spec import RunSpec
from sparkhvd.elastic import cluster
from sparkhvd.elastic.scaling import ScalingPolicy, not_enough_slots
from sparkhvd.spark.slots import free_slots

if TYPE_CHECKING:
    from sparkhvd.spark.sparkview import SparkView

__side__ = "driver"

#: How often a placement below ``min_np`` counts the free slots again while it waits.
SLOT_POLL_S = 0.5
#: How long a relaunch after a rank vanished waits for Spark to drop one of the attempt's
#: executors (see :meth:`SparkPlacer.note_losses`).
VANISHED_SETTLE_S = 10.0


class Placer(Protocol):
    """What the run asks of where its ranks run."""

    #: whether free slots can be counted (an elastic run sizes its attempts from them)
    counts_slots: bool

    def place(self, size: int, first: bool, time_left: Optional[float]) -> Placement:
        """The launcher and the slots of an attempt of ``size`` ranks (``first``: the run's
        first attempt, whose workers' Python is checked); what ``run.json`` keeps of them in
        its ``recorded``."""

    def free_slots(self, ended: Optional[str] = None) -> int:
        """Slots free now (``ended``: the job tag of the attempt that just ended, whose tasks
        may still be stopping)."""

    def note_losses(self, failure: Optional[LaunchFailure], executors: Callable[[], set]) -> None:
        """An attempt ended with ``failure``: what it lost is left out of later counts
        (``executors()``: the ids of the executors its tasks ran on)."""

    def describe_lost(self) -> str:
        """What this run lost, in words (``executor 1 on 10.0.0.3 lost``), for an error."""

    def sweep_host_copies(self, run_id: str, hosts: set[str], env: Mapping[str, str]) -> None:
        """A succeeded run's host copies on ``hosts`` (used by earlier attempts, not by the
        last) deleted where they can be reached (:mod:`sparkhvd.driver.host_sweep`; ``env``:
        the run's ``env=`` for its ranks)."""


class LocalPlacer:
    """``np < 0`` without a Spark session: the ranks are processes of this machine."""

    counts_slots = False

    def place(self, size: int, first: bool, time_left: Optional[float]) -> Placement:
        return Placement("local", nics=frozenset({"lo"}))

    def free_slots(self, ended: Optional[str] = None) -> int:
        return 0

    def note_losses(self, failure: Optional[LaunchFailure], executors: Callable[[], set]) -> None:
        return None

    def describe_lost(self) -> str:
        return "no executor of this run was lost"

    def sweep_host_copies(self, run_id: str, hosts: set[str], env: Mapping[str, str]) -> None:
        return None  # one host, this one: the last attempt's ranks cleaned it


class SparkPlacer:
    """A Spark session (classic or Connect): the barrier or horovod launcher, the task slots
    checked, the executors this run lost counted out of later placements."""

    counts_slots = True

    def __init__(self, spark: Any, spec: RunSpec) -> None:
        self.spark, self.spec = spark, spec
        #: the session, seen through the one place that knows classic from Connect
        self.view: Optional["SparkView"] = None
        #: executor id -> host of the executors this run saw lost (left out of slot counts)
        self.lost_executors: dict[str, str] = {}
        #: tasks this run saw vanish with their executor (Spark Connect's slot count)
        self.lost_tasks = 0

    def _ensure_view(self) -> "SparkView":
        if self.view is None:
            from sparkhvd.spark.sparkview import SparkView

            self.view = SparkView(self.spark)
        return self.view

    def place(self, size: int, first: bool, time_left: Optional[float]) -> Placement:
        """Which launcher, where the driver is reached, and whether the ranks share its disk;
        the task slots for ``size`` ranks checked."""
        from sparkhvd.spark.session import check_worker_python
        from sparkhvd.spark.slots import check_slots

        spec = self.spec
        placing = time.monotonic()
        view = self._ensure_view()
        name = choose_launcher(spec.facts.with_session(view))
        if first:
            check_worker_python(view, spec.backend)
        launch = spec.launch
        # Waiting for other jobs' slots is part of starting: start_timeout (from here) and the
        # run's own limit bound it too.
        busy_wait = min(launch.slot_wait_s,
                        launch.start_timeout - (time.monotonic() - placing),
                        math.inf if time_left is None else time_left)
        slots = check_slots(view, size // spec.scaling.ranks_per_task,
                            wait_s=0 if view.master.startswith("local") else launch.slot_wait_s,
                            ranks_per_task=spec.scaling.ranks_per_task,
                            busy_wait_s=max(0.0, busy_wait))
        here = view.executors_here()
        return Placement(name, driver_host=view.driver_host(), executors_here=here,
                         nics=launch.nics or (frozenset({"lo"}) if here else None),
                         session=view,
                         recorded={"spark_master": view.master, "spark_app_id": view.app_id,
                                   "session": view.kind, "slots": slots.slots})

    def free_slots(self, ended: Optional[str] = None) -> int:
        return free_slots(self._ensure_view(), self.lost_executors, self.lost_tasks, ended)

    def note_losses(self, failure: Optional[LaunchFailure], executors: Callable[[], set]) -> None:
        """The executors (or, on Connect, the tasks) an attempt lost: left out of the next
        slot count until Spark drops them itself. A rank whose task vanished without an exit
        status (its host killed: the driver's channel to it closes a moment before Spark
        notices the executor is gone) first gets up to :data:`VANISHED_SETTLE_S` for Spark to
        drop one of the attempt's executors, so the relaunch does not count a dead one's slots
        and wait for them until ``start_timeout``."""
        if failure is None or not (failure.vanished or failure.lost):
            return
        self.lost_tasks += 1
        if self.view is None or self.view.connect:
            return
        sc = self.view.sc
        if failure.lost and failure.host:
            hosts = dict(cluster.safely("executors", lambda: {
                e.id: e.host for e in cluster.executors(sc)}, {}))
            for exec_id in executors():
                if hosts.get(exec_id) == failure.host:
                    self.lost_executors[exec_id] = failure.host
        elif failure.vanished:
            ours = set(executors())
            deadline = time.monotonic() + VANISHED_SETTLE_S
            while ours and time.monotonic() < deadline:
                live = cluster.safely("executors", lambda: {e.id for e in cluster.executors(sc)},
                                      None)
                if live is not None and ours - live:
                    return  # Spark dropped one: the count leaves it out
                time.sleep(SLOT_POLL_S)

    def describe_lost(self) -> str:
        return cluster.describe_lost(self.lost_executors)

    def sweep_host_copies(self, run_id: str, hosts: set[str], env: Mapping[str, str]) -> None:
        from sparkhvd.driver.host_sweep import sweep_hosts
        from sparkhvd.spark.slots import task_slots

        if self.view is not None:
            sweep_hosts(self.view, run_id, hosts, task_slots(self.view), env)


def wait_for_size(placer: Placer, policy: ScalingPolicy, size: int, wait_s: float,
                  ended: Optional[str] = None, grow: bool = False) -> int:
    """An elastic run's size for this placement: ``size`` if that many slots are free, else
    what is free within ``min_np``..``max_np`` (waiting up to ``wait_s`` for ``min_np``; a
    planned ``grow`` to ``size`` waits a moment for its slots). Other runs keep ``size`` (the
    slot check names a shortfall). The policy decides each count; this counts and waits."""
    if not policy.elastic or not placer.counts_slots:
        return size
    began = time.monotonic()
    while True:
        free = placer.free_slots(ended)
        decision = policy.size_now(free, time.monotonic() - began, wait_s,
                                   want=size if grow else None)
        if decision.action == "place":
            return min(size, decision.size)
        if decision.action == "short":
            raise not_enough_slots(policy.min_np, free, wait_s, placer.describe_lost())
        time.sleep(SLOT_POLL_S)
