"""Surviving the cloud on backend="torch": a notice costs at most one step, elastic runs shrink
and grow back, on local Spark, a standalone cluster with Spark's graceful decommissioning, and
Spark Connect. Every test counts the ids each attempt trained (tests/elastic_training.py):
every id of an epoch exactly once across the attempts. Runs in the modern profile."""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import conftest
import elastic_training as et
from sparkhvd import DataFrameDataset, HorovodRunner
from sparkhvd.data import row_group_cache
from sparkhvd.spark.slots import busy_slots

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch_backend, pytest.mark.timeout(600)]

N = 203  # rows: with 4 per rank and step, a few rows of each epoch are left out


def _frame(spark, n=N):
    return spark.range(n).selectExpr(
        "id", "array(CAST(id % 7 AS FLOAT), CAST(id % 5 AS FLOAT), 1.0F) AS x",
        "CAST(id % 7 + 2 * (id % 5) AS FLOAT) AS y")


def _once_each(logs, epoch, n, batch):
    """Every id of ``epoch`` trained once over all attempts, and at least as many as a run
    that never resized trains at the size that ended the epoch: all but ``n % (size *
    batch)`` (the tail left out of full steps), however the size changed on the way. (More
    when a smaller size had gone past that end before the resize: nothing of it is lost.)"""
    ids = et.ids_of_epoch(logs, epoch)
    assert len(ids) == len(set(ids)), f"epoch {epoch}: an id trained twice"

    def trained(attempt, later):
        return any(later(e) for entry in logs[attempt].values() for e, _, _ in entry["steps"])

    after = [a for a in logs if trained(a, lambda e: e > epoch)]
    ended = min(after) if after else max(a for a in logs if trained(a, lambda e: e == epoch))
    size = len(logs[ended])
    assert set(ids) <= set(range(n)), f"epoch {epoch}: ids that are not the data's"
    assert len(ids) >= n - n % (size * batch), \
        f"epoch {epoch}: {n - n % (size * batch) - len(ids)} id(s) lost (ended at np={size})"


def _when(condition, what, timeout=240):
    assert conftest.wait_for(condition, timeout, 0.1), f"timed out waiting for {what}"


def _signal_rank_1(logs_dir, step, signum, rank=1):
    """A thread (not started) that sends ``signum`` to the first attempt's rank 1 (or
    ``rank``) once it has logged ``step`` of epoch 1; ``thread.sent_at``: when (time.time())."""
    def rank_1_there():
        rank1 = et.read_logs(logs_dir).get(0, {}).get(rank)
        return rank1 if rank1 and any(e == 1 and s >= step for e, s, _ in rank1["steps"]) \
            else None

    def send():
        _when(rank_1_there, "rank 1 mid-epoch")
        thread.sent_at = time.time()
        os.kill(rank_1_there()["pid"], signum)

    thread = threading.Thread(target=send, daemon=True)
    return thread


@pytest.mark.parametrize("async_save,sharded", [(False, False), (True, False), (True, True)],
                         ids=["sync", "async", "sharded-async"])
