"""``DataFrameDataset``, the driver half: a Spark DataFrame the ranks read in one global order.

Created on the driver, passed to ``HorovodRunner.run()``: the runner prepares it right before
launch (:mod:`sparkhvd.driver.arguments`): it is checked and materialised as Parquet by the
executors (:mod:`sparkhvd.data.materialize`, reused across runs), and the ranks receive a
:class:`~sparkhvd.data.sharding.ShardSource` in its place, which they read as a
:class:`~sparkhvd.data.shard.DatasetShard` (the sharding policy is in
:mod:`sparkhvd.data.sharding`).
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Mapping, Optional, Sequence, Union
from urllib.parse import urlparse

import numpy as np

from sparkhvd.data.order import DEFAULT_PARTITIONS
from sparkhvd.data.sharding import (
    MEMORY_CACHE_BYTES,
    READ_MEMORY_BYTES,
    SHIPPED_FOOTERS_BYTES,
    ShardSource,
    footer_size,
)
from sparkhvd.spark.slots import task_slots
from sparkhvd.storage import public_url

__side__ = "driver"

log = logging.getLogger(__name__)

#: More partitions than this would make each partition's share of a window smaller than a
#: row group.
MAX_PARTITIONS = 4096

def _as_list(value: Union[str, Sequence[str]], what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    names = list(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a column name or a list of column names; got {value!r}")
    return names


def _widths(lengths: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Elements per row of each array column (checked equal on every row)."""
    return {name: int(hi) for name, (_, hi) in lengths.items()}


def _common_parent(urls: Sequence[str]) -> str:
    """The folder all ``urls`` lie under (for the log line)."""
    import posixpath

    return posixpath.commonpath([u.split("://", 1)[-1] for u in urls]) if len(urls) > 1 \
        else posixpath.dirname(urls[0].split("://", 1)[-1])


def shipped_footers(manifest: Any) -> dict[str, Any]:
    """The ``ShardSource`` fields that ship the files' footers the driver holds to the ranks
    (none when they exceed :data:`~sparkhvd.data.sharding.SHIPPED_FOOTERS_BYTES` in all)."""
    from sparkhvd.data.footers import footer_of

    footers = list(manifest.extra.get("footers") or [])
    if len(footers) != len(manifest.files) or \
            sum(len(f) for f in footers) > SHIPPED_FOOTERS_BYTES:
        return {}
    return {"footers": tuple(footers),
            "footer_bytes": sum(footer_size(footer_of(f)) for f in footers)}


def default_cache_parent() -> str:
    """Where the default (driver-local) caches go: ``$TMPDIR/sparkhvd-cache``."""
    return os.path.join(tempfile.gettempdir(), "sparkhvd-cache")


