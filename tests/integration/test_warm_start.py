"""Warm starts (sparkhvd.common.warmstart, sparkhvd.rank.warm_server): after a run, an executor
keeps a process that imported torch; the next run's ranks are forked from it -- each with its
own environment, no state of an earlier run's function -- and it ends with its executor, its
idle limit or by PID. Runs in the modern profile (torch)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from conftest import wait_for
from sparkhvd import SparkRunner, TrainingError
from sparkhvd.common import warmstart

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch_backend, pytest.mark.timeout(300)]


def _probe(mark):
    """What a rank sees before and after it imports torch."""
    import os
    import sys

    at_entry = "torch" in sys.modules
    import psutil
    import torch
    import torch.distributed as dist

    seen = getattr(torch, "_warm_test_mark", None)
    if mark:
        torch._warm_test_mark = os.getpid()  # never seen by a later rank
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)  # the ranks still rendezvous and reduce
    dist.destroy_process_group()
    supervisor = psutil.Process().parent()
    return {"torch_at_entry": at_entry, "seen": seen, "pid": os.getpid(),
            "env": sorted(os.environ), "sum": float(total[0]), "path0": sys.path[0],
            "cwd": os.getcwd(),
            "server": supervisor.parent().pid if supervisor.parent() else None}


def _torch_servers():
    import psutil

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    return [s for s in warmstart.servers() if s["backend"] == "torch" and s["watch"] in mine]


def test_the_next_run_starts_its_ranks_with_torch_imported_and_nothing_of_the_last(spark,
                                                                                   tmp_path):
    first = SparkRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path),
                        env={"WARM_TEST_FIRST": "1"}).run_all(_probe, mark=True)
    assert [r["sum"] for r in first] == [2.0, 2.0]
    assert wait_for(_torch_servers, 120), warmstart.servers()  # left for the next run
    servers = {s["pid"] for s in _torch_servers()}
    second = SparkRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path),
                         env={"WARM_TEST_SECOND": "1"}).run_all(_probe, mark=False)
    for rank in second:
        assert rank["torch_at_entry"], rank  # no import on the critical path
        assert rank["server"] in servers  # forked from this executor's warm process
        assert rank["seen"] is None  # the first run's module state stayed in its ranks
        assert "WARM_TEST_SECOND" in rank["env"] and "WARM_TEST_FIRST" not in rank["env"]
        assert rank["sum"] == 2.0
    assert {r["pid"] for r in second}.isdisjoint(r["pid"] for r in first)
    cold = SparkRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path),
                       warm_start=False).run_all(_probe, mark=False)
    assert not any(r["torch_at_entry"] for r in cold)  # turned off: fresh processes
    # where a fresh rank finds modules first (python -m: its folder), a warm one does too
    assert [(r["path0"], r["cwd"]) for r in second] == [(r["path0"], r["cwd"]) for r in cold]


def _fails():
    import os
    import sys

    if int(os.environ["RANK"]) == 1:
        print("warm rank 1 says why", file=sys.stderr)
        raise ValueError("rank 1 failed on purpose")
    return "torch" in sys.modules


def test_a_warm_ranks_output_and_error_reach_the_driver(spark, tmp_path, rank_lines):
    SparkRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path)).run(_probe,
                                                                                  mark=False)
    assert wait_for(_torch_servers, 120), warmstart.servers()
    runner = SparkRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path),
                         driver_log_verbosity="all")
    with pytest.raises(TrainingError, match="rank 1 failed on purpose"):
        runner.run(_fails)
    assert any("warm rank 1 says why" in line for line in rank_lines)


@pytest.fixture
def short_dir():
    """A folder whose path leaves room for a Unix socket's name (at most 107 bytes)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="shvd-", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _server(tmp_path, watch, idle_s=600.0, backend="torch"):
    """A server started as an executor's rank would leave it (the test ends it by PID)."""
    path = str(tmp_path / "s.sock")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-m", "sparkhvd.rank.warm_server", path, str(watch),
                    str(idle_s), backend], env=env, check=True, timeout=60)
    assert wait_for(lambda: os.path.exists(path + ".json") or os.path.exists(path + ".refused"),
                    60)
    assert not os.path.exists(path + ".refused"), open(path + ".refused").read()
    with open(path + ".json") as f:
        return path, json.load(f)["pid"]


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_server_ends_with_the_process_it_serves_and_after_its_idle_limit(short_dir):
    tmp_path = short_dir
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (tmp_path / "a").mkdir()
    try:
        path, pid = _server(tmp_path / "a", watched.pid)
        watched.kill()  # the executor is gone: its server goes with it
        watched.wait()
        assert wait_for(lambda: _gone(pid), 30)
        assert not os.path.exists(path) and not os.path.exists(path + ".json")
    finally:
        watched.kill()
    (tmp_path / "b").mkdir()
    path, pid = _server(tmp_path / "b", os.getpid(), idle_s=1.0)
    assert wait_for(lambda: _gone(pid), 30)  # nothing asked of it for a second
    assert not os.path.exists(path)


