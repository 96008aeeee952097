"""The time split's decisions, without ranks: which bucket a stack is in, when a rank is a
straggler or a run input-bound, the GPU metrics (NVML faked), the report from a run folder."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import types

import pytest
from click.testing import CliRunner

from sparkhvd.common import protocol
from sparkhvd.timing.buckets import bucket_of
from sparkhvd.timing.report import render
from sparkhvd.timing.splits import TimeSplits
from sparkhvd.timing.stragglers import RankWindow, find, rank_list

SITE = "/usr/lib/python3/site-packages"
USER = "/home/me/train.py"


@pytest.mark.parametrize("frames, bucket, where", [
    ([(f"{SITE}/torch/distributed/distributed_c10d.py", 10, "all_reduce"),
      (USER, 42, "train")], "collective", "all_reduce"),
    ([(USER, 7, "__getitem__"), (f"{SITE}/torch/utils/data/_utils/fetch.py", 5, "fetch"),
      (f"{SITE}/torch/utils/data/dataloader.py", 9, "__next__"), (USER, 40, "train")],
     "data", "train.py:7 __getitem__"),
    ([(f"{SITE}/torch/serialization.py", 1, "save"), (USER, 50, "train")], "checkpoint",
     "train.py:50 train"),
    ([(f"{SITE}/torch/nn/modules/linear.py", 3, "forward"), (USER, 44, "train")], "compute",
     "train.py:44 train"),
    ([("<frozen importlib._bootstrap>", 1, "_find_and_load"), (USER, 2, "train")], "other",
     "train.py:2 train"),
    ([(f"{SITE}/sparkhvd/rank/bootstrap.py", 1, "rank_main")], "other", ""),
    ([(f"{SITE}/tensorflow/python/data/ops/dataset_ops.py", 1, "<module>"),
      ("<frozen importlib._bootstrap>", 1, "_call_with_frames_removed"), (USER, 2, "train")],
     "other", "train.py:2 train"),
    ([(USER, 9, "my_allreduce"), (USER, 40, "train")], "compute", "train.py:9 my_allreduce"),
    ([(f"{SITE}/torch/cuda/__init__.py", 9, "synchronize"), (USER, 40, "train")], "compute",
     "train.py:40 train"),  # waiting for the GPU is computing (seen on an H200)
    ([(f"{SITE}/horovod/torch/mpi_ops.py", 9, "synchronize"), (USER, 40, "train")],
     "collective", "synchronize"),
])
def test_a_stack_goes_in_one_bucket(frames, bucket, where):
    assert bucket_of(frames) == (bucket, where)


def _window(rank, **seconds):
    return RankWindow(rank, f"h{rank}", seconds, {"data": {"train.py:7 load": 1.0},
                                                   "collective": {"all_reduce": 1.0}})


def test_a_straggler_is_named_with_its_bucket_and_what_the_others_wait_in():
    ranks = [_window(0, compute=8, collective=12), _window(1, compute=8, collective=12),
             _window(2, data=11, compute=8, collective=1)]
    (finding,) = find(ranks, 3)
    assert (finding.kind, finding.rank, finding.bucket) == ("straggler", 2, "data")
    assert finding.text == ("rank 2 (host h2) is the straggler: 55 % of its time in data loading "
                            "(train.py:7 load) vs 0 % on the others; ranks 0, 1 wait in "
                            "all_reduce 60 % of the time")


def test_balanced_ranks_name_nobody_and_bound_runs_are_said():
    assert find([_window(r, compute=12, collective=8) for r in range(3)], 3) == []
    (bound,) = find([_window(r, data=15, compute=5) for r in range(2)], 2)
    assert bound.kind == "input-bound" and "75 %" in bound.text
    (comm,) = find([_window(r, compute=5, collective=15) for r in range(2)], 2)
    assert comm.kind == "communication-bound"
    assert find([_window(0, compute=5, collective=15)], 1) == [], "one rank waits for no peer"
    assert find([_window(0, compute=5, collective=5)], 2) == [], "a rank missing: no verdict"
    assert find([_window(0, data=5), _window(1, compute=5)], 2) == [], "too little sampled"
    assert rank_list([0, 1, 2, 3]) == "ranks 0\u20133" and rank_list([4]) == "rank 4"


def test_gpu_metrics_come_from_nvml(monkeypatch):
    """NVML faked: the GPUs the rank sees (CUDA_VISIBLE_DEVICES), in MLflow's names."""
    calls = []
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: calls.append("init")
    fake.nvmlDeviceGetCount = lambda: 4
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu={"gpu2": 87}[h])
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3e9, total=12e9)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    from sparkhvd.timing.system import SystemMetrics

    metrics = SystemMetrics().read()
    assert calls == ["init"]
    assert metrics["gpu_0_utilization_percentage"] == 87.0
    assert metrics["gpu_0_memory_usage_megabytes"] == 3000.0
    assert metrics["gpu_0_memory_usage_percentage"] == 25.0
    assert metrics["rss_megabytes"] > 0 and "cpu_utilization_percentage" in metrics
    assert not any(k.startswith("gpu_1") for k in metrics)


