"""HorovodRunner on real local-mode Spark (local[2]) with real horovod/Gloo ranks."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import wait_for
from sparkhvd import HorovodRunner, NotEnoughSlotsError, PayloadError, TrainingError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

WEIGHTS = np.linspace(0, 1, 11)


class Config:
    def __init__(self, base):
        self.base = base


def test_closures_globals_numpy_and_instances(spark, tmp_path):
    offset = 100
    square = lambda v: v * v  # noqa: E731

    def train(cfg, extra):
        import os

        rank = int(os.environ["HOROVOD_RANK"])
        return {"rank": rank, "value": square(cfg.base) + offset + float(WEIGHTS.sum()) + extra,
                "threads": os.environ.get("TF_NUM_INTRAOP_THREADS")}

    results = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run_all(
        train, cfg=Config(3), extra=np.float64(0.5))
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["value"] == pytest.approx(9 + 100 + 5.5 + 0.5)
    assert results[0]["threads"] == "1"  # 2 local ranks share the 2 cores of local[2]


def test_plain_horovod_code_runs_unchanged(spark, launcher, tmp_path):
    """Seed-004 style: the function does its own hvd.init() and collective ops."""
    def train_hvd():
        import horovod.tensorflow.keras as hvd
        import tensorflow as tf

        hvd.init()
        total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
        return hvd.size(), float(total.numpy())

    assert HorovodRunner(np=2, spark=spark, launcher=launcher,
                         output_dir=str(tmp_path)).run(train_hvd) == (2, 3.0)


def test_rank_error_is_training_error_and_session_stays_usable(spark, launcher, tmp_path,
                                                              rank_lines):
    def fails_on_rank_1():
        import os
        import time

        if os.environ["HOROVOD_RANK"] == "1":
            raise ValueError("bad shard on rank 1")
        time.sleep(30)  # rank 0 would wait; the launcher must stop it

    runner = HorovodRunner(np=2, spark=spark, launcher=launcher, output_dir=str(tmp_path))
    with pytest.raises(TrainingError) as info:
        runner.run(fails_on_rank_1)
    err = info.value
    assert (err.rank, err.exc_type, err.remote_message) == (1, "ValueError", "bad shard on rank 1")
    assert "fails_on_rank_1" in err.remote_traceback
    assert err.host and str(err).startswith(
        f"Training failed on rank 1 (host {err.host}): ValueError: bad shard on rank 1")
    record = json.loads(open(os.path.join(runner.last_run_dir.path, "run.json")).read())
    assert record["status"] == "failed" and record["error"]["type"] == "TrainingError"
    assert any(line.startswith("[rank 1] ValueError: bad shard") for line in rank_lines)
    # the session is still usable
    assert runner.run(lambda: "again") == "again"


def test_large_return_value(spark, tmp_path):
    def big():
        import os

        return os.urandom(1) * 0 + bytes(range(256)) * (100 * 2**20 // 256 + 1)

    data = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run(big)
    assert len(data) >= 100 * 2**20
    expected = bytes(range(256)) * (100 * 2**20 // 256 + 1)
    assert hashlib.sha256(data).digest() == hashlib.sha256(expected).digest()


def test_logs_are_rank_prefixed_and_kept_per_rank(spark, tmp_path, rank_lines):
    def chatty():
        import os
        import sys

        rank = os.environ["HOROVOD_RANK"]
        print(f"hello from {rank}")
        print(f"note on stderr from {rank}", file=sys.stderr)

    runner = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path))
    runner.run(chatty)
    assert "[rank 0] hello from 0" in rank_lines
    assert "[rank 0] note on stderr from 0" in rank_lines
    assert not any(line.startswith("[rank 1]") for line in rank_lines), "rank0 verbosity"
    logs = runner.last_run_dir.logs
    assert "hello from 1" in open(os.path.join(logs, "rank-1.log")).read()
    assert "hello from 0" in open(os.path.join(logs, "rank-0.log")).read()

    rank_lines.clear()
    HorovodRunner(np=2, spark=spark, driver_log_verbosity="all",
                  output_dir=str(tmp_path)).run(chatty)
    assert "[rank 1] hello from 1" in rank_lines and "[rank 0] hello from 0" in rank_lines


@pytest.mark.timeout(60)  # the hang guard: horovod itself would wait 600 s
def test_np_above_slots_fails_in_seconds(spark, tmp_path):
    with pytest.raises(NotEnoughSlotsError, match=r"np=3 needs 3 .* has 2"):
        HorovodRunner(np=3, spark=spark, output_dir=str(tmp_path)).run(lambda: None)


def test_spark_objects_refused_before_any_job(spark, tmp_path):
    tracker = spark.sparkContext.statusTracker()
    jobs_before = set(tracker.getJobIdsForGroup(None))
    df = spark.range(3)
    with pytest.raises(PayloadError) as info:
        HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run(lambda df: None, df=df)
    assert "argument 'df'" in str(info.value) and "DataFrameDataset" in str(info.value)

    def uses_session():
        return spark.range(1).count()

    with pytest.raises(PayloadError, match="closure variable 'spark'"):
        HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path)).run(uses_session)
    assert set(tracker.getJobIdsForGroup(None)) == jobs_before


def test_run_record(spark, launcher, tmp_path):
    runner = HorovodRunner(np=2, spark=spark, launcher=launcher, output_dir=str(tmp_path))
    assert runner.run(lambda: b"\x89HDF\r\n\x1a\nfake-model") == b"\x89HDF\r\n\x1a\nfake-model"
    run_dir = runner.last_run_dir
    record = json.loads(open(run_dir.file("run.json")).read())
    assert record["status"] == "succeeded" and record["np"] == 2
    assert record["spark_master"] == "local[2]" and record["model"] == "model.h5"
    assert record["versions"]["horovod"] == "0.28.1"
    assert {"launch", "finished", "total"} <= set(record["timings"])
    assert record["launcher"] == launcher
    assert open(run_dir.file("model.h5"), "rb").read().endswith(b"fake-model")


def test_rank_output_reaches_the_driver_while_the_rank_runs(spark, launcher, tmp_path,
                                                           rank_lines):
    """Rank 0 waits for a file that the driver creates only after seeing rank 0's line."""
    import logging

    from sparkhvd.driver.logs import rank_logger

    flag = tmp_path / "go"

    class CreateFlag(logging.Handler):
        def emit(self, record):
            if "waiting for the driver" in record.getMessage():
                flag.write_text("seen")

    handler = CreateFlag()
    rank_logger.addHandler(handler)

    def wait_for_driver(flag):
        import os
        import time

        if os.environ["HOROVOD_RANK"] != "0":
            return None
        print("waiting for the driver", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.path.exists(flag):
            time.sleep(0.1)
        return os.path.exists(flag)

    try:
        seen = HorovodRunner(np=2, spark=spark, launcher=launcher,
                             output_dir=str(tmp_path / "runs")).run(
            wait_for_driver, flag=str(flag))
    finally:
        rank_logger.removeHandler(handler)
    assert seen is True, "the line reached the driver only after the rank finished"


def test_stopped_session_is_named_before_and_during_a_run(tmp_path):
    """In a separate driver process: the shared test session must stay alive."""
    script = tmp_path / "stop_session.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time, sys
        from sparkhvd import HorovodRunner, SessionError
        from sparkhvd.spark.session import get_or_create_session

        spark = get_or_create_session(2)
        spark.stop()
        try:
            HorovodRunner(np=2, spark=spark, output_dir={str(tmp_path)!r}).run(lambda: 1)
        except SessionError as exc:
            print("BEFORE:", exc)
        spark = get_or_create_session(2)

        started = {str(tmp_path / "started")!r}

        def hangs(started):
            import time
            open(started, "w").close()
            time.sleep(600)

        def stop_once_the_ranks_run():
            import os
            while not os.path.exists(started):
                time.sleep(0.05)
            spark.stop()

        threading.Thread(target=stop_once_the_ranks_run, daemon=True).start()
        try:
            HorovodRunner(np=2, spark=spark, output_dir={str(tmp_path)!r}).run(hangs,
                                                                            started=started)
        except SessionError as exc:
            print("DURING:", exc)
        except BaseException as exc:
            print("OTHER:", type(exc).__name__, exc)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240)
    assert "BEFORE: The SparkSession was stopped before the run" in out.stdout, out.stderr[-3000:]
    assert "spark=None" in out.stdout
    assert "DURING: The SparkSession was stopped while the ranks ran" in out.stdout, \
        out.stdout + out.stderr[-3000:]


