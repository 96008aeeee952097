"""The driver's view of Spark, below everything that asks it: which session
(:mod:`~sparkhvd.spark.session`), classic or Connect (:mod:`~sparkhvd.spark.sparkview`, the one
module that knows the difference), how many task slots there are (:mod:`~sparkhvd.spark.slots`),
what is installed (:mod:`~sparkhvd.spark.installed`) and ``%%configure`` session presets
(:mod:`~sparkhvd.spark.presets`, public as ``sparkhvd.presets``). All driver side: the run, the
dataset, scoring and the CLI build on it."""
__side__ = "driver"
