"""torch_batches(device=...): batches handed out already on the device, copied from pinned
memory on a side stream one batch ahead (sparkhvd.data.device). No GPU here: the CUDA calls
go through a recording fake; the lent GPU runs the real ones (bench B5D)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparkhvd.data.device import PINNED_SETS, to_device  # noqa: E402


class FakeCopies:
    """Records the order of the calls a CUDA device would get; 'device' tensors are clones."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.pinned: list[int] = []

    def pinned_like(self, tensor):
        buffer = torch.empty_like(tensor)
        self.pinned.append(id(buffer))
        self.calls.append(("pin", tuple(tensor.shape)))
        return buffer

    def copy_ahead(self, pinned):
        done = object()
        self.calls.append(("copy", done))
        return [t.clone() for t in pinned], done

    def hand_over(self, tensors, done):
        self.calls.append(("hand over", done))

    def wait(self, done):
        self.calls.append(("wait", done))


def _batches(n=7, rows=4):
    for k in range(n):
        x = torch.from_numpy(np.full((rows, 3), k, dtype=np.float32))
        yield {"x": x, "id": torch.full((rows,), k)}, torch.full((rows,), -k)


def test_each_batch_is_copied_one_ahead_through_reused_pinned_buffers():
    fake = FakeCopies()
    got = []
    for k, (features, y) in enumerate(to_device(_batches(), "cuda", copies=fake)):
        got.append(k)
        copies = [c for c in fake.calls if c[0] == "copy"]
        handed = [c for c in fake.calls if c[0] == "hand over"]
        assert len(handed) == k + 1 and handed[-1][1] is copies[k][1], "waits on its own copy"
        assert len(copies) == min(k + 2, 7), "the next batch's copy is already under way"
        assert (features["x"] == k).all() and (features["id"] == k).all() and (y == -k).all()
    assert got == list(range(7))
    assert len(fake.pinned) == PINNED_SETS * 3, "pinned once per set of the ring, then reused"
    waits = [c[1] for c in fake.calls if c[0] == "wait"]
    copies = [c[1] for c in fake.calls if c[0] == "copy"]
    assert waits == copies[:7 - PINNED_SETS], "a set is refilled only after its copy ended"


def test_a_batch_of_another_shape_gets_new_buffers():
    fake = FakeCopies()

    def mixed():
        yield from _batches(2, rows=4)
        yield from _batches(1, rows=2)

    shapes = [f["x"].shape[0] for f, _ in to_device(mixed(), "cuda", copies=fake)]
    assert shapes == [4, 4, 2]
    assert [c[1] for c in fake.calls if c[0] == "pin"].count((2, 3)) == 1


def test_other_devices_move_each_batch():
    moved = list(to_device(_batches(2), "cpu"))
    assert [int(f["x"][0, 0]) for f, _ in moved] == [0, 1]
    assert moved[1][0]["x"].device.type == "cpu"


def test_torch_batches_hands_out_device_batches(tmp_path, monkeypatch):
    """The documented call, torch_batches(..., device="cuda"), through the same fake."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparkhvd.data import device
    from sparkhvd.data.shard import DatasetShard
    from sparkhvd.data.sharding import ShardSource

    ids = np.arange(100)
    path = str(tmp_path / "part-00000.parquet")
    pq.write_table(pa.table({"c0": pa.array(ids.astype(np.float32)), "c1": pa.array(ids)}), path,
                   row_group_size=10)
    source = ShardSource(files=(path,), row_counts=(100,), row_groups=((10,) * 10,),
                         stored={"x": "c0", "y": "c1"}, row_bytes=12, features=("x",), label="y")
    fakes = []
    monkeypatch.setattr(device, "CudaCopies", lambda dev: fakes.append(FakeCopies()) or fakes[-1])
    shard = DatasetShard(source)
    on_device = []
    for step, (_, y) in enumerate(shard.torch_batches(10, shuffle=True, seed=3,
                                                      device="cuda"), 1):
        on_device.append(y.tolist())
        assert shard.position.step == step, "the position of the batch handed out, not ahead"
    plain = [y.tolist() for _, y in DatasetShard(source).torch_batches(10, shuffle=True, seed=3)]
    assert on_device == plain and len(fakes) == 1
    assert [c[0] for c in fakes[0].calls].count("copy") == 10
