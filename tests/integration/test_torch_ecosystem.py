"""The PyTorch ecosystem, unchanged: Lightning in both shapes its users write, Hugging Face
Trainer, accelerate, FSDP2 with sharded checkpoints, DeepSpeed ZeRO-1 (launched as Spark's
DeepspeedTorchDistributor launches it), the drop-in ``sparkhvd.torch.TorchDistributor`` beside
Spark's own, and several ranks per Spark task. Weights are compared with plain torchrun's where
training is deterministic. Runs in the modern profile (tests/torch_clients.py holds the clients)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import conftest
import torch_clients
from sparkhvd import HorovodRunner, TrainingError

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch_backend, pytest.mark.timeout(600)]

CLIENTS_FILE = torch_clients.__file__


def torchrun(name: str, tmp_path, **kwargs) -> dict:
    """Rank 0's record of ``name`` under plain ``torchrun --nproc-per-node 2``."""
    out = tmp_path / f"torchrun-{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKHVD_")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         CLIENTS_FILE, name, str(out), json.dumps(kwargs)],
        capture_output=True, text=True, timeout=300, env={**env, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def same_on_every_rank(records: list[dict], world: int = 2) -> list[float]:
    assert [r["rank"] for r in records] == list(range(world))
    assert {r["world"] for r in records} == {world}, "the library saw the whole world"
    assert all(r["weights"] == records[0]["weights"] for r in records), "gradients averaged"
    return records[0]["weights"]


# -- Lightning ----------------------------------------------------------------------------------
def test_lightning_in_torchdistributors_shape_on_both_distributors(spark, tmp_path):
    """Trainer(devices=1, num_nodes=2), as TorchDistributor users write it: Spark's class, the
    drop-in and HorovodRunner(local_ranks="task") train the same weights."""
    from pyspark.ml.torch.distributor import TorchDistributor as SparksClass

    from sparkhvd.torch import TorchDistributor

    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark,
                                   output_dir=str(tmp_path / "a"))
    ours = distributor.run(torch_clients.lightning_fit, 1, 2, root="lightning")
    assert ours["world"] == 2 and ours["environment"] == "TorchElasticEnvironment"
    saved = os.listdir(distributor.last_run_dir.file("lightning/checkpoints"))
    assert [n for n in saved if n.endswith(".ckpt")], "Lightning's own checkpoint, in the run folder"
    theirs = by_value(lambda: SparksClass(num_processes=2, local_mode=False, use_gpu=False)
                      .run(torch_clients.leaving_at_exit, torch_clients.lightning_fit, 1, 2))
    assert ours["weights"] == theirs["weights"]
    records = HorovodRunner(np=2, spark=spark, backend="torch", local_ranks="task",
                            output_dir=str(tmp_path / "b")).run_all(torch_clients.lightning_fit)
    assert same_on_every_rank(records) == ours["weights"]
    assert [(r["local_rank"], r["node_rank"]) for r in records] == [(0, 0), (0, 1)]


def test_lightning_in_torchruns_shape_matches_torchrun(spark, tmp_path):
    """Trainer(devices=2, num_nodes=1) on the default numbering; torch knows torchrun's
    variables (TORCHELASTIC_RUN_ID), so Lightning uses its torchelastic environment."""
    records = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path)).run_all(
        torch_clients.lightning_fit, devices=2, num_nodes=1)
    assert {r["environment"] for r in records} == {"TorchElasticEnvironment"}
    assert same_on_every_rank(records) == torchrun(
        "lightning", tmp_path, devices=2, num_nodes=1)["weights"]


def lightning_fit_once_every_rank_is_here(meeting, **trainer):
    """lightning_fit, after every rank got here: the run stops its other ranks as soon as one
    fails, and a rank still importing Lightning then would have nothing in its log."""
    import os
    import time

    os.makedirs(meeting, exist_ok=True)
    open(os.path.join(meeting, os.environ["RANK"]), "w").close()
    while len(os.listdir(meeting)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
    return torch_clients.lightning_fit(**trainer)


def test_a_trainer_that_does_not_match_the_ranks_fails_with_lightnings_error(tmp_path):
    runner = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path))
    with pytest.raises(TrainingError) as info:
        runner.run(lightning_fit_once_every_rank_is_here, meeting=str(tmp_path / "meeting"),
                   devices=1, num_nodes=1)
    assert "does not match the world size (2)" in str(info.value)
    log = open(runner.last_run_dir.file(f"logs/rank-{info.value.rank}.log")).read()
    assert "does not match the world size (2)" in log, "the rank named was stopped by Lightning"


