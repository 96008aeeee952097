"""Checks that the installed stack can run what was asked, made on the driver before launch:
which Spark (pyspark is an extra: runtimes bring their own) and whether Keras fits Horovod."""
from __future__ import annotations

import os
import re
from importlib import metadata
from typing import Mapping, Optional

from sparkhvd.common.errors import EnvironmentMismatchError

__side__ = "driver"


def package_version(name: str) -> Optional[str]:
    """Installed version of a distribution, or ``None`` (never imports it)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def keras_problem(versions: Mapping[str, Optional[str]], environ: Mapping[str, str]) -> Optional[str]:
    """Why this TensorFlow/Keras combination would train wrongly with Horovod, or ``None``.

    Horovod 0.28 supports Keras 2 (``tf.keras`` up to TF 2.15, or ``tf-keras`` with
    ``TF_USE_LEGACY_KERAS=1``). With Keras 3, ``hvd.DistributedOptimizer`` silently stops
    averaging gradients, so we refuse to run rather than train a wrong model.
    """
    tf = versions.get("tensorflow") or versions.get("tensorflow-cpu")
    keras = versions.get("keras")
    if not tf or not keras or int(keras.split(".")[0]) < 3:
        return None
    legacy = environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    if legacy and versions.get("tf-keras"):
        return None
    fix = ("pip install tf-keras=={0}.* and export TF_USE_LEGACY_KERAS=1 before TensorFlow is "
           "imported (in the notebook's first cell, and in the env passed to the ranks), or use "
           "tensorflow 2.15").format(".".join(tf.split(".")[:2]))
    if legacy:
        return (f"TF_USE_LEGACY_KERAS=1 is set but tf-keras is not installed (TensorFlow {tf}, "
                f"Keras {keras}). Fix: {fix}; or train with backend='tf' (tf.distribute), "
                "which supports Keras 3.")
    return (f"Keras {keras} (Keras 3) is installed with TensorFlow {tf}; Horovod does not support "
            f"Keras 3 (gradients would silently not be averaged across ranks). Fix: "
            f"HorovodRunner(..., backend='tf') trains with tf.distribute and Keras 3; or, to "
            f"stay on Horovod: {fix}.")


def check_horovod_installed() -> None:
    """backend='horovod' without horovod: named before launch, with both fixes (no managed
    runtime of 2026 ships horovod, and 0.28 cannot be built against TensorFlow >= 2.19)."""
    import importlib.util

    if importlib.util.find_spec("horovod") is None:
        raise EnvironmentMismatchError(
            "backend='horovod' (the default) needs horovod, which is not installed here. Fix: "
            "HorovodRunner(..., backend='tf') trains with tf.distribute and no horovod (current "
            "TensorFlow, Keras 3); or install horovod[spark] 0.28 built with TensorFlow <= 2.18 "
            "and Gloo (see docs/guides/backends.md).")


def check_keras(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise :class:`EnvironmentMismatchError` if the Keras in use is Keras 3 (see keras_problem)."""
    names = ("tensorflow", "tensorflow-cpu", "keras", "tf-keras")
    problem = keras_problem({n: package_version(n) for n in names},
                            os.environ if environ is None else environ)
    if problem:
        raise EnvironmentMismatchError(problem)


#: The Spark versions sparkhvd runs on: [3.5, 5). 3.5 is the oldest with DataFrame barrier stages
#: and job tags; Spark 4.x is what Databricks 17+, Fabric 2.0, EMR 8 and Dataproc 3 run.
SPARK_SUPPORTED = ((3, 5), (5, 0))
SPARK_RANGE = ">=3.5,<5"
SPARK_INSTALL_HINT = ("In a runtime that has Spark (Databricks, Fabric, Synapse, EMR, Dataproc) "
                      "run in its notebook or job, where pyspark is already importable; on a "
                      "laptop or in CI: pip install 'sparkhvd[spark]' (pyspark {range}).")


def version_tuple(version: str) -> tuple[int, int]:
    """``"4.3.0.dev1"`` -> ``(4, 3)``; unparsable parts count as 0."""
    parts = [int(m) if m.isdigit() else 0
             for m in (re.match(r"\d*", p).group() or "0"  # type: ignore[union-attr]
                       for p in version.split(".")[:2])]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def spark_problem(version: Optional[str]) -> Optional[str]:
    """Why this pyspark version (``None``: not importable) cannot run sparkhvd, or ``None``."""
    hint = SPARK_INSTALL_HINT.format(range=SPARK_RANGE)
    if version is None:
        return f"pyspark is not installed, and Spark runs need it. Fix: {hint}"
    lo, hi = SPARK_SUPPORTED
    if not lo <= version_tuple(version) < hi:
        return (f"pyspark {version} is not supported: sparkhvd runs on Spark "
                f"{lo[0]}.{lo[1]} to {hi[0] - 1}.x ({SPARK_RANGE}). Fix: use a runtime with Spark "
                f"3.5 or 4.x, or pip install 'pyspark{SPARK_RANGE}'; np=-N runs local "
                "processes without Spark.")
    return None


def spark_version() -> Optional[str]:
    """The importable pyspark's version, or ``None``. Imported rather than looked up in pip's
    metadata: runtimes put their own pyspark on ``sys.path`` without a distribution record."""
    try:
        import pyspark
    except ImportError:
        return None
    return getattr(pyspark, "__version__", None) or package_version("pyspark") or "0"


def check_spark() -> str:
    """The pyspark version, or :class:`EnvironmentMismatchError` naming the supported range."""
    version = spark_version()
    problem = spark_problem(version)
    if problem:
        raise EnvironmentMismatchError(problem)
    return version  # type: ignore[return-value]


def spark_features(version: str) -> dict[str, bool]:
    """What sparkhvd uses that this Spark version offers (``sparkhvd doctor`` lists them)."""
    v = version_tuple(version)
    return {
        "barrier stage (RDD.barrier)": v >= (2, 4),
        "DataFrame barrier stage (mapInArrow barrier=True)": v >= (3, 5),
        "job tags (addTag/interruptTag)": v >= (3, 5),
        "Spark Connect client": v >= (3, 4),
        "predict_batch_udf": v >= (3, 4),
    }
