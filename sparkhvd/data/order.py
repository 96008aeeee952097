"""The global order of a ``DataFrameDataset`` epoch: which row sits at each position, and which
positions each rank takes. Pure functions of plain numbers, the same on the driver and every
rank; the why is in :mod:`sparkhvd.data.sharding`.

Three layers, from the files up:

1. **Blocks** (:func:`blocks_of`): the Parquet row groups, in storage order. A block is the unit
   that is read and that the shuffle moves around.
2. **Partitions** (:func:`layout`): the blocks -- in a *spread* order drawn once from the seed
   when shuffled, in storage order otherwise -- laid end to end and cut into ``P`` spans of
   ``N // P`` or ``N // P + 1`` rows (a block on a boundary is split into two *pieces*). ``P``
   is fixed with the dataset, not by the number of ranks.
3. **Each partition's epoch sequence** (:func:`plan_partition`): its pieces in a spread order
   drawn from ``(seed, epoch, partition)``, grouped into windows of at least ``window_rows / P``
   rows, each window's rows permuted (:func:`window_permutation`); unshuffled, the pieces' rows
   in layout order.

A *spread* order (:func:`spread_permutation`) is a permutation in which every run of
consecutive places holds blocks from all over the files, at near-even gaps -- not a uniform
draw, where a run of ``k`` blocks is ``k`` independent picks. A rank's share, a window, any
span of a partition's sequence is such a run, so on data stored sorted (by label, by date)
each holds about the table's mix of it, at every ``np``: a rank of 64 reading 26 row groups
of a label-sorted table sees every label in its batches, where 26 uniform picks leave labels
out and overweight others. The layout spreads the blocks over the files (the golden ratio's
step), each epoch spreads a partition's pieces over their storage order again (the silver
ratio's: two steps that do not resonate), and both draw an offset and a jitter of up to one
place from their seeds, so every seed and epoch has its own order.

The epoch's sequence ``S`` is a round robin over the partitions: position ``i`` is row
``i // P`` of partition ``i % P``'s sequence. At each step the ranks take the next ``size * b``
positions; rank ``r`` the ``b`` of them with ``i % size == r`` (:func:`rank_positions`) -- all
in partitions ``c`` with ``c % size == r`` when ``size`` divides ``P``
(:func:`owned_partitions`). A ``size`` that divides ``P`` and is at most :data:`MIXING_RANKS`
reads this order (:func:`round_robin`); any other deals the epoch (:mod:`sparkhvd.data.deal`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import numpy as np

__side__ = "common"  # numpy inside the functions: nothing third-party at import time

#: Default number of partitions: highly composite, so that 1, 2, 3, 4, 6 and 8 ranks share one
#: order (any other number deals its epochs: :mod:`sparkhvd.data.deal`).
DEFAULT_PARTITIONS = 24
#: The most ranks that read the round robin's order: a rank of ``size`` draws its batches from
#: ``1 / size`` of the shuffle window there, and with more than 8 ranks that is too few row
#: groups for a batch of sorted data to mix (B14: 0.90-0.92x the labels of a full permutation
#: at np 24 to 64 with the default window on a 5 GB table). More ranks deal their epochs, each
#: rank drawing from at least ``1 / MIXING_RANKS`` of the window.
MIXING_RANKS = 8
#: Seed tags: the layout, a partition's pieces and a window's rows draw from separate streams.
_LAYOUT, _PIECES, _ROWS = 1, 2, 3
#: The orders' version, kept with every position (:class:`~sparkhvd.data.position.Position`):
#: 2, the spread orders; 1 (a position saved before them), blocks and pieces drawn uniformly.
ORDER_VERSION = 2
#: Steps of the spread orders: the golden ratio's for the layout, the silver ratio's for a
#: partition's pieces each epoch (each the most evenly spreading of its kind, and unlike).
_GOLDEN, _SILVER = (5 ** 0.5 - 1) / 2, 2 ** 0.5 - 1


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of row group ``group`` of file ``file`` (indices into the manifest)."""

    file: int
    group: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def blocks_of(row_groups: Sequence[Sequence[int]]) -> list[Piece]:
    """Every row group of the files as one block, in storage order."""
    return [Piece(f, g, 0, count) for f, groups in enumerate(row_groups)
            for g, count in enumerate(groups) if count]


def partition_sizes(num_rows: int, partitions: int) -> list[int]:
    """Rows of each partition: ``N // P``, one more for the first ``N % P`` (so that position
    ``i < N`` is row ``i // P`` of partition ``i % P``)."""
    base, extra = divmod(num_rows, partitions)
    return [base + (1 if c < extra else 0) for c in range(partitions)]


def layout(blocks: Sequence[Piece], partitions: int, *, shuffle: bool,
           seed: int) -> list[tuple[Piece, ...]]:
    """Each partition's pieces: the blocks (spread by ``seed`` when ``shuffle``) laid end to
    end and cut at the partition sizes. Fixed for a dataset, seed and ``P``: the same every
    epoch and for any number of ranks."""
    import numpy as np

    order = spread_permutation(len(blocks), _GOLDEN, [seed, _LAYOUT]) if shuffle \
        else np.arange(len(blocks))
    parts: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    sizes = iter(partition_sizes(sum(b.rows for b in blocks), partitions))
    need = next(sizes)
    for k in order.tolist():
        block = blocks[k]
        lo = block.lo
        while lo < block.hi:
            while need == 0:  # a full (or empty) partition: close it
                parts.append(tuple(current))
                current, need = [], next(sizes)
            take = min(need, block.hi - lo)
            current.append(Piece(block.file, block.group, lo, lo + take))
            lo += take
            need -= take
    parts.append(tuple(current))
    parts += [()] * (partitions - len(parts))  # more partitions than rows
    return parts


