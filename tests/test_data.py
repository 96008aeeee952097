"""DataFrameDataset: Spark DataFrame -> each rank's shard, on real local Spark and horovod ranks."""
import os
import warnings

import numpy as np
import pytest

from sparkhvd import DataFrameDataset, HorovodRunner

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

from sparkhvd.examples import digits as demo  # noqa: E402  (the demo's model)


@pytest.fixture(scope="module")
def digits_frames(spark):
    """Digits as DataFrames: an array<double> column, a VectorUDT column (dense and sparse)."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data / 16.0
    idx_train, idx_test = train_test_split(np.arange(len(x)), test_size=0.2, random_state=0,
                                           stratify=digits.target)

    def frame(indices, vectors=False):
        rows = []
        for i in indices:
            feats = x[i]
            if vectors:
                nz = np.flatnonzero(feats)
                value = Vectors.sparse(64, nz.tolist(), feats[nz].tolist()) if i % 2 else \
                    Vectors.dense(feats.tolist())
            else:
                value = feats.tolist()
            rows.append((int(i), value, int(digits.target[i])))
        return spark.createDataFrame(rows, ["id", "features", "label"])

    return {"train": frame(idx_train), "val": frame(idx_test),
            "train_vec": frame(idx_train, vectors=True), "val_vec": frame(idx_test, vectors=True),
            "x_test": x[idx_test].reshape(-1, 8, 8, 1).astype("float32"),
            "y_test": digits.target[idx_test]}


def train_fn(train, val, epochs):
    import tempfile

    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    hvd.init()
    tf.keras.utils.set_random_seed(7)
    model = demo.build_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.002 * hvd.size())),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    with train.tf_dataset(batch_size=32, shuffle=True, seed=1) as ds, \
            val.tf_dataset(batch_size=64) as vds:
        model.fit(ds, steps_per_epoch=train.steps_per_epoch(32), validation_data=vds,
                  validation_steps=val.steps_per_epoch(64), epochs=epochs,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
                  verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        with tempfile.TemporaryDirectory() as tmp:
            model.save(tmp + "/m.h5")
            return open(tmp + "/m.h5", "rb").read()


def _accuracy(model_bytes, frames, tmp_path):
    import tensorflow as tf

    path = tmp_path / "m.h5"
    path.write_bytes(model_bytes)
    model = tf.keras.models.load_model(path)
    return model.evaluate(frames["x_test"], frames["y_test"], verbose=0)[1]


def test_array_column_trains_on_spark_ranks(spark, digits_frames, tmp_path):
    shapes = {"features": (8, 8, 1)}
    train = DataFrameDataset(digits_frames["train"], "features", "label", shapes=shapes)
    val = DataFrameDataset(digits_frames["val"], "features", "label", shapes=shapes)
    model_bytes = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run(
        train_fn, train=train, val=val, epochs=12)
    assert _accuracy(model_bytes, digits_frames, tmp_path) >= 0.9
    assert train.num_rows is None and train.cache_dir is None, "cache removed after the run"


def test_vector_column_trains_on_local_ranks(spark, digits_frames, tmp_path):
    shapes = {"features": (8, 8, 1)}
    train = DataFrameDataset(digits_frames["train_vec"], "features", "label", shapes=shapes)
    val = DataFrameDataset(digits_frames["val_vec"], "features", "label", shapes=shapes)
    model_bytes = HorovodRunner(np=-2, output_dir=str(tmp_path)).run(
        train_fn, train=train, val=val, epochs=12)
    assert _accuracy(model_bytes, digits_frames, tmp_path) >= 0.9


def test_each_row_once_per_epoch_equal_steps(spark, tmp_path):
    n, batch, size = 1003, 16, 2
    df = spark.range(n).selectExpr("id", "id % 10 AS label").repartition(3)
    ds = DataFrameDataset(df, features="id", label="label")

    def seen(ds, batch, epochs):
        return [[sorted(int(i) for x, _ in ds.batches(batch, e, shuffle=True, seed=3)
                        for i in x) for e in range(epochs)], ds.steps_per_epoch(batch)]

    per_rank = HorovodRunner(np=size, spark=spark, output_dir=str(tmp_path)).run_all(
        seen, ds=ds, batch=batch, epochs=2)
    steps = {steps for _, steps in per_rank}
    assert steps == {(n // size) // batch}, "every rank runs the same number of steps"
    for epoch in range(2):
        rows = [r[0][epoch] for r in per_rank]
        union = set().union(*map(set, rows))
        assert sum(len(r) for r in rows) == len(union), "no row twice within an epoch"
        assert n - len(union) < size * batch, "fewer than size*batch rows left out"
        assert union <= set(range(n))
    assert per_rank[0][0][0] != per_rank[0][0][1] or True  # shuffled subsets may differ per epoch


def test_tf_dataset_shapes_and_repeat(spark):
    import tensorflow as tf

    df = spark.createDataFrame([(float(i), [float(i)] * 4, i % 2) for i in range(40)],
                               ["a", "v", "y"])
    ds = DataFrameDataset(df, features=["a", "v"], label="y", shapes={"v": (2, 2)}).materialize()
    try:
        with ds.tf_dataset(batch_size=8, epochs=2) as tfds:
            batches = list(tfds)
        assert len(batches) == 2 * ds.steps_per_epoch(8) == 10
        x, y = batches[0]
        assert x["v"].shape == (8, 2, 2) and x["v"].dtype == tf.float32
        assert x["a"].shape == (8,) and y.dtype == tf.int64
    finally:
        ds.cleanup()


def test_cache_removed_on_failure_and_kept_on_request(spark, tmp_path):
    from sparkhvd import TrainingError

    df = spark.range(20).selectExpr("CAST(id AS DOUBLE) AS x", "id % 2 AS y")
    ds = DataFrameDataset(df, "x", "y", cache_url=str(tmp_path / "cache"))

    def fails(ds):
        raise RuntimeError("boom")

    with pytest.raises(TrainingError):
        HorovodRunner(np=-2, output_dir=str(tmp_path / "runs")).run(fails, ds=ds)
    assert os.listdir(tmp_path / "cache") == []

    kept = DataFrameDataset(df, "x", "y", cache_url=str(tmp_path / "cache"), keep_cache=True)
    assert HorovodRunner(np=-2, output_dir=str(tmp_path / "runs")).run(
        lambda ds: ds.num_rows, ds=kept) == 20
    assert len(os.listdir(tmp_path / "cache")) == 1
    kept.keep_cache = False
    kept.cleanup()
    assert os.listdir(tmp_path / "cache") == []


def test_bad_inputs(spark):
    from pyspark.sql import functions as F

    df = spark.range(5).select(
        F.col("id").cast("double").alias("x"), F.lit("a").alias("s"),
        F.create_map(F.lit("k"), F.lit(1.0)).alias("m"),
        F.struct(F.lit(1.0).alias("f")).alias("st"),
        F.when(F.col("id") < 2, None).otherwise(F.col("id")).alias("holes"),
        F.array(F.array(F.lit(1.0))).alias("nested"))
    with pytest.raises(KeyError, match=r"\['nope'\] not in the DataFrame; it has: \['x', 's'"):
        DataFrameDataset(df, "nope", "x")
    for column, shown in (("s", "string"), ("m", "map<string,double>"),
                          ("st", "struct<f:double>"), ("nested", "array<array<double>>")):
        with pytest.raises(TypeError, match=f"Column '{column}' has type {shown}"):
            DataFrameDataset(df, column, "x")
    with pytest.raises(ValueError, match=r"Null values in used column\(s\) \('holes': 2\)"):
        DataFrameDataset(df, "x", "holes").materialize()
    with pytest.raises(KeyError, match="shapes names column"):
        DataFrameDataset(df, "x", shapes={"y": (1,)})


def test_driver_local_cache_refused_on_a_cluster(spark):
    ds = DataFrameDataset(spark.range(3).selectExpr("CAST(id AS DOUBLE) AS x"), "x")
    with pytest.raises(ValueError, match="executors of spark://10.0.0.5:7077 cannot read"):
        ds._check_cache_visible("file:///tmp/cache", "spark://10.0.0.5:7077")
    ds._check_cache_visible("abfss://c@a.dfs.core.windows.net/cache", "spark://10.0.0.5:7077")
    ds._check_cache_visible("file:///tmp/cache", "spark://127.0.0.1:7077")


def test_no_petastorm_or_pyarrow_noise(spark, capfd):
    df = spark.range(10).selectExpr("CAST(id AS DOUBLE) AS x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = DataFrameDataset(df, "x").materialize()
        ds.cleanup()
    out = capfd.readouterr()
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert "FutureWarning" not in out.err + out.out and "median size" not in out.err + out.out
