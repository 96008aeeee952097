"""Where the time goes, as a user meets it: plain torch.distributed code on local[2], no change to
it. A rank whose data loading is slow is named on the console and in run.json within a minute; a
run where every rank waits on its input names nobody and says it is input-bound; report.html
renders in a real headless browser with no console error and shows run.json's numbers (the
docs' screenshot is made here). Torch profile."""
from __future__ import annotations

import glob
import html.parser
import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from conftest import wait_for
from sparkhvd import HorovodRunner

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch_backend, pytest.mark.spark, pytest.mark.timeout(400)]

#: The docs' screenshot (docs/guides/slow.md), remade by the report test when asked to.
SCREENSHOT = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "img", "report.png")


def paced_steps(stop_file, slow_rank=None, pause=0.05, min_s=0.0, limit_s=150.0):
    """One all_reduce per batch of a DataLoader whose rows take ``pause`` to load -- on
    ``slow_rank`` only, or on every rank (``slow_rank=None``). Runs until ``stop_file`` exists
    (every rank agrees) after ``min_s``, or ``limit_s``."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Rows(Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            if slow_rank is None or rank == slow_rank:
                time.sleep(pause)
            return torch.ones(4)

    start, steps = time.monotonic(), 0
    for batch in DataLoader(Rows(), batch_size=1):
        dist.all_reduce(batch)
        steps += 1
        elapsed = time.monotonic() - start
        if elapsed > limit_s:
            break
        if steps % 10 == 0 and elapsed > min_s:
            stop = torch.tensor([float(os.path.exists(stop_file))])
            dist.all_reduce(stop)
            if stop.item():
                break
    dist.destroy_process_group()
    return steps


def _stop_when_found(root, stop_file, kind, found):
    """Touch ``stop_file`` once a run under ``root`` records a finding of ``kind``; note when."""
    def seen():
        for path in glob.glob(os.path.join(root, "*", "run.json")):
            try:
                record = json.loads(open(path).read())
            except ValueError:
                continue
            findings = (record.get("time_split") or {}).get("findings") or []
            if any(f["kind"] == kind for f in findings):
                return True
        return False

    def watch():
        start = time.monotonic()
        if wait_for(seen, 150, 0.5):
            found["after_s"] = time.monotonic() - start
        open(stop_file, "w").close()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_rank_slow_to_load_its_data_is_named_within_a_minute(spark, tmp_path, caplog):
    root, stop = str(tmp_path / "runs"), str(tmp_path / "stop")
    found: dict = {}
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=root)
    watcher = _stop_when_found(root, stop, "straggler", found)
    steps = runner.run(paced_steps, stop_file=stop, slow_rank=1, pause=0.1)
    watcher.join(10)
    assert steps > 0 and found.get("after_s", 999) < 60, found
    record = runner.last_run_dir.record
    split = record["time_split"]
    straggler = next(f for f in split["findings"] if f["kind"] == "straggler")
    assert (straggler["rank"], straggler["bucket"]) == (1, "data"), straggler
    assert "rank 1 (host " in straggler["text"] and "data loading" in straggler["text"]
    assert "__getitem__" in straggler["text"] and "rank 0 waits in all_reduce" in straggler["text"]
    assert straggler["text"] in caplog.text  # said on the console
    ranks = split["ranks"]
    assert ranks["1"]["share"]["data"] > 0.5 and ranks["0"]["share"]["collective"] > 0.5
    assert ranks["0"]["where"]["collective"] == "all_reduce"
    lines = [json.loads(line) for line in open(runner.last_run_dir.file("timing.jsonl"))]
    assert {line["rank"] for line in lines} == {0, 1}
    assert all(line["system"]["rss_megabytes"] > 0 for line in lines)
    assert record["report"] == "report.html"
    _check_report_in_a_browser(runner.last_run_dir.path, record, tmp_path)


def test_a_balanced_run_names_nobody_and_says_it_is_input_bound(spark, tmp_path, caplog):
    root, stop = str(tmp_path / "runs"), str(tmp_path / "stop")
    found: dict = {}
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=root)
    watcher = _stop_when_found(root, stop, "input-bound", found)
    runner.run(paced_steps, stop_file=stop, slow_rank=None, pause=0.05, min_s=30)
    watcher.join(10)
    findings = runner.last_run_dir.record["time_split"]["findings"]
    assert [f["kind"] for f in findings] == ["input-bound"], findings
    assert "straggler" not in caplog.text and findings[0]["text"] in caplog.text


def test_time_split_off(spark, tmp_path):
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path),
                           time_split=False)
    runner.run(paced_steps, stop_file=str(tmp_path / "none"), limit_s=0)
    record = runner.last_run_dir.record
    assert "time_split" not in record and record["report"] == "report.html"
    assert not os.path.exists(runner.last_run_dir.file("timing.jsonl"))
    assert "time_split=False" in open(runner.last_run_dir.file("report.html")).read()


class _Splits(html.parser.HTMLParser):
    """The report's bars: (rank, bucket) -> data-share."""

    def __init__(self) -> None:
        super().__init__()
        self.shares: dict = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "rect" and a.get("class") == "split":
            self.shares[(a["data-rank"], a["data-bucket"])] = float(a["data-share"])


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _check_report_in_a_browser(folder, record, tmp_path):
    """report.html in headless Chromium: no console message of level error, the DOM's bars
    are run.json's shares; the screenshot (for the docs when SPARKHVD_DOCS_SCREENSHOT=1)."""
    exe = _chromium()
    if exe is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run does)")
    url = "file://" + os.path.join(folder, "report.html")
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", "--disable-default-apps", f"--user-data-dir={tmp_path}/cr",
             "--enable-logging=stderr", "--v=0"]
    env = {**os.environ, "HOME": str(tmp_path)}
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, env=env)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
    parser = _Splits()
    parser.feed(dom.stdout)
    expected = {(rank, bucket): share for rank, entry in record["time_split"]["ranks"].items()
                for bucket, share in entry["share"].items()}
    assert parser.shares == pytest.approx(expected), (parser.shares, expected)
    assert record["time_split"]["findings"][0]["text"] in dom.stdout.replace("&amp;", "&")
    shot = os.path.abspath(SCREENSHOT) if os.environ.get("SPARKHVD_DOCS_SCREENSHOT") else \
        str(tmp_path / "report.png")
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1180,2300",
                    "--hide-scrollbars", url], capture_output=True, timeout=120, env=env,
                   check=True)
    assert open(shot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
