"""Driver side of :class:`~sparkhvd.data.DataFrameDataset`: check once, write once, reuse.

1. **Conversion in Spark SQL** (:func:`converted`): Spark ML vectors become float arrays
   (``vector_to_array``), floating-point and decimal columns become ``dtype``; names are quoted
   (``a.b`` is a column, not a struct field) and stored as ``c0, c1, ...`` in Parquet.
2. **Written and checked by the executors in one scan** (:func:`write`): ``mapInArrow`` hands
   each partition's Arrow batches to a function that writes them through
   :mod:`sparkhvd.storage` (fsspec/adlfs) as one Parquet file with row groups sized by the
   table (:func:`group_bytes_for`: at most :data:`ROW_GROUP_BYTES`) -- so ``abfss://`` caches
   need no Hadoop Azure connector, only a short-lived SAS token the driver mints
   (:func:`sparkhvd.storage.delegate`) -- and counts, as it writes, what the checks need
   (:func:`batch_stats`: rows, nulls, NaNs, array lengths). The job returns each file's row
   and row-group counts and footer -- the :class:`Manifest` the ranks read by; the footers go
   to them, so no rank reads one -- and the counts; :func:`check_profile` then refuses bad data (a ragged array
   column would be silently reshaped into garbage) and the files are deleted before anything
   is launched. (A separate checking pass used to scan the DataFrame twice.)
4. **Reused** (:class:`CacheRegistry`): a DataFrame with the same plan and columns, in the same
   session, is not written again; a cache is deleted when the last dataset using it is closed or
   garbage-collected, on a failed run, and at the driver's exit (unless ``keep_cache``).

   A garbage-collected dataset's cache is never deleted *by the collector*: the collector runs
   on whatever thread allocates, possibly inside an ``import`` that holds Python's import lock,
   and deleting from remote storage waits on fsspec's IO thread -- which may itself wait for
   that lock (a deadlock seen with ``abfss://`` caches). The finalizer only queues the release
   (no lock, no I/O); :meth:`CacheRegistry.settle` does the deletions at safe points -- the next
   dataset, the end of a run, interpreter exit -- in a helper thread, bounded in time, and a
   failed or slow deletion is logged, never raised.
"""
from __future__ import annotations

import atexit
import collections
import logging
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

__side__ = "driver"

log = logging.getLogger(__name__)

_INTEGERS = ("ByteType", "ShortType", "IntegerType", "LongType")
_FLOATS = ("FloatType", "DoubleType")
_NUMERIC = _INTEGERS + _FLOATS + ("BooleanType", "DecimalType")
_ARRAY_ELEMENTS = _INTEGERS + _FLOATS
#: Largest size of one Parquet row group: the unit a rank reads, and the block the global
#: order permutes (:mod:`sparkhvd.data.order`). Small, because a row group a partition
#: boundary or a span's end splits is read by two ranks (1 MB groups cost 14 % on B14's 237 MB
#: table, 512 KB about half that) and a shuffle window (128 MB by default, over 24
#: partitions) should hold many of them; large enough to read at pyarrow's speed when a scan
#: takes several at once (bench B2T, B14). Smaller tables get smaller groups.
ROW_GROUP_BYTES = 512 << 10
#: Row groups a materialised table should hold in all: a rank reads a row group at each end
#: of its span (and its share is its groups: on sorted data, the labels its batches can
#: hold), so at np = 64 a share should be tens of groups. A table too small for that many
#: groups of :data:`ROW_GROUP_BYTES` is written in smaller ones (:func:`group_bytes_for`).
GROUPS_WANTED = 2048
#: The smallest row group written (smaller ones cost more in footers and per-group reads than
#: a split boundary costs).
MIN_GROUP_BYTES = 32 << 10
#: What a write task buffers, at most, to learn its partition's size before its first group.
SIZING_BUFFER_BYTES = 128 << 20
#: How long a safe point waits for queued cache deletions (they go on in the background after).
SETTLE_S = 30.0


