"""backend="torch": plain torch.distributed code, side by side with Spark's TorchDistributor; the
DataFrame data path as torch tensors; the helpers (metrics, checkpoints, exact resume); the
TorchScript model loaded and scored on the executors. Runs in the modern profile (Spark 4, where
TensorFlow is installed too: the torch path is checked never to import it or horovod)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import conftest
import sparkhvd
import torch_clients
from sparkhvd import DataFrameDataset, HorovodRunner, TrainingError

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch_backend, pytest.mark.spark, pytest.mark.timeout(600)]


def ddp_steps(steps=5, lr=0.1):
    """A function written for TorchDistributor: env:// rendezvous, DDP, gloo."""
    import os
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    dist.destroy_process_group()
    return {"weights": weights, "env": env, "rank": rank,
            "imported": sorted(m for m in ("tensorflow", "horovod") if m in sys.modules)}


def by_value(call):
    """Spark's class pickles by reference: this test's modules go by value for the call."""
    return conftest.by_value(call, sys.modules[__name__], torch_clients)


def test_a_torchdistributor_function_runs_unchanged_and_matches_torchdistributor(spark,
                                                                                  tmp_path):
    ours = HorovodRunner(np=2, spark=spark, backend="torch",
                         output_dir=str(tmp_path)).run_all(ddp_steps)
    assert [r["rank"] for r in ours] == [0, 1]
    assert ours[0]["weights"] == ours[1]["weights"], "DDP averaged the gradients"
    env0, env1 = ours[0]["env"], ours[1]["env"]
    assert (env0["RANK"], env1["RANK"], env0["WORLD_SIZE"]) == ("0", "1", "2")
    assert (env0["LOCAL_RANK"], env1["LOCAL_RANK"], env0["LOCAL_WORLD_SIZE"]) == ("0", "1", "2")
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] and env0["MASTER_PORT"] == env1["MASTER_PORT"]
    assert env0["GLOO_SOCKET_IFNAME"] == "lo"
    assert ours[0]["imported"] == [], "no TensorFlow or horovod import on this path"
    record = json.loads(open(os.path.join(tmp_path, os.listdir(tmp_path)[0], "run.json")).read())
    assert record["backend"] == "torch" and record["launcher"] == "barrier"

    from pyspark.ml.torch.distributor import TorchDistributor

    theirs = by_value(lambda: TorchDistributor(num_processes=2, local_mode=False,
                                               use_gpu=False).run(torch_clients.leaving_at_exit, ddp_steps))
    np.testing.assert_allclose(np.concatenate(ours[0]["weights"]),
                               np.concatenate(theirs["weights"]), rtol=1e-6)


def test_local_ranks(tmp_path):
    results = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path)).run_all(ddp_steps)
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["env"]["MASTER_ADDR"] == "127.0.0.1"


def fit(data, epochs, lr=0.005):
    import torch

    import sparkhvd.torch as st

    ctx = st.setup()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ckpt = st.Checkpoints(model, opt)
    loader = torch.utils.data.DataLoader(data.torch_dataset(16, shuffle=True, seed=1),
                                         batch_size=None)
    for epoch in range(ckpt.restore(), epochs):
        loader.dataset.set_epoch(epoch)
        losses = []
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        st.report(epoch, epochs=epochs, loss=sum(losses) / len(losses))
        ckpt.save(epoch)
    return st.model_bytes(model) if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def linear(spark):
    df = spark.range(256).selectExpr(
        "array(CAST(id % 7 AS FLOAT), CAST(id % 5 AS FLOAT), 1.0F) AS x",
        "CAST(id % 7 + 2 * (id % 5) AS FLOAT) AS y")
    with DataFrameDataset(df, "x", "y") as ds:
        yield df, ds


def _weights(run_dir):
    module = sparkhvd.load_model(run_dir)
    return np.concatenate([p.detach().numpy().ravel() for p in module.parameters()])


