"""Driver side: a DataFrame that is just a read of Parquet files is read where it lies.

``spark.read.parquet(...)`` (or a table whose optimized plan is a Parquet file scan with a
column selection and nothing else) already *is* what materialising would write: Parquet files
the ranks can read. Writing it again costs a full pass of the data and the disk for a copy.
So :func:`plan` reads the files' footers instead and, when they suit the ranks, hands them
over as they are: the checks (nulls, NaNs, array lengths) are one Spark aggregate job
(:func:`sparkhvd.data.materialize.profile`), the files' row groups are the blocks of the order,
floats are converted to the dataset's ``dtype`` as the ranks read them.

Anything else is materialised as before, and :func:`plan` says why (the log line): a plan with
more than a scan (a filter, a join, an expression, a limit...), another format (Delta's deletion
vectors and column mapping show up as a filter or missing columns; ORC, CSV), Spark ML vectors
or decimals, a column missing from a file (a partition column, schema evolution), files on
storage the ranks cannot be given read-only credentials for, or row groups too large for the
ranks to read only their share (Spark writes 128 MB row groups by default: a rank would read a
partition boundary's whole group, and a shuffle window would hold few groups).
"""
from __future__ import annotations

import concurrent.futures
import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from sparkhvd.common.patches import forbid_pickled_arrow_types
from sparkhvd.data.footers import footer_bytes
from sparkhvd.data.sharding import READ_MEMORY_BYTES

__side__ = "driver"

log = logging.getLogger(__name__)

#: Column kinds read as they are stored (vectors and decimals need Spark to convert them).
_IN_PLACE_TYPES = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType",
                   "BooleanType")
#: A row group up to this many bytes in memory is small beside a partition; larger ones only
#: when the data holds at least :data:`GROUPS_PER_PARTITION` of them per partition. Either way
#: ``P`` of them must fit the reading bound (:func:`groups_reason`).
SMALL_GROUP_BYTES = 4 << 20
GROUPS_PER_PARTITION = 10
#: Footers read at once (each is one or two range reads).
FOOTER_THREADS = 16

_NAME = re.compile(r"^[^\s,()#\[\]`]+$")


@dataclass(frozen=True)
class Found:
    """The files of a plain Parquet scan, as the ranks will read them."""

    files: list[str]
    row_counts: list[int]
    row_groups: list[list[int]]
    #: column -> numpy dtype to convert to when read
    cast: dict[str, str]
    rank_options: dict
    #: each file's footer, as :func:`~sparkhvd.data.footers.footer_bytes` (read here to check the files; shipped to the ranks)
    footers: list[bytes]


def optimized_plan(df: Any) -> str:
    """The DataFrame's optimized logical plan as Spark prints it (classic or Connect)."""
    if hasattr(df, "_jdf"):
        jvm = df.sparkSession._jvm
        text = jvm.PythonSQLUtils.explainString(df._jdf.queryExecution(), "extended")
    else:
        text = df._explain_string(mode="extended")
    return text.split("== Optimized Logical Plan ==", 1)[-1].split("== Physical Plan ==")[0]


def not_a_plain_scan(plan: str, columns: Sequence[str]) -> Optional[str]:
    """Why ``plan`` (of the DataFrame restricted to ``columns``) is not a Parquet file scan with
    a column selection; None when it is."""
    lines = [line.strip() for line in plan.strip().splitlines() if line.strip()]
    relation = re.compile(r"^(\+- )?Relation (\S+)?\[.*\] (\w+)$")
    found = relation.match(lines[-1]) if lines else None
    if found is None or len(lines) > 2:
        first = lines[0] if lines else "nothing"
        return f"its plan is more than a file scan ({first.split('[')[0].strip()} ...)"
    if found.group(3) != "parquet":
        return f"it reads {found.group(3)} files, not Parquet"
    if len(lines) == 2:
        project = re.match(r"^Project \[(.*)\]$", lines[0])
        if project is None:
            return f"its plan is more than a file scan ({lines[0].split('[')[0].strip()} ...)"
        items = [item.strip() for item in project.group(1).split(",")]
        names = [item.rsplit("#", 1)[0] for item in items]
        if any(" " in item for item in items) or names != list(columns):
            return "it computes or renames columns"
    return None


def _kind_reason(columns: Sequence[str], schema: Mapping[str, Any]) -> Optional[str]:
    for name in columns:
        data_type = schema[name]
        kind = type(data_type).__name__
        if kind == "ArrayType":
            kind = type(data_type.elementType).__name__
        if kind not in _IN_PLACE_TYPES:
            return f"column {name!r} is {data_type.simpleString()}, which Spark converts"
        if not _NAME.match(name):
            return f"column name {name!r} needs quoting"
    return None


#: Bytes of a value in memory, by Parquet physical type (the encoded size says little:
#: dictionary and run-length encoding shrink repetitive columns).
_WIDTH = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "FLOAT": 4, "DOUBLE": 8}


