"""What testing from outside found (issue 14), as a user meets it, on every launcher."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import still_alive
from sparkhvd import HorovodRunner, PayloadError, TrainingError

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(300)]

PLANTED = {"AZURE_STORAGE_ACCOUNT_KEY": "PLANTEDazureKEY0123456789==",
           "MYAPP_DB_PASSWORD": "PLANTEDdbPASSWORD42",
           "MY_API_TOKEN": "PLANTEDapiTOKEN7777"}


@pytest.fixture(params=["barrier", "horovod", "local"])
def mode(request):
    """Every way ranks start: Spark barrier stage, horovod.spark.run, local processes."""
    return request.param


def runner_for(mode, spark, tmp_path, **kw):
    if mode == "local":
        return HorovodRunner(np=-2, output_dir=str(tmp_path), **kw)
    return HorovodRunner(np=2, spark=spark, launcher=mode, output_dir=str(tmp_path), **kw)


@pytest.fixture
def spark_for(mode, request):
    return None if mode == "local" else request.getfixturevalue("spark")


def everything_written(run_dir):
    for folder, _, files in os.walk(run_dir):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                yield name, f.read().decode(errors="replace")


def test_ranks_never_see_the_drivers_secrets(mode, spark_for, tmp_path, monkeypatch, capfd):
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)

    def look():
        import os

        return sorted(os.environ)

    runner = runner_for(mode, spark_for, tmp_path, env={"GIVEN_ON_PURPOSE": "yes"})
    seen = runner.run_all(look)
    for names in seen:
        assert "GIVEN_ON_PURPOSE" in names and "PATH" in names
        assert not set(PLANTED) & set(names), f"{mode}: {set(PLANTED) & set(names)}"


def test_secret_values_are_redacted_wherever_rank_text_goes(mode, spark_for, tmp_path,
                                                            monkeypatch, capfd):
    """A rank that prints and raises with a credential's value (here: passed in on purpose)."""
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    token = PLANTED["MY_API_TOKEN"]

    def leaky(token):
        import os
        import sys

        print(f"calling the API with {token}", flush=True)
        print(f"env dump: {token}", file=sys.stderr, flush=True)
        if os.environ.get("HOROVOD_RANK") == "0":
            raise RuntimeError(f"API refused token {token}")
        import time

        time.sleep(30)

    runner = runner_for(mode, spark_for, tmp_path, driver_log_verbosity="all")
    with pytest.raises(TrainingError) as info:
        runner.run(leaky, token=token)
    err = info.value
    assert err.exc_type == "RuntimeError" and "API refused token ***" in err.remote_message
    for text in (str(err), err.remote_message, err.remote_traceback):
        assert token not in text
    out = capfd.readouterr()
    assert token not in out.out + out.err
    assert "calling the API with ***" in out.out + out.err
    for name, text in everything_written(runner.last_run_dir.path):
        assert token not in text, name


def test_children_of_a_rank_end_with_it(mode, spark_for, tmp_path):
    """A rank starts a subprocess and a multiprocessing child, then raises (rank 1) or
    returns (rank 0): run() returns, and no child is left."""
    pids_file = tmp_path / "children.txt"

    def spawns(pids_file):
        import multiprocessing
        import os
        import subprocess
        import time

        child = subprocess.Popen(["sleep", "600"])
        proc = multiprocessing.Process(target=time.sleep, args=(600,))
        proc.start()
        with open(pids_file, "a") as f:
            f.write(f"{child.pid} {proc.pid}\n")
        if os.environ["HOROVOD_RANK"] == "1":
            time.sleep(1)
            raise ValueError("rank 1 gives up")
        return "rank 0 done"

    runner = runner_for(mode, spark_for, tmp_path / "runs")
    with pytest.raises(TrainingError, match="rank 1 gives up"):
        runner.run(spawns, pids_file=str(pids_file))
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 4
    alive = still_alive(pids)
    assert not alive, f"children still alive: {alive}"
    assert runner.run(lambda: "again") == "again"


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

    def wants_timeout(timeout):
        return timeout

    with pytest.raises(PayloadError, match="run\\(\\) reserves that keyword"):
        runner.run(wants_timeout)
    assert not list(tmp_path.iterdir()), "nothing started for a bad call"


def test_stopped_session_is_named_before_and_during_a_run(tmp_path):
    """In a separate driver process: the shared test session must stay alive."""
    script = tmp_path / "stop_session.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time, sys
        from sparkhvd import HorovodRunner, SessionError
        from sparkhvd.session import get_or_create_session

        spark = get_or_create_session(2)
        spark.stop()
        try:
            HorovodRunner(np=2, spark=spark, output_dir={str(tmp_path)!r}).run(lambda: 1)
        except SessionError as exc:
            print("BEFORE:", exc)
        spark = get_or_create_session(2)

        def hangs():
            import time
            print("started", flush=True)
            time.sleep(600)

        def stop_later():
            time.sleep(8)
            spark.stop()

        threading.Thread(target=stop_later, daemon=True).start()
        try:
            HorovodRunner(np=2, spark=spark, output_dir={str(tmp_path)!r}).run(hangs)
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


def test_local_ranks_die_with_their_driver(tmp_path):
    """SIGKILL the driver of an np=-2 run: its rank processes (and their children) go too."""
    pids_file = tmp_path / "pids.txt"
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        from sparkhvd import HorovodRunner

        def hangs(pids_file):
            import os, subprocess, time
            child = subprocess.Popen(["sleep", "600"])
            with open(pids_file, "a") as f:
                f.write(f"{{os.getpid()}} {{child.pid}}\\n")
            time.sleep(600)

        HorovodRunner(np=-2, output_dir={str(tmp_path / 'runs')!r}).run(
            hangs, pids_file={str(pids_file)!r})
    """))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (
                not pids_file.exists() or len(pids_file.read_text().split()) < 4):
            time.sleep(0.2)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) == 4
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        alive = still_alive(pids)
        assert not alive, f"still alive after the driver died: {alive}"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
