"""Everything the README promises, across hosts: a Spark cluster of network namespaces
(tests/netns_cluster.py), the driver in the root namespace, one 1-core worker per host."""
import json
import os
import sys
import threading
import time

import pytest

import digits_keras
from conftest import still_alive
from sparkhvd import DataFrameDataset, HorovodRunner, TrainingError, storage

pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]

HOSTS = {"h1", "h2", "h3"}


def wait_for(predicate, timeout=120, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def record_of(runner):
    path = runner.last_run_dir.file("run.json") if not runner.last_run_dir.remote else None
    return json.loads(open(path).read()) if path else runner.last_run_dir.record


def probe():
    import os
    import socket

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
    return (socket.gethostname(), os.environ.get("HOROVOD_GLOO_IFACE"), float(total.numpy()),
            hvd.size())


# 1 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["barrier", "horovod"])
def test_ranks_on_different_hosts_with_gloo_on_the_veth(cluster_spark, tmp_path, launcher):
    results = HorovodRunner(np=3, spark=cluster_spark, launcher=launcher,
                            output_dir=str(tmp_path)).run_all(probe)
    assert {host for host, *_ in results} == HOSTS
    assert {iface for _, iface, *_ in results} == {"eth0"}, "chosen automatically, never lo"
    assert {total for *_, total, _ in results} == {6.0} and results[0][3] == 3


def test_nics_still_override(cluster_spark, tmp_path):
    results = HorovodRunner(np=2, spark=cluster_spark, nics={"eth0"},
                            output_dir=str(tmp_path)).run_all(probe)
    assert [iface for _, iface, *_ in results] == ["eth0", "eth0"]
    assert len({host for host, *_ in results}) == 2


# 2 ---------------------------------------------------------------------------------------------
def test_lines_errors_and_record_across_hosts(cluster_spark, tmp_path, rank_lines):
    def chatty():
        import os
        import socket
        import time

        rank = os.environ["HOROVOD_RANK"]
        print(f"hello from {socket.gethostname()} as rank {rank}", flush=True)
        if rank == "2":
            time.sleep(2)
            raise ValueError(f"bad shard on {socket.gethostname()}")
        time.sleep(120)

    runner = HorovodRunner(np=3, spark=cluster_spark, driver_log_verbosity="all",
                           output_dir=str(tmp_path))
    with pytest.raises(TrainingError) as info:
        runner.run(chatty)
    err = info.value
    record = record_of(runner)
    hosts = {int(k): v for k, v in record["hosts"].items()}
    assert set(hosts.values()) == HOSTS and len(record["rank_pids"]) == 3
    assert err.rank == 2 and err.exc_type == "ValueError" and err.host == hosts[2]
    assert str(err).startswith(f"Training failed on rank 2 (host {hosts[2]}): ValueError")
    assert err.remote_message == f"bad shard on {hosts[2]}"
    for rank, host in hosts.items():
        assert f"[rank {rank}] hello from {host} as rank {rank}" in rank_lines


# 3 ---------------------------------------------------------------------------------------------
def _shard_ids(ds):
    import socket

    return socket.gethostname(), [int(v) for x, _ in ds.batches(50, 0) for v in x]


def test_dataset_cache_on_a_cluster(cluster_spark, cluster_azurite, tmp_path):
    from sparkhvd.data.dataset import default_cache_parent

    df = cluster_spark.range(3000, numPartitions=3).selectExpr("CAST(id AS DOUBLE) AS x",
                                                               "id % 7 AS y")
    before = set(os.listdir(default_cache_parent())) if os.path.isdir(default_cache_parent()) \
        else set()
    with pytest.raises(ValueError, match=r"executors of spark://.* cannot read.*cache_url="):
        HorovodRunner(np=3, spark=cluster_spark, output_dir=str(tmp_path)).run(
            _shard_ids, ds=DataFrameDataset(df, "x", "y"))
    after = set(os.listdir(default_cache_parent())) if os.path.isdir(default_cache_parent()) \
        else set()
    assert after == before, "a refused cache leaves nothing behind"

    ds = DataFrameDataset(df, "x", "y", cache_url=cluster_azurite.url("cache", "datasets"),
                          storage_options=cluster_azurite.options(), memory_cache=0)
    results = HorovodRunner(np=3, spark=cluster_spark, output_dir=str(tmp_path)).run_all(
        _shard_ids, ds=ds)
    assert {host for host, _ in results} == HOSTS
    assert sorted(i for _, ids in results for i in ids) == list(range(3000))
    ds.close()


# 4 and 5 ---------------------------------------------------------------------------------------
def _train_and_probe_run_folder(**kw):
    import os

    from sparkhvd.runfolder.rank_files import run_files

    files = run_files()
    files.write_bytes("notes/inside.txt", b"written from a rank")
    try:
        files.write_bytes("../outside.txt", b"must not land")
        outside = "written"
    except (ValueError, PermissionError) as exc:
        outside = f"refused: {exc}"
    result = digits_keras.train(**kw)
    result["azure_vars"] = sorted(k for k in os.environ if "AZURE" in k or "SPARKHVD_FILES" in k
                                  and "TOKEN" in k)
    result["outside"] = outside
    return result


def test_checkpoints_and_timeline_to_abfss_from_remote_hosts(cluster_spark, cluster_azurite,
                                                            tmp_path, monkeypatch):
    """README set-up: output_dir=abfss://..., storage_options={connection_string}. The ranks
    get no key: rank 0's files travel through the driver, which writes them."""
    monkeypatch.setenv("SPARKHVD_STAGING_DIR", str(tmp_path / "staging"))
    data = dict(zip(("x_train", "x_val", "y_train", "y_val"), digits_keras.digits_split()))
    root = cluster_azurite.url("models", "runs")
    opts = cluster_azurite.options()
    key = opts["connection_string"].split("AccountKey=")[1].split(";")[0]
    runner = HorovodRunner(np=2, spark=cluster_spark, output_dir=root, storage_options=opts,
                           timeline=True)
    r0 = runner.run(_train_and_probe_run_folder, **data, epochs=2)
    assert r0["outside"].startswith("refused") and "outside the run folder" in r0["outside"]
    assert r0["azure_vars"] == ["SPARKHVD_FILES_TOKEN"]
    url = runner.last_run_dir.url
    names = set(storage.listdir(f"{url}/checkpoints", opts))
    assert {"epoch-0002.h5", "epoch-0002.optimizer.npz", "latest.json"} <= names
    assert storage.read_bytes(f"{url}/notes/inside.txt", opts) == b"written from a rank"
    timeline = storage.read_bytes(f"{url}/timeline.json", opts).decode()
    assert "ALLREDUCE" in timeline.upper()
    assert not storage.exists(f"{root}/outside.txt", opts)
    for name in ("run.json", "logs/rank-0.log", "logs/rank-1.log"):
        assert key not in storage.read_bytes(f"{url}/{name}", opts).decode(errors="replace")
    resumed = HorovodRunner(np=2, spark=cluster_spark, output_dir=root, storage_options=opts,
                            resume_from=True).run(digits_keras.train, **data, epochs=3)
    assert resumed["initial_epoch"] == 2


def test_local_run_folder_gets_rank0_files_from_another_host(cluster_spark, tmp_path):
    """The default output_dir is on the driver's disk, which rank 0's host cannot see."""
    data = dict(zip(("x_train", "x_val", "y_train", "y_val"), digits_keras.digits_split()))
    runner = HorovodRunner(np=2, spark=cluster_spark, output_dir=str(tmp_path), timeline=True)
    runner.run(digits_keras.train, **data, epochs=2)
    run = runner.last_run_dir
    assert record_of(runner)["hosts"]["0"] in HOSTS
    assert os.path.exists(run.file("checkpoints/epoch-0002.h5"))
    assert "ALLREDUCE" in open(run.file("timeline.json")).read().upper()
    resumed = HorovodRunner(np=2, spark=cluster_spark, output_dir=str(tmp_path),
                            resume_from=True).run(digits_keras.train, **data, epochs=3)
    assert resumed["initial_epoch"] == 2


# 6 ---------------------------------------------------------------------------------------------
def test_horovod_launcher_uses_the_executors_python(cluster_spark, tmp_path, monkeypatch):
    """The driver's sys.executable is a path that exists only on the driver's disk."""
    driver_only = tmp_path / "driver-only-venv" / "python"
    driver_only.parent.mkdir()
    driver_only.symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(driver_only))

    def where():
        import socket
        import sys

        return socket.gethostname(), sys.executable

    results = HorovodRunner(np=2, spark=cluster_spark, launcher="horovod",
                            output_dir=str(tmp_path / "runs")).run_all(where)
    assert {h for h, _ in results} <= HOSTS
    assert all(python != str(driver_only) for _, python in results)


