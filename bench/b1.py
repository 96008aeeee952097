"""B1 and B1C: launch overhead of a no-op, classic and Spark Connect (run by bench.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from bench_common import interleaved, local_spark, stats, timed


def _noop():
    return 0


def _import_tf():
    import tensorflow  # noqa: F401

    return 0


def _build_strategy():
    import tensorflow as tf

    tf.distribute.MultiWorkerMirroredStrategy()
    return 0


def case_b1(repeat: int, tiny: bool) -> list[dict]:
    import horovod.spark

    from sparkhvd import HorovodRunner

    spark = local_spark()
    sc = spark.sparkContext
    out = tempfile.mkdtemp(prefix="bench-b1-")
    python = sys.executable

    def floor():
        sc.parallelize(range(2), 2).map(
            lambda _: subprocess.run([python, "-c", "pass"]).returncode).collect()

    def raw(fn):
        return lambda: horovod.spark.run(fn, num_proc=2, use_gloo=True, nics={"lo"}, verbose=0,
                                         stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))

    def ours(fn, launcher="auto", backend="horovod"):
        return lambda: HorovodRunner(np=2, spark=spark, output_dir=out, launcher=launcher,
                                     backend=backend).run(fn)

    raw(_noop)()  # warm the session and horovod's imports
    rows = [{"case": "B1", "variant": "floor: 2-task Spark job + python", "unit": "s",
             **timed(floor, repeat)}]
    fns = [("no-op", _noop)] + ([] if tiny else [("imports TF", _import_tf)])
    for label, fn in fns:
        rows.append({"case": "B1", "variant": f"raw horovod.spark.run, {label}", "unit": "s",
                     **timed(raw(fn), repeat)})
        rows.append({"case": "B1", "variant": f"sparkhvd HorovodRunner, {label}", "unit": "s",
                     **timed(ours(fn), repeat)})
        rows.append({"case": "B1", "variant": f"sparkhvd launcher='horovod', {label}",
                     "unit": "s", **timed(ours(fn, "horovod"), repeat)})
    rows.append({"case": "B1", "variant": "sparkhvd backend='tf', no-op", "unit": "s",
                 **timed(ours(_noop, backend="tf"), repeat)})
    if not tiny:
        rows.append({"case": "B1", "variant": "sparkhvd backend='tf', builds the strategy",
                     "unit": "s", **timed(ours(_build_strategy, backend="tf"), repeat)})
    return rows


def case_b1c(repeat: int, tiny: bool) -> list[dict]:
    """B1 on Spark Connect: the same no-op (backend='tf', np=2) on a classic local[2] session and
    through a Spark Connect client of a local[2] Connect server, interleaved in one run."""
    from conftest import ConnectServer, connect_unavailable

    why = connect_unavailable()
    if why:
        return [{"case": "B1C", "variant": "no-op, Spark Connect vs classic", "unit": "s",
                 "skipped": f"{why}: make bench CASE=B1C PROFILE=modern"}]
    import pyspark

    from sparkhvd import HorovodRunner

    classic = local_spark()
    server = ConnectServer(tempfile.mkdtemp(prefix="bench-connect-"))
    out = tempfile.mkdtemp(prefix="bench-b1c-")

    def ours(session, connect_mode):
        def run():
            if connect_mode:  # what SparkSession.builder.remote() sets in a user's process
                os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
            else:
                os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
            HorovodRunner(np=2, spark=session, backend="tf", output_dir=out).run(_noop)
        return run

    try:
        connect = server.session()
        label = f"pyspark {pyspark.__version__}, backend='tf', no-op"
        timings = interleaved([(f"classic local[2], {label}", ours(classic, False)),
                                (f"Spark Connect (local[2] server), {label}",
                                 ours(connect, True))], repeat)
        connect.stop()
    finally:
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        server.stop()
    return [{"case": "B1C", "variant": name, "unit": "s", **stats(values)}
            for name, values in timings.items()]
