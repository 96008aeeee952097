"""What runs inside a Spark task on an executor: one barrier task (control channel, or result
rows when the driver is out of reach), horovod's patched task; each starts its supervised rank process with
:class:`~sparkhvd.common.rankprocess.RankProcess` (shared with the driver's local launcher,
``np < 0``, which plays the executor's part on the driver).

Never imports :mod:`sparkhvd.driver`; imports :mod:`sparkhvd.rank` only where horovod runs the
rank inside its own task process.
"""
__side__ = "executor"