def test_a_lightning_script_through_the_cli_in_torchdistributors_numbering(tmp_path):
    script = tmp_path / "train_lightning.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(CLIENTS_FILE)!r})
        import torch_clients
        record = torch_clients.lightning_fit(devices=1, num_nodes=int(sys.argv[1]))
        print("RECORD", json.dumps(record), flush=True)
    """))
    out = subprocess.run(
        [sys.executable, "-m", "sparkhvd.ops.cli", "run", str(script), "--np", "-2", "--backend",
         "torch", "--local-ranks", "task", "--output-dir", str(tmp_path / "runs"), "--", "2"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    record = json.loads(next(line.split("RECORD ", 1)[1] for line in
                             (out.stdout + out.stderr).splitlines() if "RECORD " in line))
    assert (record["world"], record["local_rank"]) == (2, 0)


# -- Hugging Face, accelerate, FSDP2, DeepSpeed -------------------------------------------------
@pytest.mark.parametrize("name", ["hf", "accelerate"])
def test_hugging_face_clients_match_torchrun(name, spark, tmp_path):
    records = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path),
                            env={"HF_HUB_OFFLINE": "1"}).run_all(torch_clients.CLIENTS[name])
    assert same_on_every_rank(records) == torchrun(name, tmp_path)["weights"]


@pytest.fixture(scope="module")
def fsdp2_four_epochs(spark, tmp_path_factory):
    runner = HorovodRunner(np=2, spark=spark, backend="torch",
                           output_dir=str(tmp_path_factory.mktemp("fsdp2")))
    return same_on_every_rank(runner.run_all(torch_clients.fsdp2, epochs=4))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fsdp2_sharded_checkpoints_resume_exactly(spark, tmp_path, fsdp2_four_epochs,
                                                  async_save):
    """2 epochs, then resume_from=True for 2 more: the weights of 4 straight epochs (and of
    torchrun's), from every rank's DCP shards in the run folder -- written synchronously, or
    in the background by DCP's async_save (the last one waited for at the function's end)."""
    four = fsdp2_four_epochs
    HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "b")).run_all(
        torch_clients.fsdp2, epochs=2, async_save=async_save)
    resumed = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=str(tmp_path / "b"),
                            resume_from=True)
    records = resumed.run_all(torch_clients.fsdp2, epochs=4, async_save=async_save)
    assert {r["start"] for r in records} == {2}
    assert same_on_every_rank(records) == four
    restored = resumed.last_run_dir.record["resume"]
    assert restored["epoch"] == 2 and restored["restored"].endswith("epoch-0002")
    folder = resumed.last_run_dir.file("checkpoints")
    record = json.loads(open(os.path.join(folder, "epoch-0004.json")).read())
    assert {f["rank"] for f in record["files"].values()} == {0, 1}, "both ranks' shards"
    for name, entry in record["files"].items():
        assert name.startswith("epoch-0004/")
        assert os.path.getsize(os.path.join(folder, name)) == entry["size"]
    assert json.loads(open(resumed.last_run_dir.file("checkpoints/latest.json")).read())[
        "file"] == "epoch-0004"


def test_deepspeed_zero1_launched_as_sparks_deepspeed_distributor_launches_it(tmp_path):
    """A DeepSpeed script given --deepspeed --deepspeed_config (what Spark's
    DeepspeedTorchDistributor passes), through the drop-in: ZeRO-1 on DeepSpeed's CPU
    accelerator trains torchrun's weights."""
    from sparkhvd.torch import TorchDistributor

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8,
                                  "zero_optimization": {"stage": 1},
                                  "zero_allow_untested_optimizer": True}))
    script = tmp_path / "train_ds.py"
    script.write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(CLIENTS_FILE)!r})\n"
                      "import torch_clients\nsys.argv.insert(1, 'deepspeed_script')\n"
                      "torch_clients.deepspeed_script()\n")
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False,
                                   output_dir=str(tmp_path / "runs"))
    assert distributor.run(str(script), "--deepspeed", "--deepspeed_config", str(config)) is None
    log = open(distributor.last_run_dir.file("logs/rank-0.log")).read()
    record = json.loads(log.split("RECORD ", 1)[1].splitlines()[0])
    assert record["world"] == 2
    assert record["weights"] == torchrun("deepspeed", tmp_path)["weights"]


