"""B7: scoring a DataFrame on the executors vs collecting it (run by bench.py)."""
from __future__ import annotations

import os
import tempfile

from bench_common import interleaved, local_spark, stats


def case_b7(repeat: int, tiny: bool) -> list[dict]:
    import numpy as np
    import tensorflow as tf
    from pyspark.sql import functions as F

    from sparkhvd import predict

    spark = local_spark()
    # 40k rows: the reference collects them through the driver JVM (1 GB heap in local mode),
    # which 100k rows of 784 floats already exhaust -- the reason to score on the executors.
    width, n = 784, (2_000 if tiny else 40_000)
    df = spark.range(n, numPartitions=4).select(
        F.array(*[F.rand(i).cast("float") for i in range(width)]).alias("x")).cache()
    df.count()
    model = tf.keras.Sequential([tf.keras.layers.Input((width,)),
                                 tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    path = os.path.join(tempfile.mkdtemp(prefix="bench-b7-"), "model.h5")
    model.save(path)

    def executors():
        predict(df, path, features="x", batch_size=1024, check=False) \
            .write.format("noop").mode("overwrite").save()

    def driver():
        x = np.stack(df.select("x").toPandas()["x"].values).astype("float32")
        model.predict(x, batch_size=1024, verbose=0)

    try:
        timings = interleaved([("sparkhvd.predict on the executors (local[2])", executors),
                                ("collect to the driver + model.predict", driver)],
                               max(1, min(repeat, 3)))
    finally:
        df.unpersist()
    return [{"case": "B7", "variant": variant, "unit": "rows/s", **stats([n / v for v in runs]),
             "rows": n, "floats_per_row": width} for variant, runs in timings.items()]
