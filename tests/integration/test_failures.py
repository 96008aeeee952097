"""Failure matrix on real Spark and local ranks: clear errors, no hangs, no orphans, session usable.

After each failure, no rank process the run started may be alive (PIDs from the run's run.json).
"""
import os
import signal
import threading
import time

import pytest

from conftest import assert_no_rank_left
from sparkhvd import HorovodRunner, TrainingError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


#: Every way a Spark run starts (the ``how`` fixture's params).
HOWS = [
    pytest.param({"launcher": "barrier"}, id="barrier", marks=pytest.mark.horovod),
    pytest.param({"launcher": "horovod"}, id="horovod", marks=pytest.mark.horovod),
    pytest.param({"backend": "tf"}, id="tf", marks=pytest.mark.tf_backend),
    pytest.param({"backend": "tf", "session": "connect"}, id="tf-connect",
                 marks=pytest.mark.connect),
    pytest.param({"backend": "torch"}, id="torch", marks=pytest.mark.torch_backend),
    pytest.param({"backend": "torch", "session": "connect"}, id="torch-connect",
                 marks=pytest.mark.torch_backend)]


@pytest.fixture(params=HOWS)
def how(request):
    """Every way a Spark run starts: barrier and horovod launchers, the tf and torch backends, and
    a Spark Connect session. The runner's keyword arguments, the session (``spark``) included."""
    kwargs = dict(request.param)
    kwargs["spark"] = request.getfixturevalue(kwargs.pop("session", "spark"))
    return kwargs


def _session_works(tmp_path, how):
    assert HorovodRunner(np=2, output_dir=str(tmp_path), **how).run(lambda: "ok") == "ok"
    from sparkhvd.spark.sparkview import is_connect

    if not is_connect(how["spark"]):  # a Connect client sees no job tracker
        assert how["spark"].sparkContext.statusTracker().getActiveJobsIds() == []


@pytest.mark.parametrize("death,code", [("exit", 3), ("sigkill", -9)])
def test_rank_process_dies(how, tmp_path, death, code):
    def dies(death):
        import os
        import signal
        import time

        if os.environ.get("SPARKHVD_RANK", os.environ.get("HOROVOD_RANK")) == "1":
            if death == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    runner = HorovodRunner(np=2, output_dir=str(tmp_path), **how)
    with pytest.raises(TrainingError) as info:  # the module's timeout is the hang guard
        runner.run(dies, death=death)
    err = info.value
    assert err.rank == 1 and err.exc_type is None
    assert err.exit_code in (code, 128 - code if code < 0 else code, 137 if code == -9 else code)
    assert ("signal 9" in str(err)) if death == "sigkill" else ("status 3" in str(err))
    assert_no_rank_left(runner)
    _session_works(tmp_path, how)


@pytest.mark.parametrize("how", [how for how in HOWS if how.id not in ("barrier", "horovod", "torch")],
                         indirect=True)
def test_hanging_rank_times_out(how, tmp_path):
    """The launchers' and classic torch's timeouts are tested by the hang tests that name where
    each rank is (test_stacks_and_retries.py, test_torch.py); here the tf backend's and Spark
    Connect's."""
    def hangs():
        import time

        time.sleep(3600)

    # The limit counts from the call (the first run's checks of the workers' Python included):
    # long enough for the ranks to start on a busy machine, so that their end is checked.
    runner = HorovodRunner(np=2, output_dir=str(tmp_path), **how)
    with pytest.raises(TimeoutError, match="did not finish within 20 s"):
        runner.run(hangs, timeout=20)
    record = assert_no_rank_left(runner)
    assert record["status"] == "timed out"
    _session_works(tmp_path, how)


@pytest.mark.timeout(150)
def test_healthy_ranks_are_aborted_when_one_fails(how, tmp_path):
    """Rank 1 raises once rank 0 runs; rank 0 would sleep 10 minutes, then write a marker. The
    run must end (the 150 s hang guard fails it otherwise), rank 0's process must be gone, the
    marker never written."""
    marker = tmp_path / "rank0-finished"

    def one_fails(marker):
        import os
        import time

        started = marker + ".started"
        if os.environ.get("SPARKHVD_RANK", os.environ.get("HOROVOD_RANK")) == "1":
            deadline = time.monotonic() + 100  # rank 0's start is slow on a loaded machine
            while not os.path.exists(started) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise ValueError("rank 1 fails")
        open(started, "w").close()
        time.sleep(600)
        open(marker, "w").write("rank 0 was never stopped")

    runner = HorovodRunner(np=2, output_dir=str(tmp_path), **how)
    with pytest.raises(TrainingError, match="rank 1 fails"):
        runner.run(one_fails, marker=str(marker))
    record = assert_no_rank_left(runner)
    assert "0" in {str(k) for k in record["rank_pids"]}
    assert not marker.exists()


def test_driver_interrupt_cancels_everything(how, tmp_path, rank_lines):
    def hangs():
        import time

        print("started", flush=True)
        time.sleep(3600)

    def interrupt_when_started():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("started" in l for l in rank_lines):
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # what a notebook's stop button does

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    runner = HorovodRunner(np=2, output_dir=str(tmp_path), **how)
    with pytest.raises(KeyboardInterrupt):
        runner.run(hangs)
    record = assert_no_rank_left(runner)
    assert record["status"] == "interrupted"
    _session_works(tmp_path, how)


@pytest.mark.parametrize("backend", [pytest.param("horovod", marks=pytest.mark.horovod),
                                     pytest.param("tf", marks=pytest.mark.tf_backend),
                                     pytest.param("torch", marks=pytest.mark.torch_backend)])
def test_local_ranks_timeout_and_interrupt_leave_nothing(tmp_path, backend):
    def hangs():
        import time

        time.sleep(3600)

    runner = HorovodRunner(np=-2, output_dir=str(tmp_path), backend=backend)
    with pytest.raises(TimeoutError):
        runner.run(hangs, timeout=10)
    assert_no_rank_left(runner)
    assert runner.run(lambda: 5) == 5