# -- other jobs hold the task slots -----------------------------------------------------------
class _SlotHolder:
    """Another Spark job holding ``tasks`` task slots of the session (both, by default) until
    released (as a second notebook on a shared cluster does); ``wait``: until its tasks run."""

    def __init__(self, spark, tmp_path, tasks=2, name="holds the slots", wait=True):
        import threading

        self.spark, self.release = spark, str(tmp_path / f"release-{name.replace(' ', '-')}")
        release = self.release

        def hold(_):
            import os
            import time

            while not os.path.exists(release):
                time.sleep(0.05)
            yield 1

        def run():
            spark.sparkContext.setJobGroup(name.replace(" ", "-"), name)
            spark.sparkContext.parallelize(range(tasks), tasks).mapPartitions(hold).collect()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        tracker = spark.sparkContext.statusTracker()
        assert not wait or wait_for(lambda: sum(
            tracker.getStageInfo(s).numActiveTasks for s in tracker.getActiveStageIds()
            if tracker.getStageInfo(s) is not None) == tasks, 60), \
            "the holder's tasks never started"

    def free(self, alone=True):
        """Release the slots: True once its job ended (``alone``: and no job at all is left)."""
        open(self.release, "w").close()
        self.thread.join(60)
        tracker = self.spark.sparkContext.statusTracker()
        # Had the run's barrier job stayed queued, it would start now and show up here.
        return not self.thread.is_alive() and (
            not alone or wait_for(lambda: not tracker.getActiveJobsIds(), 60))


