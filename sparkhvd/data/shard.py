"""The rank half of ``DataFrameDataset``: this rank's part of each epoch's global order.

A rank's function receives a :class:`DatasetShard` where the driver passed a
``DataFrameDataset`` (the runner prepares it, :mod:`sparkhvd.driver.arguments`): the same
reading methods -- :meth:`~DatasetShard.torch_batches`, :meth:`~DatasetShard.tf_dataset`,
:meth:`~DatasetShard.batches`, :meth:`~DatasetShard.steps_per_epoch` -- over a
:class:`~sparkhvd.data.sharding.ShardSource` (the order policy there; reading a window at a
time in :mod:`sparkhvd.data.reader`).

The shard knows where the ranks are in the order (:attr:`DatasetShard.position`, updated as
batches are handed out) and can continue from a saved position (:meth:`load_state_dict`):
the checkpoint helpers save and restore it with the model.
"""
from __future__ import annotations

import logging
from typing import Any, Generator, Iterator, Optional

import numpy as np

from sparkhvd.common.identity import current_rank, rank_hosts
from sparkhvd.data import row_group_cache
from sparkhvd.data.deal import (
    Deal,
    Sequences,
    Unit,
    by_host,
    deal,
    left_after,
    left_by_rank,
    units_at,
)
from sparkhvd.data.footers import footer_of
from sparkhvd.data.framework_batches import FrameworkBatches
from sparkhvd.data.order import (
    ORDER_VERSION,
    Piece,
    blocks_of,
    layout,
    owned_partitions,
    partition_window_rows,
    plan_partition,
    round_robin,
)
from sparkhvd.data.position import (
    EpochPlan,
    Position,
    check_resumable,
    resume_order,
    source_key,
)
from sparkhvd.data.reader import (
    Arrays,
    ShardReader,
    WindowRows,
    dealt_batches,
    numpy_of,
    rank_batches,
)
from sparkhvd.data.sharding import (
    ShardSource,
    lead_in,
    left_out,
    steps_from,
)

__side__ = "rank"

log = logging.getLogger(__name__)


