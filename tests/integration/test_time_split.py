"""Where the time goes, as a user meets it: plain DDP code on local[2] -- the way almost every
user trains, directly or under HF Trainer -- with no change to it. DDP all-reduces the gradients
inside backward(), where a stack sampler sees only computing; sparkhvd measures that wait at the
communication layer (a timing comm hook) and names the rank the others wait for, with its own
cause: a rank slow to load its data (within a minute, on the console and in run.json), a rank
slow to compute; never the rank that waits. A run where every rank waits on its input names
nobody and says it is input-bound; report.html renders in a real headless browser with no
console error and shows run.json's numbers (the docs' screenshot is made here). Torch
profile."""
from __future__ import annotations

import glob
import html
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


def ddp_train(stop_file, slow=None, limit_s=120.0, steps_at_most=None):
    """Plain DDP: a DataLoader, forward, ``loss.backward()``, ``opt.step()``. ``slow``:
    ``"data"`` -- rank 1's rows take 4 ms each to load; ``"compute"`` -- rank 1 does 20 more
    384x384 matmuls a step (a slower GPU, a throttled host); ``"input"`` -- every rank's rows
    take 4 ms; None -- balanced. Runs until ``stop_file`` exists (the ranks agree every 10
    steps), ``limit_s`` or ``steps_at_most`` steps."""
    import os
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Rows(Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            if slow == "input" or (slow == "data" and rank == 1):
                time.sleep(0.004)
            return torch.randn(64), i % 10

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    heavy = torch.randn(384, 384) / 20
    start, steps = time.monotonic(), 0
    for x, y in DataLoader(Rows(), batch_size=32):
        loss = F.cross_entropy(model(x), y)
        if slow == "compute" and rank == 1:
            for _ in range(20):
                heavy = torch.tanh(heavy @ heavy)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if steps == steps_at_most:
            break
        if steps % 10 == 0:
            stop = torch.tensor([float(os.path.exists(stop_file) or
                                       time.monotonic() - start > limit_s)])
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


def _run(spark, tmp_path, slow, kind, **kw):
    """A DDP run stopped once ``kind`` is found (or at its limit): (record, seconds to find)."""
    root, stop = str(tmp_path / "runs"), str(tmp_path / "stop")
    found: dict = {}
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=root)
    watcher = _stop_when_found(root, stop, kind, found)
    runner.run(ddp_train, stop_file=stop, slow=slow, **kw)
    watcher.join(10)
    return runner.last_run_dir, found.get("after_s")


def _findings(record):
    return (record.get("time_split") or {}).get("findings") or []


def _straggler(record):
    return next((f for f in _findings(record) if f["kind"] == "straggler"), None)


def test_a_rank_slow_to_load_its_data_is_named_within_a_minute(spark, tmp_path, rank_lines):
    """Rank 1 loads slowly; rank 0 waits for it inside backward() -- measured there, by
    DDP's timing hook -- and is not named."""
    run_dir, after_s = _run(spark, tmp_path, "data", "straggler")
    record = run_dir.record
    straggler = _straggler(record)
    assert straggler is not None and (after_s or 999) < 60, (_findings(record), after_s)
    assert (straggler["rank"], straggler["bucket"]) == (1, "data"), straggler
    assert not [f for f in _findings(record) if f["kind"] == "straggler" and f["rank"] == 0]
    assert "rank 1 (host " in straggler["text"] and "data loading" in straggler["text"]
    assert "__getitem__" in straggler["text"], straggler["text"]
    assert "rank 0 waits in DDP's gradient all-reduce (in backward)" in straggler["text"]
    assert any(straggler["text"] in line for line in rank_lines)  # said on the console
    ranks = record["time_split"]["ranks"]
    one, zero = ranks["1"]["share"], ranks["0"]["share"]  # each waits where the other does not
    assert one["data"] > one["collective"] and zero["collective"] > zero["data"], ranks
    assert ranks["0"]["waits_measured"] == ["ddp"] and ranks["0"]["steps_measured"] > 0
    lines = [json.loads(line) for line in open(run_dir.file("timing.jsonl"))]
    assert {line["rank"] for line in lines} == {0, 1}
    assert all(line["system"]["rss_megabytes"] > 0 for line in lines)
    assert record["report"] == "report.html"
    _check_report_in_a_browser(run_dir.path, record, tmp_path)


