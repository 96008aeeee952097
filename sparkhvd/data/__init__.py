"""Spark DataFrame -> each rank's own shard: :class:`DataFrameDataset`.

- :mod:`sparkhvd.driver.data` -- the driver half: checks, Parquet written by the executors, reuse;
- :mod:`sparkhvd.common.shards` -- the sharding policy both sides agree on;
- :mod:`sparkhvd.rank.data` -- the rank half: the shard a rank's function receives, streamed.
"""
from sparkhvd.driver.data.dataset import DataFrameDataset
from sparkhvd.driver.data.materialize import check_column_type

__all__ = ["DataFrameDataset", "check_column_type"]