def test_elastic_failure_is_a_training_error(cluster_spark, tmp_path):
    def fails():
        import horovod.tensorflow as hvd
        import tensorflow as tf

        hvd.init()

        @hvd.elastic.run
        def loop(state):
            raise ValueError("a bug in the elastic loop")

        loop(hvd.elastic.TensorFlowState(variables=[tf.Variable(0.0)], step=0))

    runner = HorovodRunner(np=2, min_np=1, max_np=2, spark=cluster_spark, start_timeout=30,
                           output_dir=str(tmp_path))
    with pytest.raises(TrainingError) as info:
        runner.run(fails)
    assert info.value.exc_type == "ValueError"
    assert info.value.remote_message == "a bug in the elastic loop"


# 7 and 8 ---------------------------------------------------------------------------------------
def _trains_forever():
    import os
    import socket
    import time

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    print(f"started on {socket.gethostname()} pid {os.getpid()}", flush=True)
    while True:
        hvd.allreduce(tf.constant(1.0))
        time.sleep(0.05)


def _fail_host_when_started(cluster, rank_lines, action):
    def act():
        wait_for(lambda: sum("started on" in line for line in rank_lines) >= 3, 120,
                 "3 started lines")
        host = next(h for h in ("h3", "h2", "h1")
                    if any(f"started on {h}" in line for line in rank_lines))
        act.host = host
        action(host)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return act, thread


