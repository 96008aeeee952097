"""The rank process: supervisor, bootstrap (``rank_main``), device placement, events, the run
folder as a rank sees it, the Keras helpers and the ``DataFrameDataset`` shard reader.

Never imports :mod:`sparkhvd.driver` or :mod:`sparkhvd.executor`.
"""
__side__ = "rank"
