"""Spark Connect: the same runner on a session without a SparkContext.

A real Spark Connect server (pip's pyspark, a separate process on 127.0.0.1) and a client
session built with ``remote("sc://...")`` -- what Databricks standard/serverless compute,
Dataproc serverless and Spark 4's connect mode give users. The failure matrix runs here too
(tests/test_failures.py, id ``tf-connect``); these are the rest.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import digits_keras
import sparkhvd
from sparkhvd import DataFrameDataset, HorovodRunner, NotEnoughSlotsError, TrainingError

pytestmark = [pytest.mark.connect, pytest.mark.timeout(600)]


def ranks_say_hello(greeting):
    import json
    import os

    print(f"{greeting} from rank {os.environ['SPARKHVD_RANK']}", flush=True)
    return {"rank": int(os.environ["SPARKHVD_RANK"]),
            "tf_config": json.loads(os.environ["TF_CONFIG"])}


def test_a_connect_session_has_no_sparkcontext_and_runs_ranks(connect, tmp_path, rank_lines):
    from pyspark.errors import PySparkAttributeError

    with pytest.raises(PySparkAttributeError):
        connect.sparkContext  # noqa: B018 - what made every run fail before
    runner = HorovodRunner(np=2, spark=connect, backend="tf", output_dir=str(tmp_path),
                           driver_log_verbosity="all")
    results = runner.run_all(ranks_say_hello, greeting="hi")
    assert [r["rank"] for r in results] == [0, 1]
    assert len(results[0]["tf_config"]["cluster"]["worker"]) == 2
    assert "[rank 0] hi from rank 0" in rank_lines and "[rank 1] hi from rank 1" in rank_lines
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert record["session"] == "connect" and record["control"] == "live"
    assert record["spark_master"] == "local[2]" and record["launcher"] == "barrier"


def test_too_many_ranks_are_refused_in_seconds(connect, tmp_path):
    with pytest.raises(NotEnoughSlotsError, match=r"np=3 needs 3 .* has 2"):
        HorovodRunner(np=3, spark=connect, backend="tf", output_dir=str(tmp_path)).run(
            lambda: 1)


def test_slots_that_cannot_be_counted_say_how_to_declare_them(connect):
    from sparkhvd.spark.slots import SLOTS_CONF, check_slots
    from sparkhvd.spark.sparkview import SparkView

    class Hidden(SparkView):  # a cluster master whose executor settings a client cannot see
        master = "spark://10.0.0.5:7077"

        def conf(self, key, default=None):
            return default

    with pytest.raises(NotEnoughSlotsError, match=f"spark.conf.set\\('{SLOTS_CONF}'"):
        check_slots(Hidden(connect), 2)

    class Declared(Hidden):
        def conf(self, key, default=None):
            return "4" if key == SLOTS_CONF else default

    assert check_slots(Declared(connect), 2).slots == 4


def test_horovod_spark_run_is_refused_with_the_fix(connect):
    from sparkhvd.driver.launchers import LaunchFacts
    from sparkhvd.driver.launchers import choose_launcher as choose
    from sparkhvd.spark.sparkview import SparkView

    def choose_launcher(requested, view, elastic=None):
        return choose(LaunchFacts("horovod", requested, bool(elastic)).with_session(view))

    view = SparkView(connect)
    assert view.connect and view.has_tags and view.master == "local[2]"
    assert choose_launcher("auto", view) == "barrier"
    with pytest.raises(ValueError, match="needs a SparkContext; this is a Spark Connect"):
        choose_launcher("horovod", view)
    with pytest.raises(ValueError, match="Elastic horovod training runs on horovod.spark.run"):
        choose_launcher("auto", view, elastic=(1, 2))
    # torch and tf elastic runs relaunch on the barrier launcher, on Connect too
    assert choose(LaunchFacts("torch", "auto", True).with_session(view)) == "barrier"


def test_unreachable_control_channel_still_ends_well(connect, tmp_path, monkeypatch,
                                                     rank_lines, caplog):
    """The usual Connect set-up: a laptop the executors cannot reach. Results, errors and logs
    come back in the barrier job's own rows; the console and run.json say so."""
    from sparkhvd.driver.launchers import barrier

    monkeypatch.setattr(barrier, "control_address", lambda spec, server: ("127.0.0.1", 9))
    runner = HorovodRunner(np=2, spark=connect, backend="tf", output_dir=str(tmp_path),
                           driver_log_verbosity="all")
    with caplog.at_level("WARNING", logger="sparkhvd"):
        results = runner.run_all(ranks_say_hello, greeting="offline")
    assert [r["rank"] for r in results] == [0, 1]
    assert "[rank 1] offline from rank 1" in rank_lines
    assert any("could not reach this machine's control channel" in r.getMessage()
               for r in caplog.records)
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert record["control"] == "rows"
    log = open(runner.last_run_dir.file("logs/rank-1.log")).read()
    assert "offline from rank 1" in log

    def fails():
        import os

        if os.environ["SPARKHVD_RANK"] == "1":
            raise KeyError("no such column")
        return "rank 0 is fine"

    with pytest.raises(TrainingError) as info:
        runner.run(fails)
    assert info.value.rank == 1 and info.value.exc_type == "KeyError"
    assert "no such column" in info.value.remote_traceback
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert record["status"] == "failed" and record["error"]["type"] == "TrainingError"