def test_a_host_that_dies_mid_run(cluster_spark, netns_cluster, tmp_path, rank_lines):
    act, thread = _fail_host_when_started(netns_cluster, rank_lines, netns_cluster.kill_host)
    runner = HorovodRunner(np=3, spark=cluster_spark, driver_log_verbosity="all",
                           output_dir=str(tmp_path))
    try:
        with pytest.raises(TrainingError) as info:  # the hang guard is the test's timeout
            runner.run(_trains_forever)
        thread.join(10)
        record = record_of(runner)
        hosts = {int(k): v for k, v in record["hosts"].items()}
        lost_rank = next(r for r, h in hosts.items() if h == act.host)
        err = info.value
        assert err.rank == lost_rank and err.host == act.host, str(err)
        # Whichever sign reaches the driver first names it: the task's connection closing
        # ("vanished"), its heartbeat stopping ("stopped answering") or Spark's ExecutorLost
        # ("was lost"). Which comes first is timing, not a promise.
        assert any(said in err.remote_message
                   for said in ("vanished", "stopped answering", "was lost")), err.remote_message
        # The first line -- what run.json and a notebook's error summary keep -- names the host.
        assert f"rank {lost_rank} (host {act.host})" in str(err).splitlines()[0], str(err)
        assert act.host in record["error"]["message"], record["error"]
        survivors = [int(pid) for r, pid in record["rank_pids"].items()
                     if hosts[int(r)] != act.host]
        assert still_alive(survivors, 30.0) == [], "no rank process left on the surviving hosts"
    finally:
        netns_cluster.restore_host(act.host if hasattr(act, "host") else "h3")
    assert HorovodRunner(np=3, spark=cluster_spark, output_dir=str(tmp_path)).run(
        lambda: "the session still works") == "the session still works"


