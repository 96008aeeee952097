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

import contextlib
import itertools
import logging
import warnings
from typing import Any, Iterator, Optional

import numpy as np

from sparkhvd.common.identity import current_rank
from sparkhvd.data.reader import (
    Arrays,
    InMemoryWindow,
    ShardReader,
    blocks_of,
    plan_epoch,
    rank_batches,
)
from sparkhvd.data.sharding import Position, ShardSource, steps_from

__side__ = "rank"

log = logging.getLogger(__name__)


class DatasetShard:
    """This rank's view of a materialised DataFrame (see the module docstring).

    A dataset up to ``memory_cache`` bytes is read once and kept (each rank holds all of it:
    a rank's rows change every epoch); a larger one is streamed a window at a time.
    """

    def __init__(self, source: ShardSource) -> None:
        self.source = source
        #: Bytes up to which the dataset is kept in memory (from the dataset; may be changed).
        self.memory_cache = source.memory_cache
        self._blocks = blocks_of(source.row_groups)
        self._memory: Optional[Arrays] = None
        self._resume: Optional[Position] = None
        self._restored_epoch = 0
        #: Where the ranks are after the last batch this rank handed out (None before any):
        #: what :meth:`state_dict` returns.
        self.position: Optional[Position] = None

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
        """Batches every rank runs in ``epoch``: fewer than :meth:`steps_per_epoch` in the
        epoch a restored position continues."""
        n_size = current_rank().size if size is None else size
        if self._resume is not None and self._resume.epoch == epoch:
            return steps_from(self.num_rows, self._resume.samples, batch_size, n_size)
        return self.source.steps_per_epoch(batch_size, n_size)

    def rank_bytes(self) -> int:
        """About how many bytes of rows a rank holds while reading (the whole dataset when it
        is kept in memory, else one shuffle window)."""
        return self.source.rank_bytes(self.memory_cache)

    # -- position ------------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The position after the last batch handed out (plain data; None before any)."""
        return self.position.as_dict() if self.position is not None else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continue from a saved position: the next :meth:`batches` (or ``torch_batches``,
        ``tf_dataset``) of that epoch starts where it stopped -- with any number of ranks."""
        if not state:
            self._resume = None
            self._restored_epoch = 0
            return
        position = Position.from_dict(state)
        if position.num_rows and position.num_rows != self.num_rows:
            raise ValueError(
                f"The saved data position is for {position.num_rows} rows, but this dataset has "
                f"{self.num_rows}: it is not the data the checkpoint trained on. Resume with "
                "the same DataFrame, or start the data over (resume=False).")
        self._resume = position
        self._restored_epoch = position.epoch
        self.position = position

    @property
    def resume_epoch(self) -> Optional[int]:
        """The epoch a restored position continues (None when nothing was restored)."""
        return self._resume.epoch if self._resume is not None else None

    def _start(self, epoch: int, shuffle: bool, seed: int, window: int) -> int:
        resume, self._resume = self._resume, None
        if resume is None or resume.epoch != epoch:
            if resume is not None and resume.epoch > epoch:
                self._resume = resume  # an earlier epoch first: keep it for its own epoch
            return 0
        changed = [f"{name} {was!r} -> {now!r}" for name, was, now in (
            ("shuffle", resume.shuffle, shuffle), ("seed", resume.seed, seed),
            ("shuffle window", resume.window_rows, window)) if was != now]
        if changed and resume.samples:
            log.warning("The saved data position was taken with another order (%s): epoch %d "
                        "continues at row %d of a different order, so some rows of it may be "
                        "seen twice and others not at all.", ", ".join(changed), epoch,
                        resume.samples)
        return resume.samples

    def _to_numpy(self, name: str, column: Any, n: int) -> np.ndarray:
        import pyarrow as pa

        if hasattr(column, "num_chunks"):  # a ChunkedArray: one chunk needs no copy
            column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        if isinstance(column.type, (pa.ListType, pa.LargeListType)):
            flat = column.flatten().to_numpy(zero_copy_only=False)
            if n and flat.size % n:
                raise ValueError(f"Column {name!r} holds arrays of different lengths; every row "
                                 "must have the same length (pad or truncate them).")
            values = flat.reshape(n, -1) if n else flat.reshape(0, 0)
        else:
            values = column.to_numpy(zero_copy_only=False)
        if name in self.shapes:
            values = values.reshape((n,) + self.shapes[name])
        return values

    def _reader(self) -> ShardReader:
        return ShardReader(self.source.files, dict(self.source.stored), self.storage_options,
                           self._to_numpy)

    def streams(self) -> bool:
        """Whether the dataset is streamed a window at a time (larger than ``memory_cache``)."""
        return not self.source.in_memory(self.memory_cache)

    def load_all(self, reader: Optional[ShardReader] = None) -> Arrays:
        """Every row as numpy arrays, read once and kept (the in-memory mode). The arrays are
        this shard's own (writable), so batches of them become tensors without a copy."""
        if self._memory is not None:
            return self._memory
        own = reader is None
        reader = reader or self._reader()
        try:
            parts = reader.read_many(self._blocks)
        finally:
            if own:
                reader.close()
        self._memory = {c: np.concatenate([p[c] for p in parts]) for c in self.columns}
        return self._memory

    def _shape(self, data: dict[str, np.ndarray]) -> Any:
        columns = {c: data[c] for c in self.features}
        x = columns[self.features[0]] if len(self.features) == 1 else columns
        return (x, data[self.label]) if self.label else x

    def _epoch(self, batch_size: int, epoch: int, *, shuffle: bool, seed: int, rank: int,
               size: int, start: int, window: int, reader: ShardReader) -> Iterator[Arrays]:
        steps = steps_from(self.num_rows, start, batch_size, size)
        windows = plan_epoch(self._blocks, window, shuffle=shuffle, seed=seed, epoch=epoch)
        in_memory = None
        if not self.streams():
            data = self.load_all(reader)
            in_memory = lambda w: InMemoryWindow(data, self._blocks, w)  # noqa: E731
        return rank_batches(lambda ks: reader.read_many([self._blocks[k] for k in ks]), windows,
                            batch_size=batch_size, size=size, rank=rank, start=start,
                            steps=steps, shuffle=shuffle, seed=seed, epoch=epoch,
                            in_memory=in_memory)

    def batches(self, batch_size: int, epoch: int = 0, *, shuffle: bool = False, seed: int = 0,
                rank: Optional[int] = None, size: Optional[int] = None,
                shuffle_buffer: Optional[int] = None,
                reader: Optional[ShardReader] = None) -> Iterator[Any]:
        """This rank's full batches of ``epoch``: ``(x, y)`` (or ``x`` without a label).

        The ranks' batches, step by step and rank by rank, are the epoch's one global order
        (:mod:`sparkhvd.data.sharding`), whatever the number of ranks. In an epoch a restored
        position continues (:meth:`load_state_dict`), it starts there.

        Unshuffled batches may be views of the data pyarrow read (no copy), so they may be
        read-only: copy a batch before changing it in place.

        Args:
            shuffle: a new global order every epoch, seeded by ``seed`` and the epoch.
            seed: a non-negative int, the same on every rank.
            shuffle_buffer: rows per shuffle window when streaming (default: ~64 MB of rows);
                the same on every rank and in every run that resumes this one.
        """
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int; got {seed!r}")
        self.source.steps_per_epoch(batch_size, size)  # checks batch_size and the data size
        me = current_rank()
        r = me.rank if rank is None else rank
        n_size = me.size if size is None else size
        window = self.source.window_rows(shuffle_buffer, self.memory_cache)
        start = self._start(epoch, shuffle, seed, window)
        done_before = start // (n_size * batch_size)  # steps of this epoch at this size
        own = reader is None
        reader = reader or self._reader()
        try:
            for step, data in enumerate(self._epoch(
                    batch_size, epoch, shuffle=shuffle, seed=int(seed), rank=r, size=n_size,
                    start=start, window=window, reader=reader), start=1):
                self.position = Position(epoch, start + step * n_size * batch_size, int(seed),
                                         shuffle, window, self.num_rows, batch_size, n_size,
                                         done_before + step)
                yield self._shape(data)
        finally:
            if own:
                reader.close()

    def torch_batches(self, batch_size: int, epoch: int = 0, *, shuffle: bool = False,
                      seed: int = 0, shuffle_buffer: Optional[int] = None,
                      device: Any = None) -> Iterator[Any]:
        """One epoch of this rank's full batches as torch tensors: ``(x, y)``, or ``x`` (a dict
        of tensors for several feature columns) -- :meth:`batches`, converted without a copy:
        a tensor shares memory with the rows read (the in-memory dataset, or the window), so
        change a batch only out of place (``x = x / 255``, not ``x.div_(255)``).
        ``device``: move each batch there (e.g. ``"cuda"``)."""
        import torch

        def tensor(array: np.ndarray) -> Any:
            if array.flags.writeable:
                value = torch.from_numpy(array)
            else:  # a view of a buffer pyarrow read for this batch only: shared, not copied
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given NumPy array is not "
                                            "writable", category=UserWarning)
                    value = torch.from_numpy(array)
            return value.to(device) if device is not None else value

        def convert(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: tensor(v) for k, v in value.items()}
            if isinstance(value, tuple):
                return tuple(convert(v) for v in value)
            return tensor(value)

        for batch in self.batches(batch_size, epoch, shuffle=shuffle, seed=seed,
                                  shuffle_buffer=shuffle_buffer):
            yield convert(batch)

    def torch_dataset(self, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                      shuffle_buffer: Optional[int] = None) -> Any:
        """This rank's shard as a ``torch.utils.data.IterableDataset`` of full batches.

        Each iteration is one epoch (:meth:`torch_batches`); call ``set_epoch(e)`` before each,
        as with ``DistributedSampler``, for a new shuffle. Use it with
        ``DataLoader(ds, batch_size=None)`` (the batches are already made); with
        ``num_workers=N`` the workers take every N-th batch, so each row is still seen once --
        but the position then lives in the workers: save it (:meth:`state_dict`) only from a
        loader without workers.
        """
        import torch

        shard = self

        class ShardBatches(torch.utils.data.IterableDataset):
            def __init__(self) -> None:
                super().__init__()
                self.epoch = 0

            def set_epoch(self, epoch: int) -> None:
                self.epoch = int(epoch)

            def __len__(self) -> int:
                return shard.steps_in_epoch(batch_size, self.epoch)

            def __iter__(self) -> Iterator[Any]:
                info = torch.utils.data.get_worker_info()
                workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
                for step, batch in enumerate(shard.torch_batches(
                        batch_size, self.epoch, shuffle=shuffle, seed=seed,
                        shuffle_buffer=shuffle_buffer)):
                    if step % workers == me:
                        yield batch

        return ShardBatches()

    @contextlib.contextmanager
    def tf_dataset(self, batch_size: int, epochs: Optional[int] = None, *, shuffle: bool = False,
                   seed: int = 0, prefetch: int = 2,
                   shuffle_buffer: Optional[int] = None) -> Iterator[Any]:
        """This rank's shard as a ``tf.data.Dataset`` of full batches, for the ``with`` block.

        The block owns the open Parquet files (remote ones hold connections); they are closed
        when it ends.

        Args:
            batch_size: rows per batch (per rank).
            epochs: the epoch the dataset ends before; ``None`` (default) repeats forever, which
                suits ``model.fit(..., steps_per_epoch=ds.steps_per_epoch(batch_size))``. It
                starts at epoch 0, or where a restored position continues.
            shuffle: a new global order each epoch (seeded by ``seed`` and the epoch).
            prefetch: batches prepared ahead of the training step.
            shuffle_buffer: rows per shuffle window when streaming.
        """
        import tensorflow as tf

        reader = self._reader()
        try:
            self.source.steps_per_epoch(batch_size)
            first = self._shape({c: v[:1] for c, v in reader.read(self._blocks[0]).items()})

            def spec(value: Any) -> Any:
                if isinstance(value, dict):
                    return {k: spec(v) for k, v in value.items()}
                return tf.TensorSpec((None,) + value.shape[1:], tf.as_dtype(value.dtype))

            signature = tuple(spec(v) for v in first) if self.label else spec(first)

            def generate() -> Iterator[Any]:
                begin = self._restored_epoch  # every iterator (Keras may make several)
                for epoch in (range(begin, epochs) if epochs is not None
                              else itertools.count(begin)):
                    yield from self.batches(batch_size, epoch, shuffle=shuffle, seed=seed,
                                            shuffle_buffer=shuffle_buffer, reader=reader)

            dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = \
                tf.data.experimental.AutoShardPolicy.OFF
            yield dataset.with_options(options).prefetch(prefetch)
        finally:
            reader.close()

    def __repr__(self) -> str:
        return (f"DatasetShard(features={self.features}, label={self.label!r}, "
                f"{self.num_rows} rows, {'streamed' if self.streams() else 'in memory'})")