def test_helpers_checkpoints_exact_resume_model_and_scoring(spark, linear, tmp_path):
    df, ds = linear
    straight = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "a"))
    straight.run(fit, data=ds, epochs=4)
    rows = list(csv.DictReader(open(straight.last_run_dir.file("metrics.csv"))))
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])

    first = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "b"))
    first.run(fit, data=ds, epochs=2)
    assert os.path.exists(first.last_run_dir.file("checkpoints/epoch-0002.pt"))
    resumed = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "b"),
                            resume_from=True)
    resumed.run(fit, data=ds, epochs=4)
    record = resumed.last_run_dir.record
    assert record["resume"]["epoch"] == 2 and record["resume"]["restored"]
    assert [r["epoch"] for r in csv.DictReader(open(resumed.last_run_dir.file("metrics.csv")))] \
        == ["3", "4"]
    assert record["model"] == "model.pt"
    np.testing.assert_allclose(_weights(resumed.last_run_dir.path),
                               _weights(straight.last_run_dir.path), rtol=1e-5, atol=1e-6)

    scored = sparkhvd.predict(df, straight.last_run_dir, features="x")
    got = scored.select("x", "prediction").collect()
    module = sparkhvd.load_model(straight.last_run_dir.path)
    with torch.no_grad():
        expected = module(torch.tensor([r["x"] for r in got])).squeeze(1).numpy()
    np.testing.assert_allclose([r["prediction"] for r in got], expected, rtol=1e-5, atol=1e-5)


def fit_ids(data, epochs, log_dir, kill_at=None):
    """Trains on the ids' rows, a mid-epoch checkpoint (with the data's position) every 5 steps,
    the newest 3 kept; logs each step's ids after training on them; ``kill_at=(epoch, step)``:
    rank 1 is SIGKILLed right after that step's checkpoint."""
    import os
    import signal

    import torch
    import torch.distributed as dist

    import sparkhvd.torch as st

    ctx = st.setup()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = st.Checkpoints(model, opt, data=data, every_steps=5, keep=3)
    log = open(os.path.join(log_dir, f"rank-{ctx.rank}-of-{ctx.world_size}.txt"), "a")
    for epoch in range(ckpt.restore(), epochs):
        for features, y in data.torch_batches(8, epoch, shuffle=True, seed=4):
            x, ids = features["x"], features["id"]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            log.write(f"{epoch} {' '.join(str(int(i)) for i in ids)}\n")
            log.flush()
            if ckpt.step(epoch) and kill_at == (epoch, data.position.step):  # on every rank
                dist.barrier()  # rank 0's checkpoint is in
                if ctx.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save(epoch)
    return [p.detach().flatten().tolist() for p in st.unwrap(model).parameters()]


def _trained(log_dir, epoch):
    ids = []
    for name in os.listdir(log_dir):
        for line in open(os.path.join(log_dir, name)):
            e, *rest = line.split()
            if int(e) == epoch:
                ids += [int(i) for i in rest]
    return ids