def test_a_host_that_drops_off_the_network_is_named(cluster_spark, netns_cluster, tmp_path,
                                                    rank_lines):
    act, thread = _fail_host_when_started(netns_cluster, rank_lines, netns_cluster.cut_network)
    runner = HorovodRunner(np=3, spark=cluster_spark, driver_log_verbosity="all",
                           heartbeat_timeout=8, output_dir=str(tmp_path))
    try:
        with pytest.raises(TrainingError) as info:
            runner.run(_trains_forever)
        thread.join(10)
        hosts = {int(k): v for k, v in record_of(runner)["hosts"].items()}
        lost_rank = next(r for r, h in hosts.items() if h == act.host)
        err = info.value
        assert err.rank == lost_rank and err.host == act.host, str(err)
        assert "stopped answering" in str(err) and f"host {act.host}" in str(err)
    finally:
        netns_cluster.restore_host(act.host if hasattr(act, "host") else "h3")


@pytest.mark.long("horovod elastic learns of a lost host from its Gloo timeouts and meets "
                  "again without it, then the host's worker comes back: 100-115 s on 2 cores")
def test_elastic_run_survives_a_lost_host(cluster_spark, netns_cluster, tmp_path, rank_lines):
    from sparkhvd.examples.digits import load_digits_split, train_elastic

    x_train, x_val, y_train, y_val = load_digits_split()

    def kill_one():
        wait_for(lambda: any("step 10/60 size 3" in line for line in rank_lines), 240,
                 "step 10 on 3 ranks")
        netns_cluster.kill_host("h3")

    thread = threading.Thread(target=kill_one, daemon=True)
    thread.start()
    try:
        result = HorovodRunner(np=3, min_np=2, max_np=3, spark=cluster_spark,
                               output_dir=str(tmp_path)).run(
            train_elastic, x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val,
            steps=60, pause=0.3)
    finally:
        thread.join(10)
        netns_cluster.restore_host("h3")
    assert result["sizes"][0] == 3 and result["sizes"][-1] == 2
    assert len(result["model"]) > 10_000


# 9 ---------------------------------------------------------------------------------------------
def test_doctor_reports_hosts_interfaces_and_reachability(cluster_spark, netns_cluster):
    from click.testing import CliRunner

    from sparkhvd.ops.cli import main

    result = CliRunner().invoke(main, ["doctor", "--np", "3", "--master",
                                       netns_cluster.master_url], env={"COLUMNS": "250"})
    out = result.output
    assert "cluster network" in out and "3 task(s) on 3 host(s) (h1, h2, h3)" in out, out
    for host in HOSTS:
        assert host in out
    assert "eth0" in out and out.count("yes (from 10.231.") >= 3
    assert cluster_spark.sparkContext._jsc is not None, "doctor left the session running"


@pytest.mark.long("the weights of an uninterrupted np=3 run are its reference: two runs of "
                  "four epochs on three hosts, 100-115 s of CPU on 2 cores")
