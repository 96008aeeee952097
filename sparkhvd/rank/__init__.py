"""The rank process: supervisor, bootstrap (``rank_main``), device placement, events, its
arguments opened, stack dumps. (The run folder as a rank sees it is :mod:`sparkhvd.runfolder`;
the Keras and PyTorch helpers :mod:`sparkhvd.keras` and :mod:`sparkhvd.torch`; the
``DataFrameDataset`` shard reader :mod:`sparkhvd.data`.)

Never imports :mod:`sparkhvd.driver` or :mod:`sparkhvd.executor`.
"""
__side__ = "rank"
