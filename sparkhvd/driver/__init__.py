"""The driver: the process that calls ``HorovodRunner.run`` (a notebook, ``spark-submit``, the CLI).

It checks, serialises, asks Spark for one barrier stage (or horovod, or local processes), watches
the ranks, records and publishes the run. It ships :mod:`sparkhvd.executor` code to the Spark
tasks and never imports :mod:`sparkhvd.rank`: what runs in a rank reaches it only as a payload.
"""
__side__ = "driver"
