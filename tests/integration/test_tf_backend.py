"""backend="tf": tf.distribute.MultiWorkerMirroredStrategy on the same runner, no horovod.

Runs in the modern profile (`make test PROFILE=modern`: TF >= 2.19 + Keras 3 + numpy 2, no
horovod at all), what backend="tf" users start with. The tests marked ``keras2`` run on TF 2.15 +
Keras 2 in the default profile too: the rank's TF_CONFIG, training with the Keras helpers, a plain
multi-worker script and the early refusals -- what could differ with Keras 2; the rest (resume,
data order, DataFrame input) is the same code on both. On a standalone cluster, backend="tf"
runs through a Spark Connect server (test_connect); `sparkhvd submit` to one runs the same job
with the default backend (tests/cluster/test_standalone.py).
"""
import csv
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import digits_keras
from conftest import HAS_HOROVOD
from sparkhvd import DataFrameDataset, HorovodRunner
from sparkhvd.timing.collectives import TF_GRAPH

pytestmark = [pytest.mark.tf_backend, pytest.mark.timeout(600)]


def where_am_i():
    import json
    import os
    import sys

    return {"tf_config": json.loads(os.environ["TF_CONFIG"]), "rank": os.environ["SPARKHVD_RANK"],
            "horovod": any(m.startswith("horovod") for m in sys.modules)}


@pytest.mark.keras2
@pytest.mark.parametrize("np_", [2, -2], ids=["spark", "local"])
def test_each_rank_gets_its_tf_config_and_no_horovod(any_spark, tmp_path, np_):
    """On a classic session, a Spark Connect session (any_spark), and as local processes."""
    from sparkhvd.spark.sparkview import is_connect

    if np_ < 0 and is_connect(any_spark):
        pytest.skip("np < 0 starts no Spark tasks: once is enough")
    runner = HorovodRunner(np=np_, spark=any_spark if np_ > 0 else None, backend="tf",
                           output_dir=str(tmp_path))
    results = runner.run_all(where_am_i)
    workers = results[0]["tf_config"]["cluster"]["worker"]
    assert len(workers) == 2 and len(set(workers)) == 2
    for rank, r in enumerate(results):
        assert r["tf_config"] == {"cluster": {"worker": workers},
                                  "task": {"type": "worker", "index": rank}}
        assert r["rank"] == str(rank) and not r["horovod"]
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert record["backend"] == "tf"


@pytest.mark.keras2
def test_workers_train_identically_with_the_keras_helpers(spark, data, tmp_path, rank_lines):
    runner = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path))
    began = time.monotonic()
    r0, r1 = runner.run_all(digits_keras.train, **data, epochs=8, warmup_epochs=1)
    took = time.monotonic() - began
    assert r0["backend"] == r1["backend"] == "tf"
    assert r0["start_hash"] == r1["start_hash"], "every worker starts from the same weights"
    assert r0["hash"] == r1["hash"], "and ends with the same weights"
    assert r0["accuracy"] >= 0.9
    run = runner.last_run_dir
    progress = [line for line in rank_lines if line.startswith("[rank 0] epoch ")]
    assert len(progress) == 8 and not any(line.startswith("[rank 1] epoch") for line in rank_lines)
    rows = list(csv.DictReader(open(run.file("metrics.csv"))))
    assert [int(r["epoch"]) for r in rows] == list(range(1, 9)) and "val_accuracy" in rows[0]
    assert open(run.file("curves.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    latest = json.loads(open(run.file("checkpoints/latest.json")).read())
    assert latest["epoch"] == 8 and latest["optimizer"] == "epoch-0008.optimizer.npz"
    # Keras under tf.distribute, unchanged: every rank's time split -- its Keras steps counted
    # as computing (docs/guides/slow.md), every sampled second in one bucket, no more seconds
    # than the run took -- and the throughput in the report
    split = run.record["time_split"]["ranks"]
    assert set(split) == {"0", "1"}, split
    for r in split.values():
        assert abs(sum(r["share"].values()) - 1) < 0.01 and r["where"]["compute"], r
        assert r["unmeasured"] == [TF_GRAPH], r  # a wait inside the graph looks like computing
        assert 0 < r["seconds"]["compute"] <= sum(r["seconds"].values()) <= took, (r, took)
    assert "samples_per_s" in rows[0] and "throughput (samples/s)" in open(
        run.file("report.html")).read()


def test_resume_is_exact_on_tf(spark, data, tmp_path):
    kw = dict(**data, shuffle=False, weights=True, warmup_epochs=3)
    straight = HorovodRunner(np=2, spark=spark, backend="tf",
                             output_dir=str(tmp_path / "a")).run(digits_keras.train, epochs=4, **kw)
    HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path / "b")).run(
        digits_keras.train, epochs=2, **kw)
    resumed_runner = HorovodRunner(np=2, spark=spark, backend="tf", resume_from=True,
                                   output_dir=str(tmp_path / "b"))
    resumed = resumed_runner.run(digits_keras.train, epochs=4, **kw)
    assert resumed["initial_epoch"] == 2
    for a, b in zip(straight["weights"], resumed["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    record = json.loads(open(resumed_runner.last_run_dir.file("run.json")).read())
    assert record["resume"]["epoch"] == 2 and record["resume"]["restored"]


def test_two_workers_match_one_with_the_same_global_batch(spark, data, tmp_path):
    one = HorovodRunner(np=1, spark=spark, backend="tf", output_dir=str(tmp_path)).run(
        digits_keras.train, **data, epochs=8, batch_size=64, lr=0.004)
    two = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path)).run(
        digits_keras.train, **data, epochs=8, batch_size=32, lr=0.002)
    assert one["accuracy"] >= 0.9 and two["accuracy"] >= 0.9
    assert abs(one["accuracy"] - two["accuracy"]) <= 0.03