class DatasetShard(FrameworkBatches):
    """This rank's view of a ``DataFrameDataset`` (see the module docstring).

    A rank reads only the partitions its positions fall in. When those rows fit
    ``memory_cache`` bytes it reads them once and keeps them; otherwise it streams them a
    window at a time, every epoch.
    """

    def __init__(self, source: ShardSource) -> None:
        self.source = source
        #: Bytes a rank may keep in memory (from the dataset; may be changed): its share is
        #: kept when it fits, and a dataset that fits is shuffled one window per partition.
        self.memory_cache = source.memory_cache
        self._blocks = blocks_of(source.row_groups)
        self._layouts: dict[tuple, list[tuple[Piece, ...]]] = {}
        #: The rows this rank keeps: (layout key, partitions) -> partition -> its pieces' rows.
        self._kept: Optional[tuple[tuple, dict[int, list[Arrays]]]] = None
        #: The row groups this rank keeps in a dealt epoch: (file, row group) -> its rows.
        self._kept_groups: dict[tuple[int, int], Arrays] = {}
        #: epoch -> how this rank handed it out last (the newest few epochs): the position
        #: after any of its steps follows from it (:meth:`position_at`)
        self._plans: dict[int, EpochPlan] = {}
        self._resume: Optional[Position] = None
        #: the position restored (:meth:`load_state_dict`), kept: where this shard began
        self._restored: Optional[Position] = None
        #: (the first epoch whose plan is still kept, the steps of the epochs before it since
        #: this shard began): where :meth:`position_after` counts on from (None: from the start)
        self._passed: Optional[tuple[int, int]] = None
        self._restored_epoch = 0
        #: the table's layout, saved with every position (:func:`source_key`)
        self._source_key = source_key(source.files, source.row_groups)
        #: Where the ranks are after the last batch this rank handed out (None before any):
        #: what :meth:`state_dict` returns.
        self.position: Optional[Position] = None
        #: Stored bytes of the row groups and footers this shard has read so far (what crossed
        #: from the files or the blob store, before decoding): about ``1 / size`` of the data
        #: an epoch, once in all when the rank keeps its share in memory; each footer once.
        self.bytes_read = 0
        #: Decoded bytes of the row groups this shard found kept on its host instead
        #: (:mod:`sparkhvd.data.row_group_cache`: what a rank of an earlier attempt read).
        self.host_bytes_read = 0
        #: Decoded bytes of the row groups this shard read from the driver's copies (a small
        #: table on a cluster, after a resize or a relaunch: rows no rank on its host kept).
        self.driver_bytes_read = 0
        #: file -> its Parquet metadata, read once for the run (every epoch's reader uses it),
        #: or shipped by the driver with the source (not read here at all)
        self._footers: dict[int, Any] = {i: footer_of(meta)
                                         for i, meta in enumerate(source.footers)}

    @property
    def features(self) -> list[str]:
        return list(self.source.features)

    @property
    def label(self) -> Optional[str]:
        return self.source.label

    @property
    def columns(self) -> list[str]:
        return self.source.columns

    @property
    def shapes(self) -> dict:
        return dict(self.source.shapes)

    @property
    def num_rows(self) -> int:
        return self.source.num_rows

    @property
    def storage_options(self) -> dict:
        return dict(self.source.storage_options)

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None) -> int:
        """Full batches every rank runs in a whole epoch (the same on all ranks)."""
        return self.source.steps_per_epoch(batch_size, size)

    def steps_in_epoch(self, batch_size: int, epoch: int, size: Optional[int] = None) -> int:
        """Batches every rank runs in ``epoch``: at most :meth:`steps_per_epoch` in the epoch a
        restored position continues (a lead-in step first when the position is off this
        size's step boundaries: :mod:`sparkhvd.data.sharding`)."""
        n_size = current_rank().size if size is None else size
        if self._resume is not None and self._resume.epoch == epoch:
            if self._resume.deal is not None:
                return deal(self._left_of(self._resume), size=n_size, batch=batch_size,
                            num_rows=self.num_rows).total_steps
            return steps_from(self.num_rows, self._resume.samples, batch_size, n_size)
        return self.source.steps_per_epoch(batch_size, n_size)

    @staticmethod
    def _left_of(position: Position) -> list[Unit]:
        """What is left of a dealt epoch at ``position``."""
        assert position.deal is not None
        return left_after(Deal.of(position.deal), position.step - int(position.deal["step0"]))


    @property
    def partitions(self) -> int:
        """``P``: the partitions the order is cut into (fixed with the dataset)."""
        return self.source.partitions

    def rank_bytes(self, size: Optional[int] = None) -> int:
        """About how many bytes of rows a rank holds while reading (its share when kept in
        memory, else a shuffle window of each partition it reads)."""
        n_size = current_rank().size if size is None else size
        return self.source.rank_bytes(n_size, self.memory_cache)

    # -- position ------------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The position after the last batch handed out (plain data; None before any)."""
        return self.position.as_dict() if self.position is not None else None

    def position_at(self, epoch: int, step: int = 0) -> Optional[Position]:
        """The position after step ``step`` of ``epoch`` (0: at the epoch's start, dealt anew
        when it begins) -- what a checkpoint taken there saves. In the epoch this rank is
        reading, where it is (a step that is not its step is said: the checkpoint keeps where
        the data is); in another epoch it handed out, as it handed that one out. None before
        any batch was handed out."""
        last = self.position
        if last is None:
            return None
        if step == 0:
            return last.at_epoch_start(epoch)
        plan = self._plans.get(epoch)
        if last.epoch != epoch and plan is not None and plan.step0 <= step <= plan.last_step:
            return plan.position(step)
        if (last.epoch, last.step) != (epoch, step):
            log.warning("A checkpoint of step %d of epoch %d saves the data's position as it "
                        "is: step %d of epoch %d (pass the data's own step, data.position.step, "
                        "or call step() and let the data count).", step, epoch, last.step,
                        last.epoch)
        return last

    def position_after(self, steps: int) -> Optional[Position]:
        """The position after ``steps`` steps trained since this shard began -- at the
        position it was restored to, else at epoch 0 -- for a model fed by a pipeline that runs
        ahead of it (``tf.data``'s prefetch: :attr:`position` is where the reading is, not
        the training). None before any batch was handed out."""
        if self.position is None:
            return None
        epoch = self._restored.epoch if self._restored is not None else 0
        left = steps
        if self._passed is not None and self._passed[0] > epoch:  # epochs whose plans went
            epoch, left = self._passed[0], steps - self._passed[1]
        if left < 0:
            raise ValueError(f"the position after {steps} steps trained is in an epoch this "
                             "rank no longer keeps (the pipeline is more than 3 epochs ahead)")
        while True:
            plan = self._plans.get(epoch)
            if plan is None:
                if left:
                    raise ValueError(f"{steps} steps trained, but this rank handed out no "
                                     f"batch of epoch {epoch}")
                return self.position.at_epoch_start(epoch)
            if left < plan.steps or left == plan.steps == 0:
                if left == 0 and plan.step0 == 0:
                    return self.position.at_epoch_start(epoch)
                return plan.position(plan.step0 + left)
            left -= plan.steps
            epoch += 1

    def begin_at(self, epoch: int) -> None:
        """Begin at the start of ``epoch`` (a checkpoint that kept no position of the data)."""
        self.load_state_dict(Position(epoch, 0).as_dict())

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continue from a saved position: the next :meth:`batches` (or ``torch_batches``,
        ``tf_dataset``) of that epoch starts where it stopped -- with any number of ranks.
        Raises :class:`~sparkhvd.common.errors.DataChanged` when that epoch cannot be
        continued with this dataset (:func:`~sparkhvd.data.position.check_resumable`)."""
        self._passed = None
        if not state:
            self._resume = self._restored = None
            self._restored_epoch = 0
            return
        position = Position.from_dict(state)
        check_resumable(position, source=self._source_key, num_rows=self.num_rows,
                        partitions=self.partitions)
        self._resume = self._restored = position
        self._restored_epoch = position.epoch
        self.position = position

    def _start(self, epoch: int) -> Optional[Position]:
        """The restored position ``epoch`` continues (None: the epoch begins at its start)."""
        resume, self._resume = self._resume, None
        if resume is None or resume.epoch != epoch:
            if resume is not None and resume.epoch > epoch:
                self._resume = resume  # an earlier epoch first: keep it for its own epoch
            return None
        return resume

    def _plan(self, plan: EpochPlan) -> EpochPlan:
        """Keep how ``plan.epoch`` is handed out: the newest few epochs (a pipeline that runs
        ahead of training is at most one epoch on), and of the older ones, the steps they
        held (:attr:`_passed`: :meth:`position_after` counts on from there)."""
        self._plans[plan.epoch] = plan
        for old in sorted(e for e in self._plans if e < plan.epoch - 3):
            gone = self._plans.pop(old)
            start = self._restored.epoch if self._restored is not None else 0
            at, steps = self._passed if self._passed is not None else (start, 0)
            if old == at:  # the oldest epoch of the walk: its steps counted, once
                self._passed = (old + 1, steps + gone.steps)
        return plan

    def _to_numpy(self, name: str, column: Any, n: int) -> np.ndarray:
        import pyarrow as pa

        if hasattr(column, "num_chunks"):  # a ChunkedArray: one chunk needs no copy
            column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        if isinstance(column.type, (pa.ListType, pa.LargeListType)):
            flat = numpy_of(column.flatten())
            if n and flat.size % n:
                raise ValueError(f"Column {name!r} holds arrays of different lengths; every row "
                                 "must have the same length (pad or truncate them).")
            values = flat.reshape(n, -1) if n else flat.reshape(0, 0)
        else:
            values = numpy_of(column)
        cast = self.source.cast.get(name)
        if cast is not None and values.dtype != cast:
            values = values.astype(cast)
        if name in self.shapes:
            values = values.reshape((n,) + self.shapes[name])
        return values

    def _reader(self) -> ShardReader:
        return ShardReader(self.source.files, dict(self.source.stored), self.storage_options,
                           self._to_numpy, on_read=self._count, footers=self._footers,
                           cache=row_group_cache.for_this_rank(),
                           on_host_read=self._count_host,
                           copies=row_group_cache.copies_for(self.source.data_bytes),
                           on_driver_read=self._count_driver)

    def _count(self, stored_bytes: int) -> None:
        self.bytes_read += stored_bytes

    def _count_host(self, decoded_bytes: int) -> None:
        self.host_bytes_read += decoded_bytes

    def _count_driver(self, decoded_bytes: int) -> None:
        self.driver_bytes_read += decoded_bytes

    def streams(self, size: Optional[int] = None) -> bool:
        """Whether this rank streams its rows every epoch (its share is larger than
        ``memory_cache``) rather than reading them once and keeping them."""
        n_size = current_rank().size if size is None else size
        return not self.source.keeps(n_size, self.memory_cache)

    def _shape(self, data: dict[str, np.ndarray]) -> Any:
        columns = {c: data[c] for c in self.features}
        x = columns[self.features[0]] if len(self.features) == 1 else columns
        return (x, data[self.label]) if self.label else x

    def _layout(self, shuffle: bool, seed: int) -> tuple[tuple, list[tuple[Piece, ...]]]:
        key = (shuffle, seed if shuffle else 0)
        parts = self._layouts.get(key)
        if parts is None:
            parts = self._layouts[key] = layout(self._blocks, self.partitions, shuffle=shuffle,
                                                seed=seed)
        return key, parts

    def _keep(self, key: tuple, parts: list[tuple[Piece, ...]], owned: list[int],
              reader: ShardReader) -> dict[int, list[Arrays]]:
        """The rows of partitions ``owned``, read once (in one scan per file) and kept, piece
        by piece as they were read (not copied together)."""
        want = (key, tuple(owned))
        if self._kept is None or self._kept[0] != want:
            self._kept = None  # the old rows go before the new ones are read
            pieces = [p for c in owned for p in parts[c]]
            read = iter(reader.read_many(pieces)) if pieces else iter(())
            kept = {c: [next(read) for _ in parts[c]] for c in owned if parts[c]}
            self._kept = (want, kept)
        return self._kept[1]

    def _epoch(self, batch_size: int, epoch: int, *, shuffle: bool, seed: int, rank: int,
               size: int, start: int, window: int, reader: ShardReader,
               first_step: int = 0, stop_step: Optional[int] = None
               ) -> Generator[Arrays, None, None]:
        steps = steps_from(self.num_rows, start, batch_size, size)
        if stop_step is not None:
            steps = min(steps, stop_step)
        lead = lead_in(self.num_rows, start, batch_size, size)
        key, parts = self._layout(shuffle, seed)
        owned = [c for c in owned_partitions(self.partitions, size, rank) if parts[c]]
        per_partition = partition_window_rows(window, self.partitions)
        plans = {c: plan_partition(parts[c], per_partition, partition=c, shuffle=shuffle,
                                   seed=seed, epoch=epoch) for c in owned}
        self._kept_groups = {}
        if self.streams(size):
            self._kept = None

            def open_windows(windows: Any) -> list[Any]:
                pieces = [parts[w.partition][k] for w in windows for k in w.pieces]
                read = iter(reader.read_many(pieces))
                return [WindowRows([next(read) for _ in w.pieces], merge=True)
                        for w in windows]
        else:
            kept = self._keep(key, parts, owned, reader)

            def open_windows(windows: Any) -> list[Any]:
                return [WindowRows([kept[w.partition][k] for k in w.pieces]) for w in windows]
        def run(rows: int, at: int, first: int, stop: int) -> Generator[Arrays, None, None]:
            return rank_batches(plans, open_windows, partitions=self.partitions,
                                batch_size=rows, size=size, rank=rank, start=at,
                                first_step=first, steps=stop, shuffle=shuffle, seed=seed,
                                epoch=epoch, read_ahead=self.streams(size))

        if not lead:
            yield from run(batch_size, start, first_step, steps)
            return
        # a resize left ``start`` off this size's step boundaries: the lead-in step's rows
        # first (this rank's of them: positions i % size == rank), then full steps
        if first_step == 0 and steps > 0:
            yield from run(len(range((rank - start) % size, lead, size)), start, 0, 1)
        if steps > 1:
            yield from run(batch_size, start + lead, max(0, first_step - 1), steps - 1)

    def batches(self, batch_size: int, epoch: int = 0, *, shuffle: bool = False, seed: int = 0,
                rank: Optional[int] = None, size: Optional[int] = None,
                shuffle_buffer: Optional[int] = None,
                reader: Optional[ShardReader] = None) -> Iterator[Any]:
        """This rank's full batches of ``epoch``: ``(x, y)`` (or ``x`` without a label).

        At each step the ranks' batches together are the next ``size * batch_size`` rows of
        the epoch's one global order (:mod:`sparkhvd.data.sharding`), whatever the number of
        ranks; this rank's are those at the positions ``i % size == rank``, in position order.
        In an epoch a restored position continues (:meth:`load_state_dict`), it starts there.

        Args:
            shuffle: a new global order every epoch, seeded by ``seed`` and the epoch.
            seed: a non-negative int, the same on every rank.
            shuffle_buffer: rows of the order per shuffle window when streaming (spread over
                the partitions; default about 128 MB of rows); the same on every rank and in
                every run that resumes this one.
        """
        yield from self._batches(batch_size, epoch, shuffle=shuffle, seed=seed, rank=rank,
                                 size=size, shuffle_buffer=shuffle_buffer, reader=reader)

    def _batches(self, batch_size: int, epoch: int, *, shuffle: bool, seed: int,
                 rank: Optional[int], size: Optional[int], shuffle_buffer: Optional[int],
                 reader: Optional[ShardReader], steps: Optional[tuple[int, int]] = None
                 ) -> Iterator[Any]:
        """:meth:`batches`; ``steps=(first, stop)`` hands out only those steps of the epoch
        (a ``DataLoader`` worker's part)."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int; got {seed!r}")
        self.source.steps_per_epoch(batch_size, size)  # checks batch_size and the data size
        me = current_rank()
        r = me.rank if rank is None else rank
        n_size = me.size if size is None else size
        window = self.source.window_rows(shuffle_buffer, self.memory_cache)
        resumed = self._start(epoch)
        start, done_before = (resumed.samples, resumed.step) if resumed else (0, 0)
        if resumed is not None:  # the rest of an epoch is read in the order it began in
            shuffle, seed, window = resume_order(resumed, shuffle=shuffle, seed=int(seed),
                                                 window=window, rank=r)
        first, stop = steps if steps is not None else (0, None)
        order = Position(epoch, start, int(seed), shuffle, window, self.num_rows, batch_size,
                         n_size, done_before, self.partitions, order_version=ORDER_VERSION,
                         hosts=rank_hosts(n_size), source=self._source_key)
        if (resumed is not None and resumed.deal is not None) \
                or not round_robin(self.partitions, n_size):
            yield from self._dealt(batch_size, epoch, shuffle=shuffle, seed=int(seed), rank=r,
                                   size=n_size, window=window, start=start, resumed=resumed,
                                   first=first, stop=stop, reader=reader, order=order)
            return
        lead = lead_in(self.num_rows, start, batch_size, n_size)
        plan = self._plan(EpochPlan(epoch, start, done_before,
                                    steps_from(self.num_rows, start, batch_size, n_size),
                                    order, lead=lead))
        skipped = left_out(self.num_rows, start, batch_size, n_size)
        if skipped and r == 0:
            log.warning("Epoch %d resumes at row %d of its order, %d row(s) short of a step "
                        "boundary of %d ranks: too few to give every rank one, so they are "
                        "left out of this epoch (a batch_size of at least %d avoids it).",
                        epoch, start, skipped, n_size, n_size)
        own = reader is None
        reader = reader or self._reader()
        batches = self._epoch(batch_size, epoch, shuffle=shuffle, seed=int(seed), rank=r,
                              size=n_size, start=start, window=window, reader=reader,
                              first_step=first, stop_step=stop)
        try:
            for step, data in enumerate(batches, start=first + 1):
                self.position = plan.position(done_before + step)
                yield self._shape(data)
        finally:
            batches.close()  # its read-ahead thread stops before the files close
            if own:
                reader.close()

    def _dealt(self, batch_size: int, epoch: int, *, shuffle: bool, seed: int, rank: int,
               size: int, window: int, start: int, resumed: Optional[Position],
               first: int, stop: Optional[int], reader: Optional[ShardReader],
               order: Position) -> Iterator[Any]:
        """:meth:`_batches` of a dealt epoch (:mod:`sparkhvd.data.deal`): what is left of it --
        the restored deal's rest, or the round robin's after ``start`` -- dealt to the ranks;
        this rank's span read a window at a time (kept by row group when its share fits
        ``memory_cache``)."""
        _, parts = self._layout(shuffle, seed)
        sequences = Sequences(parts, shuffle=shuffle, seed=seed, epoch=epoch,
                              window_rows=window)
        if resumed is not None and resumed.deal is not None:
            pairs = left_by_rank(Deal.of(resumed.deal),
                                 resumed.step - int(resumed.deal["step0"]))
        else:
            old = resumed.world_size if resumed is not None else 0
            pairs = [(u, u.partition % old if old and round_robin(self.partitions, old)
                      else None)
                     for u in units_at(start, sequences=sequences, window_rows=window,
                                       layout=not self.streams(size))]
        pairs = [(u, home) for u, home in pairs if u.rows]
        left = [u for u, _ in pairs]
        dealt = deal(left, size=size, batch=batch_size, num_rows=self.num_rows,
                     window_rows=window)
        hosts = order.hosts
        if resumed is not None and hosts and 0 < len(resumed.hosts) == resumed.world_size \
                and (resumed.hosts, resumed.world_size) != (hosts, size):
            # a resize, or the same size on other hosts: each host first the rows it read
            dealt = by_host(dealt, [home for _, home in pairs], resumed.hosts, hosts)
        rows_left = sum(u.rows for u in left)
        skipped = rows_left - dealt.consumed(dealt.total_steps) \
            - self.num_rows % (size * batch_size)
        if skipped > 0 and rank == 0:
            log.warning("Epoch %d resumes with %d row(s) short of a step boundary of %d ranks: "
                        "too few to give every rank one, so they are left out of this epoch "
                        "(a batch_size of at least %d avoids it).", epoch, skipped, size, size)
        record = {**dealt.as_dict(), "step0": order.step}
        plan = self._plan(EpochPlan(epoch, self.num_rows - rows_left, order.step,
                                    dealt.total_steps, order, deal=record, _dealt=dealt))
        span = dealt.spans()[rank]
        windows = [sequences.windows(u) for u in span]
        steps = dealt.total_steps if stop is None else min(stop, dealt.total_steps)
        self._kept = None
        own = reader is None
        reader = reader or self._reader()
        if self.streams(size):
            self._kept_groups = {}

            def open_windows(due: Any) -> list[Any]:
                pieces = [sequences.pieces(w) for w in due]
                read = iter(reader.read_many([p for ps in pieces for p in ps]))
                return [WindowRows([next(read) for _ in ps], merge=True) for ps in pieces]
        else:
            self._keep_groups([p for ws in windows for w in ws for p in sequences.pieces(w)],
                              reader)
            kept = self._kept_groups

            def open_windows(due: Any) -> list[Any]:
                return [WindowRows([{k: v[p.lo:p.hi] for k, v in kept[(p.file, p.group)].items()}
                                    for p in sequences.pieces(w)])
                        for w in due]
        batches = dealt_batches(span, windows, open_windows,
                                lambda s: dealt.rank_rows(rank, s), first_step=first,
                                steps=steps, read_ahead=self.streams(size))
        try:
            for step, data in enumerate(batches, start=first + 1):
                self.position = plan.position(order.step + step)
                yield self._shape(data)
        finally:
            batches.close()
            if own:
                reader.close()

    def _keep_groups(self, pieces: list[Piece], reader: ShardReader) -> None:
        """Keep the whole row groups ``pieces`` lie in (read those not kept yet, drop the rest):
        a dealt epoch's span is the same row groups every epoch but the few it splits."""
        wanted = {(p.file, p.group) for p in pieces}
        self._kept_groups = {g: rows for g, rows in self._kept_groups.items() if g in wanted}
        missing = sorted(wanted - set(self._kept_groups))
        counts = self.source.row_groups
        for (f, g), rows in zip(missing, reader.read_many(
                [Piece(f, g, 0, counts[f][g]) for f, g in missing])):
            self._kept_groups[(f, g)] = rows

    def __repr__(self) -> str:
        return (f"DatasetShard(features={self.features}, label={self.label!r}, "
                f"{self.num_rows} rows, {'streamed' if self.streams() else 'in memory'})")
