"""Which environment variables a rank process gets -- one rule, applied on every launcher.

A rank's environment is built from three parts, later ones winning:

1. the environment of the process that starts the rank (the driver for ``np < 0``, the Spark
   executor otherwise), **filtered**: only names in :data:`ENV_ALLOWLIST`, and never a name that
   looks like a credential (:data:`sparkhvd.common.redaction.SECRET_NAME`);
2. the driver's *settings* (:data:`SETTING_VARS`: ``TF_*``, ``HOROVOD_*``, ... -- not its paths,
   which mean nothing on another host), then what the user passed in
   ``HorovodRunner(env=...)`` (on purpose, so passed as is);
3. the run's own variables (rank numbers, rendezvous address, run folder).

In local mode the executor *is* the driver, so without step 1's filter every rank would see the
driver's whole environment. Shared by the driver and the executor side.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from sparkhvd.common.redaction import SECRET_NAME

__side__ = "common"

#: Machine basics a rank inherits from the host it runs on (never the driver's: paths differ).
#: ``TORCH_EXTENSIONS_DIR``: where the host keeps JIT-built PyTorch ops (DeepSpeed's), so a
#: rank finds them instead of compiling them again.
MACHINE_VARS = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "HOME", "USER", "LANG", "LC_ALL",
                "TMPDIR", "VIRTUAL_ENV", "JAVA_HOME", "SPARK_HOME", "PYSPARK_PYTHON",
                "HADOOP_CONF_DIR", "TORCH_EXTENSIONS_DIR")
#: Settings the driver forwards to every rank (exact names, or prefixes ending in ``_``).
SETTING_VARS = ("TF_", "HOROVOD_", "NCCL_", "GLOO_", "OMP_", "KMP_", "CUDA_", "XLA_FLAGS")
#: The run's own variables a backend assigns each rank (step 3) beyond ``SPARKHVD_*``, ``TF_*``
#: and ``HOROVOD_*``: torchrun's, for ``backend="torch"`` (:mod:`sparkhvd.common.backends.torch`).
#: Never taken from a host implicitly.
RUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS")
#: Every name a rank may get implicitly (see the module docstring).
ENV_ALLOWLIST = MACHINE_VARS + SETTING_VARS


def _listed(name: str, names: tuple[str, ...]) -> bool:
    return any(name == a or (a.endswith("_") and name.startswith(a)) for a in names)


def allowed(name: str, names: tuple[str, ...] = ENV_ALLOWLIST) -> bool:
    """Whether a variable may reach a rank implicitly: listed, and not credential-looking."""
    return _listed(name, names) and not SECRET_NAME.search(name)


def run_variable(name: str) -> bool:
    """Whether ``name`` is one of the run's own variables (kept by a rank's scrub)."""
    return name.startswith("SPARKHVD_") or name in RUN_VARS


def filtered(environ: Mapping[str, str], names: tuple[str, ...] = ENV_ALLOWLIST) -> dict[str, str]:
    """``environ`` reduced to the listed, non-secret names."""
    return {k: v for k, v in environ.items() if allowed(k, names)}


def rank_env(user_env: Optional[Mapping[str, str]] = None, *, verbose: bool = False,
             environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """What the driver sends to every rank: its settings (:data:`SETTING_VARS`), then
    ``user_env``; the machine basics come from wherever each rank runs."""
    env = filtered(os.environ if environ is None else environ, SETTING_VARS)
    if not verbose:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TF's C++ info/warning start-up lines
    for name, value in (user_env or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"env must map str to str; got {name!r}: {type(value).__name__}. "
                            "Convert values with str().")
        env[name] = value
    return env


def process_env(local: Mapping[str, str], sent: Mapping[str, str],
                assigned: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """A rank process' environment where it starts: ``local`` filtered, then the driver's
    ``sent`` variables, then the rank's ``assigned`` ones (see the module docstring)."""
    return {**filtered(local), **sent, **dict(assigned or {}), "PYTHONUNBUFFERED": "1"}