def _type_name(data_type: Any) -> str:
    return type(data_type).__name__


def check_column_type(name: str, data_type: Any) -> str:
    """'scalar', 'array' or 'vector' for a supported Spark type; TypeError naming the column else."""
    kind = _type_name(data_type)
    if kind in _NUMERIC:
        return "scalar"
    if kind == "VectorUDT":
        return "vector"
    if kind == "ArrayType" and _type_name(data_type.elementType) in _ARRAY_ELEMENTS:
        return "array"
    simple = data_type.simpleString() if hasattr(data_type, "simpleString") else kind
    raise TypeError(
        f"Column {name!r} has type {simple}, which DataFrameDataset cannot feed to a model. "
        "Supported: numeric scalars, array<float|double|int|long>, and Spark ML vectors "
        "(VectorUDT, dense or sparse). Convert it first, e.g. with StringIndexer for strings, "
        "VectorAssembler for several numeric columns, or select the numeric fields of a struct.")


def quoted(name: str) -> Any:
    """A column reference that takes ``name`` literally (dots, spaces, backticks)."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def is_float(data_type: Any) -> bool:
    kind = _type_name(data_type)
    if kind == "ArrayType":
        return _type_name(data_type.elementType) in _FLOATS
    return kind in _FLOATS or kind == "VectorUDT"


@dataclass
class Manifest:
    """The materialised Parquet: files in global row order, with row and row-group counts."""

    url: str
    files: list[str]
    row_counts: list[int]
    row_groups: list[list[int]]
    stored: dict[str, str]  # column -> its name in the Parquet files
    row_bytes: int
    extra: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return sum(self.row_counts)


def batch_stats(batch: Any, floats: Sequence[str]) -> dict:
    """What the checks need from one Arrow batch of the converted columns (``floats``: the
    names holding floating-point values): rows; per column rows that are null or hold a null
    element, rows holding a NaN, and the array lengths' range."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def rows_with(parents: Any, mask: Any) -> int:
        hit = pc.filter(parents, pc.fill_null(mask, False))
        return len(pc.unique(hit)) if len(hit) else 0

    stats: dict = {"rows": batch.num_rows, "nulls": {}, "nans": {}, "lengths": {}}
    for name, col in zip(batch.schema.names, batch.columns):
        nulls = col.null_count
        nans = 0
        if isinstance(col.type, (pa.ListType, pa.LargeListType)):
            lengths = pc.list_value_length(col)
            if lengths.null_count < len(lengths):
                stats["lengths"][name] = (pc.min(lengths).as_py(), pc.max(lengths).as_py())
            flat, parents = pc.list_flatten(col), pc.list_parent_indices(col)
            if flat.null_count:
                nulls += rows_with(parents, pc.is_null(flat))
            if name in floats:
                nans = rows_with(parents, pc.is_nan(flat))
        elif name in floats:
            nans = int(pc.sum(pc.fill_null(pc.is_nan(col), False)).as_py() or 0)
        if nulls:
            stats["nulls"][name] = nulls
        if nans:
            stats["nans"][name] = nans
    return stats


def merge_stats(parts: Sequence[dict], stored: Mapping[str, str]) -> dict:
    """The partitions' :func:`batch_stats` as one profile, by the user's column names."""
    names = {v: k for k, v in stored.items()}
    found: dict = {"rows": 0, "nulls": {}, "nans": {}, "lengths": {}}
    for part in parts:
        found["rows"] += part["rows"]
        for key in ("nulls", "nans"):
            for col, n in part[key].items():
                found[key][names[col]] = found[key].get(names[col], 0) + n
        for col, (lo, hi) in part["lengths"].items():
            was = found["lengths"].get(names[col], (lo, hi))
            found["lengths"][names[col]] = (min(was[0], lo), max(was[1], hi))
    return found


