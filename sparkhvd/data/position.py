"""Where the ranks are in a ``DataFrameDataset``'s epochs -- made here, and only here.

A :class:`Position` is what a checkpoint keeps of the data: the epoch, the rows of its global
order the ranks consumed and the steps they ran, and what that order was made from. The data
room makes every one: after a step of an epoch a rank handed out (:meth:`EpochPlan.position`,
the one formula the batches and the checkpoints share) and at an epoch's start
(:meth:`Position.at_epoch_start`: a fresh epoch, dealt anew whatever the epoch before was).
The checkpoint helpers (torch, sharded, Keras) store what they are given as plain data
(:meth:`Position.as_dict`) and hand it back unchanged (``DatasetShard.load_state_dict``); they
never edit it. (They did: an epoch-end checkpoint copied the ended epoch's position and set
its epoch, rows and step, which kept that epoch's deal -- and the next epoch, resumed, was dealt
only what that deal held: 768 of 960 rows.)

A position also says what it was made from, and a resume checks it (:func:`check_resumable`,
:func:`resume_order`):

* the table -- its row count, and for a shuffled order, drawn over the row groups,
  :func:`source_key` (its files' names and row groups): a position in the middle of an epoch
  of another table would train other rows at the saved places, so the resume stops and says
  what changed (an epoch's start resumes any table; an unshuffled order is the rows' own, the
  same however they were cut into files and row groups);
* the order -- shuffled or not, the seed, the shuffle window, the partitions and the orders'
  version: an epoch resumed mid-way goes on in the order it was saved in (said once), the
  call's settings from the next epoch on; a position of the orders before the spread ones
  (``order_version`` 1, shuffled) cannot be continued and stops the resume.
"""
from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from sparkhvd.common.errors import DataChanged
from sparkhvd.data.deal import Deal
from sparkhvd.data.order import ORDER_VERSION
from sparkhvd.data.sharding import samples_after

__side__ = "common"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Position:
    """Where the ranks are in the global order: ``samples`` rows of epoch ``epoch``'s sequence
    consumed by all ranks together, and what that sequence was made from (a resumed run checks
    it reads the same one). Plain data: it goes into checkpoints as a dict (:meth:`as_dict`).
    """

    epoch: int
    samples: int
    seed: int = 0
    shuffle: bool = False
    window_rows: int = 0
    num_rows: int = 0
    batch_size: int = 0
    world_size: int = 1
    #: Steps the ranks have run in this epoch, counted on across resizes: a resumed epoch goes
    #: on from the step it was saved at, whatever the number of ranks (checkpoints are named
    #: and ordered by it, so it must only grow).
    step: int = 0
    #: The dataset's partition count ``P`` (0: a position saved before partitions existed).
    partitions: int = 0
    #: An epoch dealt to the ranks (a number of ranks the round robin does not serve, or an
    #: epoch such a run resized: :mod:`sparkhvd.data.deal`): the deal (``Deal.as_dict``) and
    #: ``step0``, the epoch's steps before it; what is left follows from it and ``step``.
    deal: Optional[dict[str, Any]] = None
    #: The orders' version (:data:`~sparkhvd.data.order.ORDER_VERSION`; 1: a position saved
    #: before the spread orders, whose shuffled epochs were another sequence).
    order_version: int = 1
    #: The hosts of the ranks that were here, in rank order (empty: not known): a run resumed
    #: at another size deals each host the rows its ranks were reading
    #: (:func:`sparkhvd.data.deal.by_host`).
    hosts: tuple[str, ...] = ()
    #: The table the order was made from (:func:`source_key`; empty: saved before positions
    #: said it).
    source: str = ""

    @property
    def at_start(self) -> bool:
        """Whether this is an epoch's start: nothing of it consumed, no step run."""
        return self.samples == 0 and self.step == 0

    def at_epoch_start(self, epoch: int) -> "Position":
        """The position at the start of ``epoch`` in this one's order: no rows consumed, no
        step run, no deal (an epoch is dealt anew when it begins)."""
        return replace(self, epoch=epoch, samples=0, step=0, deal=None)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> "Position":
        """A saved position. One at an epoch's start holding a deal (an epoch-end checkpoint
        of sparkhvd before positions were made here alone: the ended epoch's deal) starts its
        epoch fresh -- the deal belongs to the epoch before."""
        known = {k: value[k] for k in cls.__dataclass_fields__ if k in value}
        if "hosts" in known:
            known["hosts"] = tuple(known["hosts"] or ())
        position = cls(**known)
        if position.at_start and position.deal is not None:
            position = replace(position, deal=None)
        return position


def source_key(files: Sequence[str], row_groups: Sequence[Sequence[int]]) -> str:
    """What names a table's layout for a saved position: each file's name (not its folder: a
    DataFrame materialised again lands in another one) and its row groups' row counts. The
    same DataFrame written the same way has the same key; other files, other row groups or
    another row count have another."""
    layout = [[posixpath.basename(str(f).rstrip("/")), [int(n) for n in groups]]
              for f, groups in zip(files, row_groups)]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


