"""How many ranks the next attempt of a run gets: decided here alone.

Like Ray Train v2's scaling policy, with torchrun's elastic range: a run asks for ``np`` ranks
and, when elastic, accepts anything from ``min_np`` to ``max_np``. Every relaunch -- after a
lost rank, executor or host, or after a notice -- takes the ranks the cluster can give *now*
(never waiting for the lost slots), as many as ``max_np``; below ``min_np`` it waits up to
``slot_wait_s`` for slots, then fails naming what is missing. While an attempt runs below
``max_np``, the driver looks for free slots every ``resize_check_s`` and grows the run back at
its next step (:mod:`sparkhvd.elastic.watch`).

The policy decides only (:meth:`ScalingPolicy.size_now` answers place, wait or short; it
never sleeps or raises): the run acts on it. The slots are counted by
:func:`sparkhvd.spark.slots.free_slots`: on classic sessions from the executors Spark has
(those being decommissioned, and those this run lost, left out) less the slots other jobs
hold or, under FIFO scheduling, wait for; on Spark Connect, which shows no executors, from the session's declared slots less the
executors this run saw lost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from sparkhvd.common.errors import NotEnoughSlotsError

if TYPE_CHECKING:
    from sparkhvd.elastic.watch import Sighting

__side__ = "driver"

#: How often a run below its ``max_np`` looks for free slots to grow into (``resize_check_s``).
RESIZE_CHECK_S = 30.0
#: A grow's relaunch waits up to this long for the slots it was planned for (the stopped
#: ranks' tasks ending, a returning executor registering) before it takes what is free.
GROW_SETTLE_S = 15.0


@dataclass(frozen=True)
class StopRequest:
    """Why the driver asks an attempt's ranks to stop at their next step."""

    #: ``decommission`` or ``grow``
    kind: str
    reason: str
    #: the size to relaunch with (``grow``)
    grow_to: Optional[int] = None
    #: executor id -> host being decommissioned (``decommission``)
    executors: Optional[dict] = None


@dataclass(frozen=True)
class SizeDecision:
    """A placement's next move: ``place`` ``size`` ranks, ``wait`` and count the slots again,
    or ``short`` -- fewer than ``min_np`` free after the wait (the run fails, naming why)."""

    action: Literal["place", "wait", "short"]
    size: int = 0


def not_enough_slots(min_np: int, free: int, wait_s: float, why: str) -> NotEnoughSlotsError:
    """The error of an elastic run that cannot go on (``why``: where the missing slots went)."""
    return NotEnoughSlotsError(
        f"The elastic run needs at least min_np={min_np} Spark task slots to go on, but {free} "
        f"are free after waiting {wait_s:.0f} s ({why}). Fix: bring executors back (or free "
        "the slots other jobs hold), lower min_np, or wait longer with slot_wait_s; the run's "
        "checkpoints are in its run folder (resume_from=True continues from them).")


@dataclass(frozen=True)
class ScalingPolicy:
    """The sizes a run may have (``min_np``..``max_np``; both ``np`` when it is not elastic)."""

    #: the size a run asks for (``np``'s ranks, never signed)
    size: int
    min_np: int
    max_np: int
    resize_check_s: float = RESIZE_CHECK_S

    @property
    def elastic(self) -> bool:
        return self.min_np != self.max_np

    def size_now(self, free: int, waited_s: float, wait_s: float,
                 want: Optional[int] = None, settle_s: float = GROW_SETTLE_S) -> "SizeDecision":
        """What a placement does with ``free`` slots free now, ``waited_s`` after it began:
        place ``min(max_np, free)`` ranks; or wait and count again -- for ``min_np`` up to
        ``wait_s``, and for a grow to ``want`` ranks up to ``settle_s`` (the ranks that just
        stopped, an executor still registering); or, ``min_np`` still not free after
        ``wait_s``, give up (``short``). Decides only: the run waits, and raises
        :func:`not_enough_slots`."""
        if want is not None and free < want and waited_s < settle_s:
            return SizeDecision("wait")
        if free >= self.min_np:
            return SizeDecision("place", min(self.max_np, free))
        return SizeDecision("short" if waited_s >= wait_s else "wait")

    def relaunch_size(self, size: int, grow_to: Optional[int] = None) -> int:
        """The size a relaunch of an attempt of ``size`` ranks asks for: a planned grow's
        ``grow_to``, else ``max_np`` for an elastic run (placing trims it to the free slots),
        else ``size`` again."""
        if not self.elastic:
            return size
        return int(grow_to) if grow_to else self.max_np

    def stop_for(self, size: int, seen: "Sighting") -> Optional[StopRequest]:
        """What an attempt of ``size`` ranks does about what the watch saw: stop at the next
        step for executors being decommissioned under it, or to grow into free slots; None:
        go on."""
        if seen.decommissioning:
            where = ", ".join(f"executor {e} on {h}"
                              for e, h in sorted(seen.decommissioning.items()))
            return StopRequest("decommission", f"{where} is being decommissioned",
                               executors=dict(seen.decommissioning))
        grow_to = self.grow_to(size, seen.free or 0) if self.elastic else None
        if grow_to is None:
            return None
        return StopRequest("grow", f"{grow_to - size} Spark task slot(s) free: growing from "
                           f"{size} to {grow_to} ranks", grow_to=grow_to)

    def grow_to(self, size: int, free: int) -> Optional[int]:
        """The size to grow to when ``free`` slots are free beside the run's ``size``, or
        None (already at ``max_np``, or nothing free)."""
        if size >= self.max_np or free < 1:
            return None
        return min(self.max_np, size + free)


def scaling_policy(size: int, elastic: Optional[tuple[int, int]],
                   resize_check_s: float = RESIZE_CHECK_S) -> ScalingPolicy:
    """The policy of a run of ``size`` ranks, elastic within ``elastic`` (``min_np``, ``max_np``)
    or not (``None``): a :class:`~sparkhvd.driver.settings.ScalingConfig`'s ``size``,
    ``elastic`` and ``resize_check_s``."""
    lo, hi = elastic if elastic else (size, size)
    return ScalingPolicy(size, lo, hi, resize_check_s)
