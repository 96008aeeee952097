"""What goes into and comes out of a rank: arguments bound on the driver, output of any shape,
return values that cannot travel -- named, on every launcher."""
import os

import pytest

from conftest import runner_for
from sparkhvd import HorovodRunner, PayloadError, TrainingError

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(300)]


def test_binary_output_and_endless_lines(mode, spark_for, tmp_path, rank_lines):
    def noisy():
        import sys

        sys.stdout.buffer.write(b"binary: \xff\xfe\x00\x81 end\n")
        sys.stdout.buffer.write(b"x" * (20 * 1024 * 1024))  # 20 MB without a newline
        sys.stdout.buffer.write(b"\nafter\n")
        sys.stdout.flush()
        return "fine"

    runner = runner_for(mode, spark_for, tmp_path)
    assert runner.run(noisy) == "fine"
    log = open(os.path.join(runner.last_run_dir.logs, "rank-0.log")).read()
    assert "binary: \ufffd\ufffd" in log and "\nafter\n" in log
    assert "x" * (20 * 1024 * 1024) in log, "the rank log keeps the long line whole"
    cut = [line for line in rank_lines if line.startswith("[rank 0] xxxx")]
    assert cut and all(len(line) < 10_000 for line in cut) and "line cut" in cut[0]
    assert "[rank 0] after" in rank_lines


def test_unpicklable_return_value_is_named(mode, spark_for, tmp_path):
    def returns_lock():
        import threading

        return threading.Lock()

    with pytest.raises(TrainingError) as info:
        runner_for(mode, spark_for, tmp_path).run(returns_lock)
    err = info.value
    assert err.rank == 0 and err.exc_type == "PayloadError"
    assert "rank 0 returned a _thread.lock" in err.remote_message
    assert "Return bytes or plain data" in err.remote_message


def test_return_value_of_a_module_only_the_ranks_have(spark, tmp_path):
    modules = tmp_path / "executor_only"
    modules.mkdir()
    (modules / "exec_only_mod.py").write_text("class Thing:\n    pass\n")

    def returns_thing():
        import exec_only_mod

        return exec_only_mod.Thing()

    runner = HorovodRunner(np=2, spark=spark, output_dir=str(tmp_path / "runs"),
                           env={"PYTHONPATH": f"{modules}:{os.environ.get('PYTHONPATH', '')}"})
    with pytest.raises(PayloadError) as info:
        runner.run(returns_thing)
    msg = str(info.value)
    assert "rank 0 returned" in msg and "'exec_only_mod'" in msg and "install" in msg


def test_arguments_are_bound_on_the_driver(tmp_path):
    def train(epochs, lr=0.1):
        return epochs

    runner = HorovodRunner(np=-2, output_dir=str(tmp_path))
    with pytest.raises(PayloadError, match=r"unexpected keyword argument 'epoch'") as info:
        runner.run(train, epoch=3)
    assert "train(epochs, lr=0.1)" in str(info.value)
    with pytest.raises(PayloadError, match="missing a required argument: 'epochs'"):
        runner.run(train, lr=0.2)

    def wants_timeout(timeout=5):
        return timeout

    # The function has its own timeout: run(timeout=30) could mean either, so it is refused
    # with both ways to say it -- never guessed.
    with pytest.raises(PayloadError, match="ambiguous") as info:
        runner.run(wants_timeout, timeout=30)
    assert "run(wants_timeout, run_timeout=600, timeout=30)" in str(info.value)
    assert not list(tmp_path.iterdir()), "nothing started for a bad call"
    # Said explicitly, both readings work.
    assert runner.run(wants_timeout, run_timeout=60, timeout=30) == 30
    assert runner.run(wants_timeout, run_timeout=None) == 5
    # A function without a timeout parameter: timeout= is the run's limit, as it always was.
    with pytest.raises(TimeoutError):
        runner.run(_sleeps, timeout=2)


def _sleeps():
    import time

    time.sleep(60)
