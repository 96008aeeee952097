"""A rank's notices: SIGTERM becomes a checkpoint after the step, then a preempted exit.

A node that is about to be reclaimed gets SIGTERM first (Kubernetes' and YARN's grace period,
systemd's shutdown); the driver sends the same signal through the rank's Spark task when an
executor is decommissioned or the run resizes. A rank whose checkpoint helper *listens*
(:class:`sparkhvd.torch.Checkpoints`, :class:`~sparkhvd.torch.ShardedCheckpoints`,
:class:`~sparkhvd.keras.KerasDistributed`) only notes the notice here; at the next step the
helper spreads it to every rank in the same small collective that times its checkpoints,
every rank finishes the step, the checkpoint is written (all ranks or none), and each rank
raises :class:`Preempted` -- the rank exits with :data:`~sparkhvd.common.protocol.
PREEMPTED_EXIT` and the driver relaunches or resizes. A rank without such a helper dies of
the signal as before (the run retries from its last checkpoint, as for a lost rank).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import NamedTuple, Optional

from sparkhvd.common import protocol
from sparkhvd.common.events import emit
from sparkhvd.common.identity import current_rank

__side__ = "rank"


class Preempted(BaseException):
    """The run was noticed and this rank's checkpoint is written: leave the training function.

    A ``BaseException`` (as ``KeyboardInterrupt``), so an ``except Exception`` in the user's
    loop does not swallow it; sparkhvd's rank bootstrap turns it into the preempted exit."""

    def __init__(self, checkpoint: str, reason: str) -> None:
        super().__init__(f"stopped on a notice ({reason}) after checkpoint {checkpoint or '-'}")
        self.checkpoint, self.reason = checkpoint, reason


class _State:
    noticed: Optional[str] = None
    noticed_at: Optional[float] = None  # time.monotonic() of the notice
    listening = False
    installed = False


_state = _State()


def install() -> None:
    """In the rank process, before the user's code: SIGTERM is a notice from now on."""
    if not _state.installed:
        signal.signal(protocol.NOTICE_SIGNAL, _on_notice)
        _state.installed = True


def take_back() -> None:
    """SIGTERM to this module again, in a rank: TensorFlow's multi-worker runtime installs its
    own C-level handler (its preemption notifier) when the strategy starts, which would swallow
    the notice."""
    if _state.installed:
        signal.signal(protocol.NOTICE_SIGNAL, _on_notice)


def _on_notice(signum: int, _frame: object) -> None:
    if not _state.listening:  # nothing would checkpoint: end as SIGTERM always did
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _state.noticed is None:
        _state.noticed = signal.Signals(signum).name
        _state.noticed_at = time.monotonic()
        print(f"sparkhvd: rank {current_rank().rank} got a notice ({_state.noticed}): "
              "checkpointing after this step, then stopping", file=sys.stderr, flush=True)


def listen() -> None:
    """A checkpoint helper exists in this rank: notices become checkpoints (said once)."""
    if not _state.listening:
        _state.listening = True
        emit(protocol.Listening(rank=current_rank().rank))


def noticed() -> Optional[str]:
    """Why this rank was noticed (``"SIGTERM"``), or None."""
    return _state.noticed


def stop(checkpoint: str) -> "Preempted":
    """Report the preemption to the driver; the exception to raise on every rank."""
    reason = _state.noticed or protocol.NOTICE_SPREAD
    seconds = None if _state.noticed_at is None else \
        round(time.monotonic() - _state.noticed_at, 3)
    if seconds is not None:  # to set beside the cluster manager's grace period
        print(f"sparkhvd: rank {current_rank().rank} stops {seconds:.2f} s after its notice "
              f"({checkpoint or 'no checkpoint'})", file=sys.stderr, flush=True)
    emit(protocol.Preempted(rank=current_rank().rank, checkpoint=checkpoint, reason=reason,
                            seconds=seconds))
    return Preempted(checkpoint, reason)


class WorldSizeChange(NamedTuple):
    """The world size of the previous attempt and of this one (equal when nothing changed)."""

    before: int
    now: int

    @property
    def changed(self) -> bool:
        return self.before != self.now

    @property
    def factor(self) -> float:
        """``now / before``: scale a learning rate by it to keep the per-sample rule, or divide
        the per-rank batch by it to keep the global batch."""
        return self.now / self.before


def world_size_change() -> WorldSizeChange:
    """How the world size changed at the last relaunch of an elastic run: ``(before, now)``.

    ``before == now`` on a first attempt and on a relaunch at the same size."""
    now = current_rank().size
    raw = os.environ.get(protocol.PREVIOUS_SIZE_ENV, "")
    return WorldSizeChange(int(raw) if raw.isdigit() else now, now)