def test_a_lost_host_is_retried_from_the_last_checkpoint(cluster_spark, netns_cluster, tmp_path,
                                                         rank_lines):
    """max_retries=1 across hosts: the host of rank 2 dies after epoch 2's checkpoint (and a
    fresh one takes its place); the run resumes at epoch 3 and ends with the weights of an
    uninterrupted run."""
    import numpy as np

    from digits_keras import pausing_data, train_pausing

    data = pausing_data()
    straight = HorovodRunner(np=3, spark=cluster_spark, output_dir=str(tmp_path / "a")).run(
        train_pausing, epochs=4, **data)
    lost = {}

    def kill_when_paused():
        wait_for(lambda: sum("paused" in line for line in rank_lines) >= 3, 240, "3 paused")
        line = next(line for line in rank_lines if line.startswith("[rank 2]") and "paused" in line)
        lost["host"] = line.split(" on ")[1].split()[0]
        netns_cluster.kill_host(lost["host"])
        netns_cluster.restore_host(lost["host"])

    thread = threading.Thread(target=kill_when_paused, daemon=True)
    thread.start()
    runner = HorovodRunner(np=3, spark=cluster_spark, max_retries=1, driver_log_verbosity="all",
                           output_dir=str(tmp_path / "b"))
    try:
        result = runner.run(train_pausing, epochs=4, pause_at=2, **data)
    finally:
        thread.join(120)
    assert result["initial_epoch"] == 2
    for a, b in zip(straight["weights"], result["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    first, second = record_of(runner)["attempts"]
    assert lost["host"] in first["error"] and first["retryable"], first
    assert second["status"] == "succeeded"


def load_batch(driver):
    """Waits for the driver's word over the network: the hosts share no disk with it."""
    import socket

    with socket.create_connection(driver, timeout=600) as conn:
        conn.recv(1)


def rank2_elsewhere(driver):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    print("in position", flush=True)
    if hvd.rank() == 2:
        load_batch(driver)
    hvd.allreduce(tf.constant(1.0))
    return "released"


def test_a_hang_across_hosts_names_where_each_rank_is(netns_cluster, cluster_spark, tmp_path):
    """Every rank's stacks come back from every host over the barrier launcher's control
    channel -- the route of a timeout's and a stall's stacks too -- once every rank is in
    position, however long three TensorFlow imports take on a busy machine; then rank 2 is
    let go and the run ends. (Horovod's launcher has no channel of ours: its ranks poll the run
    folder, the same route on one host or several -- test_stacks_and_retries runs it, and the
    TimeoutError's wording.)"""
    import socket

    listener = socket.create_server((netns_cluster.driver_ip, 0))
    runner = HorovodRunner(np=3, spark=cluster_spark, launcher="barrier",
                           output_dir=str(tmp_path))
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=runner.run(
        rank2_elsewhere, driver=listener.getsockname()[:2], run_timeout=600)))
    thread.start()
    try:
        def in_position():
            logs = [runner.last_run_dir.file(f"logs/rank-{r}.log") for r in range(3)] \
                if runner.last_run_dir is not None else []
            return bool(logs) and all(os.path.exists(f) and "in position" in open(f).read()
                                      for f in logs)

        wait_for(in_position, 240, "every rank in position")
        listener.settimeout(60)
        rank2, _ = listener.accept()  # rank 2 is in load_batch()
        # ranks 0 and 1 print, then call allreduce: ask until both are inside it
        deadline = time.monotonic() + 60
        while True:
            text = runner.dump_stacks()
            summary = text.split("Summary: ", 1)[1].split("\n", 1)[0]
            if "ranks 0, 1 wait in" in summary or time.monotonic() > deadline:
                break
        assert "rank 2 is in test_multihost.py:" in summary and "load_batch()" in summary, summary
        assert "ranks 0, 1 wait in" in summary and "allreduce" in summary, summary
        assert {line.split(" on host ")[1].split(";")[0] for line in text.splitlines()
                if line.startswith("=== rank")} == HOSTS
        for rank in range(3):
            assert f"=== rank {rank} (pid" in text
        rank2.sendall(b"g")
        rank2.close()
    finally:
        listener.close()  # a rank 2 not yet let go fails, and the run ends
        thread.join(120)
    assert result["value"] == "released"