def test_a_rank_whose_task_was_killed_ends_with_it(short_dir):
    """The task that asked for a rank is SIGKILLed: the server ends the rank, as a fresh rank
    would end through its parent-death signal."""
    tmp_path = short_dir
    (tmp_path / "s").mkdir()
    path, server = _server(tmp_path / "s", os.getpid())
    script = f"""
import os, sys, time
from sparkhvd.common import warmstart, protocol
from sparkhvd.driver.payload import dumps
work = {str(tmp_path)!r}
with open(os.path.join(work, "payload"), "wb") as f:
    f.write(dumps(lambda: time.sleep(600), {{}}))
r, w = os.pipe()
child = warmstart.spawn({path!r}, [os.path.join(work, "payload"), work, "{{}}"],
                        {{**os.environ, "SPARKHVD_RANK": "0"}}, w, protocol.EVENTS_FD_ENV)
print(child.pid, flush=True)
time.sleep(600)
"""
    task = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        supervisor = int(task.stdout.readline())
        assert not _gone(supervisor)
        task.kill()
        task.wait()
        assert wait_for(lambda: _gone(supervisor), 30)
    finally:
        task.kill()
        os.kill(server, signal.SIGTERM)
    assert wait_for(lambda: _gone(server), 30)


def test_a_warm_ranks_exit_status_is_the_same_to_every_thread_that_asks(short_dir):
    """A task's loop waits on its rank while its driver-watching thread polls it (a notice, a
    stack request): both read the rank's own status (75: preempted), never a made-up one."""
    import threading

    from sparkhvd.common import protocol
    from sparkhvd.driver.payload import dumps

    tmp_path = short_dir
    path, server = _server(tmp_path, os.getpid())
    try:
        with open(tmp_path / "payload", "wb") as f:
            f.write(dumps(_exits_preempted, {}))
        read, write = os.pipe()
        child = warmstart.spawn(path, [str(tmp_path / "payload"), str(tmp_path), "{}"],
                                {**os.environ, "SPARKHVD_RANK": "0"}, write,
                                protocol.EVENTS_FD_ENV)
        os.close(write)
        assert child is not None
        seen = []
        pollers = [threading.Thread(target=lambda: seen.append(_poll_until_done(child)))
                   for _ in range(3)]
        for thread in pollers:
            thread.start()
        assert child.wait(60) == 75
        for thread in pollers:
            thread.join(60)
        assert seen == [75, 75, 75]
        os.close(read)
    finally:
        os.kill(server, signal.SIGTERM)


def _exits_preempted():
    raise SystemExit(75)


def _poll_until_done(child):
    while child.poll() is None:
        pass
    return child.returncode


def test_a_framework_that_leaves_a_thread_is_never_forked(tmp_path):
    """What a server checks before every fork: a second thread (TensorFlow's import leaves
    one) is named, and the server would refuse (the rank starts fresh, said once)."""
    out = subprocess.run(
        [sys.executable, "-c", "import threading, time\n"
         "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
         "from sparkhvd.rank.warm_server import unsafe_to_fork\nprint(unsafe_to_fork())"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "2 threads run in it" in out.stdout, out
    assert warmstart.say_once("x") and warmstart.say_once("x") is None
    assert warmstart.spawn(str(tmp_path / "none.sock"), [], {}, 0, "X") is None  # no server
