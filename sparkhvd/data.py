"""Spark DataFrame → each rank's own shard as a ``tf.data.Dataset``.

On the driver, :class:`DataFrameDataset` checks the columns, counts nulls, and materialises the
selected columns to Parquet with petastorm's ``make_spark_converter`` (vectors become float
arrays, doubles become float32) in a cache folder. Inside a rank it reads *its* rows of those
files with pyarrow and feeds them to ``tf.data``.

Sharding policy (every epoch, every rank):

* The ``N`` materialised rows are split into ``size`` contiguous blocks of ``M = N // size`` rows;
  rank ``r`` owns rows ``[r*M, (r+1)*M)`` of the files in order. Blocks never overlap, so within
  one epoch no row is seen twice across ranks.
* Each epoch a rank runs exactly ``steps_per_epoch(batch_size) = M // batch_size`` full batches,
  the same on every rank (unequal step counts would hang allreduce). With ``shuffle=True`` the
  rank's rows are permuted each epoch (seeded by ``seed``, the epoch and the rank) before batching.
* Rows left out in an epoch: ``N - size * steps * batch_size``, always fewer than
  ``size * batch_size``. With shuffling, a different subset of each block is left out each epoch.

petastorm's own reader shards by Parquet row group, which gives ranks different row counts;
that is why ranks read the files with pyarrow, by row.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import tempfile
import warnings
from typing import Any, Iterator, Mapping, Optional, Sequence, Union
from urllib.parse import urlparse

import numpy as np

from .rank import current_rank

log = logging.getLogger(__name__)

_NUMERIC = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType",
            "BooleanType", "DecimalType")
_ARRAY_ELEMENTS = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType")
_VECTORS = ("VectorUDT",)
_PETASTORM_CONF = "petastorm.spark.converter.parentCacheDirUrl"


#: Cache folders to delete if the driver exits before the run's own clean-up.
_PENDING_CACHES: set[str] = set()


def _delete_pending_caches() -> None:
    if not _PENDING_CACHES:  # never import petastorm at interpreter exit for nothing
        return
    from petastorm.spark import spark_dataset_converter as sdc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for url in list(_PENDING_CACHES):
            sdc._delete_cache_data_atexit(url)
        _PENDING_CACHES.clear()


atexit.register(_delete_pending_caches)


def _own_cache_cleanup(cache_dir_url: str, keep: bool) -> None:
    """Replace petastorm's at-exit deletion of our cache (it ignores keep_cache, and warns).

    petastorm registers one at-exit call per materialised DataFrame; we unregister them all and
    re-register the ones that are not ours, so caches made directly with petastorm keep theirs.
    """
    from petastorm.spark import spark_dataset_converter as sdc

    atexit.unregister(sdc._delete_cache_data_atexit)
    with sdc._cache_df_meta_list_lock:
        others = [m.cache_dir_url for m in sdc._cache_df_meta_list
                  if m.cache_dir_url != cache_dir_url and m.cache_dir_url not in _PENDING_CACHES]
    for url in others:
        atexit.register(sdc._delete_cache_data_atexit, url)
    if not keep:
        _PENDING_CACHES.add(cache_dir_url)


def _type_name(data_type: Any) -> str:
    return type(data_type).__name__


def check_column_type(name: str, data_type: Any) -> str:
    """'scalar', 'array' or 'vector' for a supported Spark type; TypeError naming the column else."""
    kind = _type_name(data_type)
    if kind in _NUMERIC:
        return "scalar"
    if kind in _VECTORS:
        return "vector"
    if kind == "ArrayType" and _type_name(data_type.elementType) in _ARRAY_ELEMENTS:
        return "array"
    simple = data_type.simpleString() if hasattr(data_type, "simpleString") else kind
    raise TypeError(
        f"Column {name!r} has type {simple}, which DataFrameDataset cannot feed to a model. "
        "Supported: numeric scalars, array<float|double|int|long>, and Spark ML vectors "
        "(VectorUDT, dense or sparse). Convert it first, e.g. with StringIndexer for strings, "
        "VectorAssembler for several numeric columns, or select the numeric fields of a struct.")


def _as_list(value: Union[str, Sequence[str]], what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    names = list(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a column name or a list of column names; got {value!r}")
    return names


class DataFrameDataset:
    """A Spark DataFrame that each Horovod rank reads its own shard of (see the module docstring).

    Create it on the driver and pass it to :meth:`HorovodRunner.run` as an argument; inside the
    training function call :meth:`tf_dataset` and :meth:`steps_per_epoch`.

    Args:
        df: the DataFrame.
        features: the feature column, or a list of them (then the model gets a dict).
        label: the label column (scalar or array), or ``None`` for features only.
        shapes: per-column shape of one row, e.g. ``{"features": (8, 8, 1)}`` to reshape a
            64-element vector into an image.
        cache_url: parent folder for the materialised Parquet (default: a local temp folder).
            On a cluster it must be readable by every executor (``abfss://``, ``hdfs://``...).
        storage_options: credentials for reading ``cache_url`` in the ranks (fsspec/adlfs).
        keep_cache: keep the Parquet files after the run (default: removed, also on failure).
        dtype: floating-point type of features after materialisation (default float32).
        shared_cache: declare a ``file://`` cache to be a folder every executor sees (a shared
            mount), allowing it on a non-local master.

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
                 dtype: str = "float32", shared_cache: bool = False) -> None:
        self.features = _as_list(features, "features")
        self.label = label
        self.columns = self.features + ([label] if label else [])
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"A column is used twice: features={self.features}, label={label!r}")
        existing = list(df.columns)
        missing = [c for c in self.columns if c not in existing]
        if missing:
            raise KeyError(f"Column(s) {missing} not in the DataFrame; it has: {existing}")
        schema = {f.name: f.dataType for f in df.schema.fields}
        self.kinds = {c: check_column_type(c, schema[c]) for c in self.columns}
        self.shapes = {k: tuple(int(d) for d in v) for k, v in (shapes or {}).items()}
        unknown = set(self.shapes) - set(self.columns)
        if unknown:
            raise KeyError(f"shapes names column(s) {sorted(unknown)} that are not used; used "
                           f"columns: {self.columns}")
        self.dtype = np.dtype(dtype).name
        self.cache_url = cache_url
        self.storage_options = dict(storage_options or {})
        self.keep_cache = keep_cache
        self.shared_cache = shared_cache
        self._df = df
        self._converter = None
        self._created_parent: Optional[str] = None
        self.files: list[str] = []
        self.row_counts: list[int] = []
        self.num_rows: Optional[int] = None
        self._shard_cache: Optional[tuple[tuple[int, int], dict[str, np.ndarray]]] = None

    # -- driver side -----------------------------------------------------------------------
    def _check_nulls(self) -> None:
        from pyspark.sql import functions as F

        counts = self._df.select([F.sum(F.col(c).isNull().cast("long")).alias(c)
                                  for c in self.columns]).first()
        bad = {c: int(counts[c] or 0) for c in self.columns if counts[c]}
        if bad:
            detail = ", ".join(f"{c!r}: {n}" for c, n in bad.items())
            raise ValueError(
                f"Null values in used column(s) ({detail}). Drop or fill them before training, "
                f"e.g. df.dropna(subset={sorted(bad)}) or df.fillna(...).")

    def _check_cache_visible(self, parent: str, master: str) -> None:
        from .session import is_loopback_master

        if urlparse(parent).scheme in ("", "file") and not is_loopback_master(master) \
                and not self.shared_cache:
            raise ValueError(
                f"The DataFrameDataset cache {parent} is on the driver's local disk, which the "
                f"executors of {master} cannot read. Pass cache_url= a location every executor "
                "can read (abfss://..., hdfs://...), or shared_cache=True if it is a shared mount.")

    def materialize(self) -> "DataFrameDataset":
        """Check nulls and write the selected columns as Parquet (driver; once per run)."""
        if self.num_rows is not None:
            return self
        spark = self._df.sparkSession
        if self.cache_url:
            parent = self.cache_url
        else:
            self._created_parent = tempfile.mkdtemp(prefix="sparkhvd-cache-")
            parent = "file://" + self._created_parent
        if urlparse(parent).scheme == "" and parent.startswith("/"):
            parent = "file://" + parent
        self._check_cache_visible(parent, spark.sparkContext.master)
        self._check_nulls()
        previous = spark.conf.get(_PETASTORM_CONF, None)
        spark.conf.set(_PETASTORM_CONF, parent)
        petastorm_log = logging.getLogger("petastorm")
        level = petastorm_log.level
        petastorm_log.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from petastorm.spark import make_spark_converter

                self._converter = make_spark_converter(self._df.select(*self.columns),
                                                       dtype=self.dtype)
        finally:
            petastorm_log.setLevel(level)
            if previous is None:
                spark.conf.unset(_PETASTORM_CONF)
            else:
                spark.conf.set(_PETASTORM_CONF, previous)
        _own_cache_cleanup(self._converter.cache_dir_url, self.keep_cache)
        self.files = sorted(self._converter.file_urls)
        self.row_counts = [self._parquet_rows(f) for f in self.files]
        self.num_rows = sum(self.row_counts)
        log.info("DataFrameDataset: %d rows of %s in %d Parquet file(s) under %s", self.num_rows,
                 self.columns, len(self.files), self._converter.cache_dir_url)
        return self

    def cleanup(self) -> None:
        """Remove the materialised files (unless ``keep_cache``); the next run re-materialises."""
        if self.keep_cache or self._converter is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                self._converter.delete()
            except Exception as exc:  # noqa: BLE001 - cleanup must not hide the run's outcome
                log.warning("could not delete the dataset cache %s: %s",
                            self._converter.cache_dir_url, exc)
        _PENDING_CACHES.discard(self._converter.cache_dir_url)
        if self._created_parent:
            import shutil

            shutil.rmtree(self._created_parent, ignore_errors=True)
            self._created_parent = None
        self._converter = None
        self.files, self.row_counts, self.num_rows = [], [], None

    @property
    def cache_dir(self) -> Optional[str]:
        """URL of the materialised Parquet folder, once materialised."""
        return self._converter.cache_dir_url if self._converter is not None else None

    # HorovodRunner hooks: prepare before pickling, clean up after the run.
    def _sparkhvd_prepare(self) -> None:
        self.materialize()

    def _sparkhvd_cleanup(self) -> None:
        self.cleanup()

    def __getstate__(self) -> dict:
        if self.num_rows is None:
            raise TypeError("A DataFrameDataset is materialised on the driver before it can be "
                            "sent to the ranks: pass it as an argument of HorovodRunner.run(), "
                            "or call .materialize() first.")
        state = dict(self.__dict__)
        state.update(_df=None, _converter=None, _shard_cache=None, _created_parent=None)
        return state

    # -- both sides ------------------------------------------------------------------------
    def _open(self, url: str):
        from . import storage

        loc = storage.resolve(url, self.storage_options)
        return loc.fs.open(loc.path, "rb")

    def _parquet_rows(self, url: str) -> int:
        import pyarrow.parquet as pq

        with self._open(url) as f:
            return pq.ParquetFile(f).metadata.num_rows

    def shard_bounds(self, rank: Optional[int] = None, size: Optional[int] = None) -> tuple[int, int]:
        """``(start, stop)`` global row indices owned by ``rank`` (default: this rank)."""
        if self.num_rows is None:
            raise RuntimeError("DataFrameDataset is not materialised; pass it to "
                               "HorovodRunner.run() or call .materialize().")
        env_rank, env_size, _, _ = current_rank()
        rank = env_rank if rank is None else rank
        size = env_size if size is None else size
        per_rank = self.num_rows // size
        return rank * per_rank, (rank + 1) * per_rank

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None) -> int:
        """Full batches every rank runs per epoch (the same on all ranks)."""
        if not isinstance(batch_size, int) or batch_size <= 0:
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

        column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
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
        if name in self.features and values.dtype.kind == "f":
            values = values.astype(self.dtype, copy=False)
        return values

    def load_shard(self, rank: Optional[int] = None, size: Optional[int] = None) -> dict[str, np.ndarray]:
        """This rank's rows as numpy arrays (read once per process, only the files it needs)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        bounds = self.shard_bounds(rank, size)
        if self._shard_cache and self._shard_cache[0] == bounds:
            return self._shard_cache[1]
        start, stop = bounds
        tables, offset = [], 0
        for url, count in zip(self.files, self.row_counts):
            lo, hi = max(start, offset), min(stop, offset + count)
            if lo < hi:
                with self._open(url) as f:
                    table = pq.read_table(f, columns=self.columns)
                tables.append(table.slice(lo - offset, hi - lo))
            offset += count
        n = stop - start
        table = pa.concat_tables(tables) if tables else None
        arrays = {c: self._to_numpy(c, table.column(c), n) if table is not None
                  else np.empty((0,)) for c in self.columns}
        self._shard_cache = (bounds, arrays)
        return arrays

    def batches(self, batch_size: int, epoch: int = 0, *, shuffle: bool = False, seed: int = 0,
                rank: Optional[int] = None, size: Optional[int] = None) -> Iterator[Any]:
        """One epoch of this rank's full batches: ``(x, y)`` (or ``x`` without a label)."""
        arrays = self.load_shard(rank, size)
        steps = self.steps_per_epoch(batch_size, size)
        n = len(next(iter(arrays.values())))
        if shuffle:
            r = current_rank()[0] if rank is None else rank
            order = np.random.default_rng([seed, epoch, r]).permutation(n)
        for step in range(steps):
            if shuffle:
                # sorted gathers are faster; the order within a batch does not matter
                idx: Any = np.sort(order[step * batch_size:(step + 1) * batch_size])
            else:
                idx = slice(step * batch_size, (step + 1) * batch_size)  # views, no copy
            x = {c: arrays[c][idx] for c in self.features}
            x = x[self.features[0]] if len(self.features) == 1 else x
            yield (x, arrays[self.label][idx]) if self.label else x

    @contextlib.contextmanager
    def tf_dataset(self, batch_size: int, epochs: Optional[int] = None, *, shuffle: bool = False,
                   seed: int = 0, prefetch: int = 2) -> Iterator[Any]:
        """This rank's shard as a ``tf.data.Dataset`` of full batches.

        Args:
            batch_size: rows per batch (per rank).
            epochs: how many epochs the dataset yields; ``None`` (default) repeats forever, which
                suits ``model.fit(..., steps_per_epoch=ds.steps_per_epoch(batch_size))``.
            shuffle: permute the rank's rows each epoch (seeded by ``seed``, epoch and rank).
        """
        import tensorflow as tf

        first = next(self.batches(batch_size, 0))

        def spec(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: spec(v) for k, v in value.items()}
            return tf.TensorSpec((None,) + value.shape[1:], tf.as_dtype(value.dtype))

        signature = tuple(spec(v) for v in first) if self.label else spec(first)

        def generate() -> Iterator[Any]:
            for epoch in (range(epochs) if epochs is not None else itertools.count()):
                yield from self.batches(batch_size, epoch, shuffle=shuffle, seed=seed)

        dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.OFF
        yield dataset.with_options(options).prefetch(prefetch)

    def __repr__(self) -> str:
        state = f"{self.num_rows} rows" if self.num_rows is not None else "not materialised"
        return f"DataFrameDataset(features={self.features}, label={self.label!r}, {state})"

