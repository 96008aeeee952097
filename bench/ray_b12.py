"""B12's Ray Train v2 side: the loop of sparkhvd's B12 rank on Ray on Spark.

``setup_ray_cluster`` on ``local[2]`` (two Ray worker nodes, one per task slot), a
``TorchTrainer`` of 2 workers with ``FailureConfig(max_failures=1)``, a checkpoint every
``every`` steps and at each epoch's end through ``ray.train.report``; rank 1's worker process
is SIGKILLed after ``(epoch, step)``. Prints ``RESULT {"recovery_s": ..., "redone": ...}``:
from the kill to rank 0's first step after the restart, and the steps a rank trained twice.

Run by ``bench.py`` (``case_b12``) with the Ray environment's Python (``.venv-ray``, made by
``make bench CASE=B12 PROFILE=torch``) under ``unshare -n`` with only the loopback up: Ray then
keeps every address on 127.0.0.1 (elsewhere it rewrites 127.0.0.1 to the machine's address).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time


def loop(config: dict) -> None:
    import os as _os
    import tempfile as _tempfile
    import time as _time

    import ray.train
    import torch
    from ray.train import Checkpoint

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    checkpoint = ray.train.get_checkpoint()
    attempt = 1 if checkpoint else 0
    log_dir = config["log_dir"]
    open(_os.path.join(log_dir, f"pid-{rank}-{_os.getpid()}"), "w").close()
    log = open(_os.path.join(log_dir, f"rank-{rank}.txt"), "a")
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start_epoch, start_step = 0, 0
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(_os.path.join(folder, "state.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch, start_step = state["epoch"], state["step"]
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for epoch in range(start_epoch, config["epochs"]):
        first = start_step + 1 if epoch == start_epoch else 1
        for step in range(first, config["steps"] + 1):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            log.write(f"{attempt} {epoch} {step} {_time.time():.3f}\n")
            log.flush()
            end = step == config["steps"]
            if end or (config["every"] and step % config["every"] == 0):
                where = (epoch + 1, 0) if end else (epoch, step)
                with _tempfile.TemporaryDirectory() as folder:
                    if rank == 0:
                        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                    "epoch": where[0], "step": where[1]},
                                   _os.path.join(folder, "state.pt"))
                        ray.train.report({"epoch": epoch, "step": step},
                                         checkpoint=Checkpoint.from_directory(folder))
                    else:
                        ray.train.report({"epoch": epoch, "step": step})
            _time.sleep(config["step_s"])


def main(epochs: int, steps: int, at_epoch: int, at_step: int, every: int,
         step_s: float) -> None:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the Spark tasks that run Ray's nodes
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    from ray.util.spark import setup_ray_cluster, shutdown_ray_cluster

    log_dir = tempfile.mkdtemp(prefix="bench-b12-ray-")
    setup_ray_cluster(max_worker_nodes=2, num_cpus_head_node=0)  # a task slot each: 1 CPU
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(ignore_reinit_error=True)
    sent: dict = {}

    def lines(rank: int) -> list:
        path = os.path.join(log_dir, f"rank-{rank}.txt")
        if not os.path.exists(path):
            return []
        return [(int(a), int(e), int(s), float(t)) for a, e, s, t in
                (line.split() for line in open(path) if line.count(" ") == 3)]

    def kill() -> None:
        while not any((e, s) >= (at_epoch, at_step) for a, e, s, _ in lines(1) if a == 0):
            time.sleep(0.02)
        pid = next(int(f.split("-")[2]) for f in os.listdir(log_dir) if f.startswith("pid-1-"))
        sent["at"] = time.time()
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    trainer = TorchTrainer(
        loop, train_loop_config={"log_dir": log_dir, "epochs": epochs, "steps": steps,
                                 "every": every, "step_s": step_s},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="bench-b12-ray-store-"),
                             failure_config=FailureConfig(max_failures=1)))
    trainer.fit()
    resumed = [t for a, _, _, t in lines(0) if a == 1]
    redone = max(len({(e, s) for a, e, s, _ in lines(r) if a == 0} &
                     {(e, s) for a, e, s, _ in lines(r) if a == 1}) for r in (0, 1))
    print("RESULT " + json.dumps({"recovery_s": resumed[0] - sent["at"], "redone": redone}),
          flush=True)
    shutdown_ray_cluster()
    spark.stop()
    _stop_leftovers()


def _stop_leftovers() -> None:
    """Ray leaves agent processes behind after its shutdown: stop them by PID -- every process
    in this network namespace (made for this run by ``unshare -n``) but this one."""
    import psutil

    mine = os.readlink("/proc/self/ns/net")
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.readlink(f"/proc/{proc.pid}/ns/net") == mine:
                proc.kill()
        except (OSError, psutil.Error):
            continue


if __name__ == "__main__":
    main(*(int(v) for v in sys.argv[1:6]), float(sys.argv[6]))
