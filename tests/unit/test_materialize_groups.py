"""The row groups the materialiser writes (sparkhvd.data.materialize): sized by the table, so
a small table still has many groups -- a rank of many reads its share plus a split group at
each end, and its share holds groups from all over the table. The executors' write function
is called here as mapInArrow calls it, on Arrow batches, without Spark."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sparkhvd.data import materialize
from sparkhvd.data.materialize import (
    GROUPS_WANTED,
    MIN_GROUP_BYTES,
    ROW_GROUP_BYTES,
    group_bytes_for,
)

MB = 1 << 20


def test_a_large_table_keeps_the_usual_groups_and_a_small_one_gets_smaller_ones():
    assert group_bytes_for(1024 * MB, 8) == ROW_GROUP_BYTES
    assert group_bytes_for(32 * MB, 8) == 32 * MB * 8 // GROUPS_WANTED  # 128 KB
    assert group_bytes_for(1 * MB, 2) == MIN_GROUP_BYTES
    assert group_bytes_for(32 * MB, 8, ceiling=320) == 320, "a smaller ceiling wins"


def _written(tmp_path, rows: int, files: int, batch_rows: int = 1000) -> list[int]:
    x = np.random.default_rng(0).random((rows, 16), dtype=np.float32)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * 16)
    table = pa.table({"c0": pa.ListArray.from_arrays(offsets, x.ravel()),
                      "c1": np.arange(rows)})
    write = materialize._partition_writer(str(tmp_path), {}, ROW_GROUP_BYTES, ["c0"], files)
    (row,) = [r for out in write(iter(table.to_batches(batch_rows))) for r in out.to_pylist()]
    meta = pq.ParquetFile(tmp_path / row["file"]).metadata
    assert row["groups"] == [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert row["rows"] == rows and pq.read_table(tmp_path / row["file"]).equals(table)
    return row["groups"]


def test_a_small_partition_is_written_in_small_groups_every_row_kept(tmp_path):
    """200,000 rows of 76 bytes (about 14.5 MB in Arrow), one file of 8: each group about
    14.5 MB x 8 / 2048 -- 58 KB, some 250 groups -- where 512 KB groups made 29."""
    groups = _written(tmp_path, 200_000, 8)
    assert 200 <= len(groups) <= 300 and len(set(groups[:-1])) == 1


def test_a_partition_larger_than_the_sizing_buffer_keeps_the_usual_groups(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(materialize, "SIZING_BUFFER_BYTES", 4 * MB)
    groups = _written(tmp_path, 200_000, 2048)  # 14 MB x 2048 files: a large table
    assert len(groups) == 29 and groups[0] == ROW_GROUP_BYTES // 76, "512 KB groups"


def test_the_writers_footers_go_to_the_ranks_who_read_none(tmp_path):
    """The footer each write task returns is its file's; a shard given the footers reads only
    row groups, and one without reads each footer once for the run (the same bytes)."""
    from sparkhvd.data.footers import footer_of
    from sparkhvd.data.shard import DatasetShard
    from sparkhvd.data.sharding import ShardSource, footer_size

    rows = 20_000
    table = pa.table({"c0": np.arange(rows, dtype=np.float32), "c1": np.arange(rows) % 10})
    write = materialize._partition_writer(str(tmp_path), {}, ROW_GROUP_BYTES, ["c0"], 8)
    (row,) = [r for out in write(iter(table.to_batches(1000))) for r in out.to_pylist()]
    path = str(tmp_path / row["file"])
    meta = footer_of(row["footer"])  # Parquet's own footer bytes: no pickle
    assert meta.equals(pq.read_metadata(path)) and meta.num_row_groups == len(row["groups"]) > 1
    plain = ShardSource(files=(path,), row_counts=(rows,), row_groups=(tuple(row["groups"]),),
                        stored={"x": "c0", "y": "c1"}, row_bytes=12, features=("x",),
                        label="y", memory_cache=0)
    shipped = ShardSource(**{**plain.__dict__, "footers": (row["footer"],),
                             "footer_bytes": footer_size(meta)})
    read = {}
    for name, source in (("plain", plain), ("shipped", shipped)):
        shard = DatasetShard(source)
        for epoch in (0, 1):
            seen = sorted(int(v) for x, _ in shard.batches(100, epoch, rank=0, size=1,
                                                           shuffle=True, seed=1) for v in x)
            assert seen == list(range(rows))
        read[name] = shard.bytes_read
    assert read["plain"] - read["shipped"] == footer_size(meta) > 0
