"""B2: one rank's data throughput, DataFrameDataset vs petastorm vs pyarrow (run by bench.py)."""
from __future__ import annotations

import os
import tempfile
from typing import Callable

from bench_common import interleaved, local_spark, stats


def b2_frame(spark, rows_n: int, width: int = 784):
    """The DataFrame B2, B2T, B6 and B14 read: ``width`` random float32 per row and a label."""
    from pyspark.sql import functions as F

    return spark.range(rows_n, numPartitions=8).select(
        F.array(*[F.rand(i).cast("float") for i in range(width)]).alias("x"),
        (F.col("id") % 10).alias("y"))


def pyarrow_ceiling(files: list[str], rows: int, width: int) -> Callable[[], None]:
    """A plain pyarrow loop over the same Parquet (read each file by path, convert it, stop
    after ``rows``): the reference a reader is measured against."""
    import numpy as np
    import pyarrow.parquet as pq

    def ceiling():
        got = 0
        for f in files:
            if got >= rows:
                break
            t = pq.read_table(f, columns=["c0", "c1"])
            t.column("c0").combine_chunks().flatten().to_numpy().reshape(t.num_rows, width)
            np.asarray(t.column("c1"))
            got += t.num_rows
    return ceiling


def rank_groups_ceiling(source, rank: int, size: int, width: int) -> tuple[Callable[[], None],
                                                                          int]:
    """pyarrow reading, in one process, the row groups rank ``rank`` of ``size`` reads in a
    shuffled epoch (its partitions'), one scan per file, converted to numpy: the ceiling of
    that rank's reader. Returns the loop and the rows it reads."""
    import numpy as np
    import pyarrow.dataset as pds
    import pyarrow.fs as pafs

    from sparkhvd.data.order import blocks_of, layout, owned_partitions

    parts = layout(blocks_of(source.row_groups), source.partitions, shuffle=True, seed=1)
    groups: dict[int, set] = {}
    for c in owned_partitions(source.partitions, size, rank):
        for piece in parts[c]:
            groups.setdefault(piece.file, set()).add(piece.group)
    paths = [f.replace("file://", "") for f in source.files]
    rows = sum(source.row_groups[f][g] for f, gs in groups.items() for g in gs)

    def ceiling():  # pyarrow's fastest way to those row groups: one dataset scan per file
        for f, gs in sorted(groups.items()):
            fragment = pds.ParquetFileFormat().make_fragment(paths[f],
                                                             filesystem=pafs.LocalFileSystem())
            t = fragment.subset(row_group_ids=sorted(gs)).to_table(columns=["c0", "c1"])
            t.column("c0").combine_chunks().flatten().to_numpy().reshape(t.num_rows, width)
            np.asarray(t.column("c1"))
    return ceiling, rows


def case_b2(repeat: int, tiny: bool) -> list[dict]:
    from sparkhvd import DataFrameDataset

    rows_n = 4_000 if tiny else int(os.environ.get("BENCH_B2_ROWS", 1_000_000))
    width, batch = 784, 256
    spark = local_spark()
    df = b2_frame(spark, rows_n, width)
    ds = DataFrameDataset(df, "x", "y").materialize()
    files = [f.replace("file://", "") for f in ds.files]
    petastorm_cache = tempfile.mkdtemp(prefix="bench-petastorm-")
    spark.conf.set("petastorm.spark.converter.parentCacheDirUrl", "file://" + petastorm_cache)
    from petastorm.spark import make_spark_converter

    converter = make_spark_converter(df.select("x", "y"))
    os.environ.update(HOROVOD_RANK="0", HOROVOD_SIZE="2")
    half = rows_n // 2
    try:
        from sparkhvd.data.shard import DatasetShard

        def epoch(memory_cache):
            def run():
                shard = DatasetShard(ds.source)  # a fresh rank's shard: includes the read
                shard.memory_cache = memory_cache
                with shard.tf_dataset(batch, epochs=1) as tfds:
                    for _ in tfds:
                        pass
            return run

        def petastorm_defaults():
            with converter.make_tf_dataset(batch_size=batch, num_epochs=1, cur_shard=0,
                                           shard_count=2) as tfds:
                for _ in tfds:
                    pass

        timings = interleaved([("pyarrow in-process (ceiling)",
                                 pyarrow_ceiling(files, half, width)),
                                ("sparkhvd DataFrameDataset.tf_dataset, streamed", epoch(0)),
                                ("sparkhvd DataFrameDataset.tf_dataset, in memory",
                                 epoch(1 << 40)),
                                ("petastorm make_tf_dataset (defaults)", petastorm_defaults)],
                               repeat)
        return [{"case": "B2", "variant": variant, "unit": "rows/s per rank",
                 **stats([half / v for v in runs]), "rows": rows_n, "floats_per_row": width}
                for variant, runs in timings.items()]
    finally:
        for key in ("HOROVOD_RANK", "HOROVOD_SIZE"):
            os.environ.pop(key, None)
        ds.close()
        converter.delete()
        import shutil

        shutil.rmtree(petastorm_cache, ignore_errors=True)
