"""sparkhvd.keras on real 2-rank Horovod over local Spark: the recipe's proofs."""
import json
import os

import pytest

import digits_keras
from sparkhvd import HorovodRunner

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def four_epochs(spark, data, tmp_path_factory):
    """One uninterrupted 2-rank, 4-epoch run with warm-up and the timeline on."""
    out = tmp_path_factory.mktemp("runs")
    runner = HorovodRunner(np=2, spark=spark, output_dir=str(out), timeline=True)
    results = runner.run_all(digits_keras.train, **data, epochs=4, warmup_epochs=1)
    return runner.last_run_dir, results


def test_ranks_end_with_identical_weights(four_epochs):
    _, (r0, r1) = four_epochs
    assert r0["hash"] == r1["hash"]
    assert r0["start_hash"] == r1["start_hash"], "every rank starts from rank 0's weights"


def test_averaged_metrics_identical_on_every_rank(four_epochs):
    _, (r0, r1) = four_epochs
    assert len(r0["metrics"]) == 4
    assert r0["metrics"] == r1["metrics"]


def test_warmup_follows_documented_schedule(four_epochs):
    from sparkhvd.keras import warmup_lr

    _, (r0, r1) = four_epochs
    steps = (len(digits_keras.digits_split()[0]) // 2) // 32
    assert r0["target_lr"] == pytest.approx(0.002 * 2)
    expected = [warmup_lr(s, steps, r0["target_lr"], 2) for s in range(steps + 1)]
    assert [lr for *_, lr in r0["warmup"]] == pytest.approx(expected)
    assert r1["warmup"] == r0["warmup"]
    assert r0["warmup"][0][2] == pytest.approx(0.002)  # starts at the single-worker rate


def test_run_folder_has_checkpoints_curves_timeline(four_epochs):
    run_dir, _ = four_epochs
    ckpts = sorted(os.listdir(run_dir.file("checkpoints")))
    assert [c for c in ckpts if c.endswith(".h5")] == [
        "epoch-0001.h5", "epoch-0002.h5", "epoch-0003.h5", "epoch-0004.h5"]
    assert "epoch-0004.optimizer.npz" in ckpts and "latest.json" in ckpts
    latest = json.loads(open(run_dir.file("checkpoints/latest.json")).read())
    assert (latest["epoch"], latest["file"], latest["optimizer"]) == \
        (4, "epoch-0004.h5", "epoch-0004.optimizer.npz")
    assert latest["state"]["lr"] == pytest.approx(0.004)  # warm-up over: the scaled rate
    lines = open(run_dir.file("metrics.csv")).read().splitlines()
    assert lines[0].startswith("epoch,") and "val_accuracy" in lines[0] and len(lines) == 5
    assert open(run_dir.file("curves.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    timeline = open(run_dir.file("timeline.json")).read()
    assert timeline.lstrip().startswith("[") and "ALLREDUCE" in timeline.upper()


def test_progress_line_per_epoch(spark, data, tmp_path, rank_lines):
    HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run(
        digits_keras.train, **data, epochs=2)
    progress = [line for line in rank_lines if line.startswith("[rank 0] epoch ")]
    assert len(progress) == 2
    assert progress[1].startswith("[rank 0] epoch 2/2 - loss ")
    assert "samples/s" in progress[0] and "ETA" in progress[0] and "val_accuracy" in progress[0]
    assert not any("@@sparkhvd" in line for line in rank_lines)


def test_resume_continues_from_rank0_checkpoint(spark, data, tmp_path, four_epochs):
    """The README's way: HorovodRunner(resume_from=True) and a plain KerasDistributed inside."""
    import tensorflow as tf

    first = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path))
    first.run(digits_keras.train, **data, epochs=2)
    checkpoint = first.last_run_dir.file("checkpoints/epoch-0002.h5")

    resumed = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path), resume_from=True)
    r0, r1 = resumed.run_all(digits_keras.train, **data, epochs=4)
    assert r0["initial_epoch"] == r1["initial_epoch"] == 2  # fit starts at epoch 3
    expected = digits_keras.weights_hash(tf.keras.models.load_model(checkpoint))
    assert r0["start_hash"] == r1["start_hash"] == expected
    assert len(r0["metrics"]) == 2  # epochs 3 and 4 only
    record = json.loads(open(resumed.last_run_dir.file("run.json")).read())
    source = os.path.join(first.last_run_dir.path, "checkpoints")
    assert record["resumed_from"] == source
    assert record["resume"]["restored"].endswith("epoch-0002.h5") and record["resume"]["epoch"] == 2
    uninterrupted = four_epochs[1][0]["accuracy"]
    assert abs(r0["accuracy"] - uninterrupted) <= 0.05


def _exact_kw(data) -> dict:
    """The runs of the exact-resume tests: no shuffling, the weights returned, the resume
    inside the warm-up."""
    return dict(**data, shuffle=False, weights=True, warmup_epochs=3)


@pytest.fixture(scope="module")
def four_straight_epochs(spark, data, tmp_path_factory):
    """Rank 0's result of 4 uninterrupted epochs: what each exact resume must equal."""
    return HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path_factory.mktemp("a"))).run(
        digits_keras.train, epochs=4, **_exact_kw(data))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_is_exact(spark, data, tmp_path, async_save, four_straight_epochs):
    """2 epochs, then resume for 2 more (inside the warm-up): the same weights as 4 straight --
    with checkpoints written in the background too (async_save, a save every 2 steps: the
    ranks agree on rank 0's save in flight; the function's end waits for the last one)."""
    import numpy as np

    kw = _exact_kw(data)
    straight = four_straight_epochs
    HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path / "b")).run(
        digits_keras.train, epochs=2, async_save=async_save, **kw)
    resumed = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path / "b"),
                            resume_from=True).run(digits_keras.train, epochs=4,
                                                  async_save=async_save, **kw)
    assert resumed["initial_epoch"] == 2
    for a, b in zip(straight["weights"], resumed["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_resume_that_restores_nothing_says_so(spark, data, tmp_path, caplog):
    first = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path))
    first.run(digits_keras.train, **data, epochs=1)
    resumed = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path), resume_from=True)
    with caplog.at_level("WARNING", logger="sparkhvd"):
        r0 = resumed.run(digits_keras.train, **data, epochs=1, resume=False)
    assert r0["initial_epoch"] == 0
    assert any("no checkpoint was restored" in r.getMessage() for r in caplog.records)
    record = json.loads(open(resumed.last_run_dir.file("run.json")).read())
    assert record["resume"]["restored"] is None and "trained from scratch" in \
        record["resume"]["warning"]
    assert "resumed_from" not in record


def test_two_ranks_match_one_rank_with_same_global_batch(spark, data, tmp_path):
    one = HorovodRunner(np=1, spark=spark, output_dir=str(tmp_path)).run(
        digits_keras.train, **data, epochs=8, batch_size=64, lr=0.004)
    two = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run(
        digits_keras.train, **data, epochs=8, batch_size=32, lr=0.002)
    assert one["accuracy"] >= 0.9 and two["accuracy"] >= 0.9
    assert abs(one["accuracy"] - two["accuracy"]) <= 0.02