def test_backends_that_need_the_driver_say_so_without_the_channel():
    """Without the control channel the tasks assign ranks themselves: tf can, horovod (its
    rendezvous runs on the driver) cannot -- an error with the fix, not a hang."""
    from sparkhvd.common.protocol import TaskSpec
    from sparkhvd.executor.barrier import _rows_plan

    def spec(backend, run_env, **kw):
        return TaskSpec(payload=b"", options={}, env={}, driver=("127.0.0.1", 1), token="t",
                        start_timeout=1.0, backend=backend, run_env=run_env, **kw)

    gathered = [{"partition": p, "host": "h", "address": "127.0.0.1", "ports": [4000 + p]}
                for p in (0, 1)]
    [env] = _rows_plan(spec("tf", {"SPARKHVD_BACKEND": "tf"}), gathered, 1)
    assert env["SPARKHVD_RANK"] == "1" and json.loads(env["TF_CONFIG"])["cluster"]["worker"] \
        == ["127.0.0.1:4000", "127.0.0.1:4001"]
    # two ranks per task: each task assigns both of its own, numbered within the task
    gathered = [{"partition": p, "host": "h", "address": "127.0.0.1",
                 "ports": [4000 + 2 * p, 4001 + 2 * p]} for p in (0, 1)]
    envs = _rows_plan(spec("tf", {}, ranks_per_task=2, node_per_task=True), gathered, 1)
    assert [(e["SPARKHVD_RANK"], e["SPARKHVD_LOCAL_RANK"]) for e in envs] == [("2", "0"),
                                                                             ("3", "1")]
    with pytest.raises(RuntimeError, match="backend='horovod' needs every Spark task to reach"):
        _rows_plan(spec("horovod", {}), gathered, 0)


def test_dataframe_dataset_streams_shards_on_connect(connect, tmp_path, monkeypatch):
    from sparkhvd.data import materialize

    monkeypatch.setattr(materialize, "ROW_GROUP_BYTES", 8 * 40)
    df = connect.range(1000).selectExpr("id", "id % 10 AS label").repartition(3)
    ds = DataFrameDataset(df, features="id", label="label", memory_cache=0)

    def read(ds):
        ids = [int(i) for x, _ in ds.batches(10, 0, shuffle=True, seed=1) for i in x]
        return ids, ds.streams(), ds.steps_per_epoch(10)

    results = HorovodRunner(np=2, spark=connect, backend="tf",
                            output_dir=str(tmp_path)).run_all(read, ds=ds)
    assert all(streams for _, streams, _ in results)
    assert {steps for _, _, steps in results} == {50}
    assert sorted(results[0][0] + results[1][0]) == list(range(1000))
    cache = ds.cache_dir
    ds.close()
    assert not os.path.exists(cache)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((8,)),
                                 tf.keras.layers.Dense(4, activation="softmax")])
    path = str(tmp_path_factory.mktemp("model") / "model.keras")
    model.save(path)
    return path, model


