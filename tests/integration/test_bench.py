"""The benchmark code runs (tiny inputs, one repetition); numbers are not checked here."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.spark
@pytest.mark.timeout(900)
def test_every_case_runs_on_tiny_inputs(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--tiny",
                          "--repeat", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stderr[-4000:]
    (result,) = list((tmp_path / "results").glob("*.json"))
    data = json.loads(result.read_text())
    cases = {r["case"] for r in data["results"]}
    assert cases == {"B1", "B1C", "B1T", "B2", "B2T", "B3", "B4", "B5", "B6", "B7", "B8", "B9",
                     "B10", "B11", "B12", "B13", "B14", "B15"}
    assert all("median" in r or "skipped" in r for r in data["results"])
    assert data["env"]["versions"]["horovod"] == "0.28.1"
    table = (tmp_path / "RESULTS.md").read_text()
    assert "| B1 |" in table and "| B4 |" in table
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Goals" in table and "B1 no-op ≤ ½ × raw horovod" in table
    (tmp_path / "RESULTS.md").unlink()
    again = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--report",
                            "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "RESULTS.md").read_text() == table