@dataclass
class EpochPlan:
    """How one epoch was handed out by a rank's shard from where it began: the position after
    any of its steps follows from it (the batches and the checkpoints ask it alike).

    ``start``: rows of the order consumed before this hand-out began; ``step0``: steps run
    before it (a resumed epoch's); ``lead``: rows of a round robin's lead-in step (a resize
    left the start off this size's step boundaries); ``deal``: a dealt epoch's record
    (``Deal.as_dict`` and ``step0``), whose steps consume what it says; ``steps``: the steps
    it runs; ``order``: the position's other fields (seed, window, sizes, hosts, the source).
    """

    epoch: int
    start: int
    step0: int
    steps: int
    order: Position
    lead: int = 0
    deal: Optional[dict[str, Any]] = None
    _dealt: Optional[Deal] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.deal is not None and self._dealt is None:
            self._dealt = Deal.of(self.deal)

    @property
    def last_step(self) -> int:
        """The step number after the last step of the hand-out."""
        return self.step0 + self.steps

    def position(self, step: int) -> Position:
        """The position after step ``step`` of the epoch (counted on across resizes: from
        ``step0`` to :attr:`last_step`)."""
        if not self.step0 <= step <= self.last_step:
            raise ValueError(f"step {step} of epoch {self.epoch} is not in what this rank "
                             f"handed out of it (steps {self.step0} to {self.last_step})")
        done = step - self.step0
        if self._dealt is not None:
            samples = self.start + self._dealt.consumed(done)
        else:
            samples = samples_after(self.start, done, self.order.batch_size,
                                    self.order.world_size, self.lead)
        return replace(self.order, epoch=self.epoch, samples=samples, step=step,
                       deal=self.deal)


def check_resumable(saved: Position, *, source: str, num_rows: int, partitions: int) -> None:
    """:class:`~sparkhvd.common.errors.DataChanged` when the epoch ``saved`` is in cannot be
    continued by a dataset of table ``source`` (:func:`source_key`), ``num_rows`` rows and
    ``partitions`` partitions: it was saved mid-way from another table (its files, row groups or
    row count; an older position without a key is checked by its rows), in an order of other
    partitions, or shuffled by the orders before the spread ones. An epoch's start resumes
    any dataset (its epoch is dealt anew)."""
    if saved.at_start:
        return
    start_over = ("start that epoch over: resume the model without the data position (the "
                  "Checkpoints helper without data=, or KerasDistributed without data=: the "
                  "epoch is then trained from its start), or train from scratch "
                  "(resume_from=False)")
    changed = []
    if saved.num_rows and saved.num_rows != num_rows:
        changed.append(f"{saved.num_rows} rows, now {num_rows}")
    if saved.shuffle and saved.source and source and saved.source != source:
        # a shuffled order is drawn over the row groups; an unshuffled one is the rows' own
        changed.append(f"its files or row groups (layout {saved.source}, now {source})")
    if changed:
        raise DataChanged(
            f"The saved data position is in the middle of epoch {saved.epoch} of another table "
            f"({'; '.join(changed)}): it is not the data the checkpoint trained on, and the "
            "rows at its places are other rows, so going on would train some twice and others "
            "not at all. Resume with the same DataFrame, materialised the same way (a cache "
            "it reuses, or the same number of Spark task slots: a shuffled order is drawn over "
            f"its files' row groups), or {start_over}.")
    if saved.partitions and saved.partitions != partitions:
        raise DataChanged(
            f"The saved data position is in an order of {saved.partitions} partitions, but "
            f"this dataset has {partitions}: the rest of that epoch would be another sequence, "
            "training some rows twice and others not at all. Create the DataFrameDataset with "
            f"partitions={saved.partitions} to resume it, or {start_over}.")
    if saved.shuffle and saved.order_version < ORDER_VERSION:
        raise DataChanged(
            f"The saved data position is in the middle of epoch {saved.epoch} of a shuffled "
            f"order of sparkhvd's orders version {saved.order_version} (this sparkhvd reads "
            f"version {ORDER_VERSION}): the rest of that epoch cannot be drawn again, so going "
            "on would train some of its rows twice and others not at all. Finish that epoch "
            f"with the sparkhvd that saved it, or {start_over}.")


def resume_order(saved: Position, *, shuffle: bool, seed: int, window: int,
                 rank: int) -> tuple[bool, int, int]:
    """The order a rank reads the epoch ``saved`` is in: ``(shuffle, seed, window)``.

    The call's own when they are the saved ones or the epoch has not begun; the saved ones
    when the epoch was saved mid-way under others -- the rest of that epoch is the rest of the
    sequence it began (rank 0 says so once), and the call's settings apply from the next
    epoch."""
    if saved.at_start:
        return shuffle, seed, window
    kept = (saved.shuffle, saved.seed, saved.window_rows or window)
    changed = [f"{name} {was!r} -> {now!r}" for name, was, now in (
        ("shuffle", kept[0], shuffle), ("seed", kept[1], seed),
        ("shuffle window", kept[2], window)) if was != now]
    if changed and rank == 0:
        log.warning("Epoch %d resumes in the order it was saved in (%s): the rest of its "
                    "sequence is read, so every row of it is trained once; the new settings "
                    "apply from epoch %d.", saved.epoch, ", ".join(changed), saved.epoch + 1)
    return kept
