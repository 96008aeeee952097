"""``DataFrameDataset``: a Spark DataFrame that each rank reads its own shard of.

Created on the driver, passed to ``HorovodRunner.run()``: the runner materialises it right before
launch (:mod:`sparkhvd.data.materialize`: checks, Parquet written by the executors, reused across
runs), and each rank streams *its* rows (:mod:`sparkhvd.data.reader`).

Sharding policy (every epoch, every rank):

* The ``N`` materialised rows are split into ``size`` contiguous blocks of ``M = N // size``
  rows; rank ``r`` owns rows ``[r*M, (r+1)*M)`` of the files in order. Blocks never overlap, so
  within one epoch no row is seen twice across ranks.
* Each epoch a rank runs exactly ``steps_per_epoch(batch_size) = M // batch_size`` full batches,
  the same on every rank (unequal step counts would hang allreduce).
* Rows left out in an epoch: ``N - size * steps * batch_size``, always fewer than
  ``size * batch_size``. With shuffling, a different subset of each block is left out each epoch.

petastorm's own reader shards by Parquet row group, which gives ranks different row counts;
that is why ranks read row ranges with pyarrow.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
from typing import Any, Iterator, Mapping, Optional, Sequence, Union
from urllib.parse import urlparse

import numpy as np

from ..rank import current_rank
from .reader import ShardReader, epoch_batches, pieces_of

log = logging.getLogger(__name__)

#: A shard up to this size (bytes in memory) is read once and kept: later epochs and full
#: permutations come from memory. Larger shards are streamed every epoch.
MEMORY_CACHE_BYTES = 512 << 20
#: Default shuffle window when streaming: about this many bytes of rows (at least 4 batches).
SHUFFLE_BUFFER_BYTES = 64 << 20


def _as_list(value: Union[str, Sequence[str]], what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    names = list(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a column name or a list of column names; got {value!r}")
    return names


def default_cache_parent() -> str:
    """Where the default (driver-local) caches go: ``$TMPDIR/sparkhvd-cache``."""
    return os.path.join(tempfile.gettempdir(), "sparkhvd-cache")


class DataFrameDataset:
    """A Spark DataFrame that each Horovod rank reads its own shard of (see the module docstring).

    Create it on the driver and pass it to :meth:`HorovodRunner.run` as an argument; inside the
    training function use :meth:`tf_dataset` (or :meth:`batches`) and :meth:`steps_per_epoch`.

    Args:
        df: the DataFrame (a batch DataFrame: streaming ones are refused).
        features: the feature column, or a list of them (then the model gets a dict).
        label: the label column (scalar or array), or ``None`` for features only.
        shapes: per-column shape of one row, e.g. ``{"features": (8, 8, 1)}`` to reshape a
            64-element vector into an image.
        cache_url: parent folder for the materialised Parquet (default: a local temp folder,
            fine when every executor runs on this machine). On a cluster it must be a location
            every executor and rank can reach: ``abfss://...`` (written and read through fsspec:
            no Hadoop connector needed; the ranks get a read-only SAS token, never the key), or
            a shared mount with ``shared_cache=True``.
        storage_options: credentials for ``cache_url`` (used on the driver to mint short-lived
            SAS tokens for the executors and ranks).
        keep_cache: keep the Parquet files after the dataset is closed and at exit.
        dtype: floating-point type of float columns after materialisation (default float32).
        shared_cache: declare a ``file://`` cache to be a folder every executor sees.
        allow_nan: train on NaN values instead of refusing them.
        memory_cache: a rank's shard up to this many bytes is kept in memory after the first
            read (default 512 MB); larger shards stream every epoch.

    The materialised files are reused by every run with this dataset -- and by a new dataset
    of the same DataFrame (same plan and columns) in the same session -- until :meth:`close`
    (or garbage collection, or the driver's exit), and removed then unless ``keep_cache``;
    a failed run removes them at once. ``ds.cache_dir`` says where they are.

    Example::

        train = DataFrameDataset(df_train, features="features", label="label",
                                 shapes={"features": (8, 8, 1)})

        def train_fn(train, epochs):
            import horovod.tensorflow.keras as hvd
            hvd.init()
            with train.tf_dataset(batch_size=64, shuffle=True, seed=1) as ds:
                model.fit(ds, steps_per_epoch=train.steps_per_epoch(64), epochs=epochs)
    """

    def __init__(self, df: Any, features: Union[str, Sequence[str]], label: Optional[str] = None,
                 *, shapes: Optional[Mapping[str, Sequence[int]]] = None,
                 cache_url: Optional[str] = None,
                 storage_options: Optional[Mapping[str, Any]] = None, keep_cache: bool = False,
                 dtype: str = "float32", shared_cache: bool = False, allow_nan: bool = False,
                 memory_cache: int = MEMORY_CACHE_BYTES) -> None:
        from .materialize import check_column_type

        if getattr(df, "isStreaming", False):
            raise TypeError(
                "DataFrameDataset needs a batch DataFrame, and this one is streaming "
                "(spark.readStream). Write the stream out first (writeStream to a table or "
                "files, e.g. with trigger(availableNow=True)), then read it with spark.read.")
        self.features = _as_list(features, "features")
        self.label = label
        self.columns = self.features + ([label] if label else [])
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"A column is used twice: features={self.features}, label={label!r}")
        existing = list(df.columns)
        missing = [c for c in self.columns if c not in existing]
        if missing:
            raise KeyError(f"Column(s) {missing} not in the DataFrame; it has: {existing}")
        self._schema = {f.name: f.dataType for f in df.schema.fields}
        self.kinds = {c: check_column_type(c, self._schema[c]) for c in self.columns}
        self.shapes = {k: tuple(int(d) for d in v) for k, v in (shapes or {}).items()}
        unknown = set(self.shapes) - set(self.columns)
        if unknown:
            raise KeyError(f"shapes names column(s) {sorted(unknown)} that are not used; used "
                           f"columns: {self.columns}")
        self.dtype = np.dtype(dtype).name
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64; got {dtype!r}")
        self.cache_url = cache_url
        self.storage_options = dict(storage_options or {})
        self.keep_cache = keep_cache
        self.shared_cache = shared_cache
        self.allow_nan = allow_nan
        self.memory_cache = int(memory_cache)
        self._df = df
        self._manifest: Any = None
        self._finalizer: Any = None
        self._shard_cache: Optional[tuple[tuple[int, int], dict[str, np.ndarray]]] = None

    # -- driver side -----------------------------------------------------------------------
    def _check_cache_visible(self, parent: str, master: str,
                             executors_here: Optional[bool] = None) -> None:
        from ..sparkview import is_loopback_master

        here = is_loopback_master(master) if executors_here is None else executors_here
        if urlparse(parent).scheme in ("", "file") and not here and not self.shared_cache:
            raise ValueError(
                f"The DataFrameDataset cache {parent} is on the driver's local disk, which the "
                f"executors of {master} cannot read. Pass cache_url= a location every executor "
                "can read (abfss://...), or shared_cache=True if it is a shared mount.")

    def materialize(self) -> "DataFrameDataset":
        """Check the columns and write them as Parquet -- or reuse an earlier materialisation of
        the same DataFrame (driver; done by ``HorovodRunner.run`` before launch)."""
        if self._manifest is not None:
            return self
        from .. import storage
        from ..sparkview import SparkView
        from . import materialize as mat

        if self._df is None:
            raise RuntimeError("This DataFrameDataset was closed or came from a rank: create a "
                               "new one from the DataFrame.")
        spark = self._df.sparkSession
        parent = (self.cache_url or default_cache_parent()).rstrip("/")
        view = SparkView(spark)
        self._check_cache_visible(parent, view.master, view.executors_here())
        selected, stored = mat.converted(self._df, self.columns, self.kinds, self._schema,
                                         self.dtype)
        key = (parent, selected.semanticHash(), tuple(self.columns), self.dtype, self.allow_nan)
        manifest = mat.REGISTRY.find(key, selected)
        if manifest is not None:
            log.info("DataFrameDataset: reusing materialised data at %s (%d rows)",
                     storage.public_url(manifest.url), manifest.num_rows)
        else:
            found = mat.profile(self._df, self.columns, self.kinds, self._schema)
            mat.check_profile(found, self.columns, self.allow_nan)
            url = mat.new_cache_url(parent)
            row_bytes = mat.row_bytes(self.columns, self.kinds, self._schema, found["lengths"],
                                      self.dtype)
            try:
                written = mat.write(selected, url,
                                    storage.delegate(url, self.storage_options, write=True),
                                    max(1, mat.ROW_GROUP_BYTES // row_bytes))
            except BaseException:
                mat._delete(url, self.storage_options)
                raise
            manifest = mat.Manifest(url=url, files=[f for f, _, _ in written],
                                    row_counts=[n for _, n, _ in written],
                                    row_groups=[g for _, _, g in written], stored=stored,
                                    row_bytes=row_bytes,
                                    extra={"rank_options": storage.delegate(
                                        url, self.storage_options, write=False)})
            mat.REGISTRY.add(key, manifest, selected, self.storage_options, self.keep_cache)
            log.info("DataFrameDataset: %d rows of %s in %d Parquet file(s) under %s",
                     manifest.num_rows, self.columns, len(manifest.files),
                     storage.public_url(url))
        self._manifest = manifest
        self._finalizer = mat.finalizer(self, manifest)
        return self

    def close(self) -> None:
        """Release the materialised files: removed once no dataset uses them (unless
        ``keep_cache``). The next run materialises again."""
        from .materialize import REGISTRY

        manifest, self._manifest = self._manifest, None
        if manifest is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        REGISTRY.release(manifest, delete=not self.keep_cache, keep=self.keep_cache)
        self._shard_cache = None

    cleanup = close

    def __enter__(self) -> "DataFrameDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def cache_dir(self) -> Optional[str]:
        """URL of the materialised Parquet folder, once materialised."""
        return self._manifest.url if self._manifest is not None else None

    @property
    def files(self) -> list[str]:
        return list(self._manifest.files) if self._manifest is not None else []

    @property
    def row_counts(self) -> list[int]:
        return list(self._manifest.row_counts) if self._manifest is not None else []

    @property
    def num_rows(self) -> Optional[int]:
        return self._manifest.num_rows if self._manifest is not None else None

    # HorovodRunner hooks: prepare before pickling; after the run, a failure removes the files.
    def _sparkhvd_prepare(self) -> None:
        if self._manifest is not None:
            from ..storage import public_url

            log.info("DataFrameDataset: reusing materialised data at %s (%d rows)",
                     public_url(self._manifest.url), self._manifest.num_rows)
        self.materialize()

    def _sparkhvd_finish(self, succeeded: bool) -> None:
        if not succeeded and not self.keep_cache:
            self.close()

    def __getstate__(self) -> dict:
        if self._manifest is None:
            raise TypeError("A DataFrameDataset is materialised on the driver before it can be "
                            "sent to the ranks: pass it as an argument of HorovodRunner.run(), "
                            "or call .materialize() first.")
        state = dict(self.__dict__)
        # The ranks get the read-only, time-limited options minted for them -- never the
        # credentials the driver was given.
        state.update(_df=None, _finalizer=None, _shard_cache=None,
                     storage_options=self._manifest.extra.get("rank_options", {}))
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # -- both sides ------------------------------------------------------------------------
    def _need_manifest(self) -> Any:
        if self._manifest is None:
            raise RuntimeError("DataFrameDataset is not materialised; pass it to "
                               "HorovodRunner.run() or call .materialize().")
        return self._manifest

    def shard_bounds(self, rank: Optional[int] = None, size: Optional[int] = None) -> tuple[int, int]:
        """``(start, stop)`` global row indices owned by ``rank`` (default: this rank)."""
        manifest = self._need_manifest()
        env_rank, env_size, _, _ = current_rank()
        rank = env_rank if rank is None else rank
        size = env_size if size is None else size
        per_rank = manifest.num_rows // size
        return rank * per_rank, (rank + 1) * per_rank

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None) -> int:
        """Full batches every rank runs per epoch (the same on all ranks)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        start, stop = self.shard_bounds(0, size)
        steps = (stop - start) // batch_size
        if steps == 0:
            n_size = size or current_rank()[1]
            raise ValueError(
                f"{self.num_rows} rows cannot give each of {n_size} rank(s) one full batch of "
                f"{batch_size}: lower batch_size to at most {max(1, self.num_rows // n_size)} "
                "or use more data.")
        return steps

    # -- rank side -------------------------------------------------------------------------
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
        manifest = self._need_manifest()
        return ShardReader(manifest.files, manifest.stored, self.storage_options, self._to_numpy)

    def shard_bytes(self, rank: Optional[int] = None, size: Optional[int] = None) -> int:
        """About how many bytes this rank's rows take in memory."""
        start, stop = self.shard_bounds(rank, size)
        return (stop - start) * self._need_manifest().row_bytes

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
            parts = [reader.read(p) for p in pieces_of(self._manifest.row_groups, *bounds)]
        finally:
            reader.close()
        arrays = {c: np.concatenate([p[c] for p in parts]) if len(parts) > 1 else parts[0][c]
                  for c in self.columns} if parts else {c: np.empty((0,)) for c in self.columns}
        self._shard_cache = (bounds, arrays)
        return arrays

    def _shape(self, data: dict[str, np.ndarray]) -> Any:
        x = {c: data[c] for c in self.features}
        x = x[self.features[0]] if len(self.features) == 1 else x
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
                                 SHUFFLE_BUFFER_BYTES // max(1, self._manifest.row_bytes))
        own = reader is None
        reader = reader or self._reader()
        try:
            pieces = pieces_of(self._manifest.row_groups, *self.shard_bounds(rank, size))
            for data in epoch_batches(reader.read, pieces, batch_size, steps, rng=rng,
                                      shuffle_buffer=shuffle_buffer):
                yield self._shape(data)
        finally:
            if own:
                reader.close()

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
        state = f"{self.num_rows} rows" if self._manifest is not None else "not materialised"
        return f"DataFrameDataset(features={self.features}, label={self.label!r}, {state})"
