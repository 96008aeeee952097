"""The SparkSession a run uses, and whether Spark's worker Python can run ranks.

A run uses the session it is given (classic or Spark Connect), else the active one, else a new
local-mode session sized for ``np``. (What environment the ranks get is :mod:`sparkhvd.common.environment`'s one rule.)
"""
from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from typing import Optional

__side__ = "driver"

log = logging.getLogger(__name__)

from sparkhvd.spark.sparkview import SparkView, is_loopback_master  # noqa: F401 - re-exported


def get_or_create_session(np: int, spark=None, preset=None):
    """The given session, else the active one, else a new one: from ``preset`` when given
    (its own master, or ``local[np]``), otherwise ``local[np]`` on 127.0.0.1."""
    from pyspark.sql import SparkSession

    if spark is not None:
        if SparkView(spark).stopped():
            from sparkhvd.spark.sparkview import stopped_session_error

            raise stopped_session_error(during=False)
        return spark
    active = SparkSession.getActiveSession()
    if active is None:
        from pyspark import SparkContext

        if SparkContext._active_spark_context is not None:
            active = SparkSession(SparkContext._active_spark_context)
    if active is not None:
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    master = (preset.master if preset is not None else None) or f"local[{np}]"
    if is_loopback_master(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # keep Spark off other interfaces
    if preset is not None:
        master = preset.master or f"local[{np}]"
        log.info("No active SparkSession: starting one from preset %r (%s)", preset.name, master)
        session = preset.builder().master(master).config(
            "spark.pyspark.python", os.environ["PYSPARK_PYTHON"]).getOrCreate()
        session.sparkContext.setLogLevel("ERROR")
        return session
    log.info("No active SparkSession: starting local[%d] on 127.0.0.1", np)
    session = (SparkSession.builder.master(f"local[{np}]").appName("sparkhvd")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
               .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL",
                       os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def connect_session(remote: str):
    """A Spark Connect session: ``sc://host:port`` (a Connect server), or ``local[N]`` (a local
    Connect server started from pip's pyspark; needs ``pip install 'sparkhvd[connect]'``)."""
    from sparkhvd.spark.installed import check_spark

    check_spark()
    try:
        import pyspark.sql.connect.session  # noqa: F401 - needs grpc & co (pyspark[connect])
    except ImportError as exc:
        from sparkhvd.common.errors import EnvironmentMismatchError

        raise EnvironmentMismatchError(
            f"Spark Connect needs its client libraries ({exc}). Fix: pip install "
            "'sparkhvd[connect]' (pyspark[connect]).") from None
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote(remote)
    if remote.startswith("local"):  # the server is started here, with these settings
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.ui.showConsoleProgress", "false")
    log.info("Connecting to Spark Connect at %s", remote)
    return builder.getOrCreate()


#: What Spark's worker Python must import, per backend.
NEEDED_MODULES = {"horovod": "horovod.spark, sparkhvd", "tf": "tensorflow, sparkhvd",
                  "torch": "torch, sparkhvd"}
#: What the Spark jobs of the data path and of scoring need in the workers.
DATA_MODULES = "numpy, pyarrow, sparkhvd"
SCORING_MODULES = "numpy, pandas, pyarrow, sparkhvd"


#: Run by the worker Python: which of the modules it is given it cannot find. Found, not imported:
#: importing TensorFlow takes 5 to 9 s of CPU, and a run's first launch would pay it for a check.
_FIND_MODULES = (
    "import importlib.util, sys\n"
    "def found(name):\n"
    "    try:\n"
    "        return importlib.util.find_spec(name) is not None\n"
    "    except (ImportError, ValueError):\n"
    "        return False\n"
    "missing = [m for m in sys.argv[1:] if not found(m)]\n"
    "if missing:\n"
    "    sys.exit('No module named ' + ', '.join(repr(m) for m in missing))\n")


@functools.lru_cache(maxsize=8)
def _python_can_import(python: str, modules: str) -> Optional[str]:
    """None when ``python`` finds every module of ``modules`` (comma-separated), else why not.

    A missing module is what a wrong worker Python shows (the driver's virtual environment not
    the one Spark runs); an installed module that fails to import fails the rank that imports
    it, with its own traceback in the rank's log."""
    names = [name.strip() for name in modules.split(",") if name.strip()]
    try:
        out = subprocess.run([python, "-c", _FIND_MODULES, *names],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]


def check_worker_python(view: SparkView, backend: str = "horovod", *,
                        modules: Optional[str] = None, purpose: str = "the ranks") -> None:
    """Before any Spark job sparkhvd starts (a launch, ``DataFrameDataset``'s materialisation,
    ``predict``): fail early, with the fix, when Spark's worker Python cannot import what that
    job needs (``modules``; by default what the ranks of ``backend`` need). Known on a local
    master (the workers run this machine's Python Spark was told of); a Connect client knows
    the workers' Python only when the session says it (``spark.pyspark.python``). Without the
    check, the job fails deep inside a Spark worker (``No module named 'pyarrow'``)."""
    if not view.master.startswith("local"):
        return
    python = view.python_exec()
    if not python:
        return
    modules = modules or NEEDED_MODULES.get(backend, NEEDED_MODULES["horovod"])
    problem = _python_can_import(python, modules)
    if problem:
        from sparkhvd.common.errors import EnvironmentMismatchError

        raise EnvironmentMismatchError(
            f"Spark runs its Python workers with {python!r}, which cannot import {modules} "
            f"({problem}), which {purpose} need. Fix: export PYSPARK_PYTHON={sys.executable} "
            "before the SparkSession is created (or activate the project's virtual "
            "environment), then restart the session.")
