"""After training: score a DataFrame on the executors, track the run in MLflow, TensorBoard.

Runs in every profile, training on the profile's backend: Spark 3.5 + MLflow 2 with horovod,
Spark 4 + MLflow 3 with backend="tf" (predict_batch_udf and MLflow change across them)."""
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import digits_keras
import sparkhvd
from conftest import wait_for
from sparkhvd import EnvironmentMismatchError, HorovodRunner, TrainingError

pytestmark = [pytest.mark.every_profile, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def trained(spark, data, tmp_path_factory):
    """A run folder with a model (rank 0 returned its bytes) and TensorBoard files."""
    from conftest import PROFILE_BACKEND

    runner = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path_factory.mktemp("runs")),
                           backend=PROFILE_BACKEND)
    runner.run(digits_keras.train, **data, epochs=6, model_bytes=True, tensorboard=True)
    return runner.last_run_dir


def _frame(spark, x, y, vectors=False):
    from pyspark.ml.linalg import Vectors

    rows = [(i, Vectors.dense(x[i].reshape(-1).tolist()) if vectors
             else x[i].reshape(-1).tolist(), int(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["id", "features", "label"])


def test_predict_matches_model_predict(spark, data, trained):
    import tensorflow as tf

    model_file = trained.file(trained.record["model"])  # model.h5, or model.keras on Keras 3
    model = tf.keras.models.load_model(model_file)
    expected = model.predict(data["x_val"], verbose=0)
    for vectors in (False, True):
        df = _frame(spark, data["x_val"], data["y_val"], vectors=vectors)
        scored = sparkhvd.predict(df, trained, features="features", batch_size=64)
        assert dict(scored.dtypes)["prediction"] == "array<float>"
        got = np.stack(scored.orderBy("id").toPandas()["prediction"].values)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    classes = sparkhvd.predict(df, model_file, features="features", argmax=True)
    assert dict(classes.dtypes)["prediction"] == "bigint"
    by_id = {r["id"]: r["prediction"] for r in classes.select("id", "prediction").collect()}
    assert [by_id[i] for i in range(len(expected))] == expected.argmax(axis=1).tolist()
    accuracy = classes.where("prediction = label").count() / classes.count()
    assert accuracy >= 0.9


def test_predict_errors_are_early_and_named(spark, data, trained):
    from pyspark.sql import functions as F

    df = _frame(spark, data["x_val"][:20], data["y_val"][:20])
    with pytest.raises(KeyError, match=r"\['pixels'\] not in the DataFrame"):
        sparkhvd.predict(df, trained, features="pixels")
    holes = df.withColumn("features", F.when(F.col("id") < 3, None).otherwise(F.col("features")))
    with pytest.raises(ValueError, match=r"Null values in used column\(s\) \('features': 3"):
        sparkhvd.predict(holes, trained, features="features")
    with pytest.raises(ValueError, match="already has a column 'label'"):
        sparkhvd.predict(df, trained, features="features", output_col="label")
    with pytest.raises(FileNotFoundError, match="No model at"):
        sparkhvd.predict(df, os.path.dirname(trained.path), features="features")


def test_tensorboard_event_files_in_the_run_folder(trained):
    events = [os.path.join(d, f) for d, _, files in os.walk(trained.file("tensorboard"))
              for f in files if f.startswith("events.out.tfevents")]
    assert events and all(os.path.getsize(e) > 0 for e in events)
    assert any(os.sep + "train" + os.sep in e for e in events)
    assert any(os.sep + "validation" + os.sep in e for e in events)


# -- MLflow --------------------------------------------------------------------------------------


def test_mlflow_run_on_a_real_server(spark, data, tmp_path, mlflow_server, monkeypatch, backend,
                                     recwarn):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MY_API_TOKEN", "PLANTEDmlflowTOKEN99")
    runner = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path), mlflow="digits",
                           backend=backend)
    runner.run(digits_keras.train, **data, epochs=3, model_bytes=True, lr=0.002)
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    client = MlflowClient(mlflow_server)
    run = client.get_run(record["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "digits"
    params = run.data.params
    assert params["np"] == "2" and params["launcher"] == "barrier" and params["fn.epochs"] == "3"
    if backend == "horovod":
        assert params["version.horovod"] == "0.28.1"
    assert params["version.pyspark"] == __import__("pyspark").__version__
    assert run.data.tags["sparkhvd.run_id"] == runner.last_run_dir.run_id
    assert run.data.tags["sparkhvd.run_folder"] == runner.last_run_dir.path
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3]
    import csv

    csv_losses = [float(row["loss"]) for row in
                  csv.DictReader(open(runner.last_run_dir.file("metrics.csv")))]
    assert [m.value for m in history] == pytest.approx(csv_losses)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"run.json", "metrics.csv", "curves.png", "logs"} <= artifacts
    if int(mlflow.__version__.split(".")[0]) >= 3:  # a logged model, linked to the run
        model_id = record["mlflow"]["model_id"]
        logged = client.get_logged_model(model_id)
        assert logged.source_run_id == run.info.run_id and logged.name == "model"
        loaded = mlflow.tensorflow.load_model(f"models:/{model_id}")
        assert loaded.predict(data["x_val"][:4], verbose=0).shape == (4, 10)
        deprecated = [str(w.message) for w in recwarn if "artifact_path" in str(w.message)]
        assert not deprecated, deprecated
    else:
        assert "model" in artifacts
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    assert logs == {"logs/rank-0.log", "logs/rank-1.log"}
    text = json.dumps({"params": params, "tags": run.data.tags})
    assert "PLANTEDmlflowTOKEN99" not in text