def _train_from_frames(train, val, epochs):
    import tensorflow as tf

    from sparkhvd.examples.digits import build_model
    from sparkhvd.keras import KerasDistributed

    kd = KerasDistributed(epochs=epochs, batch_size=32)
    with kd.scope():
        model = build_model()
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(0.002)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    with train.tf_dataset(32, shuffle=True, seed=1) as ds, val.tf_dataset(64) as vds:
        model.fit(ds, steps_per_epoch=train.steps_per_epoch(32), validation_data=vds,
                  validation_steps=val.steps_per_epoch(64), **kd.fit_kwargs(model))
        _, accuracy = model.evaluate(vds, steps=val.steps_per_epoch(64), verbose=0)
    return {"steps": train.steps_per_epoch(32), "accuracy": float(accuracy)}


def test_dataframe_dataset_on_tf(spark, data, tmp_path):
    def frame(x, y):
        return spark.createDataFrame([(x[i].reshape(-1).tolist(), int(y[i])) for i in range(len(x))],
                                     ["features", "label"])

    shapes = {"features": (8, 8, 1)}
    train = DataFrameDataset(frame(data["x_train"], data["y_train"]), "features", "label",
                             shapes=shapes)
    val = DataFrameDataset(frame(data["x_val"], data["y_val"]), "features", "label",
                           shapes=shapes)
    r0, r1 = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path)).run_all(
        _train_from_frames, train=train, val=val, epochs=12)
    train.close()
    val.close()
    assert r0["steps"] == r1["steps"] == (len(data["x_train"]) // 2) // 32
    assert r0["accuracy"] >= 0.9


def _fit_ids(train, epochs):
    import tensorflow as tf

    from sparkhvd.keras import KerasDistributed

    kd = KerasDistributed(epochs=epochs, batch_size=16, data=train)
    with kd.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((1,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.SGD(0.001)), loss="mse")
    with train.tf_dataset(16, shuffle=True, seed=2) as ds:
        kwargs = kd.fit_kwargs(model)
        steps = train.steps_per_epoch(16)
        history = model.fit(ds, steps_per_epoch=steps, **kwargs)
    # where the model is in the data (the reader ran ahead: tf.data's prefetch)
    trained = train.position_after(steps * len(history.epoch))
    return {"initial_epoch": kwargs["initial_epoch"], "trained": trained.as_dict()}


def test_a_keras_resume_continues_the_data_order(spark, tmp_path):
    """KerasDistributed(data=...) restores the epoch into the dataset: the resumed run reads
    epoch 2's order (not epoch 0's again) and ends where an uninterrupted run ends."""
    df = spark.range(256).selectExpr("CAST(id AS FLOAT) AS x", "CAST(id AS FLOAT) AS y")
    with DataFrameDataset(df, "x", "y") as train:
        HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path)).run(
            _fit_ids, train=train, epochs=2)
        resumed = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path),
                                resume_from=True).run(_fit_ids, train=train, epochs=3)
    assert resumed["initial_epoch"] == 2
    # it trained epoch 2 of the order whole (not epoch 0 again), and ends at epoch 3's start
    trained = resumed["trained"]
    assert (trained["epoch"], trained["samples"], trained["step"]) == (3, 0, 0)


