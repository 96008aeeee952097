"""Rank side of :class:`~sparkhvd.data.DataFrameDataset`: one rank's batches of the global
order, reading only the partitions it takes rows from.

The order itself is :mod:`sparkhvd.data.order` (the why in :mod:`sparkhvd.data.sharding`):
each partition's epoch sequence is a list of windows, and the ranks' positions map to
``(partition, row of its sequence)``. :func:`rank_batches` walks one rank's positions a few
batches at a time (:data:`GATHER_BATCHES`): it opens the windows of its partitions those
positions reach -- all of them in one read (:class:`ShardReader`: one pyarrow scan per file,
range reads through :mod:`sparkhvd.storage` for remote caches, never a whole file) -- gathers
the rows, and drops each window once its partition's sequence has moved past it.

A rank reads only its partitions (its share: ``size`` divides ``P``), plus the row groups
split by a partition boundary. Peak memory while streaming: a window of each partition it
reads (about ``window_rows / size`` rows, at least ``window_rows / 8`` dealt) and the batches
being gathered; when its share is kept in memory, the share. :func:`dealt_batches` reads a
rank's span of an epoch dealt to a number of ranks the round robin does not serve
(:mod:`sparkhvd.data.deal`) the same way.
"""
from __future__ import annotations

import contextlib
import functools
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Mapping, Optional, Sequence

import numpy as np

from sparkhvd.common.patches import forbid_pickled_arrow_types
from sparkhvd.data.order import Piece, Window, rank_positions, window_permutation
from sparkhvd.data.row_group_cache import RowGroupCache
from sparkhvd.data.sharding import footer_size

__side__ = "rank"

Arrays = dict[str, np.ndarray]


def numpy_of(array: Any) -> np.ndarray:
    """An Arrow array's values as numpy: a read-only view of its buffer where it is a numeric
    array without nulls -- pyarrow's own ``to_numpy`` gives the same view, but first imports
    pandas (250 module files, 8 MB read at a rank's first batch, for nothing) -- else pyarrow's
    conversion."""
    import pyarrow as pa

    kind = array.type
    code = "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) \
        else "u" if pa.types.is_unsigned_integer(kind) else None
    if code is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(f"<{code}{kind.bit_width // 8}")
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                         offset=array.offset * dtype.itemsize)