@pytest.mark.ranks
def test_mlflow_failed_and_interrupted_runs(tmp_path, mlflow_server, monkeypatch, backend):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    client = MlflowClient(mlflow_server)

    def fails(token):
        raise RuntimeError("broken")

    runner = HorovodRunner(np=-2, output_dir=str(tmp_path), mlflow=True, backend=backend)
    with pytest.raises(TrainingError):
        runner.run(fails, token="not-a-secret-name")
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert client.get_run(record["mlflow"]["run_id"]).info.status == "FAILED"

    def hangs(started):

        open(started, "w").close()  # the run is tracked and its ranks train
        time.sleep(600)

    started = tmp_path / "started"

    def interrupt_once_started():  # a notebook's stop button, pressed mid-run
        if wait_for(started.exists, 120):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    runner = HorovodRunner(np=-2, output_dir=str(tmp_path), mlflow=True, backend=backend)
    with pytest.raises(KeyboardInterrupt):
        runner.run(hangs, started=str(started))
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert client.get_run(record["mlflow"]["run_id"]).info.status == "KILLED"


def _killed_on_the_first_attempt(marker):
    import os
    import signal

    rank = os.environ.get("SPARKHVD_RANK", os.environ.get("HOROVOD_RANK"))
    if not os.path.exists(marker) and rank == "1":
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, say: not the function's fault
    return "done"


@pytest.mark.ranks
def test_mlflow_records_retries(tmp_path, mlflow_server, monkeypatch, backend):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    runner = HorovodRunner(np=-2, output_dir=str(tmp_path), mlflow=True, backend=backend,
                           max_retries=2)
    assert runner.run(_killed_on_the_first_attempt, marker=str(tmp_path / "m")) == "done"
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert [a["status"] for a in record["attempts"]] == ["failed", "succeeded"]
    assert "killed by signal 9" in record["attempts"][0]["retryable"]
    run = MlflowClient(mlflow_server).get_run(record["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["sparkhvd.attempts"] == "2"
    assert "killed by signal 9" in run.data.tags["sparkhvd.attempt1"]
    assert run.data.metrics["retries"] == 1


@pytest.mark.ranks
def test_mlflow_default_store_is_local_and_offline(tmp_path, monkeypatch, backend):
    """MLflow's own default store, with no extra environment variable: ./mlruns on MLflow 2,
    sqlite:///mlflow.db on MLflow 3 (which refuses the file store unless told otherwise)."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    runner = HorovodRunner(np=-2, output_dir=str(tmp_path / "runs"), mlflow=True,
                           backend=backend)
    assert runner.run(lambda: 7) == 7
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    if int(mlflow.__version__.split(".")[0]) >= 3:
        uri = record["mlflow"]["tracking_uri"]  # MLflow makes the default path absolute
        assert uri.startswith("sqlite:///") and uri.endswith("/mlflow.db")
        assert (tmp_path / "mlflow.db").is_file()
        store = f"sqlite:///{tmp_path}/mlflow.db"
    else:
        assert (tmp_path / "mlruns").is_dir()
        store = f"file://{tmp_path}/mlruns"
    run = MlflowClient(store).get_run(record["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"


def test_mlflow_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(EnvironmentMismatchError, match=r"pip install 'sparkhvd\[mlflow\]'"):
        HorovodRunner(np=2, mlflow=True)