def _keras_elastic(train, epochs):
    """KerasDistributed on backend="tf" with step checkpoints every 2 steps and the data's
    position; prints ``elastic-log a<attempt>-r<rank> world BEFORE NOW`` once and
    ``elastic-log ... EPOCH STEP`` per step (Keras' own), slowly enough to be caught mid-epoch.
    The second attempt's ranks wait after their third step for a notice (the grow, at most
    240 s): the run is still there when the lost host comes back, however long that takes."""
    import os
    import time

    import tensorflow as tf

    from sparkhvd.elastic.notices import noticed
    from sparkhvd.keras import KerasDistributed, world_size_change

    kd = KerasDistributed(epochs=epochs, batch_size=4, data=train, every_steps=2, keep=2)
    attempt = int(os.environ["SPARKHVD_ATTEMPT"])
    tag = f"elastic-log a{attempt - 1}-r{kd.rank}"
    change = world_size_change()
    print(f"{tag} world {change.before} {change.now} pid {os.getpid()}", flush=True)

    class Steps(tf.keras.callbacks.Callback):
        done = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            print(f"{tag} {self.epoch} {batch + 1}", flush=True)
            self.done += 1
            if attempt == 2 and self.done == 3:  # at 2 ranks: until the run grows back
                waited = time.monotonic()
                while noticed() is None and time.monotonic() - waited < 240:
                    time.sleep(0.05)
            time.sleep(0.1)

    with kd.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((1,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.SGD(0.0001)), loss="mse")
    with train.tf_dataset(4, shuffle=True, seed=2) as ds:
        model.fit(ds, steps_per_epoch=train.steps_per_epoch(4),
                  **kd.fit_kwargs(model, callbacks=[Steps()]))
    return {"world": kd.size, "change": tuple(change)}


@pytest.mark.long("three attempts (3, 2, then 3 hosts), each importing TensorFlow in every rank, "
                  "and a host's worker restarting between them: 80-130 s on 2 cores")
def test_an_elastic_tf_run_loses_a_host_and_grows_back(cluster_spark, netns_cluster,
                                                       cluster_azurite, tmp_path, rank_lines):
    """backend="tf", np=3, min_np=2: a host dies mid-epoch -> the run goes on with the 2 left
    from its newest step checkpoint; the host returns -> the run grows back to 3 at its next
    step (a notice to every rank, a checkpoint, a relaunch)."""
    import elastic_training as et
    from conftest import wait_for
    from sparkhvd.spark.slots import check_slots

    # A host an earlier test restored has a worker again, but its executor may still be
    # registering: with min_np=2 the run would start on 2 hosts, not the 3 it must lose one of.
    check_slots(cluster_spark.sparkContext, 3, wait_s=120)
    df = cluster_spark.range(240).selectExpr("CAST(id AS FLOAT) / 240 AS x",
                                             "CAST(id AS FLOAT) / 240 AS y")

    def trouble():
        def mid_epoch():
            ranks = et.read_lines(rank_lines).get(0, {})
            return len(ranks) == 3 and all(any(e == 1 and s >= 3 for e, s, _ in r["steps"])
                                           for r in ranks.values())
        assert wait_for(mid_epoch, 300, 0.2)
        netns_cluster.kill_host("h3")
        assert wait_for(lambda: len(et.read_lines(rank_lines).get(1, {})) == 2, 300, 0.2)
        netns_cluster.restore_host("h3")

    thread = threading.Thread(target=trouble, daemon=True)
    try:
        with DataFrameDataset(df, "x", "y", cache_url=cluster_azurite.url("cache", "tf-elastic"),
                              storage_options=cluster_azurite.options()) as ds:
            runner = HorovodRunner(np=3, min_np=2, max_np=3, resize_check_s=2,
                                   spark=cluster_spark, backend="tf",
                                   driver_log_verbosity="all", output_dir=str(tmp_path))
            thread.start()
            result = runner.run(_keras_elastic, train=ds, epochs=2)
        thread.join(60)
        record = runner.last_run_dir.record
        assert [a["size"] for a in record["attempts"]] == [3, 2, 3], record["attempts"]
        shrink, grow = record["resizes"]
        assert (shrink["from"], shrink["to"]) == (3, 2) and "h3" in shrink["why"], shrink
        assert (grow["from"], grow["to"]) == (2, 3) and "growing" in grow["why"], grow
        assert record["attempts"][1]["preempted"]["checkpoint"], record["attempts"][1]
        assert result == {"world": 3, "change": (2, 3)}
        logs = et.read_lines(rank_lines)
        assert {r["world"] for r in logs[1].values()} == {(3, 2)}
    finally:
        thread.join(60)
        if netns_cluster.alive_workers() < 3:
            netns_cluster.restore_host("h3")
