"""The framework halves of a rank's shard (:class:`~sparkhvd.data.shard.DatasetShard`): its
batches as torch tensors, a ``torch.utils.data`` dataset and a ``tf.data.Dataset`` -- each over
the shard's one reading of the global order (``batches``), so every framework reads the same
rows in the same order and moves the same position.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

if TYPE_CHECKING:
    from sparkhvd.data.reader import ShardReader

__side__ = "rank"


class FrameworkBatches:
    """The torch and TensorFlow readings of a shard (mixed into ``DatasetShard``, whose
    ``batches``, ``_batches``, position and source they use)."""

    #: the ``tf.distribute`` strategy :meth:`tf_dataset` distributes by (None: none):
    #: ``KerasDistributed(data=...)`` sets it (:meth:`distribute_with`)
    _strategy: Any = None

    def distribute_with(self, strategy: Any) -> None:
        """Hand :meth:`tf_dataset`'s batches to ``strategy``'s replicas as they are: each
        worker's batch is its replica's (``KerasDistributed(data=...)`` calls it)."""
        self._strategy = strategy

    if TYPE_CHECKING:  # what the shard provides
        source: Any
        position: Any
        _resume: Any
        _restored: Any
        _restored_epoch: int
        _blocks: Any
        batches: Callable[..., Iterator[Any]]
        _batches: Callable[..., Iterator[Any]]
        steps_in_epoch: Callable[..., int]
        _reader: Callable[[], "ShardReader"]
        _shape: Callable[[dict[str, np.ndarray]], Any]

        @property
        def features(self) -> list[str]: ...

        @property
        def label(self) -> Optional[str]: ...

        @property
        def shapes(self) -> dict: ...


    def torch_batches(self, batch_size: int, epoch: int = 0, *, shuffle: bool = False,
                      seed: int = 0, shuffle_buffer: Optional[int] = None,
                      device: Any = None) -> Iterator[Any]:
        """One epoch of this rank's full batches as torch tensors: ``(x, y)``, or ``x`` (a dict
        of tensors for several feature columns) -- :meth:`batches`, converted without a copy:
        a tensor shares memory with the rows gathered for it, so change a batch only out of
        place (``x = x / 255``, not ``x.div_(255)``).

        ``device``: hand out batches already there. On a CUDA device each batch is gathered
        into pinned memory and copied on a side stream one batch ahead of the one training
        uses (:mod:`sparkhvd.data.device`); on any other device, moved with ``.to()``."""
        batches = self._torch(self.batches(batch_size, epoch, shuffle=shuffle, seed=seed,
                                           shuffle_buffer=shuffle_buffer))
        if device is None:
            yield from batches
            return
        from sparkhvd.data.device import to_device

        # the copy runs a batch ahead: the position is the one after the batch handed out
        # (a checkpoint taken after it must not skip the batch still being copied)
        positions: collections.deque = collections.deque()

        def noted() -> Iterator[Any]:
            for batch in batches:
                positions.append(self.position)
                yield batch

        for batch in to_device(noted(), device):
            self.position = positions.popleft()
            yield batch

    @staticmethod
    def _torch(batches: Iterator[Any]) -> Iterator[Any]:
        """Batches of numpy arrays as torch tensors sharing their memory."""
        import torch

        def convert(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            if isinstance(value, tuple):
                return tuple(convert(v) for v in value)
            return torch.from_numpy(value)

        for batch in batches:
            yield convert(batch)

    def torch_dataset(self, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                      shuffle_buffer: Optional[int] = None) -> Any:
        """This rank's shard as a ``torch.utils.data.IterableDataset`` of full batches.

        Each iteration is one epoch (:meth:`torch_batches`); call ``set_epoch(e)`` before each,
        as with ``DistributedSampler``, for a new shuffle. Use it with
        ``DataLoader(ds, batch_size=None)`` (the batches are already made). With
        ``num_workers=N`` each worker hands out one N-th of the epoch's steps, a consecutive
        run of them, and reads only the rows of those steps: every row is still seen once
        and each rank's k-th batch is still the same step on every rank, but the steps come
        in the workers' turns, not in order -- and the position lives in the workers: save it
        (:meth:`state_dict`) only from a loader without workers.
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
                if info is None:
                    yield from shard.torch_batches(batch_size, self.epoch, shuffle=shuffle,
                                                   seed=seed, shuffle_buffer=shuffle_buffer)
                    return
                steps = len(self)
                bounds = np.linspace(0, steps, info.num_workers + 1).astype(int)
                part = (int(bounds[info.id]), int(bounds[info.id + 1]))
                if part[0] < part[1]:
                    yield from shard._torch(shard._batches(
                        batch_size, self.epoch, shuffle=shuffle, seed=seed, rank=None,
                        size=None, shuffle_buffer=shuffle_buffer, reader=None, steps=part))

        return ShardBatches()

    @contextlib.contextmanager
    def tf_dataset(self, batch_size: int, epochs: Optional[int] = None, *, shuffle: bool = False,
                   seed: int = 0, prefetch: int = 2,
                   shuffle_buffer: Optional[int] = None) -> Iterator[Any]:
        """This rank's shard as a ``tf.data.Dataset`` of full batches, for the ``with`` block
        -- a ``tf.distribute`` dataset of them, each the worker's replica's, when the shard is
        given to ``KerasDistributed(data=...)`` on ``backend="tf"`` with several workers.

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
            signature = self._signature(reader, tf)

            def generate() -> Iterator[Any]:
                # every iterator (Keras and tf.distribute may make several) begins where the
                # shard was restored: a second one re-read a restored epoch from its start
                self._resume = self._restored
                begin = self._restored_epoch
                for epoch in (range(begin, epochs) if epochs is not None
                              else itertools.count(begin)):
                    yield from self.batches(batch_size, epoch, shuffle=shuffle, seed=seed,
                                            shuffle_buffer=shuffle_buffer, reader=reader)

            dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = \
                tf.data.experimental.AutoShardPolicy.OFF
            dataset = dataset.with_options(options).prefetch(prefetch)
            strategy = self._strategy
            if strategy is not None and strategy.num_replicas_in_sync > 1:
                # each worker's batches are its replica's, as they are: a plain dataset's
                # batch would be taken for the global one and cut into a piece per replica --
                # every worker then trained a 1/np of its batch a step, np steps a batch
                yield strategy.distribute_datasets_from_function(lambda _: dataset)
            else:
                yield dataset
        finally:
            reader.close()

    def _signature(self, reader: ShardReader, tf: Any) -> Any:
        """The batches' ``tf.TensorSpec``s: dtypes from the files' schema and shapes from the
        dataset (no row is read for it); a batch of one row where a source lacks the widths
        (a cache written by an older sparkhvd)."""
        import pyarrow as pa

        def spec_of(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: spec_of(v) for k, v in value.items()}
            return tf.TensorSpec((None,) + value.shape[1:], tf.as_dtype(value.dtype))

        schema = reader.schema()  # one footer read for every column
        array_columns = {c for c, stored in self.source.stored.items()
                         if pa.types.is_list(schema.field(stored).type)}
        if array_columns - set(self.source.widths):
            first = reader.read(self._blocks[0])
            data = {c: v[:1] for c, v in first.items()}
        else:
            data = {}
            for column, stored in self.source.stored.items():
                kind = schema.field(stored).type
                element = kind.value_type if pa.types.is_list(kind) else kind
                dtype = np.dtype(self.source.cast.get(column) or element.to_pandas_dtype())
                row = self.shapes.get(column) or ((self.source.widths[column],)
                                                   if column in array_columns else ())
                data[column] = np.zeros((1,) + tuple(row), dtype)
        shaped = self._shape(data)
        return tuple(spec_of(v) for v in shaped) if self.label else spec_of(shaped)