def test_sigterm_to_a_rank_costs_at_most_one_step(spark, tmp_path, async_save, sharded):
    """A node's notice: SIGTERM to rank 1's process mid-epoch. Every rank finishes its step,
    the step checkpoint is written, the ranks exit as preempted and the run relaunches from it
    (its own budget, not max_retries): no step is trained twice, no id lost. With async_save
    and a save every step, the notice's own save is written to the end before the ranks stop
    (the one in flight first) -- for sharded checkpoints too, every rank's part committed."""
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()

    thread = _signal_rank_1(logs_dir, 6, signal.SIGTERM)
    with DataFrameDataset(_frame(spark), ["x", "id"], "y") as ds:
        runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "r"))
        thread.start()
        result = runner.run(et.train_ids, data=ds, epochs=2, log_dir=str(logs_dir), step_s=0.1,
                            async_save=async_save, every_steps=1 if async_save else 1000,
                            sharded=sharded)
    thread.join(5)
    assert result == {"world": 2, "change": (2, 2)}
    record = runner.last_run_dir.record
    first, second = record["attempts"]
    assert first["status"] == "preempted" and second["status"] == "succeeded"
    # from the notice to the ranks' stop: within the time between the signal and the
    # attempt's end (run.json's whole seconds)
    ended = datetime.datetime.fromisoformat(first["ended_at"]).timestamp() + 1
    assert 0 <= first["preempted"]["notice_to_stop_s"] <= ended - thread.sent_at, \
        (first["preempted"], first["ended_at"], thread.sent_at)
    checkpoint = first["preempted"]["checkpoint"]
    assert checkpoint.startswith("epoch-0001-step-"), checkpoint
    step = int(checkpoint[len("epoch-0001-step-"):].removesuffix(".pt"))
    logs = et.read_logs(logs_dir)
    for rank in (0, 1):  # what each rank did after the checkpoint is redone: at most a step
        last = max(s for e, s, _ in logs[0][rank]["steps"] if e == 1)
        assert last - step <= 1, f"rank {rank} trained steps {step + 1}..{last} again"
    for epoch in (0, 1):
        _once_each(logs, epoch, N, 4)
    states = [s["state"] for s in record["states"]]
    assert states == ["placing", "running", "restarting", "placing", "running", "finished"]
    restart = record["states"][2]
    assert "rank 1" in restart["why"] and "notice (SIGTERM)" in restart["why"], restart
    assert restart["checkpoint"] == checkpoint


def test_an_elastic_run_on_spark_connect(connect, tmp_path):
    """min_np/max_np on a Spark Connect session (the barrier launcher): a rank killed mid-epoch
    relaunches from the step checkpoint with the slots there are; every id once per epoch
    (the steps since that checkpoint are redone, not counted twice)."""
    spark = connect
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()

    thread = _signal_rank_1(logs_dir, 5, signal.SIGKILL)
    with DataFrameDataset(_frame(spark), ["x", "id"], "y") as ds:
        runner = HorovodRunner(np=2, min_np=1, max_np=2, spark=spark, backend="torch",
                               output_dir=str(tmp_path / "r"))
        thread.start()
        runner.run(et.train_ids, data=ds, epochs=2, log_dir=str(logs_dir), step_s=0.1,
                   every_steps=2)
    thread.join(5)
    record = runner.last_run_dir.record
    assert record["session"] == "connect" and record["min_np"] == 1 and record["max_np"] == 2
    first, second = record["attempts"]
    assert first["status"] == "failed" and "killed by signal 9" in first["retryable"]
    restored = second["restored"].rsplit("/", 1)[-1]
    logs = _cut_at(et.read_logs(logs_dir), 0, restored)
    for epoch in (0, 1):
        _once_each(logs, epoch, N, 4)


def test_the_writing_rank_killed_with_async_saves_resumes_from_a_complete_checkpoint(
        spark, tmp_path):
    """Rank 0 -- the one writing -- SIGKILLed mid-epoch while it saves every step in the
    background: the relaunch restores the newest *complete* checkpoint (a save cut mid-write
    is never read), and every id of each epoch is trained once counting from it."""
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()

    thread = _signal_rank_1(logs_dir, 5, signal.SIGKILL, rank=0)
    with DataFrameDataset(_frame(spark), ["x", "id"], "y") as ds:
        runner = HorovodRunner(np=2, spark=spark, backend="torch", max_retries=1,
                               output_dir=str(tmp_path / "r"))
        thread.start()
        runner.run(et.train_ids, data=ds, epochs=2, log_dir=str(logs_dir), step_s=0.1,
                   every_steps=1, async_save=True)
    thread.join(5)
    first, second = runner.last_run_dir.record["attempts"]
    assert first["status"] == "failed" and "killed by signal 9" in first["retryable"]
    restored = second["restored"].rsplit("/", 1)[-1]
    logs = _cut_at(et.read_logs(logs_dir), 0, restored)
    for epoch in (0, 1):
        _once_each(logs, epoch, N, 4)


