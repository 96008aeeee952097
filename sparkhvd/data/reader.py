"""Rank side of :class:`~sparkhvd.data.DataFrameDataset`: the global order, a window at a time.

The order itself is the policy in :mod:`sparkhvd.data.sharding`: blocks (the Parquet row
groups) permuted per epoch, grouped into windows of at least ``window_rows`` rows, each
window's rows permuted, cut into micro-batches that the ranks take in turn.
:func:`plan_epoch` lays an epoch's windows out; :func:`rank_batches` yields one rank's batches:
it reads a window's blocks (one row group each, with pyarrow, through :mod:`sparkhvd.storage`
for remote caches: range reads, never a whole file), gathers its micro-batches from them, and
drops the window before reading the next.

Every rank reads every window that holds one of its batches -- with windows of at least
``size * batch_size`` rows, all of them: a rank decodes the whole dataset each epoch and keeps
its share. That is the price of an order that does not depend on the number of ranks (Mosaic
pays it as a local disk cache). Peak memory while streaming: one window of rows (about
``window_rows``) + one batch; in memory: the whole dataset, read once.

Mixing: two rows meet in a batch only if their blocks fall into the same window, so a sorted
dataset needs many blocks per window (the docs' rule: at least 32). Rows of one batch come in
storage order (sorted gathers are faster; the order inside a batch does not matter to a
gradient).
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


def blocks_of(row_groups: Sequence[Sequence[int]]) -> list[Piece]:
    """Every row group of the materialised files as one block, in storage order."""
    return [Piece(f, g, 0, count) for f, groups in enumerate(row_groups)
            for g, count in enumerate(groups) if count]


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


@dataclass(frozen=True)
class Window:
    """Consecutive blocks of an epoch's order: rows ``[start, start + rows)`` of ``S``."""

    number: int
    start: int
    blocks: tuple[int, ...]
    rows: int


def plan_epoch(blocks: Sequence[Piece], window_rows: int, *, shuffle: bool, seed: int,
               epoch: int) -> list[Window]:
    """An epoch's windows: the blocks permuted (``shuffle``) or in storage order, grouped into
    windows of at least ``window_rows`` rows (the last may be smaller)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(blocks)) if shuffle \
        else np.arange(len(blocks))
    windows: list[Window] = []
    current: list[int] = []
    rows = start = 0
    for k in order.tolist():
        current.append(k)
        rows += blocks[k].rows
        if rows >= window_rows:
            windows.append(Window(len(windows), start, tuple(current), rows))
            start, current, rows = start + rows, [], 0
    if current:
        windows.append(Window(len(windows), start, tuple(current), rows))
    return windows


def window_permutation(window: Window, *, seed: int, epoch: int) -> np.ndarray:
    """The order of a shuffled window's rows (its own seed: a rank skips windows it needs
    nothing from without drawing their permutations)."""
    return np.random.default_rng([seed, epoch, window.number + 1]).permutation(window.rows)


class _InMemory:
    """The whole dataset in one set of arrays (blocks in storage order): a window of it
    addressed through its blocks' storage offsets."""

    def __init__(self, data: Arrays, blocks: Sequence[Piece], window: Window) -> None:
        self.data = data
        starts = np.concatenate([[0], np.cumsum([b.rows for b in blocks])[:-1]])
        first = window.blocks[0]
        ordered = window.blocks == tuple(range(first, first + len(window.blocks)))
        self.storage = None if ordered else np.concatenate(
            [np.arange(starts[k], starts[k] + blocks[k].rows) for k in window.blocks])
        self.offset = int(starts[first]) if ordered else 0

    def take(self, index: np.ndarray) -> Arrays:
        where = np.sort(self.storage[index]) if self.storage is not None else index + self.offset
        return _take(self.data, where)

    def slice(self, lo: int, hi: int) -> Arrays:
        if self.storage is None:
            return {k: v[lo + self.offset:hi + self.offset] for k, v in self.data.items()}
        return self.take(np.arange(lo, hi))


def rank_batches(read_block: Callable[[int], Arrays], windows: Sequence[Window], *,
                 batch_size: int, size: int, rank: int, start: int, steps: int,
                 shuffle: bool, seed: int, epoch: int,
                 in_memory: Optional[Callable[[Window], Any]] = None) -> Iterator[Arrays]:
    """Rank ``rank``'s ``steps`` batches of an epoch from position ``start``: at step ``t`` the
    rows ``[start + (t*size + rank)*b, +b)`` of ``S`` (:mod:`sparkhvd.data.sharding`).

    ``read_block(k)`` reads block ``k``; ``in_memory(window)``, when the data is held in
    memory, addresses a window without reading. A batch that spans two windows is gathered
    from both; a window none of this rank's batches touches is not read.
    """
    b = batch_size
    t = 0
    pending: list[Arrays] = []
    for w in windows:
        if t >= steps:
            return
        end = w.start + w.rows
        if end <= start + (t * size + rank) * b:
            continue  # before this rank's next batch: not read
        view = in_memory(w) if in_memory is not None else \
            _Window([read_block(k) for k in w.blocks])
        perm = window_permutation(w, seed=seed, epoch=epoch) if shuffle else None
        while t < steps:
            lo = start + (t * size + rank) * b
            a, z = max(lo, w.start), min(lo + b, end)
            if a >= end:
                break
            if perm is not None:
                pending.append(view.take(np.sort(perm[a - w.start:z - w.start])))
            else:
                pending.append(view.slice(a - w.start, z - w.start))
            if lo + b > end:
                break  # the rest of this batch is in the next window
            yield _concat(pending)
            pending = []
            t += 1