class DataFrameDataset:
    """A Spark DataFrame the ranks read in one global order (see the module docstring).

    Create it on the driver and pass it to :meth:`HorovodRunner.run` as an argument (also inside
    a list or dict). Inside the training function that argument is this rank's
    :class:`~sparkhvd.data.shard.DatasetShard`: use its ``tf_dataset()`` (or ``batches()``)
    and ``steps_per_epoch()``.

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
        in_place: read a DataFrame that is just a scan of Parquet files (``spark.read.parquet``,
            a Parquet table, with a column selection) from its own files, writing nothing;
            ``None`` (default): when its files suit (see the DataFrames guide), else
            materialise; ``False``: always materialise; ``True``: in place or an error that
            says why not.
        memory_cache: bytes a rank may keep in memory (default 512 MB): a rank whose share
            fits reads it once and keeps it, and a dataset that fits whole is shuffled as one
            window per partition; otherwise the rows stream every epoch.
        partitions: ``P``, the parts the rows are cut into for the order (default 24). Any
            ``np`` reads only its share; for the ``np`` up to 8 that divide ``P`` (with 24:
            1, 2, 3, 4, 6, 8) the epoch's order is one and the same, for any other each rank
            reads a contiguous span of it, dealt (:mod:`sparkhvd.data.deal`). Positions saved with
            one ``P`` resume only with the same ``P``.

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
                 memory_cache: int = MEMORY_CACHE_BYTES,
                 partitions: int = DEFAULT_PARTITIONS,
                 in_place: Optional[bool] = None) -> None:
        from sparkhvd.data.materialize import check_column_type

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
        if isinstance(partitions, bool) or not isinstance(partitions, int) or \
                not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be an int from 1 to {MAX_PARTITIONS}; got "
                             f"{partitions!r} (24: 1, 2, 3, 4, 6 and 8 ranks divide it and "
                             "share one order)")
        self.partitions = partitions
        if in_place not in (None, True, False):
            raise ValueError(f"in_place must be None, True or False; got {in_place!r}")
        self.in_place = in_place
        self._df = df
        self._manifest: Any = None
        self._finalizer: Any = None
        #: in_place=True: the files found now (a DataFrame that cannot be read in place is
        #: refused here, not when a run starts), read by :meth:`materialize`
        self._planned: Any = self._plan_in_place() if in_place else None

    # -- driver side -----------------------------------------------------------------------
    def _check_cache_visible(self, parent: str, master: str,
                             executors_here: Optional[bool] = None) -> None:
        from sparkhvd.spark.sparkview import is_loopback_master

        here = is_loopback_master(master) if executors_here is None else executors_here
        if urlparse(parent).scheme in ("", "file") and not here and not self.shared_cache:
            raise ValueError(
                f"The DataFrameDataset cache {parent} is on the driver's local disk, which the "
                f"executors of {master} cannot read. Pass cache_url= a location every executor "
                "can read (abfss://...), or shared_cache=True if it is a shared mount.")

    def materialize(self) -> "DataFrameDataset":
        """Check the columns and find the Parquet the ranks read: the DataFrame's own files
        when it is a plain Parquet scan that suits (``in_place``), else an earlier
        materialisation of the same DataFrame, else write it (driver; done by
        ``HorovodRunner.run`` before launch)."""
        if self._manifest is not None:
            return self
        from sparkhvd.data import materialize as mat
        from sparkhvd.spark.session import DATA_MODULES, check_worker_python
        from sparkhvd.spark.sparkview import SparkView

        if self._df is None:
            raise RuntimeError("This DataFrameDataset was closed or came from a rank: create a "
                               "new one from the DataFrame.")
        spark = self._df.sparkSession
        parent = (self.cache_url or default_cache_parent()).rstrip("/")
        view = SparkView(spark)
        check_worker_python(view, modules=DATA_MODULES,
                            purpose="the Spark jobs that write the DataFrame's Parquet")
        manifest = self._in_place() if self.in_place is not False else None
        if manifest is None:
            manifest = self._materialised(parent, view)
        self._manifest = manifest
        self._finalizer = mat.finalizer(self, manifest)
        return self

    def _plan_in_place(self) -> Any:
        """The DataFrame's own Parquet files (:func:`sparkhvd.data.in_place.plan`), or why it
        cannot be read in place -- raised when ``in_place=True`` asks for it."""
        from sparkhvd.data import in_place

        found = in_place.plan(self._df, self.columns, self._schema, self.dtype,
                              self.storage_options, self.partitions)
        if isinstance(found, str) and self.in_place:
            raise ValueError(f"in_place=True, but the DataFrame cannot be read in place: "
                             f"{found}. Leave in_place unset to materialise it.")
        return found

    def _in_place(self) -> Any:
        """The DataFrame's own Parquet files, checked, when they can be read as they are
        (:mod:`sparkhvd.data.in_place`); None (with the log line saying why) otherwise."""
        from sparkhvd import storage
        from sparkhvd.data import materialize as mat

        found, self._planned = self._planned or self._plan_in_place(), None
        if isinstance(found, str):
            log.info("DataFrameDataset: materialising (not read in place: %s)", found)
            return None
        profile = mat.profile(self._df, self.columns, self.kinds, self._schema)
        mat.check_profile(profile, self.columns, self.allow_nan)
        manifest = mat.Manifest(
            url="", files=found.files, row_counts=found.row_counts, row_groups=found.row_groups,
            stored={c: c for c in self.columns},
            row_bytes=mat.row_bytes(self.columns, self.kinds, self._schema, profile["lengths"],
                                    self.dtype),
            extra={"rank_options": found.rank_options, "cast": found.cast, "in_place": True,
                   "widths": _widths(profile["lengths"]), "footers": found.footers})
        log.info("DataFrameDataset: reading %d rows of %s in place from %d Parquet file(s) "
                 "under %s (a plain file scan: nothing written)", manifest.num_rows,
                 self.columns, len(found.files),
                 storage.public_url(_common_parent(found.files)))
        return manifest

    def _materialised(self, parent: str, view: Any) -> Any:
        from sparkhvd import storage
        from sparkhvd.data import materialize as mat

        selected, stored = mat.converted(self._df, self.columns, self.kinds, self._schema,
                                         self.dtype)
        self._check_cache_visible(parent, view.master, view.executors_here())
        key = (parent, selected.semanticHash(), tuple(self.columns), self.dtype, self.allow_nan)
        manifest = mat.REGISTRY.find(key, selected)
        if manifest is not None:
            log.info("DataFrameDataset: reusing materialised data at %s (%d rows)",
                     storage.public_url(manifest.url), manifest.num_rows)
            return manifest
        url = mat.new_cache_url(parent)
        floats = [stored[c] for c in self.columns if mat.is_float(self._schema[c])]
        try:
            written, stats = mat.write(
                selected, url, storage.delegate(url, self.storage_options, write=True),
                floats, mat.file_count(task_slots(view)),
                # a rank at np=1 holds a row group of each partition: P of them fit the bound
                min(mat.ROW_GROUP_BYTES, READ_MEMORY_BYTES // self.partitions))
            found = mat.merge_stats(stats, stored)
            mat.check_profile(found, self.columns, self.allow_nan)
        except BaseException:
            mat._delete(url, self.storage_options)
            raise
        row_bytes = mat.row_bytes(self.columns, self.kinds, self._schema, found["lengths"],
                                  self.dtype)
        manifest = mat.Manifest(url=url, files=[f for f, _, _, _ in written],
                                row_counts=[n for _, n, _, _ in written],
                                row_groups=[g for _, _, g, _ in written], stored=stored,
                                row_bytes=row_bytes,
                                extra={"rank_options": storage.delegate(
                                    url, self.storage_options, write=False),
                                       "widths": _widths(found["lengths"]),
                                       "footers": [m for _, _, _, m in written]})
        mat.REGISTRY.add(key, manifest, selected, self.storage_options, self.keep_cache)
        log.info("DataFrameDataset: %d rows of %s in %d Parquet file(s) under %s",
                 manifest.num_rows, self.columns, len(manifest.files), storage.public_url(url))
        return manifest

    def close(self) -> None:
        """Release the materialised files: removed once no dataset uses them (unless
        ``keep_cache``). The next run materialises again."""
        from sparkhvd.data.materialize import REGISTRY

        manifest, self._manifest = self._manifest, None
        if manifest is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        REGISTRY.release(manifest, delete=not self.keep_cache, keep=self.keep_cache)

    cleanup = close

    def __enter__(self) -> "DataFrameDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def cache_dir(self) -> Optional[str]:
        """URL of the materialised Parquet folder, once materialised (None when read in
        place)."""
        return self._manifest.url or None if self._manifest is not None else None

    @property
    def read_in_place(self) -> Optional[bool]:
        """Whether the ranks read the DataFrame's own Parquet files (nothing was written);
        None before :meth:`materialize`."""
        if self._manifest is None:
            return None
        return bool(self._manifest.extra.get("in_place"))

    @property
    def files(self) -> list[str]:
        return list(self._manifest.files) if self._manifest is not None else []

    @property
    def row_counts(self) -> list[int]:
        return list(self._manifest.row_counts) if self._manifest is not None else []

    @property
    def num_rows(self) -> Optional[int]:
        return self._manifest.num_rows if self._manifest is not None else None

    @property
    def source(self) -> ShardSource:
        """What the ranks read (after :meth:`materialize`): files, policy inputs, and the
        read-only storage options minted for them -- never the driver's credentials."""
        manifest = self._need_manifest()
        return ShardSource(
            files=tuple(manifest.files), row_counts=tuple(manifest.row_counts),
            row_groups=tuple(tuple(g) for g in manifest.row_groups),
            stored=dict(manifest.stored), row_bytes=manifest.row_bytes,
            features=tuple(self.features), label=self.label, shapes=dict(self.shapes),
            memory_cache=self.memory_cache,
            storage_options=dict(manifest.extra.get("rank_options", {})),
            partitions=self.partitions, cast=dict(manifest.extra.get("cast", {})),
            widths=dict(manifest.extra.get("widths", {})), **shipped_footers(manifest))

    def steps_per_epoch(self, batch_size: int, size: Optional[int] = None) -> int:
        """Full batches every rank runs per epoch (the same on all ranks)."""
        return self.source.steps_per_epoch(batch_size, size)

    # -- the runner's preparation protocol (sparkhvd.driver.arguments) ------------------------
    def prepare_for_ranks(self) -> ShardSource:
        """Materialise (or reuse) on the driver; what the ranks get in this object's place."""
        if self._manifest is not None and not self.read_in_place:
            log.info("DataFrameDataset: reusing materialised data at %s (%d rows)",
                     public_url(self._manifest.url), self._manifest.num_rows)
        return self.materialize().source

    def after_run(self, succeeded: bool) -> None:
        """A failed run removes the materialised files at once (unless ``keep_cache``)."""
        if not succeeded and not self.keep_cache:
            self.close()

    def _need_manifest(self) -> Any:
        if self._manifest is None:
            raise RuntimeError("DataFrameDataset is not materialised; pass it to "
                               "HorovodRunner.run() or call .materialize().")
        return self._manifest

    def __reduce__(self) -> Any:
        raise TypeError(
            "A DataFrameDataset travels to the ranks only as an argument of HorovodRunner.run() "
            "(run(train, data=ds), also inside a list or dict): the runner materialises it and "
            "the ranks get their shard reader in its place. It was captured another way (a "
            "global or closure variable of the training function): pass it as an argument.")

    def __repr__(self) -> str:
        state = f"{self.num_rows} rows" if self._manifest is not None else "not materialised"
        return f"DataFrameDataset(features={self.features}, label={self.label!r}, {state})"