def _cut_at(logs, attempt, checkpoint):
    """``logs`` with the steps of ``attempt`` after ``checkpoint`` (what the next attempt
    restored) left out: they were lost with the rank and trained again."""
    name = checkpoint.rsplit(".", 1)[0]
    epoch = int(name.split("-")[1]) - (0 if "-step-" in name else 1)
    step = int(name.rsplit("-", 1)[1]) if "-step-" in name else 10 ** 9
    for entry in logs[attempt].values():
        entry["steps"] = [(e, s, ids) for e, s, ids in entry["steps"]
                          if e < epoch or (e == epoch and s <= step)]
    return logs


DRIVER = """
import json, os, sys
sys.path.insert(0, {tests!r})
os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python (pyspark reads it)
import elastic_training as et
from pyspark.sql import SparkSession
from sparkhvd import DataFrameDataset, HorovodRunner
from sparkhvd.data import row_group_cache
spark = (SparkSession.builder.master({master!r}).config("spark.driver.host", "127.0.0.1")
         .config("spark.decommission.enabled", "true").config("spark.executor.cores", "1")
         .config("spark.executor.memory", "1g").config("spark.ui.enabled", "false")
         .config("spark.pyspark.python", sys.executable).getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
from sparkhvd.spark.slots import check_slots
check_slots(spark.sparkContext, 3, wait_s=90)
df = spark.range({n}).selectExpr(
    "id", "array(CAST(id % 7 AS FLOAT), CAST(id % 5 AS FLOAT), 1.0F) AS x",
    "CAST(id % 7 + 2 * (id % 5) AS FLOAT) AS y")
with DataFrameDataset(df, ["x", "id"], "y") as ds:
    runner = HorovodRunner(np=3, min_np=2, max_np=3, resize_check_s=2, spark=spark,
                           backend="torch", output_dir={out!r})
    result = runner.run(et.train_ids, data=ds, epochs=2, log_dir={logs!r},
                        step_s=(0.15, 0.3, 0.05), hold=(1, 3))  # at 2 ranks: until it grows
print("RESULT " + json.dumps({{"run": runner.last_run_dir.path, "result": result}}), flush=True)
"""


@pytest.mark.long("a standalone cluster of its own, with decommissioning on: a master, four "
                  "workers and their executors start (nine JVMs on 2 cores) beside three ranks "
                  "training two epochs")