class ShardReader:
    """Reads pieces of the materialised files (remote files through one open fsspec handle
    each). ``bytes_read`` counts the column chunks' stored bytes of every row group it read,
    and each footer it read.

    Each read opens its own ``pyarrow.parquet.ParquetFile`` over the file (from the footer
    already read: no request) and drops it after: a ``ParquetFile`` read with ``pre_buffer``
    keeps the raw bytes of every row group it read for as long as it lives, and one kept open
    for an epoch held a rank's kept share twice more (B14: peak RSS 3.0-3.7x the share).

    ``footers`` (file -> its metadata) outlives the reader: the shard keeps it for the run, so a
    rank reads each file's footer once however many epochs (each a new reader) it reads --
    10,000 files on ``abfss://`` are 10,000 requests per rank."""

    def __init__(self, files: Sequence[str], stored: dict[str, str],
                 storage_options: Optional[dict], convert: Callable[[str, Any, int], np.ndarray],
                 on_read: Optional[Callable[[int], None]] = None,
                 footers: Optional[dict[int, Any]] = None,
                 cache: Optional[RowGroupCache] = None,
                 on_host_read: Optional[Callable[[int], None]] = None,
                 copies: bool = False,
                 on_driver_read: Optional[Callable[[int], None]] = None):
        self.files = list(files)
        #: row groups kept on this host (:mod:`sparkhvd.data.row_group_cache`), read before
        #: the files and added to as the files are read
        self.cache = cache
        #: the decoded bytes of the row groups found in ``cache`` (not in ``bytes_read``)
        self.host_bytes_read = 0
        self.on_host_read = on_host_read
        #: whether the row groups are also copied to the driver and read from there
        #: (:func:`sparkhvd.data.row_group_cache.copies_for`), and the bytes read there (not
        #: in ``host_bytes_read``)
        self.copies = copies
        self.driver_bytes_read = 0
        self.on_driver_read = on_driver_read
        self.stored = stored
        self.storage_options = storage_options
        self.convert = convert
        self.on_read = on_read
        self.bytes_read = 0
        self.footers: dict[int, Any] = {} if footers is None else footers
        self._sources: dict[int, Any] = {}  # file -> its path, or its open fsspec handle
        #: file -> (rows, stored bytes of the columns read) of each row group, from its footer
        self._groups: dict[int, tuple[list[int], list[int]]] = {}
        self._handles: list[Any] = []

    def _count(self, stored_bytes: int) -> None:
        self.bytes_read += stored_bytes
        if self.on_read is not None:
            self.on_read(stored_bytes)

    @contextlib.contextmanager
    def _file(self, index: int) -> Iterator[Any]:
        """File ``index`` opened for one read: a new ``ParquetFile`` over the file's source
        (a path, or the fsspec handle kept open) and its footer (read once per run:
        :attr:`footers`), closed after it (see the class docstring)."""
        import pyarrow.parquet as pq

        source = self._sources.get(index)
        if source is None:
            from sparkhvd import storage

            loc = storage.resolve(self.files[index], self.storage_options)
            if loc.is_local:
                source = loc.path
            else:
                # no read-ahead: a rank reads its own row groups, scattered through the file,
                # and adlfs' default cache fetched 4 MB beyond each (B14 measured 1.5x to 9x
                # the share); pyarrow itself coalesces neighbouring column chunks into one read
                source = loc.fs.open(loc.path, "rb", cache_type="none")
                self._handles.append(source)
            self._sources[index] = source
        meta = self.footers.get(index)
        forbid_pickled_arrow_types()  # a schema's pickled extension type is refused, not run
        opened = pq.ParquetFile(source, metadata=meta, pre_buffer=True)
        if meta is None:
            self.footers[index] = meta = opened.metadata
            self._count(footer_size(meta))
        if index not in self._groups:
            self._groups[index] = self._group_sizes(meta)
        try:
            yield opened
        finally:
            opened.close()  # and its pre-buffered bytes with it

    def _group_sizes(self, meta: Any) -> tuple[list[int], list[int]]:
        """Rows and stored bytes of the columns read, per row group (``fragment.row_groups``
        builds every group's statistics on each access: read once here)."""
        wanted = set(self.stored.values())
        rows, stored = [], []
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            rows.append(group.num_rows)
            stored.append(sum(group.column(i).total_compressed_size
                              for i in range(group.num_columns)
                              if group.column(i).path_in_schema.split(".")[0] in wanted))
        return rows, stored

    def schema(self, file: int = 0) -> Any:
        """File ``file``'s Arrow schema, from its footer (no row is read)."""
        with self._file(file) as opened:
            return opened.schema_arrow

    def read(self, piece: Piece) -> Arrays:
        """The piece's rows as numpy arrays, by column name."""
        return self.read_many([piece])[0]

    def read_many(self, pieces: Sequence[Piece]) -> list[Arrays]:
        """Several pieces, with one scan per file for all of them (a scan per row group cost
        twice pyarrow's own read of the same rows), in the order given. A row group two pieces
        share is read once."""
        by_file: dict[int, list[int]] = {}
        for i, piece in enumerate(pieces):
            by_file.setdefault(piece.file, []).append(i)
        found: list[Any] = [None] * len(pieces)
        columns = list(self.stored.values())
        for file, indices in by_file.items():
            groups = sorted({pieces[i].group for i in indices})
            tables = self._cached(file, columns, groups)
            missing = [g for g in groups if g not in tables]
            if missing:
                with self._file(file) as opened:
                    table = opened.read_row_groups(missing, columns=columns)
                rows, stored = self._groups[file]
                self._count(sum(stored[g] for g in missing))
                offset = 0
                for g in missing:
                    tables[g] = table.slice(offset, rows[g])
                    offset += rows[g]
                    if self.cache is not None:
                        self.cache.keep(self.files[file], columns, g, tables[g],
                                        copies=self.copies)
            for i in indices:
                piece = pieces[i]
                part = tables[piece.group].slice(piece.lo, piece.rows)
                found[i] = {name: self.convert(name, part.column(col), piece.rows)
                            for name, col in self.stored.items()}
        return found

    def _cached(self, file: int, columns: list[str], groups: list[int]) -> dict[int, Any]:
        """The row groups of ``groups`` kept on this host or copied to the driver (none
        without a cache)."""
        if self.cache is None:
            return {}
        tables, from_driver = self.cache.find(self.files[file], columns, groups,
                                              copies=self.copies)
        driver = sum(tables[g].nbytes for g in from_driver)
        host = sum(t.nbytes for t in tables.values()) - driver
        self.host_bytes_read += host
        self.driver_bytes_read += driver
        if host and self.on_host_read is not None:
            self.on_host_read(host)
        if driver and self.on_driver_read is not None:
            self.on_driver_read(driver)
        return tables

    def close(self) -> None:
        """Close the open remote files (they hold connections)."""
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.close()
        self._handles.clear()
        self._sources.clear()


