"""The rank half of ``DataFrameDataset``: a shard, streamed."""