def _fit_logged(train, epochs, log_dir, async_save=False):
    """KerasDistributed with step checkpoints every 3 steps (every step, written in the
    background, with ``async_save``); a callback logs each step as ``attempt epoch step``
    (Keras' own epoch and step) to ``<log_dir>/rank-N.txt``."""
    import os
    import time

    import tensorflow as tf

    from sparkhvd.keras import KerasDistributed

    kd = KerasDistributed(epochs=epochs, batch_size=8, data=train, keep=2,
                          every_steps=1 if async_save else 3, async_save=async_save)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or \
        str(len([f for f in os.listdir(log_dir) if f.startswith(f"pid-{kd.rank}-")]))
    open(os.path.join(log_dir, f"pid-{kd.rank}-{os.getpid()}"), "w").close()
    log = open(os.path.join(log_dir, f"rank-{kd.rank}.txt"), "a")

    class Steps(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            log.write(f"{attempt} {self.epoch} {batch + 1}\n")
            log.flush()
            time.sleep(0.1)  # time for the test to send its notice mid-epoch

    with kd.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((1,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.SGD(0.0001)), loss="mse")
    with train.tf_dataset(8, shuffle=True, seed=2) as ds:
        kwargs = kd.fit_kwargs(model, callbacks=[Steps()])
        model.fit(ds, steps_per_epoch=train.steps_per_epoch(8), **kwargs)
    return {"initial_epoch": kwargs["initial_epoch"], "start": list(kd.start)}


@pytest.mark.skipif(HAS_HOROVOD, reason="Keras 3 here; TF 2.15's Keras takes notices in the "
                                        "netns elastic test (tests/cluster/test_multihost.py)")
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_notice_to_a_keras_rank_costs_at_most_one_step_and_resumes_mid_epoch(spark,
                                                                               tmp_path,
                                                                               async_save):
    """SIGTERM to rank 1 mid-epoch: both ranks save after the step (a step checkpoint with the
    data's position), stop as preempted, and the relaunch continues in the middle of that
    epoch -- the run trains exactly as many steps as an uninterrupted one, plus at most one.
    With async_save (a save every step, in the background) the notice's own save is written
    to the end before the ranks stop."""
    import signal
    import threading

    from conftest import wait_for

    df = spark.range(320).selectExpr("CAST(id AS FLOAT) / 320 AS x", "CAST(id AS FLOAT) AS y")
    logs = tmp_path / "logs"
    logs.mkdir()

    def lines(rank):
        path = logs / f"rank-{rank}.txt"
        return [tuple(int(w) for w in line.split()) for line in open(path)] \
            if path.exists() else []

    def notice():
        assert wait_for(lambda: any(e == 1 and s >= 5 for _, e, s in lines(1)), 240, 0.1)
        pid = next(int(f.split("-")[2]) for f in os.listdir(logs) if f.startswith("pid-1-"))
        os.kill(pid, signal.SIGTERM)

    thread = threading.Thread(target=notice, daemon=True)
    with DataFrameDataset(df, "x", "y") as train:
        runner = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path / "r"))
        thread.start()
        result = runner.run(_fit_logged, train=train, epochs=3, log_dir=str(logs),
                            async_save=async_save)
    thread.join(5)
    record = runner.last_run_dir.record
    first, second = record["attempts"]
    assert first["status"] == "preempted" and second["status"] == "succeeded", first
    checkpoint = first["preempted"]["checkpoint"]
    assert checkpoint.startswith("epoch-0001-step-"), checkpoint
    step = int(checkpoint.split("-")[-1].split(".")[0])
    per_epoch = 320 // 2 // 8
    assert result == {"initial_epoch": 1, "start": [1, step * 16]}
    for rank in (0, 1):
        ran = lines(rank)
        before = [s for a, e, s in ran if a == 0 and e == 1]
        assert max(before) - step <= 1, f"rank {rank}: steps {step + 1}..{max(before)} redone"
        after = [(e, s) for a, e, s in ran if a == 1]
        assert len(after) == 3 * per_epoch - (per_epoch + step), "the rest of the run, once"