#: A streamed window's pieces smaller than this are copied together into blocks of about
#: this size (:class:`WindowRows`).
MERGE_BYTES = 4 << 20


class WindowRows:
    """A window's rows as its pieces were read (this window, or the rank's kept share),
    addressed as one range without copying them together (a window of ~64 MB copied into one
    array cost as much as reading it, and a kept share copied together held twice its size
    while it was).

    ``merge`` (a streamed window, which owns its pieces): runs of pieces smaller than
    :data:`MERGE_BYTES` are copied into blocks of about that size first. A gather costs a few
    numpy calls per piece it takes rows from, so a window of many small row groups (a small
    table is written in small ones) cost three times the read in gathers; a block copy is a
    fraction of it."""

    def __init__(self, parts: list[Arrays], merge: bool = False) -> None:
        if merge and len(parts) > 1:
            parts = _merged(parts)
        self.parts = parts
        self.ends = np.cumsum([len(next(iter(p.values()))) for p in parts])
        self.starts = np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    def take(self, index: np.ndarray, out: Arrays, where: np.ndarray) -> None:
        """Rows at window positions ``index`` into ``out[k][where]``: one gather per piece, each
        reading its rows in memory order (a random order read a third slower)."""
        order = np.argsort(index, kind="stable")
        index, where = index[order], where[order]
        bounds = [0, *np.searchsorted(index, self.starts[1:]).tolist(), len(index)]
        for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if hi > lo:
                local = index[lo:hi] - self.starts[p]
                for k, v in self.parts[p].items():
                    out[k][where[lo:hi]] = v[local]


def _merged(parts: list[Arrays]) -> list[Arrays]:
    """``parts`` with each run of small ones copied together (see :class:`WindowRows`)."""
    out: list[Arrays] = []
    run: list[Arrays] = []
    held = 0

    def flush() -> None:
        nonlocal held
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append({k: np.concatenate([p[k] for p in run]) for k in run[0]})
        run.clear()
        held = 0

    for part in parts:
        size = sum(v.nbytes for v in part.values())
        if size >= MERGE_BYTES:
            flush()
            out.append(part)
            continue
        run.append(part)
        held += size
        if held >= MERGE_BYTES:
            flush()
    flush()
    return out


#: Batches gathered in one go (a few numpy calls per window for all of them).
GATHER_BATCHES = 16

#: Opens windows: ``open_windows(ws)`` -> one view per window (``take``), read together.
WindowOpener = Callable[[Sequence[Window]], Sequence[Any]]