def test_a_rank_slow_to_compute_is_named_for_computing(spark, tmp_path, rank_lines):
    """Rank 1 computes more each step (a slower device): both ranks look 100 % computing to a
    stack sampler; with the wait measured inside backward(), rank 1 is named for computing --
    here in a run of 150 steps, too short for the window: it is judged as a whole when it
    ends, and the console, run.json and report.html say it."""
    run_dir, _ = _run(spark, tmp_path, "compute", "straggler", steps_at_most=150)
    straggler = _straggler(run_dir.record)
    assert straggler is not None, _findings(run_dir.record)
    assert (straggler["rank"], straggler["bucket"]) == (1, "compute"), straggler
    assert run_dir.record["time_split"]["ranks"]["0"]["share"]["collective"] > 0.3
    assert any(straggler["text"] in line for line in rank_lines)  # said on the console
    page = open(run_dir.file("report.html"), encoding="utf-8").read()
    assert "No straggler" not in page and "is the straggler" in page
    # no epoch metrics: the throughput is the steps DDP's hook counted (batch 32 per rank),
    # and the empty metrics section says why
    text = html.unescape(page)
    assert "steps per second (counted by DDP's hook)" in text
    assert "samples per second (the first step's batch: 32)" in text
    assert "No epoch metrics" not in page and "No loss or metrics: the function reported" in page
    starts = run_dir.record["timings"]["starts"][0]
    assert {"spark_job", "process_start", "function", "to_first_step"} <= set(starts), starts
    if _chromium():
        _check_report_in_a_browser(run_dir.path, run_dir.record, tmp_path)


def test_a_balanced_run_names_nobody_and_says_it_is_input_bound(spark, tmp_path, rank_lines):
    """Every rank waits on its input alike: nobody is named (the waits inside backward() are
    measured on both), and the run is said to be input-bound."""
    run_dir, _ = _run(spark, tmp_path, "input", "input-bound", limit_s=60)
    findings = _findings(run_dir.record)
    assert [f["kind"] for f in findings] == ["input-bound"], findings
    console = "\n".join(rank_lines)
    assert "straggler" not in console and findings[0]["text"] in console


def hf_train(slow_rank, max_steps):
    """An HF Trainer on a tiny model; rank ``slow_rank``'s rows take 4 ms each to load."""
    import os
    import time

    import torch
    from transformers import Trainer, TrainingArguments

    rank = int(os.environ["RANK"])

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            if rank == slow_rank:
                time.sleep(0.004)
            return {"x": torch.randn(64), "labels": i % 10}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                            torch.nn.Linear(256, 10))

        def forward(self, x, labels):
            logits = self.body(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels),
                    "logits": logits}

    args = TrainingArguments(output_dir=os.path.join(os.getcwd(), "hf"), max_steps=max_steps,
                             per_device_train_batch_size=32, report_to=[], save_strategy="no",
                             logging_steps=50, bf16=False, dataloader_num_workers=0,
                             disable_tqdm=True, use_cpu=True)
    Trainer(model=Net(), args=args, train_dataset=Rows()).train()
    return rank


def test_hf_trainer_names_the_rank_slow_to_load(spark, tmp_path):
    """The same under HF's Trainer, which wraps the model in DDP itself."""
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path))
    runner.run(hf_train, slow_rank=1, max_steps=180)
    straggler = _straggler(runner.last_run_dir.record)
    assert straggler is not None, _findings(runner.last_run_dir.record)
    assert (straggler["rank"], straggler["bucket"]) == (1, "data"), straggler


def test_time_split_off(spark, tmp_path):
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path),
                           time_split=False)
    runner.run(ddp_train, stop_file=str(tmp_path / "none"), limit_s=0)
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