def test_a_job_waiting_for_a_slot_is_counted_as_holding_the_next_one_freed(spark, tmp_path):
    """Spark's FIFO scheduler gives a freed slot to the job that waited for it first: the slot
    count an elastic run places or grows by counts another job's task still waiting as holding
    one. Counted free, the slot a lost attempt frees would get a barrier stage that waits
    behind that job until start_timeout."""
    from sparkhvd.spark.slots import busy_slots, free_slots
    from sparkhvd.spark.sparkview import SparkView

    sc, view = spark.sparkContext, SparkView(spark)
    holder = _SlotHolder(spark, tmp_path)  # both of local[2]'s slots
    waiter = _SlotHolder(spark, tmp_path, tasks=1, name="waits for a slot", wait=False)
    try:
        assert wait_for(lambda: busy_slots(sc)[0] == 3, 60), busy_slots(sc)
        assert free_slots(view) == 0
        assert any("'waits for a slot' (0 task(s), 1 waiting for a slot)" in job
                   for job in busy_slots(sc)[1]), busy_slots(sc)
    finally:
        assert holder.free(alone=False)
    try:
        assert wait_for(lambda: busy_slots(sc)[0] == 1, 60), busy_slots(sc)  # it runs now
        assert free_slots(view) == 1
    finally:
        assert waiter.free()


def _marks(marker):
    def train():
        with open(marker, "a") as f:
            f.write("ran\n")
        return 1

    return train


@pytest.mark.every_profile
def test_busy_slots_fail_in_start_timeout_naming_the_jobs(spark, tmp_path, backend):
    """Other jobs hold every slot: the run waits start_timeout for free slots, then says which
    jobs hold how many of how many -- and its function never runs."""
    import time

    marker = tmp_path / "ran"
    holder = _SlotHolder(spark, tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(NotEnoughSlotsError) as info:
            HorovodRunner(np=2, spark=spark, backend=backend, start_timeout=10,
                          output_dir=str(tmp_path / "runs")).run(_marks(str(marker)))
        took = time.monotonic() - started
    finally:
        assert holder.free()
    message = str(info.value)
    assert "2 of the session's 2" in message and "'holds the slots'" in message, message
    assert took <= 15, f"raised after {took:.1f} s"
    assert not marker.exists()


@pytest.mark.every_profile
def test_a_run_that_did_not_start_is_cancelled_and_never_runs(spark, tmp_path, backend,
                                                               monkeypatch):
    """The slots were free when checked but taken before the barrier stage started (a race the
    check cannot close): after start_timeout the run's job is cancelled -- found by the tag
    run.json names -- and its function never runs, not even once the slots are free."""
    import time

    import sparkhvd.spark.slots as slots

    monkeypatch.setattr(slots, "busy_slots", lambda sc, ignore=frozenset(): (0, []))
    marker = tmp_path / "ran"
    holder = _SlotHolder(spark, tmp_path)
    runner = HorovodRunner(np=2, spark=spark, backend=backend, start_timeout=10,
                           output_dir=str(tmp_path / "runs"))
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="start_timeout=10 s.*none of its tasks will run"):
            runner.run(_marks(str(marker)))
        took = time.monotonic() - started
    finally:
        assert holder.free(), "the run's job is still there"
    assert took <= 15, f"raised after {took:.1f} s"
    assert not marker.exists(), "the function ran after run() had given up"
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert record["spark_job"]["name"].startswith(f"sparkhvd-{record['run_id']}-")
    assert record["status"] == "timed out"
