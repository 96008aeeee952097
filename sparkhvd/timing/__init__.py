"""Where the time goes: every rank's time split into five buckets, stragglers named while the
run runs, system metrics, and ``report.html`` in every run folder.

The feature's halves, each module tagged with the side it runs on:

- common: :mod:`~sparkhvd.timing.buckets` -- the one place a stack is put in a bucket (data
  loading, computing, waiting in a collective, checkpoint I/O, other);
- rank: :mod:`~sparkhvd.timing.sampler` samples the main thread's stack at a low rate and
  reports each interval's split; :mod:`~sparkhvd.timing.system` reads CPU, memory, network and
  GPU (NVML) metrics in MLflow's names;
- driver: :mod:`~sparkhvd.timing.splits` keeps the splits (``timing.jsonl``, ``run.json``'s
  ``time_split``), compares the ranks as the run goes (:mod:`~sparkhvd.timing.stragglers`) and
  :mod:`~sparkhvd.timing.report` writes ``report.html`` (also ``sparkhvd report <run folder>``).
"""
__side__ = "common"
