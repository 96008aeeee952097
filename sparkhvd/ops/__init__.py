"""The operations side: the ``sparkhvd`` CLI (:mod:`~sparkhvd.ops.cli`), ``doctor``
(:mod:`~sparkhvd.ops.doctor`) and notebook helpers (:mod:`~sparkhvd.ops.notebook`, public as
``sparkhvd.notebook``), at the top: they use the run and the driver's view of Spark. (Session
presets are :mod:`sparkhvd.spark.presets`; MLflow tracking :mod:`sparkhvd.driver.tracking`.)
All driver side."""
__side__ = "public"