def profile(df: Any, columns: Sequence[str], kinds: Mapping[str, str],
            schema: Mapping[str, Any]) -> dict:
    """One Spark job: rows, and per column nulls, NaNs, array length range, null elements
    (``predict``'s checks, which write nothing; materialising counts them while writing)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    def rows_where(condition: Any, alias: str) -> Any:
        return F.sum(F.when(condition, 1).otherwise(0)).alias(alias)

    aggs = [F.count(F.lit(1)).alias("rows")]
    for i, name in enumerate(columns):
        col = quoted(name)
        aggs.append(F.sum(col.isNull().cast("long")).alias(f"null{i}"))
        if kinds[name] == "vector":
            col = vector_to_array(col)
        if kinds[name] in ("array", "vector"):
            aggs += [F.min(F.size(col)).alias(f"min{i}"), F.max(F.size(col)).alias(f"max{i}")]
            # array_contains, not exists(col, x -> ...): Spark compiles it, while a lambda is
            # interpreted element by element (a third of the checks' pass on 784-wide arrays).
            # It is true on a match and NULL when the array holds a null and no match;
            # NaN equals NaN in Spark's comparisons. So, with every NaN removed first:
            # NULL <=> a null element.
            probe = float("nan") if is_float(schema[name]) else 0
            aggs.append(rows_where(col.isNotNull() & F.array_contains(
                F.array_remove(col, probe), probe).isNull(), f"inull{i}"))
            if is_float(schema[name]):
                aggs.append(rows_where(F.array_contains(col, probe), f"nan{i}"))
        elif is_float(schema[name]):
            aggs.append(F.sum(F.isnan(col).cast("long")).alias(f"nan{i}"))
    row = df.agg(*aggs).first().asDict()
    found: dict = {"rows": int(row["rows"] or 0), "nulls": {}, "nans": {}, "lengths": {}}
    for i, name in enumerate(columns):
        nulls = int(row.get(f"null{i}") or 0) + int(row.get(f"inull{i}") or 0)
        if nulls:
            found["nulls"][name] = nulls
        if row.get(f"nan{i}"):
            found["nans"][name] = int(row[f"nan{i}"])
        if f"min{i}" in row and row[f"min{i}"] is not None:
            found["lengths"][name] = (int(row[f"min{i}"]), int(row[f"max{i}"]))
    return found


def check_profile(found: dict, columns: Sequence[str], allow_nan: bool) -> None:
    """The errors a profile calls for, before anything is written or launched."""
    if found["rows"] == 0:
        raise ValueError(f"The DataFrame has no rows (columns {list(columns)}): there is nothing "
                         "to train on. Check the filters or joins that produced it.")
    if found["nulls"]:
        detail = ", ".join(f"{c!r}: {n}" for c, n in found["nulls"].items())
        raise ValueError(
            f"Null values in used column(s) ({detail}; arrays count a row holding a null "
            f"element). Drop or fill them before training, e.g. "
            f"df.dropna(subset={sorted(found['nulls'])}) or df.fillna(...).")
    if found["nans"] and not allow_nan:
        detail = ", ".join(f"{c!r}: {n}" for c, n in found["nans"].items())
        raise ValueError(
            f"NaN values in used column(s) ({detail} row(s)): the model would train on NaN. "
            "Drop or fill them (df.na.drop(...), df.na.fill(...)), or pass allow_nan=True to "
            "DataFrameDataset to train on them as they are.")
    ragged = {c: r for c, r in found["lengths"].items() if r[0] != r[1]}
    if ragged:
        detail = ", ".join(f"{c!r}: from {lo} to {hi} elements" for c, (lo, hi) in ragged.items())
        raise ValueError(
            f"Array column(s) with rows of different lengths ({detail}): every row must have the "
            "same length to become one tensor. Pad or truncate them first (e.g. with "
            "F.slice or F.concat), or filter the rows that differ.")


def converted(df: Any, columns: Sequence[str], kinds: Mapping[str, str],
              schema: Mapping[str, Any], dtype: str) -> tuple[Any, dict[str, str]]:
    """The DataFrame to write: vectors as arrays, floats/decimals as ``dtype``, safe names."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql.types import ArrayType, DoubleType, FloatType

    spark_float = FloatType() if dtype == "float32" else DoubleType()
    stored, selected = {}, []
    for i, name in enumerate(columns):
        col, kind = quoted(name), _type_name(schema[name])
        if kinds[name] == "vector":
            col = vector_to_array(col, dtype=dtype)
        elif kinds[name] == "array" and is_float(schema[name]):
            col = col.cast(ArrayType(spark_float))
        elif kind in _FLOATS or kind == "DecimalType":
            col = col.cast(spark_float)
        stored[name] = f"c{i}"
        selected.append(col.alias(stored[name]))
    return df.select(*selected), stored


