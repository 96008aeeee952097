"""Why is it stuck, and carrying on: every rank's stacks on timeout, stall and demand; retries.

Each test meets the feature as a user does: a run that hangs with one rank elsewhere and the
others in a collective, a silent run, `sparkhvd stacks` from another process, a rank process
killed mid-run with max_retries.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from conftest import assert_no_rank_left, runner_for, wait_for
from digits_keras import pausing_data, train_pausing
from sparkhvd import StallError

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(300)]


def load_batch():
    import time

    time.sleep(600)


def rank1_elsewhere():

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    if hvd.rank() == 1:
        load_batch()
    print("entering allreduce", flush=True)
    hvd.allreduce(tf.constant(1.0))


def test_a_timeout_names_where_each_rank_is(mode, spark_for, tmp_path):
    """rank 1 sits in load_batch(), rank 0 waits for it in allreduce: the TimeoutError says
    so, and every rank's stacks (all threads) are in logs/stacks-*.txt; no rank process is left
    and the next run runs (test_failures.py's timeout test, for the launchers)."""
    runner = runner_for(mode, spark_for, tmp_path / "runs")
    with pytest.raises(TimeoutError) as info:
        runner.run(rank1_elsewhere,
                   run_timeout=30 if mode == "horovod" else 20)
    message = str(info.value)
    assert "rank 1 is in test_stacks_and_retries.py:" in message and "load_batch()" in message, message
    assert "rank 0 waits in" in message and "allreduce" in message, message
    [stacks] = glob.glob(str(runner.last_run_dir.file("logs/stacks-*.txt")))
    text = open(stacks).read()
    assert "=== rank 0 (pid" in text and "=== rank 1 (pid" in text
    assert '"MainThread"' in text and "load_batch" in text
    record = assert_no_rank_left(runner)
    assert record["status"] == "timed out"
    assert record["stacks"] == [os.path.relpath(stacks, runner.last_run_dir.path)]
    # and the session (or the machine) runs the next run
    assert runner_for(mode, spark_for, tmp_path / "again").run(lambda: "ok") == "ok"
    if spark_for is not None:
        assert spark_for.sparkContext.statusTracker().getActiveJobsIds() == []


def silent_for_a_while(seconds):
    import time

    print("starting", flush=True)
    time.sleep(seconds)
    return "done"


def test_a_stall_warns_with_stacks_and_the_run_goes_on(tmp_path, caplog):
    from sparkhvd import HorovodRunner

    runner = HorovodRunner(np=-2, backend="tf", stall_timeout=2, output_dir=str(tmp_path))
    with caplog.at_level("WARNING", logger="sparkhvd"):
        assert runner.run(silent_for_a_while, seconds=6) == "done"
    warned = [r.getMessage() for r in caplog.records if "No rank has made progress" in r.message]
    assert len(warned) == 1, "one warning per stall"
    assert "silent_for_a_while()" in warned[0] and "goes on" in warned[0], warned[0]
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert record["status"] == "succeeded" and len(record["stacks"]) == 1

    stopping = HorovodRunner(np=-2, backend="tf", stall_timeout=2, on_stall="stop",
                             output_dir=str(tmp_path))
    with pytest.raises(StallError, match="silent_for_a_while"):
        stopping.run(silent_for_a_while, seconds=60)
    assert json.loads(open(stopping.last_run_dir.file("run.json")).read())["status"] == "stalled"


def waits_for_data(release):
    import os
    import time

    print("ready", flush=True)
    while not os.path.exists(release):
        time.sleep(0.05)
    return "released"


@pytest.mark.parametrize("how", ["cli", "python"])
def test_stacks_on_demand_while_it_runs(tmp_path, how):
    from sparkhvd import HorovodRunner

    release = tmp_path / "release"
    runner = HorovodRunner(np=-2, backend="tf", output_dir=str(tmp_path / "runs"))
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        value=runner.run(waits_for_data, release=str(release))))
    thread.start()
    try:
        def both_ready():
            logs = glob.glob(runner.last_run_dir.file("logs/rank-*.log")) \
                if runner.last_run_dir is not None else []
            return len(logs) == 2 and all("ready" in open(f).read() for f in logs)

        assert wait_for(both_ready, 60)
        if how == "cli":
            cli = os.path.join(os.path.dirname(sys.executable), "sparkhvd")
            out = subprocess.run([cli, "stacks", runner.last_run_dir.path], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            text = out.stdout
        else:
            text = runner.dump_stacks()
        assert "Summary: ranks 0, 1 are in test_stacks_and_retries.py:" in text, text[:2000]
        assert "waits_for_data()" in text and "=== rank 1 (pid" in text
    finally:
        release.write_text("go")
        thread.join(60)
    assert result["value"] == "released"
    assert glob.glob(runner.last_run_dir.file("logs/stacks-*.txt"))


# -- retries ---------------------------------------------------------------------------------------
def _paused_pid(run_dir, rank):
    """The pid rank ``rank`` printed when it paused (``pid N on HOST paused``), from its log in
    the run folder -- however its process was started (fresh, or forked warm)."""
    import re

    try:
        text = open(run_dir.file(f"logs/rank-{rank}.log")).read()
    except OSError:
        return None
    found = re.findall(r"pid (\d+) on \S+ paused", text)
    return int(found[-1]) if found else None


def test_a_killed_rank_is_retried_from_the_last_checkpoint(spark, tmp_path, rank_lines):
    """max_retries=1: rank 1's process is SIGKILLed after epoch 2's checkpoint; the run is
    relaunched, resumes at epoch 3 from its own checkpoint and ends with the weights of an
    uninterrupted run. run.json records both attempts and why."""
    import numpy as np

    from sparkhvd import HorovodRunner

    data = pausing_data()
    straight = HorovodRunner(np=2, spark=spark, backend="tf", output_dir=str(tmp_path / "a")
                             ).run(train_pausing, epochs=4, **data)
    runner = HorovodRunner(np=2, spark=spark, backend="tf", max_retries=1,
                           output_dir=str(tmp_path / "b"))
    killed = {}

    def kill_when_paused():
        assert wait_for(lambda: runner.last_run_dir is not None and any(
            "paused" in line for line in rank_lines) and
            _paused_pid(runner.last_run_dir, 1) is not None, 240)
        latest = json.loads(open(runner.last_run_dir.file("checkpoints/latest.json")).read())
        killed["epoch"] = latest["epoch"]
        os.kill(_paused_pid(runner.last_run_dir, 1), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_paused, daemon=True)
    killer.start()
    result = runner.run(train_pausing, epochs=4, pause_at=2, **data)
    killer.join(5)
    assert killed["epoch"] == 2 and result["initial_epoch"] == 2
    for a, b in zip(straight["weights"], result["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    first, second = record["attempts"]
    assert first["status"] == "failed" and "killed by signal 9" in first["retryable"]
    assert second["status"] == "succeeded" and second["resumed_from"].endswith("checkpoints")
    assert record["status"] == "succeeded" and record["resume"]["epoch"] == 2 \
        if "resume" in record else True
    log = open(runner.last_run_dir.file("logs/rank-1.log")).read()
    assert "---- attempt 2: restarting after" in log


def test_what_the_function_raises_is_not_retried(tmp_path):
    from sparkhvd import HorovodRunner, TrainingError

    runner = HorovodRunner(np=-2, backend="tf", max_retries=3, output_dir=str(tmp_path))
    with pytest.raises(TrainingError, match="bad data"):
        runner.run(_raises)
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert len(record["attempts"]) == 1 and record["attempts"][0]["retryable"] is None


def _raises():
    raise ValueError("bad data")
