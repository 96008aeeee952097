"""Rank side of :class:`~sparkhvd.data.DataFrameDataset`: a shard, a row group at a time.

A rank owns the contiguous global rows ``[start, stop)`` of the materialised Parquet files (see
:mod:`sparkhvd.data.dataset` for the policy). :class:`ShardReader` splits that range into
*pieces* -- the parts of row groups inside it -- and reads one piece at a time with pyarrow,
through :mod:`sparkhvd.storage` for remote caches (range reads: never a whole file).

:func:`epoch_batches` turns pieces into exactly ``steps`` full batches:

- in order (``shuffle=False``): pieces in file order, rows in order;
- shuffled: the pieces' order is permuted each epoch (seeded by seed, epoch and rank), and rows
  are permuted within a window of about ``shuffle_buffer`` rows. Every row of the range is seen
  exactly once per epoch (except the fewer-than-one-batch remainder). The trade-off, as in
  petastorm and ``tf.data.Dataset.shuffle``: two rows land in the same batch only if their
  pieces were read into the same window -- a shuffle *within* windows of random pieces, not a
  full permutation of the shard. A shard that fits the dataset's ``memory_cache`` is instead
  held in memory and fully permuted every epoch.

Peak memory while streaming: about ``shuffle_buffer`` rows + one row group + the prefetched
batches, whatever the data size.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

__side__ = "rank"

Arrays = dict[str, np.ndarray]


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


def pieces_of(row_groups: Sequence[Sequence[int]], start: int, stop: int) -> list[Piece]:
    """The pieces that make up global rows ``[start, stop)``, in global order."""
    found, offset = [], 0
    for f, groups in enumerate(row_groups):
        for g, count in enumerate(groups):
            lo, hi = max(start, offset), min(stop, offset + count)
            if lo < hi:
                found.append(Piece(f, g, lo - offset, hi - offset))
            offset += count
    return found


class ShardReader:
    """Reads pieces of the materialised files (pyarrow, one open file per Parquet file)."""

    def __init__(self, files: Sequence[str], stored: dict[str, str],
                 storage_options: Optional[dict], convert: Callable[[str, Any, int], np.ndarray]):
        self.files = list(files)
        self.stored = stored
        self.storage_options = storage_options
        self.convert = convert
        self._open: dict[int, Any] = {}
        self._handles: list[Any] = []

    def _parquet(self, index: int) -> Any:
        import pyarrow.parquet as pq

        pf = self._open.get(index)
        if pf is None:
            from sparkhvd import storage

            loc = storage.resolve(self.files[index], self.storage_options)
            if loc.is_local:
                pf = pq.ParquetFile(loc.path)
            else:
                handle = loc.fs.open(loc.path, "rb")
                self._handles.append(handle)
                pf = pq.ParquetFile(handle)
            self._open[index] = pf
        return pf

    def read(self, piece: Piece) -> Arrays:
        """The piece's rows as numpy arrays, by column name."""
        table = self._parquet(piece.file).read_row_group(
            piece.group, columns=list(self.stored.values()))
        if piece.lo or piece.hi < table.num_rows:
            table = table.slice(piece.lo, piece.rows)
        return {name: self.convert(name, table.column(col), piece.rows)
                for name, col in self.stored.items()}

    def close(self) -> None:
        """Close the open files (remote ones hold connections and read-ahead buffers)."""
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.close()
        self._handles.clear()
        self._open.clear()


def _concat(parts: list[Arrays]) -> Arrays:
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _take(data: Arrays, index: Any) -> Arrays:
    return {k: v[index] for k, v in data.items()}


class _Window:
    """The rows of several pieces addressed as one range, without copying them together
    (a window of ~64 MB copied into one array cost as much as reading it from Parquet)."""

    def __init__(self, parts: list[Arrays]) -> None:
        self.parts = parts
        self.ends = np.cumsum([len(next(iter(p.values()))) for p in parts])

    def take(self, index: np.ndarray) -> Arrays:
        """Rows at the sorted positions ``index`` (one gather per piece they fall in)."""
        cuts = np.searchsorted(index, self.ends[:-1])
        starts = np.concatenate([[0], self.ends[:-1]])
        return _concat([_take(part, idx - first) for part, idx, first
                        in zip(self.parts, np.split(index, cuts), starts) if len(idx)])

    def slice(self, lo: int, hi: int) -> Arrays:
        """Rows ``[lo, hi)``: views when they lie in one piece."""
        i = int(np.searchsorted(self.ends, lo, side="right"))
        first = int(self.ends[i - 1]) if i else 0
        if hi <= self.ends[i]:
            return {k: v[lo - first:hi - first] for k, v in self.parts[i].items()}
        return self.take(np.arange(lo, hi))


def epoch_batches(read: Callable[[Piece], Arrays], pieces: Sequence[Piece], batch_size: int,
                  steps: int, *, rng: Optional[np.random.Generator],
                  shuffle_buffer: int) -> Iterator[Arrays]:
    """Exactly ``steps`` batches of ``batch_size`` rows from ``pieces`` (module docstring);
    ``rng`` (shuffling) permutes the pieces and each window of ``shuffle_buffer`` rows."""
    order = list(pieces)
    if rng is not None:
        order = [order[i] for i in rng.permutation(len(order))]
    window_rows = max(batch_size, shuffle_buffer if rng is not None else batch_size)
    carry: list[Arrays] = []
    carried = 0
    emitted = 0
    source = iter(order)
    exhausted = False
    while emitted < steps:
        parts, rows = carry, carried
        while rows < window_rows and not exhausted:
            piece = next(source, None)
            if piece is None:
                exhausted = True
                break
            parts.append(read(piece))
            rows += piece.rows
        if rows < batch_size:
            return  # not reachable when steps came from steps_per_epoch
        window = _Window(parts)
        usable = rows - rows % batch_size
        perm = rng.permutation(rows) if rng is not None else None
        for start in range(0, usable, batch_size):
            if emitted == steps:
                return
            if perm is not None:
                # sorted gathers are faster; the order within a batch does not matter
                yield window.take(np.sort(perm[start:start + batch_size]))
            else:
                yield window.slice(start, start + batch_size)
            emitted += 1
        if usable == rows:
            carry = []
        elif perm is not None:
            carry = [window.take(np.sort(perm[usable:]))]
        else:
            carry = [window.slice(usable, rows)]
        carried = rows - usable
