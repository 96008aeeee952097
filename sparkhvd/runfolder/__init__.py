"""The run folder: what one run leaves behind (``run.json``, logs, checkpoints, the model,
metrics and curves), locally or on remote storage.

- driver: :mod:`~sparkhvd.runfolder.rundir` (:class:`RunDir`: the folder, staged and
  published), :mod:`~sparkhvd.runfolder.record` (``run.json``'s schema and only writer),
  :mod:`~sparkhvd.runfolder.service` (the service remote ranks write through),
  :mod:`~sparkhvd.runfolder.curves`;
- common: :mod:`~sparkhvd.runfolder.wire` (that service's wire format);
- rank: :mod:`~sparkhvd.runfolder.rank_files` (:func:`run_files`: a rank's view of its run
  folder), :mod:`~sparkhvd.checkpoint.stores` (where checkpoints live),
  :mod:`~sparkhvd.checkpoint.write` and :mod:`~sparkhvd.checkpoint.read`
  (verified checkpoints, resume).
"""
from sparkhvd.common.faces import lazy_face

__side__ = "public"

__all__ = ["RunDir", "RunRecord", "RunFiles", "run_files", "output_folder"]
__getattr__, __dir__ = lazy_face(__name__, {"RunDir": "rundir", "RunRecord": "record",
                                            "RunFiles": "rank_files", "run_files": "rank_files",
                                            "output_folder": "rank_files"})
