"""spark-submit on a real Spark standalone cluster (master + 2 one-core workers on 127.0.0.1)."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

SPARKHVD = os.path.join(os.path.dirname(sys.executable), "sparkhvd")
JOB = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "train_digits.py")


def test_submit_digits_job_to_standalone_cluster(standalone, tmp_path):
    model = tmp_path / "out" / "model.h5"
    out = subprocess.run(
        [SPARKHVD, "submit", "--preset", "standalone-cpu", "--master", standalone.master_url,
         JOB, "--output-url", str(model), "--epochs", "15", "--runs-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-5000:])
    assert "JOB OK" in out.stdout and f"master {standalone.master_url}" in out.stdout
    assert "[rank 0] epoch 15/15" in out.stdout
    info = [line for line in out.stderr.splitlines() if " INFO " in line]
    assert len(info) < 15, "Spark's INFO lines bury the job's output:\n" + "\n".join(info[:40])

    import tensorflow as tf

    from sparkhvd.examples.digits import load_digits_split

    _, x_test, _, y_test = load_digits_split()
    _, accuracy = tf.keras.models.load_model(model).evaluate(x_test, y_test, verbose=0)
    assert accuracy >= 0.9


def test_killing_a_worker_mid_run_is_an_error_not_a_hang(standalone, tmp_path):
    """SIGKILL one worker (and its executor) while the ranks train: the job fails, promptly."""
    proc = subprocess.Popen(
        [SPARKHVD, "submit", "--preset", "standalone-cpu", "--master", standalone.master_url,
         JOB, "--output-url", str(tmp_path / "model.h5"), "--epochs", "500",
         "--runs-dir", str(tmp_path / "runs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("[rank 0] epoch 2/500"):
                break
        assert any(line.startswith("[rank 0] epoch 2/500") for line in seen), "".join(seen[-30:])
        standalone.kill("worker1")
        # A hang guard, well before horovod's 600 s start timeout: TimeoutExpired fails the test.
        rest, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        standalone.start_worker("worker1")
        standalone.wait_for_workers(2)
    assert proc.returncode != 0
    assert "JOB OK" not in rest
    assert "TrainingError: Training failed on rank" in rest, rest[-3000:]
    assert "vanished without an exit status" in rest, rest[-3000:]
    assert not (tmp_path / "model.h5").exists()