@dataclass(frozen=True)
class Chunk:
    """:data:`GATHER_BATCHES` steps (or fewer) of one rank: its positions' partitions and
    rows there, and the windows that must be opened first."""

    steps: int
    part: np.ndarray
    row: np.ndarray
    due: tuple[Window, ...]


def chunks(plans: Mapping[int, Sequence[Window]], *, partitions: int, batch_size: int,
           size: int, rank: int, start: int, first_step: int, steps: int) -> Iterator[Chunk]:
    """Rank ``rank``'s steps ``[first_step, steps)`` of an epoch begun (or resumed) at position
    ``start``, a chunk at a time (:func:`~sparkhvd.data.order.rank_positions`), each with the
    windows its positions reach first. Windows before the (resumed) start are never due."""
    upcoming = {c: 0 for c in plans}
    for chunk_start in range(first_step, steps, GATHER_BATCHES):
        count = min(GATHER_BATCHES, steps - chunk_start)
        pos = rank_positions(start, chunk_start, count, batch_size=batch_size, size=size,
                             rank=rank)
        part, row = pos % partitions, pos // partitions
        due: list[Window] = []
        for c in np.unique(part).tolist():
            if c not in plans:
                raise AssertionError(f"position in partition {c}, which rank {rank} of {size} "
                                     "does not read")
            rows_c = row[part == c]
            lowest, highest = int(rows_c.min()), int(rows_c.max())
            windows = plans[c]
            while upcoming[c] < len(windows) and windows[upcoming[c]].end <= lowest:
                upcoming[c] += 1
            while upcoming[c] < len(windows) and windows[upcoming[c]].start <= highest:
                due.append(windows[upcoming[c]])
                upcoming[c] += 1
        yield Chunk(count, part, row, tuple(due))


class ReadAhead:
    """Opens groups of windows in order on a helper thread, ahead of the one in use: the next
    windows are read while the rank gathers (and trains on) the current ones. pyarrow reads
    without the GIL; at most one group is read or waiting beyond those in use.

    ``due[i]`` is the chunk of the rank's walk that takes group ``i``; the consumer says where
    it is (:meth:`at`). Group ``i`` is read once group ``i - 1`` is taken and the consumer is
    halfway from that chunk to group ``i``'s: an attempt that stops (a resize, a failure) has
    read, on average, half a group it never used rather than a whole one -- what the next
    attempt reads again -- while the read still has half a group's training to hide behind."""

    def __init__(self, groups: Sequence[Sequence[Window]], open_windows: WindowOpener,
                 due: Sequence[int]) -> None:
        self._groups = list(groups)
        self._open = open_windows
        self._from = [0] + [(a + b) // 2 for a, b in zip(due, due[1:])]
        self._ready: queue.Queue = queue.Queue()
        self._taken = 0  # groups handed out by next()
        self._chunk = 0  # the consumer's chunk (at())
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="sparkhvd-data-read-ahead")
        self._thread.start()

    def _run(self) -> None:
        for i, group in enumerate(self._groups):
            with self._changed:
                self._changed.wait_for(functools.partial(self._may_read, i))
                if self._stopped:
                    return
            try:
                self._ready.put(self._open(group))
            except BaseException as exc:  # noqa: BLE001 - raised in the reading thread
                self._ready.put(exc)
                return

    def _may_read(self, i: int) -> bool:
        """Whether group ``i`` may be read now (or the reading stops); under ``_changed``."""
        return self._stopped or (self._taken >= i and self._chunk >= self._from[i])

    def at(self, chunk: int) -> None:
        """The consumer is at ``chunk`` of its walk."""
        with self._changed:
            self._chunk = chunk
            self._changed.notify_all()

    def next(self) -> Sequence[Any]:
        """The next group's views (an error of reading them is raised here)."""
        item = self._ready.get()
        with self._changed:
            self._taken += 1
            self._changed.notify_all()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop reading ahead; returns once the helper thread no longer uses the reader."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._thread.join()