def _split(rank, start, **seconds):
    return protocol.TimeSplit(rank=rank, host=f"h{rank}", start=start, end=start + 5,
                              seconds=seconds, where={"data": "train.py:7 load"},
                              system={"cpu_utilization_percentage": 90.0 + rank})


def test_a_run_folder_makes_a_report(tmp_path):
    """Splits kept (timing.jsonl, the summary), a finding said once, the report rendered
    from the folder alone, and `sparkhvd report` making it again."""
    said, recorded = [], []
    splits = TimeSplits(str(tmp_path), say=said.append, findings=recorded.append)
    splits.begin(1, 2)
    for i in range(5):
        splits.add(_split(0, 5.0 * i, compute=1, collective=4))
        splits.add(_split(1, 5.0 * i, data=4, compute=1))
    splits.close()
    assert len(said) == 1 and said[0].startswith("rank 1 (host h1) is the straggler: 80 %")
    summary = splits.summary()
    assert summary["ranks"]["1"]["share"]["data"] == 0.8 and summary["findings"][0]["rank"] == 1
    lines = (tmp_path / "timing.jsonl").read_text().splitlines()
    assert len(lines) == 10 and json.loads(lines[0])["attempt"] == 1
    record = {"run_id": "r1", "status": "succeeded", "np": 2, "time_split": summary,
              "states": [{"state": "placing", "at": "2026-11-26T08:00:00"},
                         {"state": "running", "at": "2026-11-26T08:00:02", "attempt": 1,
                          "size": 2}],
              "finished_at": "2026-11-26T08:00:30", "attempts": [{"attempt": 1, "size": 2,
                                                                  "status": "succeeded"}]}
    (tmp_path / "run.json").write_text(json.dumps(record))
    (tmp_path / "metrics.csv").write_text("epoch,loss,val_loss,seconds\n1,0.9,1.0,3\n2,0.5,0.7,3\n")
    page = render(str(tmp_path))
    assert 'data-rank="1" data-bucket="data" data-share="0.8"' in page
    assert "straggler: 80 %" in page and "attempt 1: 2 ranks" in page
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org", "")
    from sparkhvd.ops.cli import main

    out = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert out.exit_code == 0 and os.path.exists(tmp_path / "report.html"), out.output
    (tmp_path / "logs").mkdir()
    bad = CliRunner().invoke(main, ["report", str(tmp_path / "logs")])
    assert bad.exit_code != 0 and "no run.json" in bad.output


def _waited(rank, waits=("ddp",), unmeasured=(), **seconds):
    window = _window(rank, **seconds)
    window.waits, window.unmeasured = set(waits), set(unmeasured)
    return window


