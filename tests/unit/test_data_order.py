"""The global order of a DataFrameDataset's epochs (sparkhvd.data.sharding), read the way ranks
read it: real Parquet files with many row groups, the rank half (DatasetShard) asked for each
rank of 1, 2 or 3. No Spark: the materialised files are written here with pyarrow, as the
executors write them (one file per partition, fixed-size row groups)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkhvd.data.shard import DatasetShard
from sparkhvd.data.sharding import ShardSource


def _source(tmp_path, columns: dict, group_rows: int, files: int = 3,
            memory_cache: int = 1 << 30) -> ShardSource:
    """``columns`` (name -> array) as ``files`` Parquet files of ``group_rows``-row groups."""
    n = len(next(iter(columns.values())))
    paths, counts, groups = [], [], []
    for f, idx in enumerate(np.array_split(np.arange(n), files)):
        table = pa.table({f"c{i}": (pa.array(list(v[idx])) if v.ndim > 1 else pa.array(v[idx]))
                          for i, v in enumerate(columns.values())})
        path = str(tmp_path / f"part-{f:05d}.parquet")
        pq.write_table(table, path, row_group_size=group_rows)
        meta = pq.ParquetFile(path).metadata
        paths.append(path)
        counts.append(len(idx))
        groups.append(tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
    names = list(columns)
    row_bytes = sum(v[0].nbytes if v.ndim > 1 else v.itemsize for v in columns.values())
    return ShardSource(files=tuple(paths), row_counts=tuple(counts), row_groups=tuple(groups),
                       stored={c: f"c{i}" for i, c in enumerate(names)}, row_bytes=row_bytes,
                       features=tuple(names[:-1]), label=names[-1], memory_cache=memory_cache)


def _ids(tmp_path, n=1000, group_rows=17, memory_cache=1 << 30):
    ids = np.arange(n, dtype=np.int64)
    return _source(tmp_path, {"id": ids, "label": ids % 10}, group_rows,
                   memory_cache=memory_cache)


def _interleaved(source, size, batch, epoch, *, start_state=None, **kw):
    """The ranks' batches step by step, rank by rank (each rank its own DatasetShard)."""
    per_rank = []
    for rank in range(size):
        shard = DatasetShard(source)
        if start_state is not None:
            shard.load_state_dict(start_state)
        per_rank.append([[int(i) for i in x] for x, _ in
                         shard.batches(batch, epoch, rank=rank, size=size, **kw)])
    assert len({len(r) for r in per_rank}) == 1, "equal steps on every rank"
    return [i for step in zip(*per_rank) for b in step for i in b]