@dataclass(frozen=True)
class Window:
    """Consecutive rows ``[start, start + rows)`` of partition ``partition``'s epoch sequence:
    its pieces ``pieces`` (indices into the partition's pieces), read and permuted together."""

    partition: int
    number: int
    start: int
    pieces: tuple[int, ...]
    rows: int

    @property
    def end(self) -> int:
        return self.start + self.rows


def partition_window_rows(window_rows: int, partitions: int) -> int:
    """A partition's share of a window of ``window_rows`` positions of ``S``."""
    return max(1, -(-window_rows // partitions))


def spread_permutation(count: int, step: float, key: Sequence[int]) -> np.ndarray:
    """A spread order of ``range(count)`` (see the module docstring): the indices sorted by
    ``frac(u + i * step + j_i / count)``, ``u`` and the jitters ``j_i`` in ``[0, 1)`` drawn
    from ``key``. The points ``frac(i * step)`` of an irrational ``step`` fall at near-even
    gaps in every interval (the three-gap theorem), so the indices of any run of places --
    an interval of keys -- lie at near-even gaps over the whole range."""
    import numpy as np

    rng = np.random.default_rng(list(key))
    keys = (rng.random() + np.arange(count) * step + rng.random(count) / max(1, count)) % 1.0
    return np.argsort(keys, kind="stable")


def piece_order(pieces: Sequence[Piece], *, partition: int, shuffle: bool, seed: int,
                epoch: int) -> list[int]:
    """The order of partition ``partition``'s pieces in ``epoch``: spread over their order in
    the files (``shuffle``), or the layout's."""
    if not shuffle:
        return list(range(len(pieces)))
    stored = sorted(range(len(pieces)), key=lambda k: (pieces[k].file, pieces[k].group,
                                                       pieces[k].lo))
    return [stored[j] for j in spread_permutation(len(pieces), _SILVER,
                                                  [seed, epoch, partition, _PIECES]).tolist()]


def epoch_pieces(pieces: Sequence[Piece], *, partition: int, shuffle: bool, seed: int,
                 epoch: int) -> list[Piece]:
    """Partition ``partition``'s pieces in ``epoch``'s order (its *epoch sequence of pieces*:
    the windows are consecutive runs of it)."""
    return [pieces[k] for k in piece_order(pieces, partition=partition, shuffle=shuffle,
                                            seed=seed, epoch=epoch)]


def plan_partition(pieces: Sequence[Piece], window_rows: int, *, partition: int, shuffle: bool,
                   seed: int, epoch: int) -> list[Window]:
    """Partition ``partition``'s windows in ``epoch``: its pieces spread (``shuffle``) or in
    layout order, grouped into windows of at least ``window_rows`` rows (the last may be
    smaller)."""
    windows: list[Window] = []
    current: list[int] = []
    rows = start = 0
    for k in piece_order(pieces, partition=partition, shuffle=shuffle, seed=seed, epoch=epoch):
        current.append(k)
        rows += pieces[k].rows
        if rows >= window_rows:
            windows.append(Window(partition, len(windows), start, tuple(current), rows))
            start, current, rows = start + rows, [], 0
    if current:
        windows.append(Window(partition, len(windows), start, tuple(current), rows))
    return windows


def window_permutation(window: Window, *, seed: int, epoch: int) -> np.ndarray:
    """The order of a shuffled window's rows (its own seed: a window nobody needs is never
    drawn)."""
    import numpy as np

    return np.random.default_rng([seed, epoch, window.partition, _ROWS, window.number]) \
        .permutation(window.rows)


def rank_positions(start: int, first_step: int, steps: int, *, batch_size: int, size: int,
                   rank: int) -> np.ndarray:
    """Positions of ``S`` rank ``rank`` of ``size`` takes at steps ``[first_step,
    first_step + steps)`` of an epoch that began (or resumed) at position ``start``, batch by
    batch: at each step the ``batch_size`` positions ``i % size == rank`` of the step's
    ``size * batch_size``."""
    import numpy as np

    offset = (rank - start) % size
    return start + offset + size * np.arange(first_step * batch_size,
                                             (first_step + steps) * batch_size, dtype=np.int64)


def round_robin(partitions: int, size: int) -> bool:
    """Whether ``size`` ranks read the round robin's order (the one order such sizes share):
    ``size`` divides ``P`` -- else a rank's positions fall in every partition -- and is at most
    :data:`MIXING_RANKS` -- else a rank's part of a window is too small to mix. Any other
    ``size`` deals its epochs (:mod:`sparkhvd.data.deal`)."""
    return partitions % size == 0 and size <= MIXING_RANKS


def owned_partitions(partitions: int, size: int, rank: int) -> list[int]:
    """The partitions rank ``rank`` of ``size`` reads rows from (where :func:`round_robin`: the
    others deal their epochs, :mod:`sparkhvd.data.deal`)."""
    return list(range(rank % size, partitions, size))
