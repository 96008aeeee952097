"""spark-submit on a real Spark standalone cluster (master + 2 one-core workers on 127.0.0.1)."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

SPARKHVD = os.path.join(os.path.dirname(sys.executable), "sparkhvd")
JOB = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "train_digits.py")


@pytest.mark.long("spark-submit starts a driver JVM of its own, which trains 15 epochs on two "
                  "one-core workers: about 100 s alone, 146 s beside another test process")
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
