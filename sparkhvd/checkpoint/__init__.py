"""Checkpointing's one room: what a checkpoint is, where it lives, and how it comes back.

The frameworks' helpers (:mod:`sparkhvd.torch.checkpoints`, ``sparkhvd.torch.
sharded_checkpoints``, :mod:`sparkhvd.keras.checkpoints` and the Keras callbacks) keep only
their serialisation and their collectives; everything else is here, each decision once:

- :mod:`~sparkhvd.checkpoint.lineage` (common) -- names, progress, records, ``latest.json``,
  and which folder holds a complete checkpoint (the driver asks it too);
  :mod:`~sparkhvd.checkpoint.sources` (driver) -- ``resume_from=`` resolved into a folder;
- :mod:`~sparkhvd.checkpoint.stores` -- where checkpoints live: the run folder (on this host,
  or through the driver's run-folder service), the run resumed (read-only), a URL;
- :mod:`~sparkhvd.checkpoint.write` and :mod:`~sparkhvd.checkpoint.read` -- a checkpoint
  written so that it can be checked (files, record, ``latest.json``; ``keep=``'s pruning), and
  read back: the newest complete one, checked, an older one when it is not;
- :mod:`~sparkhvd.checkpoint.background` -- one write at a time behind training
  (``async_save``), uploads behind the saves;
- :mod:`~sparkhvd.checkpoint.host_copy` -- the newest checkpoint kept on the writing rank's
  host (and its memory snapshots), on the host store the row-group cache uses too
  (:mod:`sparkhvd.storage.host_store`);
- :mod:`~sparkhvd.checkpoint.nearest_copy` and :mod:`~sparkhvd.checkpoint.file_pieces` -- the
  plan of a restore from the nearest copy (this host, a peer, the folder), over whichever
  framework's collectives (``torch.restore_collectives``, ``keras.restore_collectives``).

The data's position goes into a checkpoint as the data made it
(:mod:`sparkhvd.data.position`): stored and handed back, never edited here.
"""

__side__ = "common"
