"""B12's Ray Train v2 side: the loop of sparkhvd's B12 rank on Ray on Spark.

``setup_ray_cluster`` on ``local[2]`` (two Ray worker nodes, one per task slot), a
``TorchTrainer`` of 2 workers with ``FailureConfig(max_failures=1)``, a checkpoint every
``every`` steps and at each epoch's end through ``ray.train.report``, of B12's model
(``wide``: B15's, about 1 GB of state with Adam, each checkpoint uploaded with
``CheckpointUploadMode.ASYNC``); rank 1's worker process is SIGKILLed after
``(epoch, step)``. Prints ``RESULT {"recovery_s": ..., "redone": ..., "steps_per_s": ...}``:
from the kill to rank 0's first step after the restart, the steps a rank trained twice, and
rank 0's steps/s before the kill.

Run by ``bench.py`` (``case_b12``) with the Ray environment's Python (``.venv-ray``, made by
``make bench CASE=B12 PROFILE=torch``) under ``unshare -n`` with only the loopback up: Ray then
keeps every address on 127.0.0.1 (elsewhere it rewrites 127.0.0.1 to the machine's address).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time


def loop(config: dict) -> None:
    import os as _os
    import sys
    import tempfile as _tempfile
    import time as _time

    import ray.train
    import torch
    from ray.train import Checkpoint, CheckpointUploadMode

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    checkpoint = ray.train.get_checkpoint()
    attempt = 1 if checkpoint else 0
    log_dir = config["log_dir"]
    open(_os.path.join(log_dir, f"pid-{rank}-{_os.getpid()}"), "w").close()
    log = open(_os.path.join(log_dir, f"rank-{rank}.txt"), "a")
    sys.path.insert(0, config["bench_dir"])
    from b12 import model_and_loss  # the model and step of sparkhvd's B12 rank

    module, optimizer, settings, loss_of = model_and_loss(config["wide"])
    model = ray.train.torch.prepare_model(module)
    opt = optimizer(model.parameters(), **settings)
    start_epoch, start_step = 0, 0
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(_os.path.join(folder, "state.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch, start_step = state["epoch"], state["step"]
    for epoch in range(start_epoch, config["epochs"]):
        first = start_step + 1 if epoch == start_epoch else 1
        for step in range(first, config["steps"] + 1):
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()
            log.write(f"{attempt} {epoch} {step} {_time.time():.3f}\n")
            log.flush()
            end = step == config["steps"]
            if end or (config["every"] and step % config["every"] == 0):
                where = (epoch + 1, 0) if end else (epoch, step)
                if rank != 0:
                    ray.train.report({"epoch": epoch, "step": step})
                elif config["wide"]:  # Ray's asynchronous upload (the local copy then deleted)
                    folder = _tempfile.mkdtemp()
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "epoch": where[0], "step": where[1]},
                               _os.path.join(folder, "state.pt"))
                    ray.train.report({"epoch": epoch, "step": step},
                                     checkpoint=Checkpoint.from_directory(folder),
                                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                                     delete_local_checkpoint_after_upload=True)
                else:
                    with _tempfile.TemporaryDirectory() as folder:
                        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                    "epoch": where[0], "step": where[1]},
                                   _os.path.join(folder, "state.pt"))
                        ray.train.report({"epoch": epoch, "step": step},
                                         checkpoint=Checkpoint.from_directory(folder))
            _time.sleep(config["step_s"])


def steps_per_s(times: list) -> float:
    """Rank 0's training speed before the loss (as ``b12.steps_per_s``)."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def main(epochs: int, steps: int, at_epoch: int, at_step: int, every: int,
         step_s: float, wide: bool = False) -> None:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the Spark tasks that run Ray's nodes
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    from ray.util.spark import setup_ray_cluster, shutdown_ray_cluster

    log_dir = tempfile.mkdtemp(prefix="bench-b12-ray-")
    setup_ray_cluster(max_worker_nodes=2, num_cpus_head_node=0)  # a task slot each: 1 CPU
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
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
    store = tempfile.mkdtemp(prefix="bench-b12-ray-store-")  # the newest two, as sparkhvd's
    trainer = TorchTrainer(
        loop, train_loop_config={"log_dir": log_dir, "epochs": epochs, "steps": steps,
                                 "every": every, "step_s": step_s, "wide": wide,
                                 "bench_dir": os.path.dirname(os.path.abspath(__file__))},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=store, failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    try:
        trainer.fit()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    resumed = [t for a, _, _, t in lines(0) if a == 1]
    redone = max(len({(e, s) for a, e, s, _ in lines(r) if a == 0} &
                     {(e, s) for a, e, s, _ in lines(r) if a == 1}) for r in (0, 1))
    before = [t for a, _, _, t in lines(0) if a == 0]
    print("RESULT " + json.dumps({"recovery_s": resumed[0] - sent["at"], "redone": redone,
                                  "steps_per_s": steps_per_s(before)}), flush=True)
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
    main(*(int(v) for v in sys.argv[1:6]), float(sys.argv[6]),
         len(sys.argv) > 7 and sys.argv[7] == "wide")
