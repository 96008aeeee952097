"""Session presets: ``%%configure`` JSON bodies in ``conf/``, validated, rendered every way needed.

A preset is exactly what a Synapse/Livy ``%%configure -f`` cell takes (``driverMemory``,
``driverCores``, ``executorMemory``, ``executorCores``, ``numExecutors``, ``conf``). From one preset
sparkhvd renders the cell text, the SparkSession builder settings, the ``spark-submit`` flags and
the largest ``np`` the session can run. A preset may declare how many nodes its pool has with
``conf["spark.sparkhvd.nodes"]`` (``numExecutors`` must not exceed it: one executor per node).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sparkhvd.common.errors import SparkhvdError

__side__ = "driver"

#: Keys a Livy session body (and so ``%%configure``) accepts.
ALLOWED_KEYS = ("driverMemory", "driverCores", "executorMemory", "executorCores", "numExecutors",
                "conf", "name", "jars", "pyFiles", "files", "archives", "queue", "kind",
                "proxyUser", "heartbeatTimeoutInSecond")
_MEMORY = re.compile(r"^\d+[kmgtp]b?$", re.I)
NODES_KEY = "spark.sparkhvd.nodes"


class PresetError(SparkhvdError, ValueError):
    """A preset is malformed; the message names the key and the fix."""


def presets_dirs() -> list[Path]:
    """Where presets are looked up: ``$SPARKHVD_PRESETS_DIR``, ``./conf``, the project's ``conf/``."""
    dirs = []
    if os.environ.get("SPARKHVD_PRESETS_DIR"):
        dirs.append(Path(os.environ["SPARKHVD_PRESETS_DIR"]))
    dirs.append(Path.cwd() / "conf")
    dirs.append(Path(__file__).resolve().parents[2] / "conf")  # <checkout>/sparkhvd/spark/
    seen, unique = set(), []
    for d in dirs:
        if d.resolve() not in seen and d.is_dir():
            seen.add(d.resolve())
            unique.append(d)
    return unique


def _positive_int(body: dict, key: str, name: str) -> Optional[int]:
    if key not in body:
        return None
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PresetError(f"Preset {name!r}: {key}={value!r} must be a positive whole number, "
                          f"e.g. \"{key}\": 2.")
    return value


