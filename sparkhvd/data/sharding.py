"""What a rank needs to read its shard of a ``DataFrameDataset``, and the sharding policy.

The driver half (:mod:`sparkhvd.data.dataset`) materialises the DataFrame and hands the
ranks a :class:`ShardSource` -- plain data, no Spark, no credentials beyond the read-only ones
minted for the ranks; the rank half (:mod:`sparkhvd.data.shard`) reads it. The policy both
sides must agree on lives here, once:

* The ``N`` materialised rows are split into ``size`` contiguous blocks of ``M = N // size``
  rows; rank ``r`` owns rows ``[r*M, (r+1)*M)`` of the files in order. Blocks never overlap, so
  within one epoch no row is seen twice across ranks.
* Each epoch a rank runs exactly ``steps_per_epoch(batch_size) = M // batch_size`` full batches,
  the same on every rank (unequal step counts would hang allreduce).
* Rows left out in an epoch: ``N - size * steps * batch_size``, always fewer than
  ``size * batch_size``. With shuffling, a different subset of each block is left out each epoch.

petastorm's own reader shards by Parquet row group, which gives ranks different row counts;
that is why ranks read row ranges.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from sparkhvd.common.identity import current_rank

__side__ = "common"


#: A shard up to this size (bytes in memory) is read once and kept: later epochs and full
#: permutations come from memory. Larger shards are streamed every epoch.
MEMORY_CACHE_BYTES = 512 << 20


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

    def shard_bounds(self, rank: Optional[int] = None,
                     size: Optional[int] = None) -> tuple[int, int]:
        """``(start, stop)`` global row indices owned by ``rank`` (default: this rank)."""
        me = current_rank()
        rank = me.rank if rank is None else rank
        size = me.size if size is None else size
        per_rank = self.num_rows // size
        return rank * per_rank, (rank + 1) * per_rank

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None) -> int:
        """Full batches every rank runs per epoch (the same on all ranks)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        start, stop = self.shard_bounds(0, size)
        steps = (stop - start) // batch_size
        if steps == 0:
            n_size = size or current_rank().size
            raise ValueError(
                f"{self.num_rows} rows cannot give each of {n_size} rank(s) one full batch of "
                f"{batch_size}: lower batch_size to at most {max(1, self.num_rows // n_size)} "
                "or use more data.")
        return steps

    def shard_bytes(self, rank: Optional[int] = None, size: Optional[int] = None) -> int:
        """About how many bytes ``rank``'s rows take in memory."""
        start, stop = self.shard_bounds(rank, size)
        return (stop - start) * self.row_bytes
