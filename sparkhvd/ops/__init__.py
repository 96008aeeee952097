"""The operations side: the ``sparkhvd`` CLI (:mod:`~sparkhvd.ops.cli`), ``doctor``
(:mod:`~sparkhvd.ops.doctor`), ``%%configure`` presets (:mod:`~sparkhvd.ops.presets`, public as
``sparkhvd.presets``), notebook helpers (:mod:`~sparkhvd.ops.notebook`, public as
``sparkhvd.notebook``) and MLflow tracking (:mod:`~sparkhvd.ops.tracking`). All driver side."""
__side__ = "public"