@dataclass
class Preset:
    """A validated ``%%configure`` body."""

    name: str
    body: dict
    path: Optional[str] = None
    conf: dict = field(init=False)

    def __post_init__(self) -> None:
        self.validate()
        self.conf = {k: str(v).lower() if isinstance(v, bool) else str(v)
                     for k, v in self.body.get("conf", {}).items()}

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`PresetError` naming the first problem and its fix."""
        body, name = self.body, self.name
        if not isinstance(body, dict):
            raise PresetError(f"Preset {name!r} must be a JSON object (a %%configure body).")
        unknown = [k for k in body if k not in ALLOWED_KEYS]
        if unknown:
            raise PresetError(f"Preset {name!r}: unknown key(s) {unknown}. %%configure accepts "
                              f"{list(ALLOWED_KEYS)}; Spark settings go inside \"conf\".")
        for key in ("driverMemory", "executorMemory"):
            if key in body and not (isinstance(body[key], str) and _MEMORY.match(body[key])):
                raise PresetError(f"Preset {name!r}: {key}={body[key]!r} is not a Spark memory "
                                  f"size; use a number and a unit, e.g. \"{key}\": \"4g\".")
        for key in ("driverCores", "executorCores", "numExecutors"):
            _positive_int(body, key, name)
        conf = body.get("conf", {})
        if not isinstance(conf, dict):
            raise PresetError(f"Preset {name!r}: \"conf\" must be an object of Spark settings.")
        for key, value in conf.items():
            if not isinstance(value, (str, int, float, bool)):
                raise PresetError(f"Preset {name!r}: conf[{key!r}] must be a string or number, "
                                  f"not {type(value).__name__}.")
        gpu = conf.get("spark.executor.resource.gpu.amount")
        if gpu not in (None, "", "0", 0) and not conf.get(
                "spark.executor.resource.gpu.discoveryScript"):
            raise PresetError(f"Preset {name!r}: spark.executor.resource.gpu.amount is set but "
                              "spark.executor.resource.gpu.discoveryScript is not; Spark cannot "
                              "find the GPUs without it. Add the pool's discovery script path "
                              "(e.g. getGpusResources.sh shipped with Spark).")
        if conf.get("spark.task.resource.gpu.amount") and gpu in (None, "", "0", 0):
            raise PresetError(f"Preset {name!r}: spark.task.resource.gpu.amount needs "
                              "spark.executor.resource.gpu.amount (GPUs per executor).")
        nodes = conf.get(NODES_KEY)
        if nodes is not None:
            try:
                nodes = int(nodes)
            except (TypeError, ValueError):
                raise PresetError(f"Preset {name!r}: conf[{NODES_KEY!r}]={nodes!r} must be a "
                                  "whole number of nodes.") from None
            if body.get("numExecutors", 1) > nodes:
                raise PresetError(f"Preset {name!r}: numExecutors={body['numExecutors']} is larger "
                                  f"than the {nodes} node(s) the pool declares "
                                  f"({NODES_KEY}); Horovod on Spark wants at most one executor "
                                  f"per node: set numExecutors <= {nodes}.")

    # -- renderings ---------------------------------------------------------------------------
    @property
    def master(self) -> Optional[str]:
        """The preset's own master (local presets set ``spark.master``), else ``None``."""
        return self.conf.get("spark.master")

    def configure_cell(self) -> str:
        """The ``%%configure -f`` notebook cell for this preset."""
        return "%%configure -f\n" + json.dumps(self.body, indent=4)

    def spark_conf(self) -> dict[str, str]:
        """The preset as Spark settings (for ``SparkSession.builder``/``SparkConf``)."""
        out = {}
        for key, setting in (("driverMemory", "spark.driver.memory"),
                             ("driverCores", "spark.driver.cores"),
                             ("executorMemory", "spark.executor.memory"),
                             ("executorCores", "spark.executor.cores"),
                             ("numExecutors", "spark.executor.instances")):
            if key in self.body:
                out[setting] = str(self.body[key])
        out.update(self.conf)
        return out

    def builder(self, app_name: str = "sparkhvd"):
        """A ``SparkSession.builder`` configured with this preset (call ``.getOrCreate()``)."""
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName(app_name)
        for key, value in self.spark_conf().items():
            builder = builder.config(key, value)
        return builder

    def spark_submit_args(self, master: Optional[str] = None) -> list[str]:
        """``spark-submit`` flags for this preset (``--total-executor-cores`` on standalone)."""
        master = master or self.master
        args: list[str] = []
        if master:
            args += ["--master", master]
        flags = (("driverMemory", "--driver-memory"), ("driverCores", "--driver-cores"),
                 ("executorMemory", "--executor-memory"), ("executorCores", "--executor-cores"))
        for key, flag in flags:
            if key in self.body:
                args += [flag, str(self.body[key])]
        if "numExecutors" in self.body:
            if master and master.startswith("spark://"):
                total = self.body["numExecutors"] * self.body.get("executorCores", 1)
                args += ["--total-executor-cores", str(total)]
            elif not (master or "").startswith("local"):
                args += ["--num-executors", str(self.body["numExecutors"])]
        for key, value in self.conf.items():
            if key not in ("spark.master",):
                args += ["--conf", f"{key}={value}"]
        return args

    def max_np(self) -> int:
        """The largest ``np`` a session made from this preset can run."""
        from sparkhvd.spark.slots import count_slots

        master = self.master or "spark://preset"
        cores = self.body.get("executorCores", 1)
        executors = [cores] * self.body.get("numExecutors", 1)
        return count_slots(master, self.spark_conf(), cpu_count=os.cpu_count() or 1,
                           executor_cores=executors).slots

    def check_np(self, size: int) -> None:
        """Raise :class:`PresetError` if ``size`` Spark ranks do not fit this preset's sessions."""
        limit = self.max_np()
        if size > limit:
            raise PresetError(f"np={size} does not fit preset {self.name!r}: it gives at most "
                              f"{limit} task slot(s). Lower np, or use a larger preset "
                              f"(see `sparkhvd presets`).")


def load_preset(name_or_path: str) -> Preset:
    """A preset by name (``local-cpu``) from :func:`presets_dirs`, or from a JSON file path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        candidates = [path]
    else:
        candidates = [d / f"{name_or_path}.json" for d in presets_dirs()]
    for candidate in candidates:
        if candidate.is_file():
            try:
                body = json.loads(candidate.read_text())
            except json.JSONDecodeError as exc:
                raise PresetError(f"Preset file {candidate} is not valid JSON: {exc}") from None
            return Preset(candidate.stem, body, str(candidate))
    known = ", ".join(list_preset_names()) or "none found"
    raise PresetError(f"No preset named {name_or_path!r} (known: {known}). Presets are JSON "
                      f"files in {', '.join(map(str, presets_dirs())) or 'conf/'}.")


def list_preset_names() -> list[str]:
    """Names of every preset found (first directory wins)."""
    names: list[str] = []
    for d in presets_dirs():
        names += [p.stem for p in sorted(d.glob("*.json")) if p.stem not in names]
    return names
