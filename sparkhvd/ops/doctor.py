"""``sparkhvd doctor``: what this environment and its cluster can run, each failure with its fix.

Stack checks run on the driver. The cluster probe runs one Spark barrier stage of ``np`` tasks --
exactly how the barrier launcher places ranks -- and each task reports its host, the address it
reaches the driver from, the network interface Gloo would use there, and whether it can open a
connection to the driver (the control/rendezvous side of a run) and to Spark's own driver port.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

__side__ = "driver"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    #: a failed optional check is reported ("n/a") but does not fail the doctor
    optional: bool = False


def check(name: str, fn: Callable[[], str], fix: str) -> Check:
    """Run one check; any exception becomes a failed row with its fix."""
    try:
        return Check(name, True, fn())
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row with its fix
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Check(name, False, message, fix)


def horovod_build() -> str:
    import horovod

    try:
        import horovod.tensorflow as hvd  # fails unless the TensorFlow extension was built
    except ImportError as exc:
        raise RuntimeError(f"horovod {horovod.__version__} lacks TensorFlow support ({exc})") \
            from None
    if not hvd.gloo_built():
        raise RuntimeError(f"horovod {horovod.__version__} was built without Gloo")
    return f"horovod {horovod.__version__}: TensorFlow + Gloo"


def keras_stack() -> str:
    from sparkhvd.spark.installed import check_keras, package_version

    check_keras()
    tf = package_version("tensorflow-cpu") or package_version("tensorflow")
    return f"tensorflow {tf}, keras {package_version('keras')}"


def java() -> str:
    path = shutil.which("java") or (os.path.join(os.environ["JAVA_HOME"], "bin", "java")
                                    if os.environ.get("JAVA_HOME") else None)
    if not path:
        raise RuntimeError("java not found on PATH or in JAVA_HOME")
    out = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30)
    line = (out.stderr or out.stdout).splitlines()[0]
    from sparkhvd.spark.installed import spark_version, version_tuple

    found = re.search(r'version "(\d+)(?:\.(\d+))?', line)
    major = int(found.group(1)) if found else 0
    if found and major == 1:  # "1.8.0" is Java 8
        major = int(found.group(2) or 0)  # "1.8.0" is Java 8
    spark = spark_version()
    if spark and version_tuple(spark) >= (4, 0) and 0 < major < 17:
        raise RuntimeError(f"{line}: Spark {spark} needs Java 17 or newer")
    return line


def horovod_backend() -> str:
    built = horovod_build()
    return f"{built}; {keras_stack()}"


def tf_backend() -> str:
    import tensorflow as tf

    if not hasattr(tf.distribute, "MultiWorkerMirroredStrategy"):
        raise RuntimeError(f"tensorflow {tf.__version__} has no MultiWorkerMirroredStrategy")
    from sparkhvd.spark.installed import package_version

    keras = getattr(tf.keras, "__version__", None) or package_version("keras")
    return f"tensorflow {tf.__version__}, keras {keras}: MultiWorkerMirroredStrategy"


def torch_backend() -> str:
    import torch
    import torch.distributed as dist

    from sparkhvd.spark.installed import package_version

    if not dist.is_available():
        raise RuntimeError(f"torch {torch.__version__} was built without torch.distributed")
    kinds = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                   ("nccl", dist.is_nccl_available())) if ok]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    clients = [f"{name} {package_version(dist_name)}" for name, dist_name in TORCH_CLIENTS
               if package_version(dist_name)]
    return (f"torch {torch.__version__}: torch.distributed ({', '.join(kinds) or 'no backend'}), "
            f"{gpus} GPU(s); torchrun's worker variables, so these run unchanged: "
            f"{', '.join(clients) or 'none of Lightning, transformers, accelerate, DeepSpeed installed'}"
            "; not supported: elastic torch runs (torchrun --nnodes=MIN:MAX), "
            "horovod.torch (horovod 0.28 does not build against torch >= 2.1)")


#: The PyTorch libraries the tests run unchanged: (shown name, distribution).
TORCH_CLIENTS = (("Lightning", "lightning"), ("transformers", "transformers"),
                 ("accelerate", "accelerate"), ("DeepSpeed", "deepspeed"))


def spark_stack() -> str:
    """The pyspark version (inside the supported range) and what sparkhvd uses that it offers."""
    from sparkhvd.spark.installed import check_spark, spark_features

    version = check_spark()
    features = spark_features(version)
    have = [name for name, ok in features.items() if ok]
    lacks = [name for name, ok in features.items() if not ok]
    return (f"pyspark {version}: " + ", ".join(have)
            + (f"; not here: {', '.join(lacks)}" if lacks else ""))


def stack_checks() -> list[Check]:
    """Spark, which backends this environment can run (at least one must), and Java."""
    backends = [
        check("backend horovod", horovod_backend,
              "run `make setup` (builds horovod with TensorFlow + Gloo; needs TensorFlow <= "
              "2.18 with Keras 2 or tf-keras), or use backend='tf'"),
        check("backend tf", tf_backend, "install tensorflow (>= 2.4)"),
        check("backend torch", torch_backend, "install torch (e.g. pip install torch)"),
    ]
    usable = [b for b in backends if b.ok]
    for b in backends:
        b.optional = bool(usable)
    from sparkhvd.spark.installed import SPARK_INSTALL_HINT, SPARK_RANGE

    return [check("Spark", spark_stack, SPARK_INSTALL_HINT.format(range=SPARK_RANGE))] \
        + backends + [
        check("Java", java, "install Java 17 (apt-get install -y openjdk-17-jre-headless) or "
                            "set JAVA_HOME"),
    ]


# -- cluster probe -----------------------------------------------------------------------------
def _probe_task(driver: str, port: int, spark_port: int, batches: Any) -> Any:
    """One barrier task (``mapInArrow``): where am I, and can I reach the driver."""
    import json

    import pyarrow as pa
    from pyspark import BarrierTaskContext

    from sparkhvd.common.netif import iface_towards

    for _ in batches:
        pass
    context = BarrierTaskContext.get()

    def reach(target_port: int) -> str:
        if not target_port:
            return "-"
        try:
            with socket.create_connection((driver, target_port), timeout=5) as s:
                return f"yes (from {s.getsockname()[0]})"
        except OSError as exc:
            return f"NO ({exc.strerror or exc})"

    try:
        iface = iface_towards(driver) or "?"
    except OSError as exc:
        iface = f"none ({exc.strerror or exc})"
    context.barrier()
    row = {"partition": context.partitionId(), "host": socket.gethostname(), "iface": iface,
           "driver": reach(port), "spark": reach(spark_port)}
    yield pa.RecordBatch.from_pydict({"row": [json.dumps(row)]})


def probe_cluster(spark: Any, np: int, timeout: float = 120) -> list[dict]:
    """One barrier stage of ``np`` tasks reporting host, Gloo interface and reachability --
    the launcher's own DataFrame barrier path, so it works on Spark Connect too."""
    import functools
    import json

    from sparkhvd.spark.sparkview import SparkView

    view = SparkView(spark)
    host = view.driver_host()
    listener = socket.create_server(("127.0.0.1" if host == "127.0.0.1" else "", 0))
    listener.settimeout(1)
    accepting = threading.Event()

    def accept() -> None:
        while not accepting.is_set():
            try:
                conn, _ = listener.accept()
                conn.close()
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    spark_port = 0 if view.connect else int(view.conf("spark.driver.port", "0") or 0)
    try:
        task = functools.partial(_probe_task, host, listener.getsockname()[1], spark_port)
        rows = view.job("sparkhvd-doctor", "sparkhvd doctor: cluster probe").run(
            lambda: view.barrier_collect(np, task, "row string"))
    finally:
        accepting.set()
        listener.close()
    return sorted((json.loads(r["row"]) for r in rows), key=lambda r: r["partition"])


