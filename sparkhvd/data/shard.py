"""The rank half of ``DataFrameDataset``: this rank's shard, in memory or streamed.

A rank's function receives a :class:`DatasetShard` where the driver passed a
``DataFrameDataset`` (the runner prepares it, :mod:`sparkhvd.driver.arguments`): the same
reading methods -- :meth:`~DatasetShard.tf_dataset`, :meth:`~DatasetShard.batches`,
:meth:`~DatasetShard.steps_per_epoch` -- over a :class:`~sparkhvd.data.sharding.ShardSource`
(policy there; streaming in :mod:`sparkhvd.data.reader`).
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator, Optional

import numpy as np

from sparkhvd.common.identity import current_rank
from sparkhvd.data.reader import ShardReader, epoch_batches, pieces_of
from sparkhvd.data.sharding import ShardSource

__side__ = "rank"

#: Default shuffle window when streaming: about this many bytes of rows (at least 4 batches).
SHUFFLE_BUFFER_BYTES = 64 << 20


class DatasetShard:
    """This rank's rows of a materialised DataFrame (see the module docstring).

    A shard up to ``memory_cache`` bytes is read once and kept: later epochs and full
    permutations come from memory. Larger shards are streamed every epoch.
    """

    def __init__(self, source: ShardSource) -> None:
        self.source = source
        #: Bytes up to which the shard is kept in memory (from the dataset; may be changed).
        self.memory_cache = source.memory_cache
        self._shard_cache: Optional[tuple[tuple[int, int], dict[str, np.ndarray]]] = None

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

    def shard_bounds(self, rank: Optional[int] = None, size: Optional[int] = None) -> tuple[int, int]:
        """``(start, stop)`` global row indices owned by ``rank`` (default: this rank)."""
        return self.source.shard_bounds(rank, size)

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None) -> int:
        """Full batches every rank runs per epoch (the same on all ranks)."""
        return self.source.steps_per_epoch(batch_size, size)

    def shard_bytes(self, rank: Optional[int] = None, size: Optional[int] = None) -> int:
        """About how many bytes this rank's rows take in memory."""
        return self.source.shard_bytes(rank, size)

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

    def streams(self, rank: Optional[int] = None, size: Optional[int] = None) -> bool:
        """Whether this rank's shard is streamed (larger than ``memory_cache``)."""
        return self.shard_bytes(rank, size) > self.memory_cache

    def load_shard(self, rank: Optional[int] = None, size: Optional[int] = None) -> dict[str, np.ndarray]:
        """This rank's rows as numpy arrays, read once and kept (use for shards that fit)."""
        bounds = self.shard_bounds(rank, size)
        if self._shard_cache and self._shard_cache[0] == bounds:
            return self._shard_cache[1]
        reader = self._reader()
        try:
            parts = [reader.read(p) for p in pieces_of(self.source.row_groups, *bounds)]
        finally:
            reader.close()
        arrays = {c: np.concatenate([p[c] for p in parts]) if len(parts) > 1 else parts[0][c]
                  for c in self.columns} if parts else {c: np.empty((0,)) for c in self.columns}
        self._shard_cache = (bounds, arrays)
        return arrays

    def _shape(self, data: dict[str, np.ndarray]) -> Any:
        columns = {c: data[c] for c in self.features}
        x = columns[self.features[0]] if len(self.features) == 1 else columns
        return (x, data[self.label]) if self.label else x

    def batches(self, batch_size: int, epoch: int = 0, *, shuffle: bool = False, seed: int = 0,
                rank: Optional[int] = None, size: Optional[int] = None,
                shuffle_buffer: Optional[int] = None,
                reader: Optional[ShardReader] = None) -> Iterator[Any]:
        """One epoch of this rank's full batches: ``(x, y)`` (or ``x`` without a label).

        Unshuffled batches are views of the data pyarrow read (no copy), so they may be
        read-only: copy a batch before changing it in place.

        Args:
            shuffle: a new order every epoch, seeded by ``seed``, the epoch and the rank (see
                :mod:`sparkhvd.data.reader` for what streaming shuffles mean).
            shuffle_buffer: rows per shuffle window when streaming (default: ~64 MB of rows).
        """
        steps = self.steps_per_epoch(batch_size, size)
        r = current_rank()[0] if rank is None else rank
        rng = np.random.default_rng([seed, epoch, r]) if shuffle else None
        if not self.streams(rank, size):
            arrays = self.load_shard(rank, size)
            order = rng.permutation(len(next(iter(arrays.values())))) if rng is not None \
                else None
            for step in range(steps):
                if order is not None:
                    idx: Any = np.sort(order[step * batch_size:(step + 1) * batch_size])
                else:
                    idx = slice(step * batch_size, (step + 1) * batch_size)  # views, no copy
                yield self._shape({c: arrays[c][idx] for c in self.columns})
            return
        if shuffle_buffer is None:
            shuffle_buffer = max(4 * batch_size,
                                 SHUFFLE_BUFFER_BYTES // max(1, self.source.row_bytes))
        own = reader is None
        reader = reader or self._reader()
        try:
            pieces = pieces_of(self.source.row_groups, *self.shard_bounds(rank, size))
            for data in epoch_batches(reader.read, pieces, batch_size, steps, rng=rng,
                                      shuffle_buffer=shuffle_buffer):
                yield self._shape(data)
        finally:
            if own:
                reader.close()

    def torch_batches(self, batch_size: int, epoch: int = 0, *, shuffle: bool = False,
                      seed: int = 0, shuffle_buffer: Optional[int] = None,
                      device: Any = None) -> Iterator[Any]:
        """One epoch of this rank's full batches as torch tensors: ``(x, y)``, or ``x`` (a dict
        of tensors for several feature columns) -- :meth:`batches`, converted without a copy
        where the arrays allow it. ``device``: move each batch there (e.g. ``"cuda"``)."""
        import torch

        def tensor(array: np.ndarray) -> Any:
            if not array.flags.writeable:  # a view of pyarrow's buffer: torch wants its own
                array = array.copy()
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
        ``num_workers=N`` the workers take every N-th batch, so each row is still seen once.
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
                return shard.steps_per_epoch(batch_size)

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
            epochs: how many epochs the dataset yields; ``None`` (default) repeats forever, which
                suits ``model.fit(..., steps_per_epoch=ds.steps_per_epoch(batch_size))``.
            shuffle: a new order each epoch (seeded by ``seed``, epoch and rank).
            prefetch: batches prepared ahead of the training step.
            shuffle_buffer: rows per shuffle window when streaming.
        """
        import tensorflow as tf

        reader = self._reader()
        try:
            first = next(self.batches(batch_size, 0, reader=reader))

            def spec(value: Any) -> Any:
                if isinstance(value, dict):
                    return {k: spec(v) for k, v in value.items()}
                return tf.TensorSpec((None,) + value.shape[1:], tf.as_dtype(value.dtype))

            signature = tuple(spec(v) for v in first) if self.label else spec(first)

            def generate() -> Iterator[Any]:
                for epoch in (range(epochs) if epochs is not None else itertools.count()):
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
                f"{self.num_rows} rows, rank rows {self.shard_bounds()})")
