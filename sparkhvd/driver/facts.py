"""What a launcher saw of an attempt's ranks, as data: the words between the launchers, which
see, and :mod:`sparkhvd.driver.rank_end`, which decides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

__side__ = "driver"

#: What a launcher can see of a rank (:class:`RankFact`).
FactKind = Literal["exited", "vanished", "silent", "raised"]


@dataclass(frozen=True)
class RankFact:
    """One thing seen of one rank, as data -- never a decision.

    ``exited``: its process ended with :attr:`exit_code` (0, a failure, a signal, or
    :data:`~sparkhvd.common.protocol.PREEMPTED_EXIT`: stopped on a notice after its
    checkpoint); ``vanished``: its process or its task's connection went without an exit status
    (its executor lost); ``silent``: its Spark task sent no heartbeat for ``heartbeat_timeout``
    (its host lost, or off the network); ``raised``: the rank reported an exception (its
    traceback is in the attempt's inbox), seen by the attempt, not the launcher.
    """

    rank: Optional[int]  # None: horovod named a host slot, not a rank
    kind: FactKind
    #: when it was seen (``time.monotonic()``)
    at: float
    exit_code: Optional[int] = None
    host: Optional[str] = None
    #: the address of the Spark executor the rank's task ran on (as Spark lists its executors)
    executor: Optional[str] = None
    #: the Spark partition of the rank's task (which executor ran it, Spark's status store says)
    partition: Optional[int] = None
    #: what the launcher saw, in its words ("rank 1 (Spark partition 1 on host h2) ...")
    detail: str = ""

    @property
    def failed(self) -> bool:
        """Whether this fact is a rank ending otherwise than with status 0."""
        return self.kind != "exited" or self.exit_code != 0

    @property
    def noticed(self) -> bool:
        """Whether the rank stopped on a notice, after its checkpoint."""
        from sparkhvd.common.protocol import PREEMPTED_EXIT

        return self.kind == "exited" and self.exit_code == PREEMPTED_EXIT


@dataclass(frozen=True)
class GroupStatus:
    """What one :meth:`WorkerGroup.poll` saw, as data."""

    #: every fact seen of the ranks so far (exits with status 0 too)
    facts: tuple[RankFact, ...] = ()
    #: whether some rank may still be running
    running: bool = True
    #: the launch is over and every rank returned: their results, rank 0's first
    done: bool = False
    results: tuple = ()
    #: an error that is no rank's: a stopped or lost session, tasks that never started, the
    #: launch's own call failing (Spark aborting the stage)
    error: Optional[Exception] = None
    #: how long after :attr:`error` a rank's fact may still arrive that explains it (the
    #: barrier launcher: a heartbeat timeout, for a lost host Spark aborted the stage for)
    explained_within_s: float = 0.0
    #: how long after a rank's host is lost its rank shows as ``silent`` (the barrier
    #: launcher: a heartbeat timeout): how long a failure that only says a peer went away
    #: may wait for its cause
    silent_after_s: float = 0.0


#: A group whose ranks still run and have shown nothing.
RUNNING = GroupStatus()
