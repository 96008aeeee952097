"""What a rank needs to read its part of a ``DataFrameDataset``, and the order policy.

The driver half (:mod:`sparkhvd.data.dataset`) materialises the DataFrame and hands the
ranks a :class:`ShardSource` -- plain data, no Spark, no credentials beyond the read-only ones
minted for the ranks; the rank half (:mod:`sparkhvd.data.shard`) reads it. The policy both
sides must agree on lives here, once.

**One global order per epoch, whatever the number of ranks** (as Mosaic Streaming's "elastic
determinism"). For each ``(seed, epoch)`` the ``N`` materialised rows form one sequence ``S``:

* ``shuffle=True``: the *blocks* -- the Parquet row groups, fixed when the data is materialised
  -- are permuted (seeded by ``seed`` and ``epoch``); consecutive permuted blocks form
  *windows* of at least ``window_rows`` rows; each window's rows are permuted (seeded by seed,
  epoch and the window's number). A dataset that fits ``memory_cache`` is one window: a full
  permutation.
* ``shuffle=False``: the rows in the files' order.

``S`` is cut into *micro-batches* of ``batch_size`` rows (micro-batch ``g`` is
``S[g*b:(g+1)*b]``, its rows in storage order). At step ``t`` of an epoch, rank ``r`` of
``size`` takes micro-batch ``t*size + r``: the ranks' batches, taken step by step and rank by
rank, are ``S`` itself, for any ``size``. Nothing in ``S`` depends on ``size`` or the rank.

* Each epoch every rank runs ``steps = (N - start) // (size * b)`` batches, the same on all
  ranks (unequal step counts would hang allreduce); ``start`` is 0, or the position an epoch
  resumes from. Fewer than ``size * b`` rows are left out at the end.
* A **position** (:class:`Position`) is ``(epoch, samples)``: how many rows of ``S`` the ranks
  together consumed. A run resumed with any number of ranks continues ``S`` from there.

petastorm's reader, and this module until it moved to a global order, gave each rank one fixed
block of rows for the whole run: on sorted data every rank trained on a biased slice.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from sparkhvd.common.identity import current_rank

__side__ = "common"


#: A dataset up to this size (bytes in memory) is read once by each rank and kept: later
#: epochs are full permutations from memory. Larger datasets are streamed every epoch.
MEMORY_CACHE_BYTES = 512 << 20
#: Default shuffle window when streaming: about this many bytes of rows -- 32 row groups of
#: :data:`~sparkhvd.data.materialize.ROW_GROUP_BYTES`, enough blocks for sorted data to mix.
SHUFFLE_WINDOW_BYTES = 128 << 20


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
    #: Batches each rank has run in this epoch (with this world size, since the epoch's start
    #: or the position it resumed from).
    step: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> "Position":
        known = {k: value[k] for k in cls.__dataclass_fields__ if k in value}
        return cls(**known)


def steps_from(num_rows: int, start: int, batch_size: int, size: int) -> int:
    """Full batches every rank runs from position ``start`` to the end of an epoch."""
    return max(0, num_rows - start) // (size * batch_size)


@dataclass(frozen=True)
class ShardSource:
    """The materialised Parquet as the ranks see it."""

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
        """Whether each rank keeps the whole dataset in memory (it fits ``memory_cache``)."""
        budget = self.memory_cache if memory_cache is None else memory_cache
        return self.data_bytes <= budget

    def window_rows(self, shuffle_window: Optional[int] = None,
                    memory_cache: Optional[int] = None) -> int:
        """Rows per shuffle window: every row when the data is kept in memory, else
        ``shuffle_window`` rows (default about :data:`SHUFFLE_WINDOW_BYTES` of rows)."""
        if self.in_memory(memory_cache):
            return max(1, self.num_rows)
        if shuffle_window is not None:
            return max(1, int(shuffle_window))
        return max(1, SHUFFLE_WINDOW_BYTES // max(1, self.row_bytes))

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None,
                        start: int = 0) -> int:
        """Full batches every rank runs per epoch (the same on all ranks), from position
        ``start`` (default: a whole epoch)."""
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

    def rank_bytes(self, memory_cache: Optional[int] = None,
                   shuffle_window: Optional[int] = None) -> int:
        """About how many bytes of rows a rank holds while reading: the whole dataset when it
        is kept in memory, else one window (plus one row group and a batch, not counted)."""
        return min(self.num_rows, self.window_rows(shuffle_window, memory_cache)) \
            * self.row_bytes