def row_bytes(columns: Sequence[str], kinds: Mapping[str, str], schema: Mapping[str, Any],
              lengths: Mapping[str, tuple[int, int]], dtype: str) -> int:
    """Bytes per row once in memory (numpy), to size row groups and the memory budget."""
    import numpy as np

    total = 0
    for name in columns:
        kind = _type_name(schema[name])
        element = schema[name].elementType if kind == "ArrayType" else schema[name]
        size = np.dtype(dtype).itemsize if (is_float(schema[name]) or kind == "DecimalType") \
            else 8 if _type_name(element) in ("LongType", "IntegerType") else 4
        count = lengths.get(name, (1, 1))[1] if kinds[name] in ("array", "vector") else 1
        total += size * max(1, count)
    return max(1, total)


def file_count(cores: int) -> int:
    """How many files (write tasks) to materialise into: one wave of the cluster's task slots.

    Every write task costs a Python worker and a file, so a 2,000-row DataFrame spread over
    1,000 partitions must not become 1,000 tasks and files (it took minutes). ``coalesce`` to
    the task slots merges them without a shuffle and keeps the scan as wide as the cluster; a
    DataFrame with fewer partitions keeps its own (``coalesce`` never splits). A file's size
    does not matter to the ranks: they read row groups.
    """
    return max(1, cores)