@pytest.mark.keras2
def test_horovod_only_options_are_refused_on_tf():
    assert HorovodRunner(np=3, min_np=2, backend="tf").elastic == (2, 3)  # relaunched, not horovod's
    with pytest.raises(ValueError, match="launcher='horovod' need backend='horovod'"):
        HorovodRunner(np=3, launcher="horovod", backend="tf")
    with pytest.raises(ValueError, match="timeline=True need backend='horovod'"):
        HorovodRunner(np=2, timeline=True, backend="tf")
    with pytest.raises(ValueError, match="backend must be one of"):
        HorovodRunner(np=2, backend="mpi")


# -- other people's plain TensorFlow code, unchanged ---------------------------------------------
def test_tf_tutorial_code_trains_unchanged(spark, tmp_path):
    """TF's multi-worker tutorial shape (strategy from TF_CONFIG, model built in its scope):
    under Keras 3 it fails bare; here every rank gets the fix, and the workers agree."""
    from plaincode.tf_multiworker_tutorial import main

    runner = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path))
    r0, r1 = runner.run_all(main, epochs=3)
    assert r0 == pytest.approx(r1, rel=1e-6), "both workers end with the same weights"


def test_a_function_without_a_strategy_is_refused_before_training(spark, tmp_path):
    """spark-tensorflow-distributor's example shape (no strategy: MirroredStrategyRunner runs
    it inside one). Bare, each worker would train its own model: refused at fit, with the fix;
    through sparkhvd.keras.in_strategy it trains as one model."""
    from plaincode.tf_strategyless import train
    from sparkhvd import TrainingError
    from sparkhvd.keras import in_strategy

    runner = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path))
    with pytest.raises(TrainingError, match="StrategyMissingError") as info:
        runner.run(train, epochs=1)
    assert "MultiWorkerMirroredStrategy" in str(info.value)
    assert "sparkhvd.keras.in_strategy(train)" in str(info.value)
    w0, w1 = runner.run_all(in_strategy(train), epochs=3)
    for a, b in zip(w0, w1):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
    # One worker needs no strategy: nothing to refuse.
    assert HorovodRunner(np=-1, backend="tf", output_dir=str(tmp_path)).run(train, epochs=1)


@pytest.mark.keras2
@pytest.mark.timeout(400)
def test_sparkhvd_run_backend_tf_runs_a_plain_multiworker_script(tmp_path):
    import plaincode

    script = os.path.join(os.path.dirname(plaincode.__file__), "tf_multiworker_tutorial.py")
    cli = os.path.join(os.path.dirname(sys.executable), "sparkhvd")
    out = subprocess.run([cli, "run", script, "--np", "-2", "--backend", "tf", "--verbosity",
                          "all", "--output-dir", str(tmp_path / "runs"), "--", "2"],
                         capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sums = sorted(line.split("checksum ")[1] for line in out.stdout.splitlines()
                  if "checksum" in line)
    assert len(sums) == 2 and sums[0] == sums[1], out.stdout[-2000:]


def pipeline_before_the_strategy(x, y):
    import tensorflow as tf

    from sparkhvd.keras import KerasDistributed

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # TF runs an op here
    kd = KerasDistributed(epochs=1, batch_size=16)
    return kd, dataset


@pytest.mark.keras2
def test_a_pipeline_built_before_the_strategy_names_the_rule_and_the_fix(data, tmp_path):
    """TensorFlow's own error says only "Collective ops must be configured at program
    startup"; the TrainingError says what comes first."""
    from sparkhvd import TrainingError

    runner = HorovodRunner(np=-2, backend="tf", output_dir=str(tmp_path))
    with pytest.raises(TrainingError) as info:
        runner.run(pipeline_before_the_strategy, x=data["x_train"][:64],
                   y=data["y_train"][:64])
    message = str(info.value)
    assert "Collective ops must be configured at program startup" in message
    assert "Fix: create sparkhvd.keras.KerasDistributed(...)" in message