MODES = {"in memory": {}, "streamed": {"memory_cache": 0}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_one_global_order_whatever_the_number_of_ranks(tmp_path, mode, shuffle):
    source = _ids(tmp_path, **MODES[mode])
    window = {"shuffle_buffer": 120} if mode == "streamed" else {}
    for epoch in range(2):
        orders = {size: _interleaved(source, size, 16, epoch, shuffle=shuffle, seed=5, **window)
                  for size in (1, 2, 3)}
        shortest = min(len(o) for o in orders.values())
        for size, order in orders.items():
            assert order[:shortest] == orders[1][:shortest], f"np={size} differs from np=1"
            assert len(set(order)) == len(order), "no row twice in an epoch"
            assert 1000 - len(order) < size * 16, "fewer than size*batch rows left out"
        if shuffle:
            assert orders[1] != sorted(orders[1])
        else:
            assert orders[1] == list(range(len(orders[1]))), "unshuffled: the files' order"
    if shuffle:
        assert _interleaved(source, 2, 16, 0, shuffle=True, seed=5, **window) != \
            _interleaved(source, 2, 16, 1, shuffle=True, seed=5, **window), "new order per epoch"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("new_size", [1, 2, 3])
def test_a_position_resumes_mid_epoch_with_any_number_of_ranks(tmp_path, mode, new_size):
    """np=2 stops after step 7 of epoch 1; the rest of the epoch with np=1, 2 or 3 trains each
    row of the epoch once across both runs, and with the same np it is the same sequence."""
    source = _ids(tmp_path, **MODES[mode])
    kw = {"shuffle": True, "seed": 2, "shuffle_buffer": 150}
    whole = _interleaved(source, 2, 16, 1, **kw)
    first = [DatasetShard(source) for _ in range(2)]
    before: list[int] = []
    for rank, shard in enumerate(first):
        for step, (x, _) in enumerate(shard.batches(16, 1, rank=rank, size=2, **kw), 1):
            before += [int(i) for i in x]  # trained
            if step == 7:
                break  # killed after step 7: batch 8 never handed out
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["samples"] == 7 * 2 * 16
    assert state["epoch"] == 1 and state["step"] == 7
    after = _interleaved(source, new_size, 16, 1, start_state=state, **kw)
    both = before + after
    assert len(set(both)) == len(both), "no row trained twice across the two runs"
    assert 1000 - len(both) < new_size * 16
    assert set(after) == set(whole[7 * 32:7 * 32 + len(after)]) or new_size != 2
    if new_size == 2:
        assert sorted(before) == sorted(whole[:7 * 32]) and after == whole[7 * 32:]
    shard = DatasetShard(source)
    shard.load_state_dict(state)
    assert shard.steps_in_epoch(16, 1, size=new_size) == (1000 - 224) // (16 * new_size)
    assert shard.steps_in_epoch(16, 2, size=new_size) == 1000 // (16 * new_size)


def test_a_position_of_other_data_is_refused(tmp_path):
    shard = DatasetShard(_ids(tmp_path))
    with pytest.raises(ValueError, match="for 999 rows.*has 1000.*not the data"):
        shard.load_state_dict({"epoch": 0, "samples": 32, "num_rows": 999})
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        next(shard.batches(8, 0, shuffle=True, seed=-1))


def _digits(tmp_path, sort: bool, memory_cache: int):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = np.tile((x / 16.0).astype("float32"), (4, 1))
    y = np.tile(y, 4).astype(np.int64)
    rng = np.random.default_rng(0)
    held = rng.random(len(y)) < 0.15
    order = np.argsort(y[~held], kind="stable") if sort else \
        rng.permutation(int((~held).sum()))
    source = _source(tmp_path, {"x": x[~held][order], "y": y[~held][order]}, group_rows=16,
                     memory_cache=memory_cache)
    return source, (x[held], y[held])


def _train(source, held, window, epochs=4, size=2, batch=32):
    """Softmax regression, data-parallel the way the ranks do it: each step averages the ranks'
    gradients over their batches (one global batch)."""
    shards = [DatasetShard(source) for _ in range(size)]
    w, b = np.zeros((64, 10)), np.zeros(10)
    labels_per_batch = []
    for epoch in range(epochs):
        streams = [s.batches(batch, epoch, rank=r, size=size, shuffle=True, seed=1,
                             shuffle_buffer=window) for r, s in enumerate(shards)]
        for step in zip(*streams):
            gw, gb = np.zeros_like(w), np.zeros_like(b)
            for x, y in step:
                labels_per_batch.append(len(set(y.tolist())))
                logits = x @ w + b
                p = np.exp(logits - logits.max(1, keepdims=True))
                p /= p.sum(1, keepdims=True)
                p[np.arange(len(y)), y] -= 1
                gw += x.T @ p / len(y) / size
                gb += p.mean(0) / size
            w -= 0.5 * gw
            b -= 0.5 * gb
    x, y = held
    return float(((x @ w + b).argmax(1) == y).mean()), float(np.mean(labels_per_batch))


@pytest.mark.parametrize("mode", ["in memory", "streamed"])
def test_sorted_data_trains_like_shuffled_data(tmp_path, mode):
    """Rows ordered by label train to the held-out accuracy of the same rows in random order,
    and batches hold as many distinct labels (the streamed window is ~1/10 of the data)."""
    memory_cache = 0 if mode == "streamed" else 1 << 30
    results = {}
    for sort in (False, True):
        folder = tmp_path / ("sorted" if sort else "random")
        folder.mkdir()
        source, held = _digits(folder, sort, memory_cache)
        assert 600 // 16 >= 32, "the docs' rule: at least 32 blocks per window"
        results[sort] = _train(source, held, window=600)
    (random_acc, random_labels), (sorted_acc, sorted_labels) = results[False], results[True]
    assert random_acc > 0.9
    assert abs(sorted_acc - random_acc) <= 0.02, results
    assert abs(sorted_labels - random_labels) <= 0.1 * random_labels, results


@pytest.mark.parametrize("mode", MODES)
def test_every_reader_gives_the_same_order(tmp_path, mode):
    """torch_batches, torch_dataset and tf_dataset are batches() converted: the same rows, in
    the same order (each checked where its framework is installed)."""
    source = _ids(tmp_path, **MODES[mode])
    kw = {"shuffle": True, "seed": 9}
    want = [[int(i) for i in x] for x, _ in DatasetShard(source).batches(16, 1, **kw)]
    found = {}
    if importlib.util.find_spec("torch"):
        import torch

        found["torch_batches"] = [x.tolist() for x, _ in
                                  DatasetShard(source).torch_batches(16, 1, **kw)]
        data = DatasetShard(source).torch_dataset(16, **kw)
        data.set_epoch(1)
        found["torch_dataset"] = [x.tolist() for x, _ in
                                  torch.utils.data.DataLoader(data, batch_size=None)]
    if importlib.util.find_spec("tensorflow"):
        shard = DatasetShard(source)
        shard.load_state_dict({"epoch": 1, "samples": 0})  # start at epoch 1, as a resume does
        with shard.tf_dataset(16, epochs=2, **kw) as ds:
            found["tf_dataset"] = [[int(i) for i in x.numpy()] for x, _ in ds]
    for reader, batches in found.items():
        assert batches == want, reader


def test_a_position_of_another_order_warns_only_mid_epoch(tmp_path, caplog):
    source = _ids(tmp_path)
    shard = DatasetShard(source)
    shard.load_state_dict({"epoch": 1, "samples": 0})  # an epoch's start, as Keras restores it
    with caplog.at_level("WARNING", logger="sparkhvd.data.shard"):
        next(shard.batches(8, 1, shuffle=True, seed=3))
        assert not caplog.records
        shard.load_state_dict({"epoch": 1, "samples": 64, "seed": 2, "shuffle": True,
                               "window_rows": 1000, "num_rows": 1000})
        next(shard.batches(8, 1, shuffle=True, seed=3))
    assert "seed 2 -> 3" in caplog.text and "continues at row 64" in caplog.text