def test_the_straggler_is_the_rank_the_others_wait_for():
    """DDP: rank 1 loads slowly, rank 0 waits inside backward() (measured there). Rank 1 is
    named for data; rank 0's extra time is waiting, never a straggler's. A rank that computes
    more while the others wait is named for computing."""
    data_slow = [_waited(0, compute=6, collective=14), _waited(1, data=13, compute=7)]
    (finding,) = find(data_slow, 2)
    assert (finding.rank, finding.bucket) == (1, "data")
    compute_slow = [_waited(0, compute=11, collective=9), _waited(1, compute=20)]
    (finding,) = find(compute_slow, 2)
    assert (finding.rank, finding.bucket) == (1, "compute")


def test_nobody_is_named_when_nobody_waits_or_the_wait_is_hidden():
    """Ranks that never wait for each other (independent work) name nobody, however unequal;
    where a rank's wait cannot be measured (its own comm hook, tf.distribute), computing
    alone names nobody -- the old wrong answer named the waiting rank for computing."""
    assert find([_waited(0, waits=(), compute=15, data=5),
                 _waited(1, waits=(), compute=5, data=15)], 2) == []
    hidden = [_waited(0, waits=(), unmeasured=("own comm hook",), compute=19, data=1),
              _waited(1, waits=(), unmeasured=("own comm hook",), compute=5, data=15)]
    assert find(hidden, 2) == [], "rank 0 waits inside computing: no verdict from it"
    some_wait = [_waited(0, unmeasured=("own comm hook",), compute=10, collective=5, data=1),
                 _waited(1, unmeasured=("own comm hook",), compute=20, collective=0, data=1)]
    assert find(some_wait, 2) == [], "more computing never names a rank while waits hide"


def test_a_straggler_that_goes_away_is_said_once(tmp_path):
    said: list = []
    splits = TimeSplits(str(tmp_path), say=said.append, findings=lambda found: None)
    splits.begin(1, 2)
    for i in range(6):  # 30 s: rank 1 loads slowly, rank 0 waits for it
        splits.add(_split(0, 5.0 * i, compute=1, collective=4))
        splits.add(_split(1, 5.0 * i, data=4, compute=1))
    for i in range(6, 30):  # then 2 minutes balanced
        splits.add(_split(0, 5.0 * i, compute=4, collective=1))
        splits.add(_split(1, 5.0 * i, compute=4, collective=1))
    splits.close()
    assert [s.split(":")[0] for s in said] == ["rank 1 (host h1) is the straggler",
                                              "rank 1 (host h1) is no longer the straggler"]
    kinds = [f["kind"] for f in splits.summary()["findings"]]
    assert kinds == ["straggler", "straggler-gone"]


def test_a_short_attempt_is_judged_as_a_whole_when_it_ends(tmp_path):
    """150 quick DDP steps (8 s a rank, under the window's 15 s): rank 1 computes 81 % of its
    time while rank 0 waits 68 % in DDP's all-reduce. Nothing can be said while it runs; when
    the attempt ends (the next begins, or the ranks are done) it is compared over its whole
    time and rank 1 is named for computing -- on the console and in run.json's findings. A
    balanced short attempt names nobody."""
    said, recorded = [], []
    splits = TimeSplits(str(tmp_path), say=said.append, findings=recorded.append)
    splits.begin(1, 2)
    for i in range(2):
        splits.add(dataclasses.replace(_split(0, 4.0 * i, compute=1.2, collective=2.6),
                                       waits=["ddp"], steps=75))
        splits.add(dataclasses.replace(_split(1, 4.0 * i, compute=2.6, collective=0.4,
                                              data=0.2), waits=["ddp"], steps=75))
    assert said == [], "too short for the window"
    splits.begin(2, 2)  # the first attempt ends
    assert len(said) == 1 and said[0].startswith("rank 1 (host h1) is the straggler: 81 % of "
                                                 "its time in computing"), said
    assert said[0].endswith("(over attempt 1 as a whole)")
    for i in range(2):  # a balanced attempt
        for rank in (0, 1):
            splits.add(dataclasses.replace(_split(rank, 4.0 * i, compute=3.5, collective=0.5),
                                           waits=["ddp"], steps=75))
    splits.close()
    assert len(said) == 1, "the balanced attempt names nobody"
    (finding,) = splits.summary()["findings"]
    assert (finding["kind"], finding["rank"], finding["bucket"]) == ("straggler", 1, "compute")
    assert recorded[-1] == splits.summary()["findings"]


