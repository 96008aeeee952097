"""The benchmark's harness runs (tiny inputs, one repetition); numbers are not checked here.

CI runs the case that covers the harness end to end -- B1: every launcher, a result per case,
the goals table -- and the report (RESULTS.md, results.png, `--report` again); the other cases
(B2-B15, each its own workload on the same harness) run with `make bench`: they cost CI a
minute and a half of two cores and checked only that their workloads start.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.spark
@pytest.mark.timeout(900)
def test_the_harness_runs_its_cases_on_tiny_inputs(tmp_path):
    cases = ["B1"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--tiny",
                          "--repeat", "1", "--out", str(tmp_path),
                          *(arg for case in cases for arg in ("--case", case))],
                         capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stderr[-4000:]
    (result,) = list((tmp_path / "results").glob("*.json"))
    data = json.loads(result.read_text())
    assert {r["case"] for r in data["results"]} == set(cases)
    assert all("median" in r or "skipped" in r for r in data["results"])
    assert data["env"]["versions"]["horovod"] == "0.28.1"
    table = (tmp_path / "RESULTS.md").read_text()
    assert "| B1 |" in table
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Goals" in table and "B1 no-op ≤ ½ × raw horovod" in table
    (tmp_path / "RESULTS.md").unlink()
    again = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--report",
                            "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "RESULTS.md").read_text() == table
