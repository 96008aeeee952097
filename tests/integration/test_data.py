"""DataFrameDataset: Spark DataFrame -> each rank's shard, on real local Spark and real ranks.

Runs in every profile (Spark 3.5 with horovod, Spark 4 with backend="tf"): materialisation goes
through Spark's Arrow path, which changes with Spark, pandas and pyarrow."""
import os
import warnings

import numpy as np
import pytest

from sparkhvd import DataFrameDataset, HorovodRunner, PayloadError

pytestmark = [pytest.mark.spark, pytest.mark.every_profile, pytest.mark.timeout(600)]

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


@pytest.mark.horovod
def test_array_column_trains_on_spark_ranks(spark, digits_frames, tmp_path):
    shapes = {"features": (8, 8, 1)}
    train = DataFrameDataset(digits_frames["train"], "features", "label", shapes=shapes)
    val = DataFrameDataset(digits_frames["val"], "features", "label", shapes=shapes)
    model_bytes = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run(
        train_fn, train=train, val=val, epochs=12)
    assert _accuracy(model_bytes, digits_frames, tmp_path) >= 0.9
    cache = train.cache_dir
    assert cache and os.listdir(cache), "kept for the next run"
    train.close()
    val.close()
    assert not os.path.exists(cache), "removed when the dataset is closed"


@pytest.mark.horovod
def test_vector_column_trains_on_local_ranks(spark, digits_frames, tmp_path):
    shapes = {"features": (8, 8, 1)}
    train = DataFrameDataset(digits_frames["train_vec"], "features", "label", shapes=shapes)
    val = DataFrameDataset(digits_frames["val_vec"], "features", "label", shapes=shapes)
    model_bytes = HorovodRunner(np=-2, output_dir=str(tmp_path)).run(
        train_fn, train=train, val=val, epochs=12)
    assert _accuracy(model_bytes, digits_frames, tmp_path) >= 0.9


def _seen(ds, batch, epochs, shuffle_buffer=None):
    """Per epoch: the row ids this rank saw, in order; the steps per epoch; whether it streamed;
    and the ids of the rank's unshuffled epoch."""
    plain = [int(i) for x, _ in ds.batches(batch, 0) for i in x]
    return [[[int(i) for x, _ in ds.batches(batch, e, shuffle=True, seed=3,
                                          shuffle_buffer=shuffle_buffer) for i in x]
             for e in range(epochs)], ds.steps_per_epoch(batch), ds.streams(), plain]