def test_a_decommissioned_worker_shrinks_the_run_and_a_new_one_grows_it_back(tmp_path,
                                                                            monkeypatch):
    """A standalone cluster with spark.decommission.enabled, np=3, min_np=2: a worker told to
    decommission (SIGPWR, as decommission-worker.sh sends) mid-epoch -> a checkpoint at the
    step of the notice (at most a step redone per rank), the run goes on with 2 ranks; a new
    worker -> it grows back to 3 at its next step (the 2 ranks wait at their third step for
    it, however long the worker takes to come). Every id once per epoch."""
    monkeypatch.setenv("SPARK_WORKER_OPTS", "-Dspark.decommission.enabled=true")
    cluster = conftest.StandaloneCluster(str(tmp_path), workers=3, cores=1)
    logs_dir, out = tmp_path / "logs", tmp_path / "runs"
    logs_dir.mkdir()
    n = 253
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=os.path.dirname(conftest.__file__),
                                    master=cluster.master_url, n=n, out=str(out),
                                    logs=str(logs_dir)))
    try:
        cluster.wait_for_workers(3)
        driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            def mid_epoch():
                ranks = et.read_logs(logs_dir).get(0, {})
                return len(ranks) == 3 and all(any(e == 1 and s >= 4 for e, s, _ in r["steps"])
                                               for r in ranks.values())
            _when(mid_epoch, "three ranks mid-epoch")
            os.kill(cluster.procs["worker2"].pid, signal.SIGPWR)  # decommission-worker.sh
            _when(lambda: len(et.read_logs(logs_dir).get(1, {})) == 2, "the run at 2 ranks")
            cluster.start_worker("worker3")  # capacity comes back
            stdout, stderr = driver.communicate(timeout=400)
        except AssertionError as exc:  # say what the driver said
            driver.kill()
            raise AssertionError(f"{exc}\n--- the driver's stderr:\n"
                                 f"{driver.communicate(timeout=60)[1][-5000:]}") from None
        finally:
            if driver.poll() is None:
                driver.kill()
        assert driver.returncode == 0, stderr[-5000:]
        line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
        done = json.loads(line[len("RESULT "):])
        record = json.load(open(os.path.join(done["run"], "run.json")))
        sizes = [a["size"] for a in record["attempts"]]
        assert sizes == [3, 2, 3], record["attempts"]
        resizes = record["resizes"]
        assert (resizes[0]["from"], resizes[0]["to"]) == (3, 2)
        assert "decommissioned" in resizes[0]["why"], resizes[0]
        assert (resizes[1]["from"], resizes[1]["to"]) == (2, 3) and "growing" in resizes[1]["why"]
        assert done["result"] == {"world": 3, "change": [2, 3]}
        logs = et.read_logs(logs_dir)
        assert {r["world"] for r in logs[1].values()} == {(3, 2)}
        step = int(record["attempts"][0]["preempted"]["checkpoint"].split("-")[-1][:-3])
        epoch = int(record["attempts"][0]["preempted"]["checkpoint"].split("-")[1])
        for rank, entry in logs[0].items():
            last = max(s for e, s, _ in entry["steps"] if e == epoch)
            assert last - step <= 1, f"rank {rank} redid steps {step + 1}..{last}"
        for epoch in range(2):
            _once_each(logs, epoch, n, 4)
    finally:
        cluster.stop()


def test_a_run_on_a_local_master_grows_back_when_another_job_gives_its_slot_back(spark,
                                                                                 tmp_path):
    """A notebook on one large machine: local[2], np=2, min_np=1. Another job takes a slot as
    rank 1 dies: the run goes on with 1 rank; when the job ends, the run sees the free slot
    (resize_check_s=3) and grows back to 2 at its next step. Then rank 1 of the grown attempt
    is SIGKILLed: the relaunch resumes from a checkpoint the grown attempt wrote (not one from
    before the grow), redoing at most every_steps steps. Every id of each epoch once, as many
    as a run that never resized trains (the steps each loss took since its checkpoint are
    trained again, not counted twice). The checkpoints go to an ``abfss://`` folder
    (Azurite), so rank 0 keeps a host copy: the run resumes at another np from it, the data's
    position continuing. The relaunches read rows the attempts before them read from the
    host, and what the ranks kept there is gone when the run is."""
    store = conftest.Azurite.start(str(tmp_path / "azurite"))
    try:
        store.make_container("ckpt")
        _grow_back(spark, tmp_path, store)
    finally:
        store.stop()


