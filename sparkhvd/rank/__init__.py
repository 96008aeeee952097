"""The rank process, at the top of its side: supervisor, bootstrap (``rank_main``), device
placement, its arguments opened, stack dumps. It wires up the rank halves of the features below
it: the time sampler (:mod:`sparkhvd.timing`), notices (:mod:`sparkhvd.elastic`), the run folder as
a rank sees it (:mod:`sparkhvd.runfolder`), plain TF code (:mod:`sparkhvd.keras`) and the
``DataFrameDataset`` shard reader (:mod:`sparkhvd.data`). What a rank reports goes through
:mod:`sparkhvd.common.events`, which those features use too.

Never imports :mod:`sparkhvd.driver` or :mod:`sparkhvd.executor`.
"""
__side__ = "rank"
