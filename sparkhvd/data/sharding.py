"""What a rank needs to read its part of a ``DataFrameDataset``, and the order policy.

The driver half (:mod:`sparkhvd.data.dataset`) materialises the DataFrame (or finds it can be
read in place) and hands the ranks a :class:`ShardSource` -- plain data, no Spark, no
credentials beyond the read-only ones minted for the ranks; the rank half
(:mod:`sparkhvd.data.shard`) reads it. The policy both sides must agree on lives here and in
:mod:`sparkhvd.data.order`, once.

**One global order per epoch, whatever the number of ranks, and each rank reads only its
share** (Mosaic Streaming's canonical nodes). The ``N`` rows are cut once into ``P``
*partitions* (``partitions=``, default 24, fixed with the dataset): the Parquet row groups
(*blocks*), in a *spread* order drawn from the seed when shuffled (any run of it holds blocks
from all over the files: :mod:`sparkhvd.data.order`), laid end to end and cut into ``P`` spans
of equal size. For each ``(seed, epoch)`` the rows form one sequence ``S``:

* a round robin over the partitions: position ``i`` is row ``i // P`` of partition ``i % P``'s
  own sequence;
* ``shuffle=True``: a partition's sequence is its blocks in a spread order (drawn by seed,
  epoch and partition), grouped into *windows* of at least ``window_rows / P`` rows, each
  window's rows permuted. A dataset that fits ``memory_cache`` has one window per
  partition: each partition fully permuted every epoch.
* ``shuffle=False``: a partition's rows in the files' order (partition 0 holds the first
  ``N / P`` rows), so ``S`` takes one row of each ``P``-th of the data in turn.

At each step the ranks take the next ``size * b`` positions of ``S``; rank ``r`` takes the
``b`` positions ``i`` with ``i % size == r``. Nothing in ``S`` depends on ``size`` or the rank,
and when ``size`` divides ``P`` rank ``r``'s positions all lie in the partitions
``c % size == r``: it reads its share and keeps only that in memory. The ``size`` that divide
``P`` and are at most 8 read this order (1, 2, 3, 4, 6 and 8 ranks with the default:
:func:`~sparkhvd.data.order.round_robin`).

**Any other number of ranks deals the epoch** (:mod:`sparkhvd.data.deal`): for a ``size``
prime to ``P`` the round robin's positions of a rank would fall in every partition (each rank
reading the whole table), and with more than 8 ranks a rank's part of a window (``1 / size``
of it) holds too few row groups for a batch of sorted data to mix. Instead what is left of the epoch -- each partition's sequence of
pieces, or the rest of it -- is laid end to end in partition order and cut into ``size``
consecutive spans of equal rows; rank ``r`` reads only the ``r``-th, interleaving its
partitions' rows round robin and drawing each a window at a time (permuted when shuffled). So:

* *share*: every ``size`` reads ``1 / size`` of the row groups per epoch, plus a row group a
  span's end splits (a rank reads the row groups its partitions share once), which is small
  when a share holds tens of row groups: a materialised table is written in about 2,048 of
  them however small it is (:func:`sparkhvd.data.materialize.group_bytes_for`), and the
  files' footers come with the source (:attr:`ShardSource.footers`). B14's plans: all ranks
  read 1.00-1.04x the files at every np from 1 to 64, the busiest rank at most 1.08x its
  share (np=64), where the round robin read np times;
* *memory*: a window of each unit it reads (about ``1 / size`` of the shuffle window, and at
  least ``1 / 8`` of it beyond 8 ranks) and at least a row group of each, within
  :data:`READ_MEMORY_BYTES` by default; a share that fits
  ``memory_cache`` is kept by row group, read once (its span is the same row groups every
  epoch);
* *resizes*: what a rank reads is also kept on its host's disk for the run (its newest 512
  MB: :mod:`sparkhvd.data.row_group_cache`), and a run resumed at another size, or on other
  hosts, deals each host first the rows its ranks held (:func:`~sparkhvd.data.deal.by_host`,
  the hosts from :attr:`~sparkhvd.data.position.Position.hosts`): the windows a stopped attempt was in are read from
  the host, not the files -- on one host nothing is read twice (B14's 73 MB table, 8 -> 7 ->
  8 mid-epoch: 0.996x the files, was 3.63x); across hosts what moves is read again, a
  window cut between hosts by where its rows lie (1.31x on 8 hosts of a rank each, of which
  the lost host's whole share, read again, is 1/8);
* *mixing*: a rank's batch draws from every partition of its span at once, as the round
  robin's does from its partitions, and from at least ``1 / 8`` of the shuffle window: where
  a span holds fewer units than that takes (more than 8 ranks) its units' windows are
  widened (:meth:`~sparkhvd.data.deal.Deal.spans`) -- with the default window at least 16 MB
  of rows, 32 row groups of 512 KB, however many ranks; and since a span, like a partition
  and a window, is a run of spread orders, its row groups come from all over the table: on
  sorted data a rank of 64 sees about the table's mix (B14's plans: 0.98x the labels of a full
  permutation per rank's batch at np=64 on a small table, where uniformly drawn blocks gave
  0.87x; on a 5 GB table's layout 0.96-0.99x at np 12 to 64, 0.90-0.94x at np 16 to 64
  before the windows were widened);
* *exactly once*: the position of a dealt epoch keeps its deal and the steps run
  (:attr:`~sparkhvd.data.position.Position.deal`); what is left follows from them, on any rank, and a run resumed with
  any number of ranks deals it again (with the same number: the same spans and sequence, as
  if it had not stopped);
* *order*: one and the same ``S`` for every ``size`` up to 8 dividing ``P``, fixed with the
  dataset (as Mosaic Streaming fixes its canonical nodes); another ``size`` gets its own order
  (each rank a span of the same epoch's rows), and a resize from a round-robin ``size`` to
  another deals the rest of the round robin's epoch. (Before the mixing bound, 12 and 24
  ranks read the round robin too: a position they saved resumes with any number of ranks.)

* Each epoch every rank runs ``N // (size * b)`` full batches, the same on all ranks (unequal
  step counts would hang allreduce): the epoch's *end* is ``E = N - N % (size * b)``, and the
  ``N % (size * b)`` rows after it are left out, as a run that never resized leaves them out.
* An epoch resumed at a position ``start`` that is not on this size's step boundaries (a run
  that changed its number of ranks mid-epoch) first runs one *lead-in* step of the
  ``(E - start) % (size * b)`` rows up to the next boundary, dealt the same way (rank ``r``
  the positions ``i % size == r``: its batch is a few rows smaller), then full steps to
  ``E`` (:func:`lead_in`, :func:`steps_from`). So every row up to the end is trained exactly
  once across any chain of shrinks and grows -- the tail too. (A lead-in of fewer rows than
  ranks would leave a rank without a row: those rows are left out, with a warning.)
* A **position** (:class:`~sparkhvd.data.position.Position`, made in the data room alone) is
  ``(epoch, samples)``: how many rows of ``S`` the ranks together consumed, and ``step``: the
  steps run in the epoch, counted on across resizes (what checkpoints are named and ordered
  by, so it only grows). A run resumed with any number of ranks continues ``S`` from there; a
  position of another ``P`` or another table is refused (it is another sequence), and an epoch
  saved under another shuffle, seed or window goes on in the order it was saved in.

Before: every rank read every row group of every window and kept ``1 / size`` of the rows
(``size`` times the reads of the data per epoch), and a dataset kept in memory was kept whole
by every rank; later, a ``size`` not dividing ``P`` still read ``1 / gcd(size, P)`` (np=5 the
whole table).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from sparkhvd.common.identity import current_rank
from sparkhvd.data.order import (
    DEFAULT_PARTITIONS,
    MIXING_RANKS,
    partition_sizes,
    round_robin,
)

__side__ = "common"


#: A dataset up to this size (bytes in memory) is shuffled as one window per partition (each
#: partition fully permuted every epoch), and a rank keeps its share in memory when the share
#: is up to this size. Larger datasets are shuffled in windows and streamed every epoch.
MEMORY_CACHE_BYTES = 512 << 20
#: Default shuffle window when streaming: about this many bytes of rows of ``S``, spread over
#: the partitions -- 128 row groups of :data:`~sparkhvd.data.materialize.ROW_GROUP_BYTES`,
#: enough blocks for sorted data to mix.
SHUFFLE_WINDOW_BYTES = 128 << 20
#: A rank's reading memory by default: the row data in flight while streaming (the windows it
#: trains on and the next ones, read ahead: twice :data:`SHUFFLE_WINDOW_BYTES` over all ranks,
#: and at least a quarter of it per rank past 8 ranks;
#: and at least one row group of each partition it reads at once -- all ``P`` of them at
#: np=1). A table read in place whose row groups would not fit (``P`` x its largest group) is
#: materialised in small row groups instead (:func:`sparkhvd.data.in_place.groups_reason`).
READ_MEMORY_BYTES = 256 << 20
#: The files' footers go to the ranks with the source when they take up to this many bytes in
#: all (:attr:`ShardSource.footers`); beyond, each rank reads its own.
SHIPPED_FOOTERS_BYTES = 4 << 20


def epoch_end(num_rows: int, batch_size: int, size: int) -> int:
    """``E``: the position where ``size`` ranks' full steps of ``batch_size`` rows end an
    epoch (the rows after it are left out)."""
    return num_rows - num_rows % (size * batch_size)


def _off_boundary(num_rows: int, start: int, batch_size: int, size: int) -> int:
    """Rows from ``start`` to ``size``'s next step boundary before the epoch's end (0: on one,
    or past the end)."""
    end = epoch_end(num_rows, batch_size, size)
    return (end - start) % (size * batch_size) if start < end else 0


def lead_in(num_rows: int, start: int, batch_size: int, size: int) -> int:
    """Rows of the lead-in step an epoch resumed at ``start`` runs first, so that the rest of
    it falls on ``size``'s step boundaries (0: none needed, or fewer rows than ranks -- see
    :func:`left_out`)."""
    rows = _off_boundary(num_rows, start, batch_size, size)
    return rows if rows >= size else 0


def left_out(num_rows: int, start: int, batch_size: int, size: int) -> int:
    """Rows before the epoch's end that an epoch resumed at ``start`` cannot train: a lead-in
    of fewer rows than ranks (each rank's batch must hold a row). Usually 0."""
    rows = _off_boundary(num_rows, start, batch_size, size)
    return rows if rows < size else 0


def steps_from(num_rows: int, start: int, batch_size: int, size: int) -> int:
    """Steps every rank runs from position ``start`` to the end of an epoch: the lead-in, if
    any (:func:`lead_in`), then full batches."""
    end = epoch_end(num_rows, batch_size, size)
    if start >= end:
        return 0
    lead = lead_in(num_rows, start, batch_size, size)
    full = (end - start - lead) // (size * batch_size)
    return full + (1 if lead else 0)


def samples_after(start: int, step: int, batch_size: int, size: int, lead: int) -> int:
    """The position after ``step`` steps (1-based) of an epoch resumed at ``start`` whose
    lead-in step holds ``lead`` rows."""
    if step <= 0:
        return start
    if lead:
        return start + lead + (step - 1) * size * batch_size
    return start + step * size * batch_size


def footer_size(meta: Any) -> int:
    """What reading a Parquet file's footer takes from storage: its metadata and the 8 bytes
    after it (length and magic)."""
    return int(meta.serialized_size) + 8


@dataclass(frozen=True)
class ShardSource:
    """The Parquet files as the ranks see them (materialised, or the DataFrame's own)."""

    files: tuple[str, ...]
    row_counts: tuple[int, ...]
    row_groups: tuple[tuple[int, ...], ...]
    #: column -> its name in the Parquet files
    stored: Mapping[str, str]
    row_bytes: int
    features: tuple[str, ...]
    label: Optional[str]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    memory_cache: int = MEMORY_CACHE_BYTES
    #: Read-only, time-limited options minted for the ranks (never the driver's credentials).
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    #: ``P``: the partitions the order is cut into (:mod:`sparkhvd.data.order`).
    partitions: int = DEFAULT_PARTITIONS
    #: column -> numpy dtype to convert to when read (files read in place, whose floats are
    #: not yet the dataset's ``dtype``); empty for materialised files.
    cast: Mapping[str, str] = field(default_factory=dict)
    #: column -> elements per row of an array column (what a batch's shape needs before any
    #: row is read; scalars are absent)
    widths: Mapping[str, int] = field(default_factory=dict)
    #: Each file's Parquet footer (:func:`sparkhvd.data.footers.footer_bytes`), read once for the run by the
    #: driver -- the materialiser's writers return them, a table read in place has them read
    #: to be checked -- so no rank reads one (at np=64 every rank read every file's footer:
    #: 0.3x its share on B14's plans). Empty when they are larger than
    #: :data:`SHIPPED_FOOTERS_BYTES` in all: each rank reads its own, once per run.
    footers: tuple[bytes, ...] = ()
    #: What the driver read of the files' footers (counted once: :attr:`footers`).
    footer_bytes: int = 0

    @property
    def num_rows(self) -> int:
        return sum(self.row_counts)

    @property
    def columns(self) -> list[str]:
        return list(self.features) + ([self.label] if self.label else [])

    @property
    def data_bytes(self) -> int:
        """About how many bytes all rows take in memory."""
        return self.num_rows * self.row_bytes

    def in_memory(self, memory_cache: Optional[int] = None) -> bool:
        """Whether the whole dataset fits ``memory_cache``: then each partition is shuffled as
        one window (the order does not depend on the number of ranks, so neither does this)."""
        budget = self.memory_cache if memory_cache is None else memory_cache
        return self.data_bytes <= budget

    def window_rows(self, shuffle_window: Optional[int] = None,
                    memory_cache: Optional[int] = None) -> int:
        """Rows of ``S`` per shuffle window (spread over the partitions): every row when the
        dataset fits ``memory_cache``, else ``shuffle_window`` rows (default about
        :data:`SHUFFLE_WINDOW_BYTES` of rows)."""
        if self.in_memory(memory_cache):
            return max(1, self.num_rows)
        if shuffle_window is not None:
            return max(1, int(shuffle_window))
        return max(1, SHUFFLE_WINDOW_BYTES // max(1, self.row_bytes))

    def deals(self, size: int) -> bool:
        """Whether ``size`` ranks read an epoch dealt in spans (:mod:`sparkhvd.data.deal`): a
        number of ranks that does not divide ``P``, or more than
        :data:`~sparkhvd.data.order.MIXING_RANKS` (:func:`~sparkhvd.data.order.round_robin`)."""
        return not round_robin(self.partitions, size)

    def rank_rows(self, size: int) -> int:
        """Rows one of ``size`` ranks reads in an epoch (the largest such share): its
        partitions' when ``size`` divides ``P``, else its span's."""
        if self.deals(size):
            return -(-self.num_rows // size)
        sizes = partition_sizes(self.num_rows, self.partitions)
        return max(sum(sizes[c] for c in range(r, self.partitions, size)) for r in range(size))

    def keeps(self, size: int, memory_cache: Optional[int] = None) -> bool:
        """Whether each of ``size`` ranks keeps the rows it reads in memory (read once): its
        share fits ``memory_cache``."""
        budget = self.memory_cache if memory_cache is None else memory_cache
        return self.rank_rows(size) * self.row_bytes <= budget

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None,
                        start: int = 0) -> int:
        """Batches every rank runs per epoch (the same on all ranks), from position ``start``
        (default: a whole epoch, all full; from a ``start`` off this size's step boundaries,
        a lead-in step first -- :func:`steps_from`)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        n_size = current_rank().size if size is None else size
        steps = steps_from(self.num_rows, start, batch_size, n_size)
        if steps == 0 and start == 0:
            raise ValueError(
                f"{self.num_rows} rows cannot give each of {n_size} rank(s) one full batch of "
                f"{batch_size}: lower batch_size to at most {max(1, self.num_rows // n_size)} "
                "or use more data.")
        return steps

    def rank_bytes(self, size: int = 1, memory_cache: Optional[int] = None,
                   shuffle_window: Optional[int] = None) -> int:
        """About how many bytes of rows one of ``size`` ranks holds while reading: its share
        when it keeps it in memory, else a window of each partition (or unit) it reads, about
        ``1 / size`` of the shuffle window and at least ``1 / MIXING_RANKS`` of it (plus a row
        group and the batches being gathered, not counted)."""
        if self.keeps(size, memory_cache):
            return self.rank_rows(size) * self.row_bytes
        window = self.window_rows(shuffle_window, memory_cache)
        return min(self.rank_rows(size), window // min(size, MIXING_RANKS)) * self.row_bytes