def _grow_back(spark, tmp_path, store):
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    sc = spark.sparkContext

    def lose_rank_1_to_another_job():
        def rank_1_pid():
            rank1 = et.read_logs(logs_dir).get(0, {}).get(1)
            return rank1["pid"] if rank1 and len(rank1["steps"]) >= 3 else None

        _when(rank_1_pid, "rank 1 mid-epoch")
        # another job waits for a slot (Spark's FIFO: the first slot freed is its own) ...
        threading.Thread(target=lambda: _hold_one_slot(sc), daemon=True).start()
        _when(lambda: busy_slots(sc)[0] >= 3, "the other job to wait for a slot")  # 2 ranks + it
        os.kill(rank_1_pid(), signal.SIGKILL)  # ... and gets rank 1's
        _when(lambda: len(et.read_logs(logs_dir).get(1, {})) == 1, "the run at 1 rank")
        _when(lambda: et.read_logs(logs_dir)[1][0]["steps"], "a step at 1 rank")
        sc.cancelJobGroup("elastic-test-blocker")

        def grown_rank_1_pid():
            rank1 = et.read_logs(logs_dir).get(2, {}).get(1)
            return rank1["pid"] if rank1 and len(rank1["steps"]) >= 3 else None

        _when(grown_rank_1_pid, "rank 1 three steps into the grown attempt")
        os.kill(grown_rank_1_pid(), signal.SIGKILL)

    thread = threading.Thread(target=lose_rank_1_to_another_job, daemon=True)
    with DataFrameDataset(_frame(spark), ["x", "id"], "y") as ds:
        runner = HorovodRunner(np=2, min_np=1, max_np=2, resize_check_s=3, spark=spark,
                               backend="torch", output_dir=str(tmp_path / "r"),
                               env={row_group_cache.DIR_ENV: str(tmp_path / "rows")})
        thread.start()
        try:
            runner.run(et.train_ids, data=ds, epochs=3, log_dir=str(logs_dir), every_steps=2,
                       step_s=[0.1, 0.25, 0.15, 0.05], url=store.url("ckpt", "grow"),
                       storage_options=store.options())
        finally:  # a failed run must not leave the other job holding a slot for later tests
            sc.cancelJobGroup("elastic-test-blocker")
    thread.join(5)
    record = runner.last_run_dir.record
    attempts = record["attempts"]
    assert [a["size"] for a in attempts][:3] == [2, 1, 2] and len(attempts) >= 4, attempts
    assert record["resume"]["copy"] == "host", record["resume"]  # not Azurite
    grow = record["resizes"][1]
    assert (grow["from"], grow["to"]) == (1, 2) and "slot(s) free" in grow["why"], grow
    logs = et.read_logs(logs_dir)
    grown = min((e, s) for entry in logs[2].values() for e, s, _ in entry["steps"])
    restored = _progress(attempts[3]["restored"])
    assert restored >= grown, f"the relaunch rolled back to {restored}, before the grow"
    for entry in logs[2].values():
        last = max((e, s) for e, s, _ in entry["steps"])
        assert last[0] > restored[0] or last[1] - restored[1] <= 2, \
            f"steps {restored} to {last} redone: more than every_steps=2"
    for attempt in range(1, len(attempts)):  # what each loss took is trained again after it
        if attempt - 1 in logs and attempts[attempt].get("restored"):
            _cut_at(logs, attempt - 1, attempts[attempt]["restored"].rsplit("/", 1)[-1])
    for epoch in range(3):
        _once_each(logs, epoch, N, 4)
    # the relaunches read rows the attempts before had read from this host, not the files; and
    # what the ranks kept there went when the function returned
    assert any(entry.get("read", (0, 0))[1] > 0 for attempt in range(1, len(attempts))
               for entry in logs.get(attempt, {}).values()), "no row read from the host"
    kept = tmp_path / "rows" / f"sparkhvd-row-groups-{os.getuid()}"
    assert not (kept / runner.last_run_dir.run_id).exists(), list(kept.rglob("*"))


def _progress(checkpoint):
    """``(epoch, step)`` a checkpoint file continues from: ``epoch-000E-step-K.pt`` -> (E, K),
    ``epoch-000E.pt`` (after E epochs) -> (E, 0)."""
    name = checkpoint.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return int(name.split("-")[1]), int(name.rsplit("-", 1)[1]) if "-step-" in name else 0