def test_a_killed_run_resumes_mid_epoch_with_another_number_of_ranks(spark, tmp_path):
    """np=2 killed after step 10 of epoch 1 (a step checkpoint there, with the data's position;
    every 5 steps, the newest 3 kept); resumed with np=2 it ends with the uninterrupted run's weights; resumed with 1 or 3 ranks
    every id of epoch 1 is trained exactly once across both runs."""
    n = 203
    df = spark.range(n).selectExpr(
        "id", "array(CAST(id % 7 AS FLOAT), CAST(id % 5 AS FLOAT), 1.0F) AS x",
        "CAST(id % 7 + 2 * (id % 5) AS FLOAT) AS y")
    with DataFrameDataset(df, ["x", "id"], "y") as ds:
        logs = {k: tmp_path / k for k in ("straight", "killed", "np2", "np1", "np3")}
        for folder in logs.values():
            folder.mkdir()
        straight = HorovodRunner(np=2, spark=spark, backend="torch",
                                 output_dir=str(tmp_path / "a")).run(
            fit_ids, data=ds, epochs=2, log_dir=str(logs["straight"]))
        killed = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "b"))
        with pytest.raises(TrainingError):
            killed.run(fit_ids, data=ds, epochs=2, log_dir=str(logs["killed"]), kill_at=(1, 10))
        assert sorted(os.listdir(killed.last_run_dir.file("checkpoints"))) == [
            "epoch-0001-step-0000005.json", "epoch-0001-step-0000005.pt",
            "epoch-0001-step-0000010.json", "epoch-0001-step-0000010.pt",
            "epoch-0001.json", "epoch-0001.pt", "latest.json"], "every 5 steps, the newest 3"
        same = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "b"),
                             resume_from=True)
        weights = same.run(fit_ids, data=ds, epochs=2, log_dir=str(logs["np2"]))
        assert same.last_run_dir.record["resume"]["step"] == 10
        np.testing.assert_array_equal(np.concatenate(weights), np.concatenate(straight))
        for size in (1, 3):
            HorovodRunner(np=-size, backend="torch", output_dir=str(tmp_path / f"c{size}"),
                          resume_from=killed.last_run_dir.path).run(
                fit_ids, data=ds, epochs=2, log_dir=str(logs[f"np{size}"]))
    before = _trained(logs["killed"], 1)
    assert len(before) == 10 * 2 * 8
    for size in (1, 2, 3):
        after = _trained(logs[f"np{size}"], 1)
        both = before + after
        assert len(set(both)) == len(both), f"np={size}: an id of epoch 1 trained twice"
        assert set(both) <= set(range(n)) and n - len(both) < size * 8, f"np={size}"
        assert len(_trained(logs[f"np{size}"], 0)) == 0, "epoch 0 is not trained again"


def fit_chain(data, kind, log_dir, stop=None):
    """Trains on the ids' rows as a user's loop does -- ``save(epoch, step=k)`` mid-epoch,
    ``save(epoch)`` at each epoch's end -- logging each step's ids; ``stop=(epoch, step)``
    returns right after that step's checkpoint (``step`` 0: after the epoch's own), as a run
    killed before its next checkpoint."""
    import os

    import torch

    import sparkhvd.torch as st

    ctx = st.setup()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = getattr(st, kind)(model, opt, data=data)
    log = open(os.path.join(log_dir, f"rank-{ctx.rank}-of-{ctx.world_size}.txt"), "a")
    for epoch in range(ckpt.restore(), 2):
        for features, y in data.torch_batches(16, epoch, shuffle=True, seed=0):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(features["x"]).squeeze(1), y).backward()
            opt.step()
            log.write(f"{epoch} {' '.join(str(int(i)) for i in features['id'])}\n")
            log.flush()
            if stop == (epoch, data.position.step):
                ckpt.save(epoch, step=data.position.step)
                return "stopped"
        ckpt.save(epoch)
        if stop == (epoch, 0):
            return "stopped"
    return "done"


@pytest.mark.parametrize("kind", ["Checkpoints", "ShardedCheckpoints"])
def test_a_run_resumed_after_a_resize_and_an_epoch_end_trains_the_next_epoch_whole(
        spark, tmp_path, kind):
    """The chain found from outside (issue 93), as a user runs it: 2 ranks save after step 3 of
    epoch 0; 5 resume it (a dealt epoch), end the epoch and save it, and stop; 2 resume that
    and train epoch 1 -- every one of its 1,000 - 1,000 % 32 ids once (it trained 768 of 960
    when the epoch-end checkpoint kept the ended epoch's deal), epoch 0's ids once across the
    first two runs."""
    df = spark.range(1000).selectExpr("id", "array(CAST(id % 7 AS FLOAT), 1.0F, 0.5F) AS x",
                                      "CAST(id % 7 AS FLOAT) AS y")
    logs = {k: tmp_path / k for k in ("a", "b", "c")}
    with DataFrameDataset(df, ["x", "id"], "y") as ds:
        for name, size, stop in (("a", 2, (0, 3)), ("b", 5, (0, 0)), ("c", 2, None)):
            logs[name].mkdir()  # each run resumes the newest one before it
            runner = HorovodRunner(np=-size, backend="torch", output_dir=str(tmp_path / "runs"),
                                   resume_from=name != "a")
            assert runner.run(fit_chain, data=ds, kind=kind, log_dir=str(logs[name]),
                              stop=stop) == ("stopped" if stop else "done")
    epoch0 = _trained(logs["a"], 0) + _trained(logs["b"], 0)
    assert len(epoch0) == len(set(epoch0)) and 1000 - len(epoch0) < 5 * 16
    epoch1 = _trained(logs["c"], 1)
    assert sorted(epoch1) == sorted(set(epoch1)) and len(epoch1) == 1000 // 32 * 32


