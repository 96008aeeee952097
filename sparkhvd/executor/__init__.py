"""What runs inside a Spark task on an executor: one barrier task (control channel, or result
rows when the driver is out of reach), horovod's patched task, and :class:`~sparkhvd.executor.
process.RankProcess`, which starts one supervised rank process (also used by the driver's local
launcher, ``np < 0``, which plays the executor's part on the driver).

Never imports :mod:`sparkhvd.driver`; imports :mod:`sparkhvd.rank` only where horovod runs the
rank inside its own task process.
"""
__side__ = "executor"