def rank_batches(plans: Mapping[int, Sequence[Window]], open_windows: WindowOpener, *,
                 partitions: int, batch_size: int, size: int, rank: int, start: int,
                 first_step: int, steps: int, shuffle: bool, seed: int, epoch: int,
                 read_ahead: bool = False) -> Generator[Arrays, None, None]:
    """Rank ``rank``'s batches at steps ``[first_step, steps)`` of an epoch begun (or resumed)
    at position ``start``, each batch's rows in position order.

    ``plans``: the windows of each partition this rank reads (its epoch sequence). A window
    is opened when a position first reaches it (windows of several partitions that come due
    together are read together; ``read_ahead``: on a helper thread, from halfway through the
    group before, :class:`ReadAhead`) and dropped once the positions have passed its end.
    """
    def walk() -> Iterator[Chunk]:
        return chunks(plans, partitions=partitions, batch_size=batch_size, size=size,
                      rank=rank, start=start, first_step=first_step, steps=steps)

    ahead = None
    if read_ahead:
        due = [(k, c.due) for k, c in enumerate(walk()) if c.due]
        ahead = ReadAhead([d for _, d in due], open_windows, [k for k, _ in due])
    live: dict[int, list[tuple[Window, Any, Optional[np.ndarray]]]] = {c: [] for c in plans}
    b = batch_size
    try:
        for k, chunk in enumerate(walk()):
            if ahead is not None:
                ahead.at(k)
            if chunk.due:
                views = ahead.next() if ahead is not None else open_windows(chunk.due)
                for window, view in zip(chunk.due, views):
                    perm = window_permutation(window, seed=seed, epoch=epoch) if shuffle \
                        else None
                    live[window.partition].append((window, view, perm))
            out = _gather(chunk, live)
            for t in range(chunk.steps):
                yield {k: v[t * b:(t + 1) * b] for k, v in out.items()}
    finally:
        if ahead is not None:
            ahead.close()


def _gather(chunk: Chunk, live: dict[int, list[tuple[Window, Any, Optional[np.ndarray]]]]
            ) -> Arrays:
    """The chunk's rows, in position order, from the open windows (dropping those passed)."""
    out: Optional[Arrays] = None
    for c in np.unique(chunk.part).tolist():
        mask = chunk.part == c
        where_c = np.flatnonzero(mask)
        rows_c = chunk.row[mask]
        lowest = int(rows_c.min())
        live[c] = [entry for entry in live[c] if entry[0].end > lowest]
        for window, view, perm in live[c]:
            inside = (rows_c >= window.start) & (rows_c < window.end)
            if not inside.any():
                continue
            local = rows_c[inside] - window.start
            if perm is not None:
                local = perm[local]
            if out is None:
                out = _empty_like(view, len(chunk.part))
            view.take(local, out, where_c[inside])
    assert out is not None
    return out


def _empty_like(view: WindowRows, n: int) -> Arrays:
    sample = view.parts[0]
    return {k: np.empty((n,) + v.shape[1:], v.dtype) for k, v in sample.items()}


@dataclass(frozen=True)
class DealtChunk:
    """:data:`GATHER_BATCHES` steps (or fewer) of a rank of a deal
    (:mod:`sparkhvd.data.deal`): each row's window and place in it, the windows that must be
    opened first and those no row after this chunk needs."""

    sizes: tuple[int, ...]
    window: np.ndarray
    place: np.ndarray
    due: tuple[int, ...]
    done: tuple[int, ...]


