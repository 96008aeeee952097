"""Surviving the cloud: elastic runs on every backend, notices that cost at most one step.

The feature's halves, each module tagged with the side it runs on:

- rank: :mod:`~sparkhvd.elastic.notices` -- a notice (SIGTERM to the rank, or the driver's
  request) becomes "finish this step, checkpoint, exit as preempted" wherever a checkpoint
  helper listens; the old and new world size after a resize;
- driver: :mod:`~sparkhvd.elastic.scaling` -- how many ranks the next attempt gets
  (``min_np``..``max_np`` from the free task slots), and :mod:`~sparkhvd.elastic.watch` --
  what the driver watches while an attempt runs (executors being decommissioned, slots that
  came back) and when it asks the ranks to stop at their next step.

The run's states and its failure policy are the driver's (:mod:`sparkhvd.driver.run`,
:mod:`sparkhvd.driver.retry`); the public names are in :mod:`sparkhvd.torch` and
:mod:`sparkhvd.keras`.
"""
__side__ = "common"
