"""Spark DataFrame -> every rank's batches of one global order: :class:`DataFrameDataset`.

The feature's two halves live here side by side, each module tagged with the side it runs on
(``__side__``):

- driver: :mod:`~sparkhvd.data.dataset` (checks, reuse), :mod:`~sparkhvd.data.materialize`
  (Parquet written by the executors);
- common: :mod:`~sparkhvd.data.sharding` -- the order policy both sides agree on;
  :mod:`~sparkhvd.data.position` -- where the ranks are in it, made there alone;
- rank: :mod:`~sparkhvd.data.shard` (the shard a rank's function receives; its torch and
  TensorFlow readings in :mod:`~sparkhvd.data.framework_batches`) and
  :mod:`~sparkhvd.data.reader` (the order read a window at a time).

Public names are imported on first use (:mod:`sparkhvd.common.faces`): a rank never loads the
driver half.
"""
from sparkhvd.common.faces import lazy_face

__side__ = "public"

__all__ = ["DataFrameDataset", "check_column_type", "DatasetShard", "Position", "DataChanged"]
__getattr__, __dir__ = lazy_face(__name__, {"DataFrameDataset": "dataset",
                                            "check_column_type": "materialize",
                                            "DatasetShard": "shard", "Position": "position",
                                            "DataChanged": "position"})