# -- the drop-in TorchDistributor ---------------------------------------------------------------
def steps(lr, n=3):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i in range(n):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(i + 10 * dist.get_rank()))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "CUDA_VISIBLE_DEVICES")
    out = {"weights": [round(float(v), 6) for p in model.parameters()
                       for v in p.detach().flatten()],
           "env": {k: os.environ.get(k) for k in keys}}
    dist.destroy_process_group()
    return out


def by_value(call):
    """Spark's class pickles by reference: this test's modules go by value for the call."""
    return conftest.by_value(call, sys.modules[__name__], torch_clients)


def test_the_drop_in_gives_what_sparks_class_gives(spark, tmp_path):
    """A function with positional arguments and a script with a command line, through both
    classes on one session: same return value, same numbering; sparkhvd adds the run folder."""
    from pyspark.ml.torch.distributor import TorchDistributor as SparksClass

    from sparkhvd.torch import TorchDistributor

    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark,
                            output_dir=str(tmp_path))
    mine = ours.run(steps, 0.1, 4)
    theirs = by_value(lambda: SparksClass(num_processes=2, local_mode=False, use_gpu=False)
                      .run(torch_clients.leaving_at_exit, steps, 0.1, 4))
    assert mine == theirs
    assert mine["env"] == {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "NODE_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    assert os.path.exists(ours.last_run_dir.file("run.json"))

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, os
        import torch, torch.distributed as dist
        parser = argparse.ArgumentParser()
        parser.add_argument("--scale", type=float)
        args = parser.parse_args()
        dist.init_process_group("gloo")
        t = torch.tensor([args.scale * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"SUM {t.item():g} NODE {os.environ['NODE_RANK']}", flush=True)
    """))
    assert ours.run(str(script), "--scale", "2") is None
    log = open(ours.last_run_dir.file("logs/rank-1.log")).read()
    assert "SUM 6 NODE 1" in log
    with pytest.raises(ValueError, match="key-word"):
        ours.run(str(script), scale=2)


def test_use_gpu_without_gpus_says_how_to_fix_it(spark):
    from sparkhvd.torch import TorchDistributor

    with pytest.raises(RuntimeError, match="spark.task.resource.gpu.amount.*use_gpu=False"):
        TorchDistributor(num_processes=2, local_mode=False, spark=spark)


# -- several ranks per Spark task ---------------------------------------------------------------
def ranks_env(fail_rank=None):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    if dist.get_rank() == fail_rank:
        raise ValueError(f"bad batch on rank {fail_rank}")
    dist.barrier()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE")
    return {"env": {k: int(os.environ[k]) for k in keys}, "sum": total.item(),
            "pid": os.getpid(), "ppid": os.getppid()}


def test_two_tasks_of_two_ranks_each(spark, tmp_path):
    runner = HorovodRunner(np=4, ranks_per_task=2, spark=spark, backend="torch",
                           output_dir=str(tmp_path))
    records = runner.run_all(ranks_env)
    assert [r["env"]["RANK"] for r in records] == [0, 1, 2, 3]
    assert [(r["env"]["LOCAL_RANK"], r["env"]["GROUP_RANK"]) for r in records] == \
        [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert {(r["env"]["LOCAL_WORLD_SIZE"], r["env"]["GROUP_WORLD_SIZE"], r["sum"])
            for r in records} == {(2, 2, 6.0)}
    assert len({r["pid"] for r in records}) == 4, "a process per rank"
    record = runner.last_run_dir.record
    assert record["ranks_per_task"] == 2 and record["slots"] >= 2
    assert sorted(int(k) for k in record["hosts"]) == [0, 1, 2, 3]
    for rank in range(4):
        assert os.path.exists(runner.last_run_dir.file(f"logs/rank-{rank}.log"))

    with pytest.raises(TrainingError) as info:
        HorovodRunner(np=4, ranks_per_task=2, spark=spark, backend="torch",
                      output_dir=str(tmp_path)).run(ranks_env, fail_rank=3)
    assert info.value.rank == 3 and "bad batch on rank 3" in str(info.value)


def load_batch():
    import time

    time.sleep(600)


def rank3_elsewhere():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 3:
        load_batch()
    dist.all_reduce(torch.ones(1))


def test_a_hang_with_two_ranks_per_task_names_each_rank(spark, tmp_path):
    """Stacks hold per rank: the Spark task signals each of its ranks."""
    runner = HorovodRunner(np=4, ranks_per_task=2, spark=spark, backend="torch",
                           output_dir=str(tmp_path))
    with pytest.raises(TimeoutError) as info:
        runner.run(rank3_elsewhere, run_timeout=15)
    message = str(info.value)
    assert "rank 3 is in test_torch_ecosystem.py:" in message and "load_batch()" in message
    assert "ranks 0, 1, 2 wait in all_reduce" in message, message


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no GPU here: runs wherever one is")


def on_gpu():
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    return {"device": torch.cuda.current_device(), "sum": total.item(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


@needs_gpu
def test_on_gpus_nccl_and_one_rank_per_gpu(tmp_path):
    """Wherever a GPU is present: every GPU a rank (np=-N local processes), each on
    cuda:LOCAL_RANK, nccl all_reduce."""
    gpus = torch.cuda.device_count()
    records = HorovodRunner(np=-gpus, backend="torch", output_dir=str(tmp_path)).run_all(on_gpu)
    assert [r["device"] for r in records] == list(range(gpus))
    assert {r["sum"] for r in records} == {float(gpus)}


@needs_gpu
def test_deepspeed_zero1_on_gpus(tmp_path):
    pytest.importorskip("deepspeed")
    gpus = torch.cuda.device_count()
    records = HorovodRunner(np=-gpus, backend="torch", output_dir=str(tmp_path)).run_all(
        torch_clients.deepspeed_zero1)
    assert {r["world"] for r in records} == {gpus}
    assert [r["device"] for r in records] == [f"cuda:{i}" for i in range(gpus)]


@needs_gpu
def test_lightning_and_hf_trainer_on_gpus(tmp_path):
    """The clients as their users write them for GPUs: Trainer(accelerator="gpu") over nccl,
    HF Trainer on CUDA; each rank on its own GPU."""
    gpus = torch.cuda.device_count()
    runner = HorovodRunner(np=-gpus, backend="torch", output_dir=str(tmp_path))
    lightning = runner.run_all(torch_clients.lightning_fit, devices=gpus, num_nodes=1,
                               accelerator="gpu")
    assert [r["device"] for r in lightning] == [f"cuda:{i}" for i in range(gpus)]
    assert {r["backend"] for r in lightning} == {"nccl"}
    assert {r["world"] for r in lightning} == {gpus}
    hf = HorovodRunner(np=-gpus, backend="torch", output_dir=str(tmp_path)).run_all(
        torch_clients.hf_trainer, use_cpu=False)
    assert [r["device"] for r in hf] == [f"cuda:{i}" for i in range(gpus)]


def test_ranks_per_task_is_checked_against_the_slots(spark):
    from sparkhvd.common.errors import NotEnoughSlotsError

    with pytest.raises(NotEnoughSlotsError, match="np=6 with ranks_per_task=2 needs 3 Spark task"):
        HorovodRunner(np=6, ranks_per_task=2, spark=spark, backend="torch").run(ranks_env)


def test_torchdistributors_lightning_shape_on_torchruns_numbering_says_the_fix(tmp_path):
    """Trainer(devices=1, num_nodes=2) with two ranks on one host: Lightning's bare IndexError
    comes with the one-line fix."""
    with pytest.raises(TrainingError) as info:
        HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path)).run(
            torch_clients.lightning_fit)
    assert info.value.exc_type == "IndexError"
    assert "local_ranks='task'" in str(info.value), str(info.value)


def test_fabric_in_torchdistributors_shape_on_torchruns_numbering_names_fabric(tmp_path):
    """The same shape in Lightning Fabric fails in Fabric's strategy: the fix names Fabric."""
    with pytest.raises(TrainingError) as info:
        HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path)).run(
            torch_clients.fabric_fit)
    assert info.value.exc_type == "IndexError"
    message = str(info.value)
    assert "Lightning's Fabric" in message and "Fabric(devices=" in message, message
    assert "Trainer" not in message and "local_ranks='task'" in message
    assert HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path)).run(
        torch_clients.fabric_fit, devices=2, num_nodes=1)["world"] == 2
