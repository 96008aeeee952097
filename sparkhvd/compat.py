"""Checks that the installed stack can train with Horovod, made on the driver before launch."""
from __future__ import annotations

import os
from importlib import metadata
from typing import Mapping, Optional

from .errors import EnvironmentMismatchError


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


def check_keras(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise :class:`EnvironmentMismatchError` if the Keras in use is Keras 3 (see keras_problem)."""
    names = ("tensorflow", "tensorflow-cpu", "keras", "tf-keras")
    problem = keras_problem({n: package_version(n) for n in names},
                            os.environ if environ is None else environ)
    if problem:
        raise EnvironmentMismatchError(problem)
