"""B9: an over-partitioned DataFrame, materialised and read (run by bench.py)."""
from __future__ import annotations

import tempfile
import time

from bench_common import local_spark, stats


def _count_rows(ds):
    return sum(len(x) for x, _ in ds.batches(50, 0))


def case_b9(repeat: int, tiny: bool) -> list[dict]:
    """An over-partitioned DataFrame (2,000 rows in 1,000 partitions): materialise it and read
    one epoch on np=2, merged into one wave of write tasks (sparkhvd) vs one Parquet file per
    partition (what it did before)."""
    from pyspark.sql import functions as F

    from sparkhvd import DataFrameDataset, HorovodRunner
    from sparkhvd.data import materialize as mat

    spark = local_spark()
    rows, parts = (200, 100) if tiny else (2_000, 1_000)
    out = tempfile.mkdtemp(prefix="bench-b9-")
    df = spark.range(rows, numPartitions=parts).select(F.col("id").cast("double").alias("x"),
                                                       (F.col("id") % 2).alias("y"))
    merged = mat.file_count
    results = []
    for label, count in (("merged into one wave of tasks (sparkhvd)", merged),
                         ("one Parquet file per partition (before)",
                          lambda *_: None)):
        mat.file_count = count
        values = []
        try:
            for _ in range(repeat):
                t0 = time.perf_counter()
                ds = DataFrameDataset(df.select("x", "y"), "x", "y")
                try:
                    HorovodRunner(np=2, spark=spark, output_dir=out).run(_count_rows, ds=ds)
                finally:
                    ds.close()
                values.append(time.perf_counter() - t0)
        finally:
            mat.file_count = merged
        results.append({"case": "B9", "variant": f"{rows:,} rows in {parts:,} partitions, "
                        f"materialise + one epoch np=2: {label}", "unit": "s", **stats(values)})
    return results