@pytest.mark.parametrize("streaming", [False, True])
def test_each_row_once_per_epoch_equal_steps_and_shuffled(spark, tmp_path, monkeypatch,
                                                          streaming, backend):
    """The order policy on real ranks, in memory and streamed (a tiny memory budget and tiny
    row groups force many blocks and several shuffle windows): each epoch one global order,
    the ranks' batches taken in turn (tests/unit/test_data_order.py checks it for 1-3 ranks)."""
    from sparkhvd.data import materialize

    n, batch, size = 1003, 16, 2
    if streaming:
        monkeypatch.setattr(materialize, "ROW_GROUP_BYTES", 8 * 40)  # ~40 rows per row group
    df = spark.range(n).selectExpr("id", "id % 10 AS label").repartition(3)
    ds = DataFrameDataset(df, features="id", label="label",
                          memory_cache=0 if streaming else 1 << 30)
    per_rank = HorovodRunner(np=size, spark=spark, output_dir=str(tmp_path),
                             backend=backend).run_all(
        _seen, ds=ds, batch=batch, epochs=2, shuffle_buffer=100 if streaming else None)
    import pyarrow.parquet as pq

    stored = [int(i) for f in ds.files for i in pq.read_table(f).column(0).to_pylist()]
    ds.close()
    assert {streams for _, _, streams, _ in per_rank} == {streaming}
    assert {steps for _, steps, _, _ in per_rank} == {n // (size * batch)}, "equal steps"
    for epoch in range(2):
        rows = [r[0][epoch] for r in per_rank]
        union = set().union(*map(set, rows))
        assert sum(len(r) for r in rows) == len(union), "no row twice within an epoch"
        assert n - len(union) < size * batch, "fewer than size*batch rows left out"
        assert union <= set(range(n))
    def in_turn(lists):  # the step's positions: rank r's batch holds those i % size == r
        steps = zip(*(np.array_split(ids, len(ids) // batch) for ids in lists))
        return [int(i) for step in steps for i in np.stack(step, axis=1).ravel()]

    plain = in_turn([r[3] for r in per_rank])
    assert plain == round_robin(stored, 24)[:len(plain)], \
        "unshuffled: one row of each 24th of the files' order in turn"
    first, second = (in_turn([r[0][e] for r in per_rank]) for e in range(2))
    assert first != second, "a different order every epoch"
    assert first != plain, "shuffled, not in file order"


def round_robin(rows, partitions):
    """The unshuffled order: ``rows`` cut into ``partitions`` consecutive parts, one row of
    each in turn."""
    n = len(rows)
    sizes = [n // partitions + (c < n % partitions) for c in range(partitions)]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return [rows[int(starts[i % partitions] + i // partitions)] for i in range(n)]


def test_streamed_epoch_without_drops_sees_every_row_once(spark, monkeypatch):
    """When the rows divide into batches, a streamed shuffled epoch is a permutation."""
    from sparkhvd.data import materialize

    monkeypatch.setattr(materialize, "ROW_GROUP_BYTES", 8 * 24)
    df = spark.range(960, numPartitions=4).selectExpr("id", "id % 3 AS label")
    from sparkhvd.data.shard import DatasetShard

    with DataFrameDataset(df, "id", "label", memory_cache=0).materialize() as dataset:
        assert len(dataset.source.row_groups[0]) > 1, "several row groups per file"
        epochs = [[int(i) for rank in (0, 1) for x, _ in DatasetShard(dataset.source).batches(
            32, e, shuffle=True, seed=1, rank=rank, size=2, shuffle_buffer=64) for i in x]
                  for e in range(3)]
        for rows in epochs:
            assert sorted(rows) == list(range(960))
        assert epochs[0] != epochs[1] != epochs[2]
        plain = [int(i) for x, _ in DatasetShard(dataset.source).batches(32, 0, rank=1, size=2)
                 for i in x]
        assert plain == round_robin(list(range(960)), 24)[1::2], \
            "unshuffled: 24 parts in turn, rank 1 takes every second position"


def test_datasets_travel_inside_containers_but_not_in_closures(spark, tmp_path, backend):
    """The preparation protocol: an argument that needs the driver is found inside lists and
    dicts too; captured any other way, it is refused with the fix."""
    df = spark.range(64).selectExpr("CAST(id AS DOUBLE) AS x", "id % 2 AS y")
    train, val = DataFrameDataset(df, "x", "y"), DataFrameDataset(df.limit(32), "x", "y")
    runner = HorovodRunner(np=-2, output_dir=str(tmp_path), backend=backend)
    try:
        got = runner.run(lambda data, sizes: [type(data["train"]).__name__,
                                              data["train"].steps_per_epoch(8),
                                              [s.num_rows for s in sizes]],
                         data={"train": train}, sizes=[train, val])
        assert got == ["DatasetShard", 4, [64, 32]]
        with pytest.raises(PayloadError, match="only as an argument of HorovodRunner.run"):
            runner.run(lambda: train.num_rows)
    finally:
        train.close()
        val.close()


def test_second_run_reuses_the_materialised_data(spark, tmp_path, caplog, backend):
    df = spark.range(200).selectExpr("CAST(id AS DOUBLE) AS x", "id % 2 AS y")
    first = DataFrameDataset(df, "x", "y")
    runner = HorovodRunner(np=-2, output_dir=str(tmp_path), backend=backend)
    assert runner.run(lambda ds: ds.num_rows, ds=first) == 200
    cache = first.cache_dir
    with caplog.at_level("INFO", logger="sparkhvd"):
        assert runner.run(lambda ds: ds.num_rows, ds=first) == 200
        again = DataFrameDataset(df, "x", "y")  # a new dataset of the same DataFrame
        assert runner.run(lambda ds: ds.num_rows, ds=again) == 200
    assert again.cache_dir == cache
    assert sum("reusing materialised data" in r.getMessage() for r in caplog.records) == 2
    first.close()
    assert os.path.exists(cache), "still used by the other dataset"
    del again
    import gc

    gc.collect()  # the collector only queues the release: no I/O inside it
    assert os.path.exists(cache)
    runner.run(lambda: None)  # the end of a run is a safe point
    assert not os.path.exists(cache), "removed when the last dataset went away"


def test_tf_dataset_shapes_and_repeat(spark):
    import tensorflow as tf

    df = spark.createDataFrame([(float(i), [float(i)] * 4, i % 2) for i in range(40)],
                               ["a", "v", "y"])
    from sparkhvd.data.shard import DatasetShard

    dataset = DataFrameDataset(df, features=["a", "v"], label="y", shapes={"v": (2, 2)})
    ds = DatasetShard(dataset.materialize().source)  # what a rank gets, read here
    try:
        with ds.tf_dataset(batch_size=8, epochs=2) as tfds:
            batches = list(tfds)
        assert len(batches) == 2 * ds.steps_per_epoch(8) == 10
        x, y = batches[0]
        assert x["v"].shape == (8, 2, 2) and x["v"].dtype == tf.float32
        assert x["a"].shape == (8,) and y.dtype == tf.int64
    finally:
        dataset.cleanup()


def test_cache_removed_on_failure_and_kept_on_request(spark, tmp_path, backend):
    from sparkhvd import TrainingError

    df = spark.range(20).selectExpr("CAST(id AS DOUBLE) AS x", "id % 2 AS y")
    ds = DataFrameDataset(df, "x", "y", cache_url=str(tmp_path / "cache"))

    def fails(ds):
        raise RuntimeError("boom")

    with pytest.raises(TrainingError):
        HorovodRunner(np=-2, output_dir=str(tmp_path / "runs"), backend=backend).run(fails, ds=ds)
    assert os.listdir(tmp_path / "cache") == []

    kept = DataFrameDataset(df, "x", "y", cache_url=str(tmp_path / "cache"), keep_cache=True)
    assert HorovodRunner(np=-2, output_dir=str(tmp_path / "runs"), backend=backend).run(
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
    with pytest.raises(ValueError, match=r"Null values in used column\(s\) \('holes': 2"):
        DataFrameDataset(df, "x", "holes").materialize()
    with pytest.raises(KeyError, match="shapes names column"):
        DataFrameDataset(df, "x", shapes={"y": (1,)})


def test_edge_cases_are_refused_before_launch_and_leave_nothing(spark, tmp_path, backend):
    """Empty, NaN, ragged arrays, a streaming DataFrame: clear errors before any rank starts,
    and no cache folder left behind."""
    from pyspark.sql import functions as F

    cache = tmp_path / "cache"
    runner = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path / "runs"), backend=backend)

    def fails(df, *cols, match, **kw):
        ds = DataFrameDataset(df, *cols, cache_url=str(cache), **kw)
        with pytest.raises(ValueError, match=match):
            runner.run(lambda ds: ds.num_rows, ds=ds)
        assert not cache.exists() or os.listdir(cache) == []
        assert not list((tmp_path / "runs").glob("*")), "no rank was started"

    empty = spark.range(10).where("id > 100").selectExpr("CAST(id AS DOUBLE) AS x", "id AS y")
    fails(empty, "x", "y", match="has no rows")
    nan = spark.range(10).select(F.when(F.col("id") == 3, F.lit(float("nan")))
                                 .otherwise(F.col("id").cast("double")).alias("x"),
                                 F.col("id").alias("y"))
    fails(nan, "x", "y", match=r"NaN values in used column\(s\) \('x': 1 row")
    assert DataFrameDataset(nan, "x", "y", allow_nan=True).materialize().close() is None
    ragged = spark.createDataFrame([([1.0, 2.0], 0), ([1.0, 2.0, 3.0, 4.0], 1)] * 4, ["v", "y"])
    fails(ragged, "v", "y", match=r"'v': from 2 to 4 elements")
    nan_array = spark.createDataFrame([([1.0, float("nan")], 0), ([1.0, 2.0], 1)] * 4,
                                      ["v", "y"])
    fails(nan_array, "v", "y", match=r"NaN values .*'v': 4 row")
    holes = spark.createDataFrame(  # a null element, also beside a NaN, in float and int arrays
        [([1.0, None], [1, 2], 0), ([float("nan"), None], [3, None], 1), ([1.0, 2.0], [4, 5], 2)]
        * 2, "v array<double>, w array<int>, y long")
    fails(holes, "v", "y", match=r"Null values in used column\(s\) \('v': 4;")
    fails(holes, "w", "y", match=r"Null values in used column\(s\) \('w': 2;")
    stream = spark.readStream.format("rate").load()
    with pytest.raises(TypeError, match="this one is streaming"):
        DataFrameDataset(stream, "value")
    assert not cache.exists() or os.listdir(cache) == []


def test_dotted_names_and_decimal_labels(spark, tmp_path, backend):
    from pyspark.sql import functions as F

    df = spark.range(40).select(F.col("id").cast("double").alias("f.x"),
                                (F.col("id") % 2).cast("decimal(10,2)").alias("label"))
    ds = DataFrameDataset(df, "f.x", "label")

    def first_batch(ds):
        (x, y), = [next(ds.batches(8, 0))]
        return str(x.dtype), str(y.dtype), x.tolist(), y.tolist()

    x_dtype, y_dtype, x, y = HorovodRunner(np=-2, output_dir=str(tmp_path), backend=backend).run(
        first_batch, ds=ds)
    ds.close()
    assert (x_dtype, y_dtype) == ("float32", "float32")
    want = round_robin(list(range(40)), 24)[0:16:2]  # rank 0 of 2: the even positions
    assert x == [float(i) for i in want] and y == [float(i % 2) for i in want]


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


def test_remote_cache_on_azurite(spark, azurite, tmp_path, backend):
    """cache_url=abfss://: the executors write and the ranks stream through fsspec/adlfs with
    SAS tokens the driver minted -- no Hadoop Azure connector, no key on a rank."""
    azurite.make_container("cache")
    key = azurite.connection_string().split("AccountKey=")[1].split(";")[0]
    df = spark.range(3000).selectExpr("CAST(id AS DOUBLE) AS x", "id % 7 AS y").repartition(3)
    ds = DataFrameDataset(df, "x", "y", cache_url=azurite.url("cache", "datasets"),
                          storage_options=azurite.options(), memory_cache=0)

    def read_all(ds):
        import json

        from sparkhvd import storage

        ids = [int(v) for x, _ in ds.batches(50, 0) for v in x]
        try:
            storage.write_bytes(ds.files[0] + ".evil", b"x", ds.storage_options)
            wrote = True
        except Exception:  # noqa: BLE001 - a read-only token must refuse
            wrote = False
        return ids, json.dumps(ds.storage_options), wrote, ds.streams()

    results = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path),
                            backend=backend).run_all(read_all, ds=ds)
    assert ds.cache_dir.startswith(azurite.url("cache", "datasets"))
    assert sorted(results[0][0] + results[1][0]) == list(range(3000))
    for _ids, options, wrote, streamed in results:
        assert streamed and "SharedAccessSignature=" in options
        assert key not in options and "AccountKey" not in options
        assert not wrote, "the ranks' token is read-only"
    from sparkhvd import storage

    names = storage.listdir(ds.cache_dir, azurite.options())
    assert names and all(n.startswith("part-") for n in names)
    cache = ds.cache_dir
    ds.close()
    assert not storage.exists(cache, azurite.options())


def _ids(ds):
    return sorted(int(v) for x, _ in ds.batches(50, 0) for v in x)


def test_an_over_partitioned_dataframe_is_merged_not_one_file_per_partition(spark, tmp_path):
    """2,000 rows spread over 1,000 partitions: written in one wave of tasks (at most the
    session's task slots), every row read once -- seconds, not minutes (see bench B9)."""
    from pyspark.sql import functions as F

    df = spark.range(2000, numPartitions=1000).select(F.col("id").cast("double").alias("x"),
                                                      (F.col("id") % 2).alias("y"))
    ds = DataFrameDataset(df, "x", "y").materialize()
    try:
        assert len(ds._manifest.files) <= spark.sparkContext.defaultParallelism
        r0, r1 = HorovodRunner(np=2, spark=spark, backend="tf",  # every profile has tf
                               output_dir=str(tmp_path)).run_all(_ids, ds=ds)
        assert sorted(r0 + r1) == [float(i) for i in range(2000)]
    finally:
        ds.close()


def test_spark_workers_without_the_stack_are_named_before_any_data_job(tmp_path):
    """`.venv/bin/python script.py` with the user's own session and no PYSPARK_PYTHON: Spark's
    workers run `python3` from PATH (here the system's, without pyarrow or sparkhvd).
    DataFrameDataset and predict say so, with the fix, before their Spark jobs fail deep in a
    worker with `No module named 'pyarrow'`."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent('''
        from pyspark.sql import SparkSession
        from sparkhvd import DataFrameDataset, EnvironmentMismatchError, predict

        spark = (SparkSession.builder.master("local[1]")
                 .config("spark.ui.enabled", "false").getOrCreate())
        df = spark.createDataFrame([([0.0, 1.0], 0), ([1.0, 0.0], 1)], "x array<double>, y long")
        for what, call in (("dataset", lambda: DataFrameDataset(df, ["x"], "y").materialize()),
                           ("predict", lambda: predict(df, "model.keras", "x"))):
            try:
                call()
                print(what, "no error")
            except EnvironmentMismatchError as exc:
                print(what, exc)
        spark.stop()
    '''))
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_PYTHON"}
    env["PATH"] = "/usr/bin:/bin"  # no virtual environment activated
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("dataset", "predict"))]
    assert len(lines) == 2, out.stdout + out.stderr[-3000:]
    for line in lines:
        assert "Python workers with 'python3', which cannot import" in line
        assert f"Fix: export PYSPARK_PYTHON={sys.executable}" in line
    assert "write the DataFrame's Parquet" in lines[0] and "predict's Spark jobs" in lines[1]


def _metrics_then_none():
    from sparkhvd.common import protocol
    from sparkhvd.common.events import emit

    for epoch in (1, 2):
        emit(protocol.Metrics(rank=0, record={"epoch": epoch, "loss": 1.0 / epoch}))


def test_a_collected_remote_cache_is_deleted_at_a_safe_point_not_in_the_collector(
        spark, azurite, tmp_path, backend):
    """A dataset cached on abfss:// (Azurite) is garbage-collected inside an import -- where the
    collector once deleted it through fsspec's IO thread, which waited for the import lock the
    importing thread held: a deadlock. Now the collector only queues the release; the run that
    follows (writing metrics.csv and curves) returns, and deletes the cache at its end."""
    import gc
    import importlib
    import sys

    from sparkhvd import storage

    azurite.make_container("cache")
    df = spark.range(300).selectExpr("CAST(id AS DOUBLE) AS x", "id % 7 AS y")
    ds = DataFrameDataset(df, "x", "y", cache_url=azurite.url("cache", "collected"),
                          storage_options=azurite.options()).materialize()
    cache = ds.cache_dir
    ds.cycle = ds  # only the collector frees it
    del ds
    module = tmp_path / "collects_while_imported.py"
    module.write_text("import gc\nFREED = gc.collect()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        imported = importlib.import_module("collects_while_imported")
    finally:
        sys.path.remove(str(tmp_path))
    assert imported.FREED > 0 and storage.listdir(cache, azurite.options()), \
        "nothing is deleted inside the collector"
    runner = HorovodRunner(np=-1, backend=backend, output_dir=str(tmp_path / "runs"))
    runner.run(_metrics_then_none)
    assert os.path.exists(runner.last_run_dir.file("metrics.csv"))
    assert not storage.exists(cache, azurite.options()), "deleted at the end of the run"
    gc.collect()


def test_metrics_without_matplotlib_write_the_csv_and_warn_nothing(tmp_path, caplog, backend,
                                                                    monkeypatch):
    """Nobody asked for a picture: without matplotlib (the plots extra) a run writes
    metrics.csv, no curves.png, and no warning."""
    import importlib.abc
    import sys

    class NoMatplotlib(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "matplotlib":
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    monkeypatch.setattr(sys, "meta_path", [NoMatplotlib(), *sys.meta_path])
    for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    runner = HorovodRunner(np=-1, backend=backend, output_dir=str(tmp_path))
    with caplog.at_level("WARNING", logger="sparkhvd"):
        runner.run(_metrics_then_none)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert open(runner.last_run_dir.file("metrics.csv")).read().splitlines()[0] == "epoch,loss"
    assert not os.path.exists(runner.last_run_dir.file("curves.png"))


def _parquet_table(spark, path, rows=3000, block_size=32 << 10):
    spark.range(rows, numPartitions=3).selectExpr(
        "id", "CAST(id AS DOUBLE) AS x", "array(CAST(id AS DOUBLE), CAST(-id AS DOUBLE)) AS v",
        "id % 7 AS y").write.option("parquet.block.size", block_size).parquet(str(path))
    return spark.read.parquet(str(path))


def test_a_plain_parquet_scan_is_read_in_place(spark, tmp_path, caplog, backend):
    """spark.read.parquet(...) with a column selection: no materialisation, the files' own
    row groups as the blocks, the checks in one Spark job; every row once across the ranks,
    floats converted to the dataset's dtype as they are read."""
    df = _parquet_table(spark, tmp_path / "table")
    with caplog.at_level("INFO", logger="sparkhvd.data"):
        ds = DataFrameDataset(df.select("id", "x", "v", "y"), ["x", "v"], "y").materialize()
    assert ds.read_in_place and ds.cache_dir is None
    assert "in place from 3 Parquet file(s)" in caplog.text
    assert all(f.startswith("file:") and "table" in f for f in ds.files)
    assert sum(len(g) for g in ds.source.row_groups) > 3, "the table's own row groups"

    def read(ds):
        rows = [(float(a), [float(b) for b in v], str(a.dtype), str(v.dtype))
                for x, _ in ds.batches(50, 0, shuffle=True, seed=1)
                for a, v in zip(x["x"], x["v"])]
        return rows, ds.bytes_read

    results = HorovodRunner(np=-2, output_dir=str(tmp_path / "run"),
                            backend=backend).run_all(read, ds=ds)
    rows = [r for rank_rows, _ in results for r in rank_rows]
    assert sorted(int(x) for x, *_ in rows) == list(range(3000))
    assert all(v == [x, -x] and dx == dv == "float32" for x, v, dx, dv in rows)
    ds.close()
    assert os.path.exists(tmp_path / "table"), "the user's files are never deleted"


def test_other_dataframes_are_materialised_and_say_why(spark, tmp_path, caplog):
    df = _parquet_table(spark, tmp_path / "table")
    with caplog.at_level("INFO", logger="sparkhvd.data"):
        with DataFrameDataset(df.filter("id > 5"), "x", "y").materialize() as filtered:
            assert filtered.read_in_place is False and filtered.cache_dir
    assert "materialising (not read in place: its plan is more than a file scan (Project" in \
        caplog.text
    with pytest.raises(ValueError, match="in_place=True, but.*computes or renames columns"):
        DataFrameDataset(df.selectExpr("x * 2 AS x", "y"), "x", "y", in_place=True)  # when made
    spark.range(60_000, numPartitions=2).selectExpr(  # 2 files, one 15 MB row group each
        "transform(sequence(1, 64), i -> CAST(id + i AS DOUBLE)) AS v", "id % 7 AS y") \
        .write.parquet(str(tmp_path / "big"))
    caplog.clear()
    with caplog.at_level("INFO", logger="sparkhvd.data"):
        with DataFrameDataset(spark.read.parquet(str(tmp_path / "big")), "v", "y",
                              memory_cache=0).materialize() as one_group:
            assert not one_group.read_in_place
    assert "row groups hold up to" in caplog.text and "parquet.block.size" in caplog.text
    with DataFrameDataset(df, "x", "y", in_place=False).materialize() as written:
        assert written.cache_dir and not written.read_in_place
    nulls = spark.createDataFrame([(1.0, 0), (None, 1)], "x double, y long")
    nulls.write.parquet(str(tmp_path / "nulls"))
    with pytest.raises(ValueError, match="Null values in used column"):
        DataFrameDataset(spark.read.parquet(str(tmp_path / "nulls")), "x", "y").materialize()


def test_a_run_whose_np_does_not_divide_p_reads_its_share_every_row_once(spark, tmp_path,
                                                                         caplog, backend):
    """np=3 ranks of a dataset of 4 partitions deal the epoch: each rank reads its span (not
    the whole table, as the round robin's ranks did), every row once, nothing to warn of."""
    df = spark.range(120).selectExpr("CAST(id AS DOUBLE) AS x", "id % 2 AS y")

    def read(ds):
        rows = sorted(int(v) for x, _ in ds.batches(8, 0, shuffle=True, seed=1) for v in x)
        return rows, ds.state_dict()["deal"]["size"]

    with DataFrameDataset(df, "x", "y", partitions=4) as ds:
        with caplog.at_level("WARNING", logger="sparkhvd"):
            results = HorovodRunner(np=-3, output_dir=str(tmp_path), backend=backend).run_all(
                read, ds=ds)
    assert not [r for r in caplog.records if "partitions" in r.getMessage()]
    assert [dealt for _, dealt in results] == [3, 3, 3]
    reads = [rows for rows, _ in results]
    every = sorted(v for rank in reads for v in rank)
    assert len(every) == len(set(every)) == 120 // 24 * 24
