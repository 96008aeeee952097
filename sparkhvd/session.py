"""The SparkSession a run uses, and whether Spark's worker Python can run ranks.

A run uses the session it is given, else the active one, else a new local-mode session sized for
``np``. (What environment the ranks get is :mod:`sparkhvd.environment`'s one rule.)
"""
from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from typing import Optional
from urllib.parse import urlparse

log = logging.getLogger(__name__)

def is_loopback_master(master: str) -> bool:
    """Whether every executor of this master runs on this machine (local or 127.0.0.1)."""
    if master.startswith("local"):
        return True
    host = urlparse(master).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def get_or_create_session(np: int, spark=None, preset=None):
    """The given session, else the active one, else a new one: from ``preset`` when given
    (its own master, or ``local[np]``), otherwise ``local[np]`` on 127.0.0.1."""
    from pyspark.sql import SparkSession

    if spark is not None:
        if getattr(spark.sparkContext, "_jsc", None) is None:
            from .launchers.base import stopped_session_error

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


#: What Spark's worker Python must import, per backend.
NEEDED_MODULES = {"horovod": "horovod.spark, sparkhvd", "tf": "tensorflow, sparkhvd"}


@functools.lru_cache(maxsize=8)
def _python_can_import(python: str, modules: str) -> Optional[str]:
    try:
        out = subprocess.run([python, "-c", f"import {modules}"],
                             capture_output=True, text=True, timeout=120)
    except OSError as exc:
        return str(exc)
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]


def check_worker_python(sc, backend: str = "horovod") -> None:
    """On a local master, fail early when Spark's worker Python cannot import what the ranks
    need (horovod or tensorflow, and sparkhvd)."""
    if not sc.master.startswith("local"):
        return
    python = sc.pythonExec or "python3"
    modules = NEEDED_MODULES.get(backend, NEEDED_MODULES["horovod"])
    problem = _python_can_import(python, modules)
    if problem:
        from .errors import EnvironmentMismatchError

        raise EnvironmentMismatchError(
            f"Spark runs its Python workers with {python!r}, which cannot import {modules} "
            f"({problem}). Fix: export PYSPARK_PYTHON={sys.executable} before the "
            "SparkSession is created (or activate the project's virtual environment), then "
            "restart the session.")
