"""Where a run's attempts go: what the run asks of the machines it runs on, in one seam.

The run (:class:`~sparkhvd.driver.run.Run`) never reads Spark itself. It asks a
:class:`Placer` four things, each answered at once, as data: *place* an attempt of ``size``
ranks -- the placement (launcher, driver address, slots, what ``run.json`` keeps), or what is
:class:`Short` and how long waiting may help; count the *free slots* an elastic run may place
or grow into; *note the losses* of an attempt (the executors of the ranks that went, from
their facts: left out of later counts); and say what was lost. Waiting is the run's: its
*placing* state looks again each step, its deadline checked there. Two placers run real
ranks -- :class:`SparkPlacer` (a classic or Connect session) and :class:`LocalPlacer`
(``np < 0`` without Spark: local processes) -- and the unit tests hand the run a scripted one,
as Ray Train v2's controller tests swap in a dummy worker group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence, Union

from sparkhvd.common.errors import NotEnoughSlotsError
from sparkhvd.driver.launchers import Placement, RankFact, choose_launcher
from sparkhvd.driver.spec import RunSpec
from sparkhvd.elastic import cluster
from sparkhvd.spark.slots import free_slots

if TYPE_CHECKING:
    from sparkhvd.spark.sparkview import SparkView

__side__ = "driver"

#: How often a placement that waits (slots short, below ``min_np``) looks again.
SLOT_POLL_S = 0.5


@dataclass(frozen=True)
class Short:
    """An attempt that cannot be placed now: ``missing`` slots short (``free`` there are),
    worth waiting for up to ``wait_s`` from the first look (executors still registering, other
    jobs' tasks ending); then :attr:`error`."""

    missing: int
    free: int
    wait_s: float
    error: NotEnoughSlotsError
    #: the other jobs that hold the missing slots, in words (none: the session has too few)
    jobs: tuple = ()


class Placer(Protocol):
    """What the run asks of where its ranks run."""

    #: whether free slots can be counted (an elastic run sizes its attempts from them)
    counts_slots: bool

    def place(self, size: int, first: bool, time_left: Optional[float],
              waited_s: float = 0.0, ended: Optional[str] = None) -> Union[Placement, Short]:
        """The launcher and the slots of an attempt of ``size`` ranks (``first``: the run's
        first attempt, whose workers' Python is checked; ``waited_s``: how long this placement
        has looked; ``ended``: the job tag of the attempt that just ended), or what is short --
        one look, no wait."""

    def free_slots(self, ended: Optional[str] = None) -> int:
        """Slots free now (``ended``: the job tag of the attempt that just ended, whose tasks
        may still be stopping)."""

    def note_losses(self, lost: Sequence[RankFact],
                    executors: Callable[[], Mapping[int, str]]) -> None:
        """An attempt ended for ``lost`` (the rank its verdict names: vanished, silent,
        killed): the executor it ran on is left out of later counts (``executors()``: the
        executor id of each of the attempt's Spark partitions, as last seen running)."""

    def describe_lost(self) -> str:
        """What this run lost, in words (``executor 1 on 10.0.0.3 lost``), for an error."""

    def sweep_host_copies(self, run_id: str, hosts: set[str], env: Mapping[str, str]) -> None:
        """A succeeded run's host copies on ``hosts`` (used by earlier attempts, not by the
        last) deleted where they can be reached (:mod:`sparkhvd.driver.host_sweep`; ``env``:
        the run's ``env=`` for its ranks)."""


class LocalPlacer:
    """``np < 0`` without a Spark session: the ranks are processes of this machine."""

    counts_slots = False

    def place(self, size: int, first: bool, time_left: Optional[float],
              waited_s: float = 0.0, ended: Optional[str] = None) -> Union[Placement, Short]:
        return Placement("local", nics=frozenset({"lo"}))

    def free_slots(self, ended: Optional[str] = None) -> int:
        return 0

    def note_losses(self, lost: Sequence[RankFact],
                    executors: Callable[[], Mapping[int, str]]) -> None:
        return None

    def describe_lost(self) -> str:
        return "no executor of this run was lost"

    def sweep_host_copies(self, run_id: str, hosts: set[str], env: Mapping[str, str]) -> None:
        return None  # one host, this one: the last attempt's ranks cleaned it


class SparkPlacer:
    """A Spark session (classic or Connect): the barrier or horovod launcher, the task slots
    looked at, the executors this run lost counted out of later placements."""

    counts_slots = True

    def __init__(self, spark: Any, spec: RunSpec) -> None:
        self.spark, self.spec = spark, spec
        #: the session, seen through the one place that knows classic from Connect
        self.view: Optional["SparkView"] = None
        #: executor id -> host of the executors this run saw lost (left out of slot counts)
        self.lost_executors: dict[str, str] = {}
        #: tasks this run saw vanish with their executor (Spark Connect's slot count)
        self.lost_tasks = 0
        #: executor id -> host of an executor whose rank vanished: left out of the next count
        self._suspects: dict[str, str] = {}
        #: a task that vanished (Spark Connect: no executors to name), the next count only
        self._suspect_tasks = 0
        self._checked = False

    def _ensure_view(self) -> "SparkView":
        if self.view is None:
            from sparkhvd.spark.sparkview import SparkView

            self.view = SparkView(self.spark)
        return self.view

    def place(self, size: int, first: bool, time_left: Optional[float],
              waited_s: float = 0.0, ended: Optional[str] = None) -> Union[Placement, Short]:
        """Which launcher, where the driver is reached, and whether the ranks share its disk;
        or what is short of ``size`` ranks' task slots, and how long waiting may help: while
        a cluster's executors register (``slot_wait_s``; not on a local master), while other
        jobs hold them (``slot_wait_s``, ``start_timeout`` and the run's limit)."""
        from sparkhvd.spark.session import check_worker_python
        from sparkhvd.spark.slots import Shortfall, look_for_slots

        spec = self.spec
        view = self._ensure_view()
        name = choose_launcher(spec.facts.with_session(view))
        if first and not self._checked:
            check_worker_python(view, spec.backend)
            self._checked = True
        launch = spec.launch
        found = look_for_slots(view, size // spec.scaling.ranks_per_task,
                               spec.scaling.ranks_per_task, waited_s, ended)
        if isinstance(found, Shortfall):
            wait_s = (0.0 if view.master.startswith("local") else launch.slot_wait_s) \
                if found.kind == "slots" else \
                min(launch.slot_wait_s, launch.start_timeout,
                    float("inf") if time_left is None else waited_s + time_left)
            return Short(found.missing * spec.scaling.ranks_per_task,
                         found.free * spec.scaling.ranks_per_task, wait_s, found.error,
                         found.jobs)
        here = view.executors_here()
        self._suspects.clear()  # placed: the next count is Spark's own again
        self._suspect_tasks = 0
        return Placement(name, driver_host=view.driver_host(), executors_here=here,
                         nics=launch.nics or (frozenset({"lo"}) if here else None),
                         session=view,
                         recorded={"spark_master": view.master, "spark_app_id": view.app_id,
                                   "session": view.kind, "slots": found.slots})

    def free_slots(self, ended: Optional[str] = None) -> int:
        return free_slots(self._ensure_view(), {**self.lost_executors, **self._suspects},
                          self.lost_tasks + self._suspect_tasks, ended)

    def note_losses(self, lost: Sequence[RankFact],
                    executors: Callable[[], Mapping[int, str]]) -> None:
        """The executors (or, on Connect, the tasks) of the ranks an attempt lost, from their
        facts: the executor that ran each one's partition (else the only one at its address or
        host). A host gone silent: left out of every later count until Spark drops it. A rank that vanished (its
        task's connection closed without an exit status -- its executor or only its Python
        worker gone): left out of the next count only, so the relaunch neither waits for a
        dead executor's slots nor loses a live one for the rest of the run."""
        gone = [fact for fact in lost if fact.kind in ("vanished", "silent")]
        if not gone:  # a rank killed by a signal: its executor is still there
            return
        if any(fact.kind == "silent" for fact in gone):
            self.lost_tasks += 1
        else:
            self._suspect_tasks = 1
        if self.view is None or self.view.connect:
            return
        sc = self.view.sc
        listed = dict(cluster.safely("executors", lambda: {
            e.id: e.host for e in cluster.executors(sc)}, {}))
        ran_on = executors()
        for fact in gone:
            exec_id = ran_on.get(fact.partition) if fact.partition is not None else None
            if exec_id is None:
                there = [e for e, host in listed.items() if host in (fact.executor, fact.host)]
                exec_id = there[0] if len(there) == 1 else None
            if exec_id is None or exec_id not in listed:
                continue  # not known, or Spark dropped it already
            if fact.kind == "silent":
                self.lost_executors[exec_id] = listed[exec_id]
            else:
                self._suspects[exec_id] = listed[exec_id]

    def describe_lost(self) -> str:
        return cluster.describe_lost(self.lost_executors)

    def sweep_host_copies(self, run_id: str, hosts: set[str], env: Mapping[str, str]) -> None:
        from sparkhvd.driver.host_sweep import sweep_hosts
        from sparkhvd.spark.slots import task_slots

        if self.view is not None:
            sweep_hosts(self.view, run_id, hosts, task_slots(self.view), env)
