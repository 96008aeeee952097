"""B5 and B5D: ResNet-50 on a GPU, and fed from a DataFrameDataset (run by bench.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from bench_common import ROOT, local_spark, stats, turns


def _resnet50_images(steps: int, batch: int, distributed: bool) -> dict:
    """B5's loop: ResNet-50 (torchvision, random weights) on synthetic 224x224 images, bf16
    autocast, channels-last, SGD; images/s over the steps after 10 warm-up steps. With
    ``distributed``: DDP over nccl, one rank per GPU (cuda:LOCAL_RANK), as a sparkhvd rank runs
    it; without: one plain process on cuda:0, nothing of sparkhvd or torch.distributed."""
    import os as _os
    import time as _time

    import torch
    import torchvision

    local = int(_os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    size = 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl")
        size = dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    warm = 10
    for step in range(warm + steps):
        if step == warm:
            torch.cuda.synchronize()
            start = _time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    seconds = _time.perf_counter() - start
    if distributed:
        dist.destroy_process_group()
    return {"samples_per_s": steps * batch * size / seconds,
            "device": torch.cuda.get_device_name(local)}


def _resnet50_from_dataset(ds, steps: int, batch: int) -> dict:
    """B5D's rank: the B5 loop (DDP over nccl, bf16, channels-last) fed from a
    ``DataFrameDataset`` -- int8 images, shuffled, streamed, handed out on the GPU by
    ``torch_batches(..., device=...)`` (pinned memory, copied one batch ahead) and made floats
    there; images/s after 10 warm-up steps."""
    import os as _os
    import time as _time

    import torch
    import torch.distributed as dist
    import torchvision

    local = int(_os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    torch.backends.cudnn.benchmark = True
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(
        torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last),
        device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ds.memory_cache = 0  # read from the files every epoch, as a dataset larger than memory

    def batches():
        epoch = 0
        while True:
            yield from ds.torch_batches(batch, epoch, shuffle=True, seed=1, device="cuda")
            epoch += 1

    warm = 10
    for step, (x, y) in zip(range(warm + steps), batches()):
        if step == warm:
            torch.cuda.synchronize()
            start = _time.perf_counter()
        images = (x.view(-1, 3, 224, 224).float() / 128).contiguous(
            memory_format=torch.channels_last)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), y.long() % 1000)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    seconds = _time.perf_counter() - start
    size = dist.get_world_size()
    dist.destroy_process_group()
    return {"samples_per_s": steps * batch * size / seconds}


def _b5d(repeat: int, tiny: bool, gpus: int, name: str) -> list[dict]:
    """B5D: ResNet-50 fed from a DataFrameDataset vs the same loop on synthetic on-device data,
    both through sparkhvd at np=-GPUs, taking turns (goal: >= 0.9x)."""
    from pyspark.sql import functions as F

    from sparkhvd import DataFrameDataset, HorovodRunner

    steps, batch = (5, 8) if tiny else (60, 128)
    rows_n = 64 if tiny else 4096  # 4096 x 150,528 int8 = 617 MB
    spark = local_spark()
    df = spark.range(rows_n, numPartitions=8).select(
        F.array_repeat((F.col("id") % 100).cast("byte"), 3 * 224 * 224).alias("x"),
        (F.col("id") % 1000).alias("y"))
    out = tempfile.mkdtemp(prefix="bench-b5d-")
    with DataFrameDataset(df, "x", "y").materialize() as ds:
        results = turns("B5", f"B5D: ResNet-50 bf16 batch {batch}/GPU, {gpus} GPU(s)", repeat, {
            "synthetic images on the GPU": lambda: HorovodRunner(
                np=-gpus, backend="torch", output_dir=out).run(
                _resnet50_images, steps=steps, batch=batch, distributed=True),
            "fed from a DataFrameDataset (torch_batches(device='cuda'), streamed, shuffled)":
                lambda: HorovodRunner(np=-gpus, backend="torch", output_dir=out).run(
                    _resnet50_from_dataset, ds=ds, steps=steps, batch=batch)})
    for r in results:
        r.update(unit="images/s", gpu=name)
    return results


def _plain_resnet50(steps: int, batch: int) -> dict:
    """B5's reference: the same loop in a fresh plain Python process (no sparkhvd)."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import b5; "
            f"print('RESULT ' + json.dumps(b5._resnet50_images({steps}, {batch}, False)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def case_b5(repeat: int, tiny: bool) -> list[dict]:
    """GPU training throughput: ResNet-50 images/s through sparkhvd (backend='torch', np=-GPUs:
    one local rank per GPU, DDP over nccl) vs the same loop in one plain process, taking turns.
    The Keras form of B5 needs TensorFlow with a GPU; it is recorded as skipped without one."""
    import importlib.util

    rows: list[dict] = []
    gpus = 0
    if importlib.util.find_spec("torch") is not None:
        import torch

        gpus = torch.cuda.device_count()
    if not gpus or importlib.util.find_spec("torchvision") is None:
        rows.append({"case": "B5", "variant": "ResNet-50 images/s (GPU, torch)",
                     "unit": "images/s", "skipped": "no GPU (or no torchvision) on this machine; "
                     "run `make bench CASE=B5` on a GPU host"})
        rows.append({"case": "B5", "variant": "B5D: ResNet-50 fed from a DataFrameDataset vs "
                     "synthetic data on the GPU", "unit": "images/s",
                     "skipped": "no GPU (or no torchvision) on this machine"})
        rows.append({"case": "B5", "variant": "checkpoint every step on a GPU: the step held "
                     "by the device-to-host copy (b15.gpu_rows)", "unit": "s",
                     "skipped": "no GPU on this machine"})
    else:
        from sparkhvd import HorovodRunner

        steps, batch = (5, 8) if tiny else (60, 128)
        out = tempfile.mkdtemp(prefix="bench-b5-")
        results = turns("B5", f"ResNet-50 bf16 batch {batch}/GPU, {gpus} GPU(s)", repeat, {
            "plain torch, one process": lambda: _plain_resnet50(steps, batch),
            f"sparkhvd HorovodRunner(np=-{gpus}, backend='torch'), DDP nccl":
                lambda: HorovodRunner(np=-gpus, backend="torch", output_dir=out)
                .run(_resnet50_images, steps=steps, batch=batch, distributed=True)})
        name = torch.cuda.get_device_name(0)
        for r in results:
            r.update(unit="images/s", gpu=name)
        import b15

        rows += results + _b5d(repeat, tiny, gpus, name) + b15.gpu_rows(repeat, tiny, stats)
    tf_gpus = []
    if importlib.util.find_spec("tensorflow") is not None and gpus:
        import tensorflow as tf

        tf_gpus = tf.config.list_physical_devices("GPU")
    if not tf_gpus:
        rows.append({"case": "B5", "variant": "ResNet-50 images/s (GPU, Keras)",
                     "unit": "images/s", "skipped": "needs TensorFlow with a GPU; "
                     "not measured here"})
    return rows