@pytest.mark.parametrize("client", ["hf", "lightning"])
def test_hf_and_lightning_resume_their_own_checkpoints_through_a_resize(
        spark, tmp_path, client, request, monkeypatch):
    """np=2, min_np=1 while another job holds one of local[2]'s slots: the run starts with 1
    rank. Mid-run the other job ends and rank 0 is killed: the run relaunches with 2 ranks
    (a resize), and the library resumes from its own checkpoints in the run folder (the one
    line each needs) -- finishing its steps once, at the new size. The resize is in run.json
    and (Lightning's run) in MLflow, on a real tracking server."""
    tracking = None
    if client == "lightning":
        tracking = request.getfixturevalue("mlflow_server")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    logs = tmp_path / "logs"
    logs.mkdir()
    sc = spark.sparkContext
    blocker = threading.Thread(target=lambda: _hold_one_slot(sc), daemon=True)
    blocker.start()
    _when(lambda: _running_tasks(sc) >= 1, "the other job to hold a slot")

    def kill_mid_run():
        _when(lambda: len(et.read_steps(logs)) >= 4, f"{client} mid-run")
        sc.cancelJobGroup("elastic-test-blocker")
        _when(lambda: _running_tasks(sc) == 1, "the other job to end")  # our one rank's task
        pid = next(int(f.split("-")[2]) for f in os.listdir(logs)
                   if f.startswith(f"{client}-0-"))
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill_mid_run, daemon=True)
    fn = et.hf_elastic if client == "hf" else et.lightning_elastic
    runner = HorovodRunner(np=2, min_np=1, max_np=2, spark=spark, backend="torch",
                           output_dir=str(tmp_path / "r"), mlflow="elastic" if tracking else None)
    thread.start()
    try:
        result = runner.run(fn, log_dir=str(logs), hold_from=4)
    finally:  # a failed run must not leave the other job holding a slot for later tests
        sc.cancelJobGroup("elastic-test-blocker")
    thread.join(5)
    record = runner.last_run_dir.record
    assert [a["size"] for a in record["attempts"]] == [1, 2], record["attempts"]
    assert record["attempts"][1]["resumed_by"] == "library", record["attempts"][1]
    assert (record["resizes"][0]["from"], record["resizes"][0]["to"]) == (1, 2)
    assert result == {"world": 2, "step": 12}
    steps = et.read_steps(logs)
    first_at_two = next(i for i, (_, world) in enumerate(steps) if world == 2)
    assert steps[first_at_two][0] > 2, "it resumed from a checkpoint, not from the start"
    assert [s for s, _ in steps[first_at_two:]] == list(range(steps[first_at_two][0], 13))
    # the library's loop sampled, unchanged, and its DDP's wait timed inside backward()
    split = record["time_split"]["ranks"]
    assert set(split) == {"0", "1"}, split
    for r in split.values():
        assert abs(sum(r["share"].values()) - 1) < 0.01 and r["seconds"]["compute"] > 0, r
        assert r["waits_measured"] == ["ddp"] and r["steps_measured"] > 0, r
    if tracking:
        from mlflow.tracking import MlflowClient

        mlflow = MlflowClient(tracking)
        run_id = record["mlflow"]["run_id"]
        sizes = [(m.step, m.value) for m in mlflow.get_metric_history(run_id, "world_size")]
        assert sorted(sizes) == [(1, 1.0), (2, 2.0)]
        tag = mlflow.get_run(run_id).data.tags["sparkhvd.resize1"]
        assert tag.startswith("1 -> 2: ") and "killed by signal 9" in tag, tag
        # every rank's system metrics in MLflow's own shape; the report among the artifacts
        metrics = mlflow.get_run(run_id).data.metrics
        assert {"system/rank_0/cpu_utilization_percentage",
                "system/rank_1/rss_megabytes"} <= set(metrics), sorted(metrics)
        assert "report.html" in {a.path for a in mlflow.list_artifacts(run_id)}


def _hold_one_slot(sc):
    import time as _time

    sc.setJobGroup("elastic-test-blocker", "holds a slot", interruptOnCancel=True)
    try:
        sc.parallelize([0], 1).foreach(lambda _: _time.sleep(600))
    except Exception:  # noqa: BLE001 - cancelled by the test
        pass


def _running_tasks(sc):
    tracker = sc.statusTracker()
    return sum(getattr(tracker.getStageInfo(s), "numActiveTasks", 0) or 0
               for j in tracker.getActiveJobsIds() if tracker.getJobInfo(j)
               for s in tracker.getJobInfo(j).stageIds)