def cluster_checks(spark: Any, np: int) -> tuple[list[Check], Optional[list[dict]]]:
    """Slots, then the probe (when the slots are there)."""
    from sparkhvd.spark.slots import check_slots

    found: dict = {}

    from sparkhvd.spark.sparkview import SparkView

    view = SparkView(spark)

    def slots() -> str:
        result = check_slots(view, np, wait_s=0 if view.master.startswith("local") else 30)
        found["slots"] = result
        return f"{result.slots} slot(s) >= np={np} ({result.detail})"

    checks = [check("task slots", slots, "use a larger preset or lower np" + (
        "; on Spark Connect, declare them with spark.sparkhvd.slots" if view.connect else ""))]
    if not checks[0].ok:
        return checks, None
    rows: list[dict] = []

    def probe() -> str:
        rows.extend(probe_cluster(spark, np))
        bad = [r for r in rows if not r["driver"].startswith("yes")]
        hosts = sorted({r["host"] for r in rows})
        if bad:
            raise RuntimeError(f"{len(bad)} task(s) cannot reach the driver: "
                               + "; ".join(f"{r['host']}: {r['driver']}" for r in bad))
        return (f"{np} task(s) on {len(hosts)} host(s) ({', '.join(hosts)}); Gloo interface(s): "
                f"{', '.join(sorted({r['iface'] for r in rows}))}")

    checks.append(check("cluster network", probe,
                        "let the executors reach the driver (firewall, spark.driver.host), or "
                        "pass nics= to choose the interface"))
    return checks, rows