def group_bytes_for(known_bytes: int, files: int, ceiling: int = ROW_GROUP_BYTES) -> int:
    """A row group's size for a file whose partition holds at least ``known_bytes`` (in Arrow
    memory), one of ``files``: :data:`GROUPS_WANTED` groups in all, between
    :data:`MIN_GROUP_BYTES` and ``ceiling``."""
    return int(min(ceiling, max(MIN_GROUP_BYTES, known_bytes * max(1, files) // GROUPS_WANTED)))


def _partition_writer(url: str, options: Mapping[str, Any], group_bytes: int,
                      floats: Sequence[str], files: int = 1) -> Any:
    """The function ``mapInArrow`` runs on the executors (see the module docstring). Its
    partition is one of about ``files``; it buffers up to :data:`SIZING_BUFFER_BYTES` (or all
    of a smaller partition) to size the row groups by the table (:func:`group_bytes_for`)."""

    def write(batches: Any) -> Any:
        import itertools
        import json

        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        from sparkhvd import storage
        from sparkhvd.data.footers import footer_bytes

        batches = (b for b in batches if b.num_rows)
        first = next(batches, None)
        if first is None:  # an empty partition writes no file
            return
        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        name = f"part-{partition:05d}.parquet"
        groups: list[int] = []
        enough = min(SIZING_BUFFER_BYTES, group_bytes * GROUPS_WANTED // max(1, files))
        buffered = [first]
        while sum(b.nbytes for b in buffered) < enough:
            more = next(batches, None)
            if more is None:
                break
            buffered.append(more)
        known = sum(b.nbytes for b in buffered)
        rows_per_group = max(1, group_bytes_for(known, files, group_bytes) *
                             sum(b.num_rows for b in buffered) // max(1, known))
        stats = []
        with storage.open_atomic(f"{url}/{name}", options) as f:
            writer = pq.ParquetWriter(f, first.schema)
            pending = None
            for batch in itertools.chain(buffered, batches):
                stats.append(batch_stats(batch, floats))
                table = pa.Table.from_batches([batch])
                pending = table if pending is None else pa.concat_tables([pending, table])
                while pending.num_rows >= rows_per_group:
                    writer.write_table(pending.slice(0, rows_per_group),
                                       row_group_size=rows_per_group)
                    groups.append(rows_per_group)
                    pending = pending.slice(rows_per_group)
            if pending is not None and pending.num_rows:
                writer.write_table(pending, row_group_size=pending.num_rows)
                groups.append(pending.num_rows)
            writer.close()
        yield pa.RecordBatch.from_pydict({"partition": [partition], "file": [name],
                                          "rows": [sum(groups)], "groups": [groups],
                                          "stats": [json.dumps(stats)],
                                          "footer": [footer_bytes(writer.writer.metadata)]})

    return write


def write(df: Any, url: str, executor_options: Mapping[str, Any], floats: Sequence[str],
          files: Optional[int] = None, group_bytes: Optional[int] = None
          ) -> tuple[list[tuple[str, int, list[int], bytes]], list[dict]]:
    """Write ``df`` under ``url`` from the executors: ``(file, rows, row groups, footer)`` in
    row order (the footer: its ``FileMetaData``'s :func:`~sparkhvd.data.footers.footer_bytes`), and every batch's
    :func:`batch_stats`.

    ``files``: at most this many files (partitions are merged in order, see :func:`file_count`).
    """
    import json
    import warnings

    if files:
        df = df.coalesce(files)  # narrow: no shuffle, row order kept
    writer = _partition_writer(url, dict(executor_options), group_bytes or ROW_GROUP_BYTES,
                               list(floats), files or 1)
    with warnings.catch_warnings():  # pyspark's own pandas/pyarrow version checks warn
        warnings.simplefilter("ignore", DeprecationWarning)
        rows = df.mapInArrow(writer, "partition long, file string, rows long, "
                                     "groups array<long>, stats string, footer binary"
                             ).collect()
    rows = sorted(rows, key=lambda r: r["partition"])
    return ([(f"{url}/{r['file']}", int(r["rows"]), [int(g) for g in r["groups"]],
              bytes(r["footer"])) for r in rows],
            [s for r in rows for s in json.loads(r["stats"])])


# -- reuse ---------------------------------------------------------------------------------------
@dataclass
class _Entry:
    manifest: Manifest
    df: Any
    options: dict
    keep: bool
    users: int = 0


class CacheRegistry:
    """The materialised caches of this driver process, shared by equal DataFrames."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()
        #: releases queued by garbage-collected datasets (appended without a lock: the
        #: collector may run while this thread holds ``_lock``)
        self._collected: collections.deque = collections.deque()
        self._settling: Optional[threading.Thread] = None
        atexit.register(self.delete_all)

    def find(self, key: tuple, df: Any) -> Optional[Manifest]:
        """A live cache of the same plan (confirmed with ``sameSemantics``), now one user more."""
        self.settle()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            try:
                same = entry.df.sameSemantics(df)
            except Exception:  # noqa: BLE001 - a stopped session: the old cache is unusable
                same = False
            if not same:
                return None
            entry.users += 1
            return entry.manifest

    def add(self, key: tuple, manifest: Manifest, df: Any, options: dict, keep: bool) -> None:
        with self._lock:
            self._entries[key] = _Entry(manifest, df, dict(options), keep, users=1)

    def release(self, manifest: Manifest, *, delete: bool, keep: Optional[bool] = None) -> None:
        """One user less; the files go when nobody uses them (and ``delete`` allows it).
        ``keep`` updates whether the cache outlives its users (``keep_cache``). Called at safe
        points only (``close()``, a failed run): it deletes on this thread."""
        url_options = self._drop(manifest, keep)
        if url_options is not None and delete:
            _delete(*url_options)

    def collected(self, manifest: Manifest) -> None:
        """A dataset using ``manifest`` was garbage-collected: queue its release for the next
        safe point. Runs inside the collector: no lock, no I/O, never raises."""
        self._collected.append(manifest)

    def settle(self, wait_s: float = SETTLE_S) -> None:
        """A safe point: release what collected datasets queued and delete the caches nobody
        uses any more, in a helper thread; wait at most ``wait_s`` for it (the deletions go on
        in the background after that, and a failure is logged)."""
        doomed = []
        while self._collected:
            url_options = self._drop(self._collected.popleft(), None)
            if url_options is not None:
                doomed.append(url_options)
        self._delete_in_background(doomed, wait_s)

    def _delete_in_background(self, doomed: list[tuple[str, dict]], wait_s: float) -> None:
        if doomed:
            self._settling = threading.Thread(target=_delete_each, args=(doomed,), daemon=True,
                                              name="sparkhvd-cache-cleanup")
            self._settling.start()
        if self._settling is not None:
            self._settling.join(wait_s)
            if self._settling.is_alive():
                log.warning("deleting unused dataset caches did not finish within %g s; it "
                            "goes on in the background", wait_s)
            else:
                self._settling = None

    def _drop(self, manifest: Manifest, keep: Optional[bool]) -> Optional[tuple[str, dict]]:
        """One user less; ``(url, options)`` to delete when that was the last one."""
        with self._lock:
            key = next((k for k, e in self._entries.items() if e.manifest is manifest), None)
            entry = self._entries.get(key) if key is not None else None
            if entry is None:
                return None
            if keep is not None:
                entry.keep = keep
            entry.users -= 1
            if entry.users > 0 or entry.keep:
                return None
            self._entries.pop(key, None)  # type: ignore[arg-type]
        return manifest.url, entry.options

    def delete_all(self) -> None:
        """At exit: every cache nobody asked to keep (bounded like :meth:`settle`)."""
        self._collected.clear()  # their entries are among these
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        self._delete_in_background([(e.manifest.url, e.options) for e in entries if not e.keep],
                                   SETTLE_S)


def _delete_each(doomed: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    for url, options in doomed:
        _delete(url, options)


def _delete(url: str, options: Mapping[str, Any]) -> None:
    from sparkhvd import storage

    try:
        storage.delete(url, options, recursive=True)
        log.debug("deleted the dataset cache %s", storage.public_url(url))
    except Exception as exc:  # noqa: BLE001 - clean-up must not hide anything else
        log.warning("could not delete the dataset cache %s: %s", storage.public_url(url), exc)


REGISTRY = CacheRegistry()


def new_cache_url(parent: str) -> str:
    """A fresh folder name under ``parent`` for one materialisation."""
    return f"{parent.rstrip('/')}/sparkhvd-{uuid.uuid4().hex[:16]}"


def finalizer(owner: Any, manifest: Manifest) -> Any:
    """Queue the release of ``manifest`` when ``owner`` is garbage-collected (done at the next
    safe point: :meth:`CacheRegistry.settle`)."""
    return weakref.finalize(owner, REGISTRY.collected, manifest)


class DatasetCaches:
    """The datasets' caches as a run service (:class:`sparkhvd.driver.services.RunService`):
    no rank runs once the run ended -- a safe point to delete the caches of datasets
    garbage-collected meanwhile (never done by the collector itself)."""

    def attempt_starts(self, start: Any) -> Mapping[str, str]:
        return {}

    def attempt_ended(self, hosts: frozenset) -> None:
        return None

    def run_ended(self, succeeded: bool, hosts: Sequence[frozenset]) -> None:
        REGISTRY.settle()
