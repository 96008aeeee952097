"""Rank side of :class:`~sparkhvd.data.DataFrameDataset`: the global order, a window at a time.

The order itself is the policy in :mod:`sparkhvd.data.sharding`: blocks (the Parquet row
groups) permuted per epoch, grouped into windows of at least ``window_rows`` rows, each
window's rows permuted, cut into micro-batches that the ranks take in turn.
:func:`plan_epoch` lays an epoch's windows out; :func:`rank_batches` yields one rank's batches:
it reads a window's blocks (one row group each; one pyarrow scan per file for all of a window's
row groups in it, through :mod:`sparkhvd.storage` for remote caches: range reads, never a whole
file), gathers its micro-batches from them (:data:`GATHER_BATCHES` at a time), and drops the
window before reading the next.

Every rank reads every window that holds one of its batches -- with windows of at least
``size * batch_size`` rows, all of them: a rank decodes the whole dataset each epoch and keeps
its share. That is the price of an order that does not depend on the number of ranks (Mosaic
pays it as a local disk cache). Peak memory while streaming: one window of rows (about
``window_rows``) + the batches being gathered; in memory: the whole dataset, read once.

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
    """Reads pieces of the materialised files (pyarrow datasets, one fragment per Parquet
    file; remote files through one open fsspec handle each)."""

    def __init__(self, files: Sequence[str], stored: dict[str, str],
                 storage_options: Optional[dict], convert: Callable[[str, Any, int], np.ndarray]):
        self.files = list(files)
        self.stored = stored
        self.storage_options = storage_options
        self.convert = convert
        self._open: dict[int, Any] = {}
        self._handles: list[Any] = []

    def _fragment(self, index: int) -> Any:
        """File ``index`` as a pyarrow dataset fragment (its footer read once)."""
        import pyarrow.dataset as pds

        fragment = self._open.get(index)
        if fragment is None:
            from sparkhvd import storage

            loc = storage.resolve(self.files[index], self.storage_options)
            if loc.is_local:
                import pyarrow.fs as pafs

                fragment = pds.ParquetFileFormat().make_fragment(
                    loc.path, filesystem=pafs.LocalFileSystem())
            else:
                handle = loc.fs.open(loc.path, "rb")
                self._handles.append(handle)
                fragment = pds.ParquetFileFormat().make_fragment(handle)
            fragment.ensure_complete_metadata()
            self._open[index] = fragment
        return fragment

    def read(self, piece: Piece) -> Arrays:
        """The piece's rows as numpy arrays, by column name."""
        return self.read_many([piece])[0]

    def read_many(self, pieces: Sequence[Piece]) -> list[Arrays]:
        """Several pieces, with one scan per file for all of them (a scan per row group cost
        twice pyarrow's own read of the same rows), in the order given."""
        by_file: dict[int, list[int]] = {}
        for i, piece in enumerate(pieces):
            by_file.setdefault(piece.file, []).append(i)
        found: list[Any] = [None] * len(pieces)
        columns = list(self.stored.values())
        for file, indices in by_file.items():
            fragment = self._fragment(file)
            groups = sorted({pieces[i].group for i in indices})
            table = fragment.subset(row_group_ids=groups).to_table(columns=columns)
            starts, offset = {}, 0
            for g in groups:
                starts[g] = offset
                offset += fragment.row_groups[g].num_rows
            for i in indices:
                piece = pieces[i]
                part = table.slice(starts[piece.group] + piece.lo, piece.rows)
                found[i] = {name: self.convert(name, part.column(col), piece.rows)
                            for name, col in self.stored.items()}
        return found

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
        self.starts = np.concatenate([[0], self.ends[:-1]])

    def take(self, index: np.ndarray) -> Arrays:
        """Rows at positions ``index``, in that order: one gather per piece for all of them
        (a window's worth of batches at once costs a few calls per batch, not one per piece)."""
        if len(self.parts) == 1:
            return _take(self.parts[0], index)
        which = np.searchsorted(self.ends, index, side="right")
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(self.parts) + 1))
        out = {k: np.empty((len(index),) + v.shape[1:], v.dtype)
               for k, v in self.parts[0].items()}
        for p, part in enumerate(self.parts):
            chosen = order[bounds[p]:bounds[p + 1]]
            if len(chosen):
                local = index[chosen] - self.starts[p]
                for k, v in part.items():
                    out[k][chosen] = v[local]
        return out

    def slice(self, lo: int, hi: int) -> Arrays:
        """Rows ``[lo, hi)``: views when they lie in one piece."""
        i = int(np.searchsorted(self.ends, lo, side="right"))
        first = int(self.starts[i])
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


class InMemoryWindow:
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
        where = self.storage[index] if self.storage is not None else index + self.offset
        return _take(self.data, where)

    def slice(self, lo: int, hi: int) -> Arrays:
        if self.storage is None:
            return {k: v[lo + self.offset:hi + self.offset] for k, v in self.data.items()}
        return self.take(np.arange(lo, hi))


#: Batches gathered from a window in one go (a few numpy calls per piece for all of them).
GATHER_BATCHES = 16


def rank_batches(read_blocks: Callable[[Sequence[int]], list[Arrays]],
                 windows: Sequence[Window], *,
                 batch_size: int, size: int, rank: int, start: int, steps: int,
                 shuffle: bool, seed: int, epoch: int,
                 in_memory: Optional[Callable[[Window], Any]] = None) -> Iterator[Arrays]:
    """Rank ``rank``'s ``steps`` batches of an epoch from position ``start``: at step ``t`` the
    rows ``[start + (t*size + rank)*b, +b)`` of ``S`` (:mod:`sparkhvd.data.sharding`).

    ``read_blocks(ks)`` reads blocks ``ks``; ``in_memory(window)``, when the data is held in
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
        view = in_memory(w) if in_memory is not None else _Window(read_blocks(w.blocks))
        perm = window_permutation(w, seed=seed, epoch=epoch) if shuffle else None
        segments = []  # (rows of S in this window, whether the batch ends here)
        u = t
        while u < steps:
            lo = start + (u * size + rank) * b
            a, z = max(lo, w.start), min(lo + b, end)
            if a >= end:
                break
            segments.append((a - w.start, z - w.start, lo + b <= end))
            if lo + b > end:
                break
            u += 1
        for first in range(0, len(segments), GATHER_BATCHES):
            chunk = segments[first:first + GATHER_BATCHES]
            if perm is not None:  # each batch's rows in storage order: faster gathers
                rows = view.take(np.concatenate([np.sort(perm[a:z]) for a, z, _ in chunk]))
                offsets = np.cumsum([0] + [z - a for a, z, _ in chunk])
                parts = [{k: v[o:e] for k, v in rows.items()}
                         for o, e in zip(offsets[:-1], offsets[1:])]
            else:
                parts = [view.slice(a, z) for a, z, _ in chunk]
            for part, (_, _, ends_here) in zip(parts, chunk):
                pending.append(part)
                if ends_here:
                    yield _concat(pending)
                    pending = []
                    t += 1
