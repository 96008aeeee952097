"""Spark DataFrame -> each rank's own shard: :class:`DataFrameDataset`.

- :mod:`sparkhvd.data.dataset` -- the class and the sharding policy;
- :mod:`sparkhvd.data.materialize` -- driver side: checks, Parquet written by the executors, reuse;
- :mod:`sparkhvd.data.reader` -- rank side: a shard streamed a row group at a time.
"""
from .dataset import DataFrameDataset
from .materialize import check_column_type

__all__ = ["DataFrameDataset", "check_column_type"]
