"""The rank side of :mod:`sparkhvd.driver.arguments`: what the driver prepared, opened here.

A :class:`~sparkhvd.data.sharding.ShardSource` (a prepared ``DataFrameDataset``) becomes this
rank's :class:`~sparkhvd.data.shard.DatasetShard` -- also inside a list, tuple or dict.
"""
from __future__ import annotations

from typing import Any

from sparkhvd.data.sharding import ShardSource

__side__ = "rank"


def open_argument(value: Any) -> Any:
    """``value`` with every prepared part opened for this rank."""
    if isinstance(value, ShardSource):
        from sparkhvd.data.shard import DatasetShard  # numpy/pyarrow only when used

        return DatasetShard(value)
    if type(value) in (list, tuple):
        return type(value)(open_argument(v) for v in value)
    if type(value) is dict:
        return {k: open_argument(v) for k, v in value.items()}
    return value
