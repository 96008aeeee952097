"""B2T: the PyTorch data path (run by bench.py)."""
from __future__ import annotations

import os
import tempfile
import time

from b2 import b2_frame, pyarrow_ceiling, rank_groups_ceiling
from bench_common import interleaved, local_spark, stats


def _torch_distributor_input(rows: int, batch: int):
    """In a TorchDistributor task: one pass over its spooled partition through Spark's own
    loader (``_get_spark_partition_data_loader``), rows/s."""
    import time as _time

    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    loader = _get_spark_partition_data_loader(rows, batch, num_workers=0)
    seen, start = 0, _time.perf_counter()
    for x, _ in loader:
        seen += len(x)
    return {"rows_per_s": seen / (_time.perf_counter() - start)}


def _one_torch_epoch(ds, batch):
    """In a rank: one shuffled epoch of torch batches, as a training loop reads it."""
    import resource
    import time as _time

    import torch  # noqa: F401 - imported by the training code before any data is read

    rows, start = 0, _time.perf_counter()
    for x, _ in ds.torch_batches(batch, shuffle=True, seed=1):
        rows += int(x.shape[0])
    seconds = _time.perf_counter() - start
    return {"rows_per_s": rows / seconds, "peak_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "streamed": ds.streams()}


def case_b2t(repeat: int, tiny: bool) -> list[dict]:
    """B2 for PyTorch: rows/s of rank 0 of 2 reading its shard as torch batches -- sparkhvd's
    torch_batches and torch_dataset through a DataLoader, against the pyarrow ceiling,
    petastorm's make_torch_dataloader (defaults) and TorchDistributor's DataFrame input
    (Spark's private ``_train_on_dataframe``: it spools every partition to a local Arrow file
    first, timed separately); then peak RSS per rank at 100k vs 800k rows."""
    import importlib.util

    missing = [m for m in ("torch", "petastorm") if importlib.util.find_spec(m) is None]
    if missing:
        return [{"case": "B2T", "variant": "torch data path", "unit": "rows/s per rank",
                 "skipped": f"{' and '.join(missing)} not installed here: `make bench` installs "
                 "torch into the default profile, which has petastorm"}]
    import torch
    from pyspark.ml.torch.distributor import TorchDistributor

    from sparkhvd import DataFrameDataset, HorovodRunner
    from sparkhvd.data.shard import DatasetShard

    torch.set_num_threads(1)
    rows_n = 4_000 if tiny else int(os.environ.get("BENCH_B2T_ROWS", 400_000))
    width, batch, half = 784, 256, rows_n // 2
    spark = local_spark()
    df = b2_frame(spark, rows_n, width)
    t0 = time.perf_counter()
    ds = DataFrameDataset(df, "x", "y").materialize()
    materialize_s = time.perf_counter() - t0
    files = [f.replace("file://", "") for f in ds.files]
    petastorm_cache = tempfile.mkdtemp(prefix="bench-petastorm-")
    spark.conf.set("petastorm.spark.converter.parentCacheDirUrl", "file://" + petastorm_cache)
    from petastorm.spark import make_spark_converter

    t0 = time.perf_counter()
    converter = make_spark_converter(df.select("x", "y"))
    petastorm_s = time.perf_counter() - t0
    os.environ.update(HOROVOD_RANK="0", HOROVOD_SIZE="2")
    rank_ceiling, rank_rows = rank_groups_ceiling(ds.source, 0, 2, width)
    try:
        def batches():
            for _ in DatasetShard(ds.source).torch_batches(batch):  # a fresh rank's shard
                pass

        def shuffled():
            for _ in DatasetShard(ds.source).torch_batches(batch, shuffle=True, seed=1):
                pass

        def loader():
            data = DatasetShard(ds.source).torch_dataset(batch)
            for _ in torch.utils.data.DataLoader(data, batch_size=None):
                pass

        def petastorm_defaults():
            with converter.make_torch_dataloader(batch_size=batch, num_epochs=1, cur_shard=0,
                                                 shard_count=2) as data:
                for _ in data:
                    pass

        timings = interleaved([
            ("pyarrow in-process (ceiling)", pyarrow_ceiling(files, half, width)),
            ("pyarrow in-process, the row groups rank 0 of 2 reads (its ceiling)",
             rank_ceiling),
            ("sparkhvd DatasetShard.torch_batches", batches),
            ("sparkhvd DatasetShard.torch_batches shuffled (global order)", shuffled),
            ("sparkhvd torch_dataset through a DataLoader", loader),
            ("petastorm make_torch_dataloader (defaults)", petastorm_defaults)], repeat)
        rows = [{"case": "B2T", "variant": variant, "unit": "rows/s per rank",
                 **stats([(rank_rows if "rank 0 of 2 reads" in variant else half) / v
                           for v in runs]), "rows": rows_n}
                for variant, runs in timings.items()]
    finally:
        for key in ("HOROVOD_RANK", "HOROVOD_SIZE"):
            os.environ.pop(key, None)
        converter.delete()
        import shutil

        shutil.rmtree(petastorm_cache, ignore_errors=True)
    spools, speeds = [], []
    for _ in range(max(1, min(repeat, 2))):
        t0 = time.perf_counter()
        got = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)\
            ._train_on_dataframe(_torch_distributor_input, df.repartition(2), rows=half,
                                 batch=batch)
        spools.append(time.perf_counter() - t0)
        speeds.append(got["rows_per_s"])
    rows.append({"case": "B2T", "variant": "TorchDistributor DataFrame input (Spark's loader)",
                 "unit": "rows/s per rank", **stats(speeds), "rows": rows_n})
    rows += [
        {"case": "B2T", "variant": "sparkhvd materialize() (Parquet, once per dataset)",
         "unit": "s", **stats([materialize_s]), "rows": rows_n},
        {"case": "B2T", "variant": "petastorm make_spark_converter (Parquet cache)", "unit": "s",
         **stats([petastorm_s]), "rows": rows_n},
        {"case": "B2T", "variant": "TorchDistributor _train_on_dataframe, whole run (spools "
         "each partition to an Arrow file)", "unit": "s", **stats(spools), "rows": rows_n}]
    ds.close()
    out = tempfile.mkdtemp(prefix="bench-b2t-")
    for n in ((1_000, 4_000) if tiny else (100_000, 800_000)):
        sized = DataFrameDataset(b2_frame(spark, n, width), "x", "y").materialize()
        try:
            runs = [HorovodRunner(np=2, spark=spark, output_dir=out).run_all(
                _one_torch_epoch, ds=sized, batch=batch) for _ in range(min(repeat, 2))]
        finally:
            sized.close()
        how = "streamed" if runs[0][0]["streamed"] else "in memory"
        rows.append({"case": "B2T", "variant": f"peak RSS per rank, {n:,} rows, torch_batches "
                     f"shuffled ({how})", "unit": "MB", "rows": n,
                     **stats([max(r["peak_mb"] for r in run) for run in runs])})
    return rows
