"""B6: streaming one shuffled epoch, peak RSS and rows/s (run by bench.py)."""
from __future__ import annotations

import tempfile

from b2 import b2_frame
from bench_common import local_spark, stats


def _one_shuffled_epoch(ds, batch):
    """In a rank: one shuffled epoch through tf.data, as training reads it."""
    import resource
    import time as _time

    import tensorflow  # noqa: F401 - imported by the training code before any data is read

    rows, start = 0, _time.perf_counter()
    # the whole epoch, as training meets it: the in-memory path reads its shard up front (in
    # tf_dataset), the streamed path as it goes; tf.data's start-up is in both
    with ds.tf_dataset(batch, epochs=1, shuffle=True, seed=1) as tfds:
        for x, _ in tfds:
            rows += int(x.shape[0])
    seconds = _time.perf_counter() - start
    return {"rows_per_s": rows / seconds, "peak_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "streamed": ds.streams()}


def case_b6(repeat: int, tiny: bool) -> list[dict]:

    from sparkhvd import DataFrameDataset, HorovodRunner

    spark = local_spark()
    width, batch = 784, 256
    sizes = (1_000, 2_000, 4_000) if tiny else (100_000, 400_000, 800_000)
    out = tempfile.mkdtemp(prefix="bench-b6-")
    rows = []
    for n in sizes:
        ds = DataFrameDataset(b2_frame(spark, n, width), "x", "y").materialize()
        variants = [("default", None)]
        if n == sizes[0]:
            variants.append(("streamed (memory_cache=0)", 0))
        try:
            for label, budget in variants:
                if budget is not None:
                    ds.memory_cache = budget
                runs = [HorovodRunner(np=2, spark=spark, output_dir=out).run_all(
                    _one_shuffled_epoch, ds=ds, batch=batch) for _ in range(min(repeat, 2))]
                how = "streamed" if runs[0][0]["streamed"] else "in memory"
                name = f"{n:,} rows x {width} float32, {label}: {how}"
                rows.append({"case": "B6", "variant": f"peak RSS per rank, {name}", "unit": "MB",
                             **stats([max(r["peak_mb"] for r in run) for run in runs]),
                             "rows": n})
                rows.append({"case": "B6", "variant": f"rows/s per rank, {name}",
                             "unit": "rows/s per rank",
                             **stats([min(r["rows_per_s"] for r in run) for run in runs]),
                             "rows": n})
        finally:
            ds.close()
    return rows