@pytest.mark.parametrize("shipping", ["closure", "artifact"])
def test_predict_on_connect_matches_the_model(connect, small_model, monkeypatch, shipping):
    """No broadcast on Connect: small models ride in the UDF, large ones as an artifact."""
    from sparkhvd.scoring import scorer as scoring

    if shipping == "artifact":
        monkeypatch.setattr(scoring, "CLOSURE_LIMIT", 0)
    path, model = small_model
    x = np.random.default_rng(1).random((300, 8)).astype("float32")
    df = connect.createDataFrame([(i, x[i].tolist()) for i in range(len(x))], ["id", "features"])
    scored = sparkhvd.predict(df, path, features="features", batch_size=64)
    got = np.stack([np.asarray(r["prediction"]) for r in scored.orderBy("id").collect()])
    np.testing.assert_allclose(got, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_keras_checkpoints_resume_and_mlflow_on_connect(connect, data, tmp_path, monkeypatch):
    """Training helpers, checkpoints through the run-folder service, resume_from=True and
    MLflow (its local default store) -- on a Connect session."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kw = dict(**data, shuffle=False, weights=True)
    first = HorovodRunner(np=2, spark=connect, backend="tf", output_dir=str(tmp_path / "runs"),
                          mlflow="connect")
    first.run(digits_keras.train, epochs=2, **kw)
    latest = json.loads(open(first.last_run_dir.file("checkpoints/latest.json")).read())
    assert latest["epoch"] == 2
    resumed = HorovodRunner(np=2, spark=connect, backend="tf", resume_from=True,
                            output_dir=str(tmp_path / "runs"))
    result = resumed.run(digits_keras.train, epochs=3, **kw)
    assert result["initial_epoch"] == 2 and result["accuracy"] > 0.5
    record = json.loads(open(first.last_run_dir.file("run.json")).read())
    store = mlflow.get_tracking_uri()
    run = MlflowClient(store).get_run(record["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["np"] == "2"


def test_abfss_run_folder_on_connect(connect, azurite, tmp_path):
    from sparkhvd import storage

    azurite.make_container("models")
    runner = HorovodRunner(np=2, spark=connect, backend="tf",
                           output_dir=azurite.url("models", "connect-runs"),
                           storage_options=azurite.options())

    def writes_a_file():
        import os

        from sparkhvd.runfolder.rank_files import run_files

        if os.environ["SPARKHVD_RANK"] == "0":
            run_files().write_bytes("notes/hello.txt", b"from rank 0")
        return "done"

    assert runner.run(writes_a_file) == "done"
    url = runner.last_run_dir.url
    assert storage.read_bytes(f"{url}/notes/hello.txt", azurite.options()) == b"from rank 0"
    assert b'"session": "connect"' in storage.read_bytes(f"{url}/run.json", azurite.options())


def test_cli_run_and_doctor_take_a_remote(connect_server, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import json, os, sys\n"
                      "cfg = json.loads(os.environ['TF_CONFIG'])\n"
                      "print('worker', cfg['task']['index'], 'of', len(cfg['cluster']['worker']),"
                      " 'args', sys.argv[1:])\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}  # rich wraps tables at 80
    out = subprocess.run([sys.executable, "-m", "sparkhvd.ops.cli", "run", str(script), "--np", "2",
                          "--backend", "tf", "--remote", connect_server.url,
                          "--output-dir", str(tmp_path / "runs"), "--", "--epochs", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[rank 0] worker 0 of 2 args ['--epochs', '1']" in out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "sparkhvd.ops.cli", "doctor", "--remote",
                          connect_server.url, "--np", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    assert "via Spark Connect" in text and "connect session" in text, text[-3000:]
    assert "cluster network" in text and "2 task(s)" in text, text[-3000:]


def test_standalone_cluster_through_a_connect_server(standalone, tmp_path_factory, tmp_path):
    """The Connect server as a cluster's driver: executors on standalone workers; the slots
    come from the session's settings (a Connect client sees no executors)."""
    from conftest import ConnectServer

    server = ConnectServer(tmp_path_factory.mktemp("connect-standalone"), standalone.master_url,
                           **{"spark.executor.cores": "1", "spark.cores.max": "2",
                              "spark.executor.memory": "1g"})
    try:
        session = server.session()
        runner = HorovodRunner(np=2, spark=session, backend="tf", output_dir=str(tmp_path))
        results = runner.run_all(ranks_say_hello, greeting="cluster")
        assert [r["rank"] for r in results] == [0, 1]
        record = json.loads(open(runner.last_run_dir.file("run.json")).read())
        assert record["spark_master"] == standalone.master_url and record["slots"] == 2
        session.stop()
    finally:
        server.stop()


def test_tasks_that_reached_the_driver_are_detached_when_another_cannot():
    """Partly reachable: the registered tasks are told to run without the channel (so every
    task takes the same road), and a late one is too."""
    import socket
    import threading
    import time

    from sparkhvd.common import protocol
    from sparkhvd.common.backends import get_backend
    from sparkhvd.driver.launchers.control import ControlServer

    class Sink:
        def receive(self, msg):
            pass

    server = ControlServer("127.0.0.1", 2, "t0ken", Sink(), {}, get_backend("tf"))
    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    try:
        def hello(partition):
            sock = socket.create_connection(server.server_address, timeout=30)
            sock.sendall(protocol.encode(protocol.Hello(token="t0ken", partition=partition,
                                                        host="h", address="127.0.0.1", ports=[1])))
            return sock, sock.makefile("rb")

        sock, reader = hello(0)
        server.detach_if_incomplete(60.0)
        assert not server.detached, "not before the grace period"
        deadline = time.monotonic() + 30
        while server.first_hello is None and time.monotonic() < deadline:
            time.sleep(0.05)  # waits for the condition: the server took the Hello
        server.detach_if_incomplete(0.0)
        assert isinstance(protocol.decode(reader.readline()), protocol.Detached)
        late, late_reader = hello(1)
        assert isinstance(protocol.decode(late_reader.readline()), protocol.Detached)
        assert server.tasks == {} and server.facts(15.0) == []
        for s in (sock, late):
            s.close()
    finally:
        server.shutdown()
        server.server_close()


def _trains_until_stopped():
    import os
    import time

    print(f"training started pid {os.getpid()}", flush=True)
    while True:
        time.sleep(0.1)


def test_a_lost_connect_server_ends_the_run_in_seconds_with_its_name(tmp_path, monkeypatch,
                                                                       rank_lines):
    """The Connect server's JVM SIGKILLed after both ranks started: run() raises a SessionError
    naming the sc:// endpoint within 60 s (pyspark's client alone would retry for ~10 minutes),
    and no rank process is left."""
    import signal
    import threading
    import time

    from conftest import ConnectServer, connect_unavailable, still_alive, wait_for
    from sparkhvd import SessionError

    why = connect_unavailable()
    if why:
        pytest.skip(why)
    server = ConnectServer(tmp_path)  # its own server: this test kills it
    killed: dict = {}
    try:
        session = server.session()
        monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")

        def kill_when_started():
            if wait_for(lambda: sum("training started" in line for line in rank_lines) >= 2,
                        180):
                os.killpg(server.proc.pid, signal.SIGKILL)
                killed["at"] = time.monotonic()

        threading.Thread(target=kill_when_started, daemon=True).start()
        backend = "tf" if __import__("importlib").util.find_spec("tensorflow") else "torch"
        runner = HorovodRunner(np=2, spark=session, backend=backend, driver_log_verbosity="all",
                               output_dir=str(tmp_path / "runs"))
        with pytest.raises(SessionError) as info:
            runner.run(_trains_until_stopped)
        took = time.monotonic() - killed["at"]
        assert took < 60, f"run() took {took:.0f} s after the server died"
        message = str(info.value)
        assert server.url in message and "was lost" in message and "reconnect" in message
        record = runner.last_run_dir.record
        assert record["status"] == "failed" and "was lost" in record["error"]["message"]
        pids = [int(p) for p in record["rank_pids"].values()]
        assert len(pids) == 2 and still_alive(pids, 30.0) == [], "no rank process left"
    finally:
        server.stop()