@dataclass(frozen=True)
class Footer:
    """What a file's footer says: rows per row group, the columns it has, and the largest
    row group's size (the used columns' values, as wide as in memory)."""

    groups: list[int]
    names: list[str]
    largest_bytes: int
    total_bytes: int
    pickled: bytes


def _footer(url: str, options: Mapping[str, Any], columns: Sequence[str]) -> Footer:
    import pyarrow.parquet as pq

    from sparkhvd import storage

    forbid_pickled_arrow_types()
    loc = storage.resolve(url, options)
    if loc.is_local:
        meta = pq.read_metadata(loc.path)
    else:
        with loc.fs.open(loc.path, "rb") as handle:
            meta = pq.read_metadata(handle)
    used = set(columns)
    sizes = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        sizes.append(sum(group.column(i).num_values * _WIDTH.get(group.column(i).physical_type, 8)
                         for i in range(group.num_columns)
                         if group.column(i).path_in_schema.split(".")[0] in used))
    return Footer([meta.row_group(g).num_rows for g in range(meta.num_row_groups)],
                  meta.schema.to_arrow_schema().names, max(sizes, default=0), sum(sizes),
                  footer_bytes(meta))


def plan(df: Any, columns: Sequence[str], schema: Mapping[str, Any], dtype: str,
         storage_options: Mapping[str, Any], partitions: int) -> Union[Found, str]:
    """The files to read in place, or why the DataFrame must be materialised (its checks are
    the caller's: they need a Spark job, run only once the files are found to suit)."""
    from sparkhvd import storage
    from sparkhvd.data.materialize import quoted

    reason = _kind_reason(columns, schema)
    if reason:
        return reason
    try:
        selected = df.select(*[quoted(c) for c in columns])
        reason = not_a_plain_scan(optimized_plan(selected), columns)
        files = sorted(set(df.inputFiles()))
    except Exception as exc:  # noqa: BLE001 - any surprise means: materialise
        return f"its plan could not be read ({type(exc).__name__})"
    if reason:
        return reason
    if not files:
        return "it lists no files"
    schemes = {storage.resolve(f, storage_options).container for f in files} \
        if not files[0].startswith("file:") else {None}
    if len(schemes) > 1:
        return "its files are in more than one container"
    try:
        rank_options = storage.delegate(files[0], storage_options, write=False)
    except Exception as exc:  # noqa: BLE001 - no way to give the ranks read access
        return f"the ranks cannot be given read-only access to its files ({exc})"
    try:
        with concurrent.futures.ThreadPoolExecutor(FOOTER_THREADS) as pool:
            footers = list(pool.map(lambda f: _footer(f, storage_options, columns), files))
    except Exception as exc:  # noqa: BLE001 - unreadable here: let Spark read it
        return f"its footers could not be read ({type(exc).__name__}: {exc})"
    for url, footer in zip(files, footers):
        missing = [c for c in columns if c not in footer.names]
        if missing:
            return (f"file {storage.public_url(url)} has no column {missing[0]!r} (a "
                    "partition column, or the schema changed)")
    row_groups = [footer.groups for footer in footers]
    largest = max(footer.largest_bytes for footer in footers)
    total = sum(footer.total_bytes for footer in footers)
    reason = groups_reason(largest, total, partitions)
    if reason:
        return reason
    float_type = {"float32": "float32", "float64": "float64"}[dtype]
    cast = {c: float_type for c in columns
            if _element(schema[c]) in ("FloatType", "DoubleType")}
    return Found(files=files, row_counts=[sum(g) for g in row_groups], row_groups=row_groups,
                 cast=cast, rank_options=rank_options,
                 footers=[footer.pickled for footer in footers])


def groups_reason(largest: int, total: int, partitions: int) -> Optional[str]:
    """Why row groups of up to ``largest`` bytes (``total`` in all, in memory) are too large to
    read in place with ``partitions`` partitions; None when they suit. A rank reads a
    partition boundary's whole group (so groups must be small beside a partition), and holds
    a group of each partition it reads at once -- all of them at np=1 -- within
    :data:`~sparkhvd.data.sharding.READ_MEMORY_BYTES`."""
    fix = ("write the table with smaller row groups, e.g. parquet.block.size=4194304, to read "
           "it in place")
    if largest > max(SMALL_GROUP_BYTES, total // (GROUPS_PER_PARTITION * partitions)):
        return (f"its row groups hold up to {largest / (1 << 20):.0f} MB: a rank would read "
                f"far more than its share ({fix})")
    if largest * partitions > READ_MEMORY_BYTES:
        return (f"its row groups hold up to {largest / (1 << 20):.0f} MB: a rank reading all "
                f"{partitions} partitions at once would hold {partitions} of them, "
                f"{largest * partitions / (1 << 20):.0f} MB, over the "
                f"{READ_MEMORY_BYTES >> 20} MB reading bound ({fix}, or fewer partitions=)")
    return None


def _element(data_type: Any) -> str:
    kind = type(data_type).__name__
    return type(data_type.elementType).__name__ if kind == "ArrayType" else kind