def fit_sharded(data, stop_after=None):
    """DDP with sharded checkpoints (DCP) every 3 steps, carrying the data's position."""
    import torch

    import sparkhvd.torch as st

    ctx = st.setup()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = st.ShardedCheckpoints(model, opt, data=data, every_steps=3)
    start = ckpt.restore()
    for x, y in data.torch_batches(8, start, shuffle=True, seed=2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()
        ckpt.step(start)
        if stop_after is not None and data.position.step == stop_after:
            break
        if stop_after is None:
            break  # one batch is enough to see where the resumed run starts
    return data.state_dict()


def test_sharded_checkpoints_carry_the_data_position(spark, linear, tmp_path):
    _, ds = linear
    first = HorovodRunner(np=-2, spark=spark, backend="torch", output_dir=str(tmp_path))
    assert first.run(fit_sharded, data=ds, stop_after=7)["samples"] == 7 * 2 * 8
    resumed = HorovodRunner(np=-1, spark=spark, backend="torch", output_dir=str(tmp_path),
                            resume_from=first.last_run_dir.path)
    position = resumed.run(fit_sharded, data=ds)
    assert resumed.last_run_dir.record["resume"]["step"] == 6
    assert (position["epoch"], position["samples"]) == (0, 6 * 2 * 8 + 8), "after step 6, on"


def test_a_state_dict_result_is_the_runs_model(tmp_path):
    def returns_state(steps=1):
        import torch

        torch.manual_seed(0)
        return torch.nn.Linear(2, 1).state_dict()

    runner = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path))
    state = runner.run(returns_state)
    assert runner.last_run_dir.record["model"] == "model.state_dict.pt"
    loaded = sparkhvd.load_model(runner.last_run_dir.path)
    assert set(loaded) == {"weight", "bias"}
    assert torch.equal(loaded["weight"], state["weight"])


def test_a_rank_error_names_the_rank_with_its_traceback(spark, tmp_path):
    def fails():
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("bad shard on rank 1")
        dist.barrier()

    with pytest.raises(TrainingError) as info:
        HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path)).run(fails)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "bad shard on rank 1" in str(info.value)


def test_a_torchrun_script_through_the_cli(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, os
        import torch
        import torch.distributed as dist

        parser = argparse.ArgumentParser()
        parser.add_argument("--value", type=float, default=1.0)
        args = parser.parse_args()
        dist.init_process_group("gloo")
        t = torch.tensor([args.value * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: sum {t.item():g}",
              flush=True)
        dist.destroy_process_group()
    """))
    out = subprocess.run([sys.executable, "-m", "sparkhvd.ops.cli", "run", str(script), "--np", "-2",
                          "--backend", "torch", "--output-dir", str(tmp_path / "runs"),
                          "--", "--value", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "rank 0 of 2: sum 6" in out.stdout + out.stderr


def load_batch():
    import time

    time.sleep(600)


def rank1_elsewhere():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        load_batch()
    dist.all_reduce(torch.ones(1))


def test_a_hang_names_the_rank_that_is_elsewhere(spark, tmp_path):
    """rank 1 sits in load_batch(), rank 0 waits in all_reduce: the TimeoutError says so."""
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path))
    with pytest.raises(TimeoutError) as info:
        runner.run(rank1_elsewhere, run_timeout=15)
    message = str(info.value)
    assert "rank 1 is in test_torch.py:" in message and "load_batch()" in message, message
    assert "rank 0 waits in all_reduce" in message, message
