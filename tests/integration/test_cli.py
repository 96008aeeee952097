"""The sparkhvd CLI through click's runner and as real subprocesses."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sparkhvd.ops.cli import main

SPARKHVD = os.path.join(os.path.dirname(sys.executable), "sparkhvd")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_presets_list_shows_max_np():
    result = CliRunner().invoke(main, ["presets"])
    assert result.exit_code == 0, result.output
    assert "gpu-large" in result.output and "standalone-cpu" in result.output


@pytest.mark.parametrize("fmt,check", [
    ("configure", lambda out: out.startswith("%%configure -f") and '"numExecutors": 3' in out),
    ("json", lambda out: json.loads(out)["executorCores"] == 12),
    ("spark-submit", lambda out: "--executor-cores 12" in out and "--conf" in out),
])
def test_presets_show(fmt, check):
    result = CliRunner().invoke(main, ["presets", "show", "gpu-large", "--as", fmt])
    assert result.exit_code == 0, result.output
    assert check(result.output)


def test_presets_show_unknown_fails_with_message():
    result = CliRunner().invoke(main, ["presets", "show", "nope"])
    assert result.exit_code != 0 and "No preset named 'nope'" in result.output


def test_submit_dry_run_prints_command():
    job = os.path.join(ROOT, "jobs", "train_digits.py")
    result = CliRunner().invoke(main, ["submit", "--preset", "standalone-cpu", "--master",
                                       "spark://127.0.0.1:7077", "--dry-run", job,
                                       "--output-url", "/tmp/m.h5"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "spark-submit --master spark://127.0.0.1:7077" in out
    assert "--total-executor-cores 2" in out and f"spark.pyspark.python={sys.executable}" in out
    assert "--conf spark.log.level=WARN" in out
    assert out.strip().endswith("train_digits.py --output-url /tmp/m.h5")


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_run_plain_horovod_script_as_subprocess(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "import horovod.tensorflow as hvd\n"
        "import tensorflow as tf\n"
        "hvd.init()\n"
        "total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)\n"
        "print(f'rank {hvd.rank()} of {hvd.size()} args {sys.argv[1:]} total {float(total)}')\n")
    out = subprocess.run([SPARKHVD, "run", str(script), "--np", "-2", "--output-dir",
                          str(tmp_path / "runs"), "--", "--lr", "0.1"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank 0] rank 0 of 2 args ['--lr', '0.1'] total 3.0" in out.stdout
    assert "run folder:" in out.stdout


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_run_failing_script_exits_nonzero(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit(4)\n")
    out = subprocess.run([SPARKHVD, "run", str(script), "--np", "-2", "--output-dir",
                          str(tmp_path / "runs")], capture_output=True, text=True, timeout=280)
    assert out.returncode == 1
    assert "bad.py exited with status 4" in out.stderr


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_doctor_passes_on_this_machine():
    """As the docs show it (docs_examples.DOCTOR)."""
    from docs_examples import DOCTOR

    out = subprocess.run([SPARKHVD, *DOCTOR.split()[1:]], capture_output=True, text=True,
                         timeout=280,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout + out.stderr
    for check in ("backend horovod", "backend tf", "MultiWorkerMirroredStrategy", "Java",
                  "Spark session", "task slots", "cluster network"):
        assert check in out.stdout
    assert "FAIL" not in out.stdout


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_doctor_fails_with_fix_for_unreachable_storage(tmp_path):
    (tmp_path / "file").write_text("x")
    out = subprocess.run([SPARKHVD, "doctor", "--storage-url", str(tmp_path / "file" / "runs")],
                         capture_output=True, text=True, timeout=280,
                         env={**os.environ, "COLUMNS": "250"})
    assert out.returncode == 1
    assert "FAIL" in out.stdout and "check the URL" in out.stdout


def _check_progress_output(console: str, log: str, epochs: int) -> None:
    """Every epoch's header and final bar on the console, tagged; nothing cut; a readable log."""
    lines = console.splitlines()
    for epoch in range(1, epochs + 1):
        assert f"[rank 0] Epoch {epoch}/{epochs}" in lines, console[-3000:]
    finals = [line for line in lines if line.startswith("[rank 0] 100/100 [====")]
    assert len(finals) == epochs, console[-3000:]
    assert all("loss:" in line and "accuracy:" in line for line in finals)
    assert "line cut" not in console and "\r" not in console and "\b" not in console
    assert "\r" not in log and "\b" not in log
    assert max(len(line) for line in log.splitlines()) < 1000
    assert sum(line.startswith("100/100 [====") for line in log.splitlines()) == epochs


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_keras_progress_bars_through_sparkhvd_run(tmp_path):
    """Horovod's Keras MNIST example shape (verbose=1 on rank 0) through `sparkhvd run`: each
    bar's final state is a tagged line, nothing is cut, the rank log is readable."""
    import glob

    import plaincode

    script = os.path.join(os.path.dirname(plaincode.__file__), "hvd_keras_mnist.py")
    out = subprocess.run([SPARKHVD, "run", script, "--np", "-2", "--output-dir",
                          str(tmp_path / "runs"), "--", "6"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [log] = glob.glob(str(tmp_path / "runs" / "*" / "logs" / "rank-0.log"))
    _check_progress_output(out.stdout, open(log).read(), 6)


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_keras_progress_bars_on_horovods_launcher(spark, tmp_path, rank_lines):
    """The same through launcher="horovod", whose output travels through horovod's own pipes."""
    import plaincode
    from sparkhvd import HorovodRunner
    from sparkhvd.common.script import read_script, run_script

    script = os.path.join(os.path.dirname(plaincode.__file__), "hvd_keras_mnist.py")
    runner = HorovodRunner(np=2, spark=spark, launcher="horovod", output_dir=str(tmp_path))
    runner.run(run_script, source=read_script(script), path=script, argv=["3"])
    _check_progress_output("\n".join(rank_lines),
                           open(runner.last_run_dir.file("logs/rank-0.log")).read(), 3)


def test_python_m_works_under_every_old_module_name():
    """``python -m sparkhvd.cli`` is ``python -m sparkhvd``; every other old name the package
    still keeps (the tests' list, tests/unit/test_package_layout.py) runs its module too (exit
    0, no traceback)."""
    from unit.test_package_layout import OLD_NAMES

    def run(module, *args):
        return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                              text=True, timeout=120)

    new, old = run("sparkhvd", "--help"), run("sparkhvd.cli", "--help")
    assert old.returncode == 0, old.stderr
    assert old.stdout.replace("sparkhvd.cli", "sparkhvd") == new.stdout
    for name in sorted(set(OLD_NAMES) - {"sparkhvd.cli"}):
        done = run(name)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (name, done.stderr)