def dealt_chunks(span: Sequence[Any], windows: Sequence[Sequence[Any]],
                 rank_rows: Callable[[int], int], first_step: int, steps: int
                 ) -> Iterator[DealtChunk]:
    """A rank's steps ``[first_step, steps)`` of a deal, a chunk at a time: ``span`` its units,
    ``windows[k]`` unit ``k``'s windows (numbered in that order across the units: window
    ``w`` is ``flat[w]``), ``rank_rows(s)`` the rows of its first ``s`` steps."""
    from sparkhvd.data.deal import rank_rows_between

    ids, starts = [], []  # per unit: its windows' numbers, and where each starts in its sequence
    count = 0
    for unit_windows in windows:
        ids.append(np.arange(count, count + len(unit_windows)))
        starts.append(np.cumsum([0] + [w.rows for w in unit_windows]))
        count += len(unit_windows)
    opened: set[int] = set()
    for s0 in range(first_step, steps, GATHER_BATCHES):
        s1 = min(steps, s0 + GATHER_BATCHES)
        unit, place = rank_rows_between(span, rank_rows(s0), rank_rows(s1))
        window = np.empty(len(unit), dtype=np.int64)
        local = np.empty(len(unit), dtype=np.int64)
        passed: list[int] = []
        for k in np.unique(unit).tolist():
            mask = unit == k
            at = np.searchsorted(starts[k], place[mask], side="right") - 1
            window[mask] = ids[k][at]
            local[mask] = place[mask] - starts[k][at]
            # the unit's later rows lie past its highest place here
            ends = starts[k][1:]
            passed += ids[k][ends <= int(place[mask].max()) + 1].tolist()
        due = tuple(dict.fromkeys(w for w in window.tolist() if w not in opened))
        opened.update(due)
        done = [w for w in passed if w in opened]
        yield DealtChunk(tuple(rank_rows(s + 1) - rank_rows(s) for s in range(s0, s1)),
                         window, local, due, tuple(done))
        opened.difference_update(done)


def dealt_batches(span: Sequence[Any], windows: Sequence[Sequence[Any]],
                  open_windows: Callable[[Sequence[Any]], Sequence[Any]],
                  rank_rows: Callable[[int], int], *, first_step: int, steps: int,
                  read_ahead: bool = False) -> Generator[Arrays, None, None]:
    """A rank's batches at steps ``[first_step, steps)`` of a deal (see :func:`dealt_chunks`),
    each batch's rows in the rank's sequence. A window is opened (``open_windows``: views with
    ``take``, read together; ``read_ahead``: on a helper thread, from halfway through the
    group before, :class:`ReadAhead`) when a row first reaches it and dropped once no later
    row needs it."""
    from sparkhvd.data.deal import permutation

    flat = [w for unit_windows in windows for w in unit_windows]

    def walk() -> Iterator[DealtChunk]:
        return dealt_chunks(span, windows, rank_rows, first_step, steps)

    ahead = None
    if read_ahead:
        due = [(k, [flat[w] for w in c.due]) for k, c in enumerate(walk()) if c.due]
        ahead = ReadAhead([d for _, d in due], open_windows, [k for k, _ in due])
    live: dict[int, tuple[Any, Optional[np.ndarray]]] = {}
    try:
        for k, chunk in enumerate(walk()):
            if ahead is not None:
                ahead.at(k)
            if chunk.due:
                due = [flat[w] for w in chunk.due]
                views = ahead.next() if ahead is not None else open_windows(due)
                for w, view in zip(chunk.due, views):
                    live[w] = (view, permutation(flat[w]))
            out: Optional[Arrays] = None
            for w in np.unique(chunk.window).tolist():
                where = np.flatnonzero(chunk.window == w)
                view, perm = live[w]
                local = chunk.place[where]
                if perm is not None:
                    local = perm[local]
                if out is None:
                    out = _empty_like(view, len(chunk.window))
                view.take(local, out, where)
            for w in chunk.done:
                live.pop(w, None)
            assert out is not None
            at = 0
            for rows in chunk.sizes:
                yield {k: v[at:at + rows] for k, v in out.items()}
                at += rows
    finally:
        if ahead is not None:
            ahead.close()
