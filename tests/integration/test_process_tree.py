"""No process a rank started outlives the run, however it ends -- on every launcher."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import runner_for, still_alive
from sparkhvd import TrainingError

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(300)]


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


def test_children_of_a_stopped_rank_end_with_it(mode, spark_for, tmp_path):
    """Rank 1 raises while rank 0 -- which started a child -- is still busy: the run stops
    rank 0, and its child goes too (horovod's launcher used to leave it behind)."""
    pids_file = tmp_path / "children.txt"

    def busy_with_a_child(pids_file):
        import os
        import subprocess
        import time

        if os.environ["HOROVOD_RANK"] == "0":
            child = subprocess.Popen(["sleep", "600"])
            with open(pids_file, "a") as f:
                f.write(f"{child.pid}\n")
            time.sleep(600)
        while not os.path.exists(pids_file):
            time.sleep(0.05)
        raise ValueError("rank 1 gives up")

    runner = runner_for(mode, spark_for, tmp_path / "runs")
    with pytest.raises(TrainingError, match="rank 1 gives up"):
        runner.run(busy_with_a_child, pids_file=str(pids_file))
    pids = [int(p) for p in pids_file.read_text().split()]
    assert still_alive(pids, grace=5.0) == [], "rank 0's child outlived the run"


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


def test_a_supervisor_signalled_while_it_ends_the_tree_stays_quiet(tmp_path, capfd, backend):
    """The rank leaves 150 children behind and exits; its supervisor, ending them, gets
    SIGTERM after SIGTERM (a launcher aborting the run). No traceback (a handler that imported
    psutil while the interrupted code was importing it found a partial module), no child
    left."""
    marker = tmp_path / "supervisor.txt"

    def leaves_children(marker):
        import os
        import subprocess

        pids = [subprocess.Popen(["sleep", "600"]).pid for _ in range(150)]
        with open(marker + ".tmp", "w") as f:
            f.write(" ".join(map(str, [os.getppid(), os.getpid(), *pids])))
        os.rename(marker + ".tmp", marker)
        os._exit(0)

    stop = []

    def pester():  # from the moment the rank is gone: the supervisor is ending its tree
        while not marker.exists():
            time.sleep(0.001)
        supervisor, rank = (int(p) for p in marker.read_text().split()[:2])
        while os.path.exists(f"/proc/{rank}") and not stop:
            time.sleep(0.0005)
        while not stop:
            with contextlib.suppress(ProcessLookupError):
                os.kill(supervisor, signal.SIGTERM)
            time.sleep(0.001)

    import contextlib
    import threading

    from sparkhvd import HorovodRunner

    thread = threading.Thread(target=pester, daemon=True)
    thread.start()
    try:
        with contextlib.suppress(TrainingError):
            HorovodRunner(np=-1, backend=backend, output_dir=str(tmp_path / "runs")).run(
                leaves_children, marker=str(marker))
    finally:
        stop.append(True)
        thread.join(5)
    out = capfd.readouterr()
    supervisor, _, *pids = [int(p) for p in marker.read_text().split()]
    assert still_alive(pids, grace=5.0) == []
    assert "Traceback" not in out.err + out.out and "partially initialized" not in out.err
