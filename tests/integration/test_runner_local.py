"""np < 0: ranks as local processes on the driver, no Spark tasks."""
import pytest

from sparkhvd import HorovodRunner, TrainingError

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(180)]


def test_local_ranks_return_rank0_result(tmp_path):
    def train(k):
        import os

        return int(os.environ["HOROVOD_RANK"]) * 10 + k, int(os.environ["HOROVOD_SIZE"])

    runner = HorovodRunner(np=-2, output_dir=str(tmp_path))
    assert runner.run(train, k=1) == (1, 2)
    assert runner.run_all(train, k=2) == [(2, 2), (12, 2)]


def test_the_function_may_be_passed_as_fn_and_have_its_own_fn(tmp_path):
    """Databricks' HorovodRunner takes run(fn=train, np=7); a function with its own ``fn``
    parameter still gets it when passed first."""
    def train(np, scale=1):
        return np * scale

    def apply(fn, x):
        return fn + x

    runner = HorovodRunner(np=-1, output_dir=str(tmp_path))
    assert runner.run(fn=train, np=7) == 7
    assert runner.run_all(fn=train, np=2, scale=3) == [6]
    assert runner.run(apply, fn=10, x=1) == 11
    with pytest.raises(TypeError, match="missing the training function"):
        runner.run(np=7)


def test_the_backend_neutral_entry_points(tmp_path, rank_lines):
    """SparkRunner says its backend; @distributed is the decorator form; both hand back the
    run's folder, and the console says where it is."""
    import sparkhvd

    with pytest.raises(TypeError):
        sparkhvd.SparkRunner(np=-1)  # no backend: nothing about the name picks one

    def where(scale, offset=0):
        import os

        return int(os.environ.get("RANK", -1)) * scale + offset

    runner = sparkhvd.SparkRunner(np=-2, backend="torch", output_dir=str(tmp_path))
    assert runner.run(where, scale=10) == 0
    assert any(line.startswith(f"[sparkhvd] run {runner.last_run_dir.run_id}: run folder ")
               for line in rank_lines)

    @sparkhvd.distributed(np=-2, backend="torch", output_dir=str(tmp_path))
    def train(scale, offset=0):
        return where(scale, offset)

    assert train(3, offset=1) == -2  # still a plain function here (no rank: -1 * 3 + 1)
    assert train.distributed(10, offset=1) == 1
    assert train.distributed_all(10) == [0, 10]
    assert train.runner.last_run_dir.record["status"] == "succeeded"


def test_local_allreduce_with_horovod(tmp_path):
    def train():
        import horovod.tensorflow as hvd
        import tensorflow as tf

        hvd.init()
        return float(hvd.allreduce(tf.constant(float(hvd.rank())), op=hvd.Sum).numpy())

    assert HorovodRunner(np=-2, output_dir=str(tmp_path)).run(train) == 1.0


def test_local_rank_exception(tmp_path):
    def train():
        import os

        if os.environ["HOROVOD_RANK"] == "0":
            raise KeyError("missing column")
        import time
        time.sleep(30)

    with pytest.raises(TrainingError) as info:
        HorovodRunner(np=-2, output_dir=str(tmp_path)).run(train)
    assert info.value.rank == 0 and info.value.exc_type == "KeyError"


def test_local_rank_process_dies(tmp_path):
    def train():
        import os
        import time

        if os.environ["HOROVOD_RANK"] == "1":
            os._exit(3)
        time.sleep(30)

    with pytest.raises(TrainingError) as info:
        HorovodRunner(np=-2, output_dir=str(tmp_path)).run(train)
    err = info.value
    assert (err.rank, err.exit_code, err.exc_type) == (1, 3, None)
    assert "exited with status 3" in str(err)


def test_a_rank_that_crashes_says_where(tmp_path, rank_lines):
    """A rank that dies of a crash of its own (a native library's SIGSEGV) still dies of the
    signal, and says where it was: its log holds every thread's stack and the error's last
    lines the crashing function."""
    def crashes_here():
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV

    def train():
        import os
        import time

        if os.environ["HOROVOD_RANK"] == "1":
            crashes_here()
        time.sleep(30)

    with pytest.raises(TrainingError) as info:
        HorovodRunner(np=-2, output_dir=str(tmp_path)).run(train)
    err = info.value
    assert (err.rank, err.exc_type) == (1, None) and err.exit_code in (-11, 139)
    assert "signal 11" in str(err)
    assert "in crashes_here" in err.remote_traceback, err.remote_traceback
    assert any("Fatal Python error: Segmentation fault" in line for line in rank_lines)