def test_a_ddp_run_without_epoch_metrics_shows_its_steps_per_second(tmp_path):
    """Throughput from the steps DDP's hook counted (and samples/s from the first batch); the
    empty metrics section says why instead of standing empty."""
    splits = TimeSplits(str(tmp_path), say=lambda _: None, findings=lambda _: None)
    splits.begin(1, 2)
    for i in range(3):
        for rank in (0, 1):
            split = _split(rank, 5.0 * i, compute=4, collective=1)
            split.steps, split.batch = 50, 32
            splits.add(split)
    splits.close()
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "status": "succeeded"}))
    page = render(str(tmp_path))
    assert "steps per second (counted by DDP&#x27;s hook)" in page
    assert "samples per second (the first step&#x27;s batch: 32)" in page
    assert "No epoch metrics" not in page and "No loss or metrics: the function reported none" \
        in page
    (tmp_path / "timing.jsonl").unlink()
    assert "No throughput: no epoch metrics" in render(str(tmp_path))


def test_a_launch_breaks_down_step_by_step_with_the_slowest_rank_for_each():
    from sparkhvd.timing.start_times import breakdown

    cold = protocol.StartTimes(rank=0, marks={"process": 10.5, "ready": 10.6, "function": 10.7,
                                              "framework_start": 10.7, "framework": 11.7,
                                              "rendezvous": 11.9, "first_step": 12.0,
                                              "returned": 13.0})
    warm = protocol.StartTimes(rank=1, warm=True, marks={
        "process": 10.2, "ready": 10.21, "framework": 10.21, "function": 10.3,
        "rendezvous": 11.9, "first_step": 12.0, "returned": 13.0})
    steps = breakdown({0: cold, 1: warm}, launched_at=10.0, placing_s=0.25, result_at=13.2)
    assert steps == {"placing": 0.25, "spark_job": 0.5, "process_start": 0.1, "prepare": 0.1,
                     "import": 1.0, "rendezvous": 1.6, "to_first_step": 2.0, "function": 2.7,
                     "result_back": 0.2, "ranks": 2, "warm_ranks": 1}
    # a warm rank's framework was there before its function: no import, no negative span
    alone = breakdown({1: warm}, launched_at=None)
    assert alone["import"] == 0.0 and "spark_job" not in alone and alone["warm_ranks"] == 1
    # torch imported while the function was unpickled: the import, not the preparation
    unpickled = protocol.StartTimes(rank=0, marks={"ready": 10.0, "framework_start": 10.1,
                                                   "framework": 11.1, "function": 11.2})
    steps = breakdown({0: unpickled}, launched_at=None)
    assert (steps["import"], steps["prepare"]) == (1.0, 0.2)


def test_a_framework_import_that_failed_leaves_the_breakdown_whole():
    """torch's import began and raised (a missing CUDA library): no ``framework`` mark, and the
    driver's breakdown still comes out (never the run's error)."""
    from sparkhvd.timing.start_times import breakdown

    failed = protocol.StartTimes(rank=0, marks={"ready": 1.0, "framework_start": 1.1,
                                                "function": 1.5})
    steps = breakdown({0: failed}, launched_at=0.5)
    assert steps["prepare"] == 0.5 and "import" not in steps and steps["ranks"] == 1
