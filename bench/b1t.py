"""B1T, B8, B10: PyTorch side by side with Spark's TorchDistributor (run by bench.py)."""
from __future__ import annotations

import os
import tempfile
import time

from bench_common import interleaved, local_spark, stats, torch_unavailable, turns


def case_b1t(repeat: int, tiny: bool) -> list[dict]:
    """B1 for PyTorch: a no-op at np=2 that joins the process group (what every torch run does
    first), through sparkhvd (backend='torch': its ranks forked from the executor's warm
    process after the first run -- and with ``warm_start=False``, every rank a fresh process)
    and through TorchDistributor, interleaved; each timed run right after an untimed one of the
    same launcher (a cell run again)."""
    why = torch_unavailable()
    if why:
        return [{"case": "B1T", "variant": "no-op, sparkhvd vs TorchDistributor", "unit": "s",
                 "skipped": f"{why}: make bench CASE=B1T PROFILE=torch"}]
    from pyspark.ml.torch.distributor import TorchDistributor

    from sparkhvd import HorovodRunner

    spark = local_spark()
    out = tempfile.mkdtemp(prefix="bench-b1t-")
    timings = interleaved([
        ("sparkhvd HorovodRunner(backend='torch'), init_process_group no-op",
         lambda: HorovodRunner(np=2, spark=spark, backend="torch", output_dir=out)
         .run(_torch_noop)),
        ("sparkhvd HorovodRunner(backend='torch', warm_start=False), init_process_group no-op",
         lambda: HorovodRunner(np=2, spark=spark, backend="torch", output_dir=out,
                               warm_start=False).run(_torch_noop)),
        ("TorchDistributor(local_mode=False), init_process_group no-op",
         lambda: TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
         .run(_torch_noop))], repeat, primed=True)
    return [{"case": "B1T", "variant": name, "unit": "s", **stats(values)}
            for name, values in timings.items()]


def _torch_noop():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.destroy_process_group()
    return 0


def _torch_digits(epochs):
    """A plain DDP loop on the digits (no sparkhvd helpers): what both launchers run in B8."""

    import torch
    import torch.distributed as dist

    from sparkhvd.examples.digits import load_digits_split

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    x_train, _, y_train, _ = load_digits_split()
    x = torch.from_numpy(x_train.reshape(len(x_train), 64))[rank::size]
    y = torch.from_numpy(y_train)[rank::size]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps, start = 0, time.perf_counter()
    for _ in range(epochs):
        for i in range(0, len(x) - 32 + 1, 32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
            opt.step()
            steps += 1
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"samples_per_s": steps * 32 * size / seconds}


def case_b8(repeat: int, tiny: bool) -> list[dict]:
    """Small training throughput, np=2 on CPU: the same DDP loop through sparkhvd and through
    TorchDistributor (samples/s inside the loop, both ranks together; launch excluded)."""
    why = torch_unavailable()
    if why:
        return [{"case": "B8", "variant": "digits DDP, sparkhvd vs TorchDistributor",
                 "unit": "samples/s", "skipped": f"{why}: make bench CASE=B8 PROFILE=torch"}]
    from pyspark.ml.torch.distributor import TorchDistributor

    from sparkhvd import HorovodRunner

    spark = local_spark()
    out = tempfile.mkdtemp(prefix="bench-b8-")
    epochs = 2 if tiny else 20
    return turns("B8", f"digits MLP DDP, {epochs} epochs", repeat, {
        "sparkhvd HorovodRunner(backend='torch')":
            lambda: HorovodRunner(np=2, spark=spark, backend="torch", output_dir=out)
            .run(_torch_digits, epochs=epochs),
        "TorchDistributor(local_mode=False)":
            lambda: TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
            .run(_torch_digits, epochs)})


def _hf_throughput(steps):
    """A Hugging Face Trainer fine-tuning a small BERT built from a config (no hub): samples/s
    of its training loop, both ranks together, as Trainer itself reports it."""

    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64, num_labels=2))
    ids = torch.randint(0, 1000, (2048, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(32, dtype=torch.long),
             "labels": int(ids[i, 0] % 2)} for i in range(len(ids))]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps,
                             per_device_train_batch_size=16, report_to=[], use_cpu=True,
                             disable_tqdm=True, logging_steps=10_000, save_strategy="no",
                             dataloader_num_workers=0, seed=0)
    metrics = Trainer(model=model, args=args, train_dataset=data).train().metrics
    return {"samples_per_s": float(metrics["train_samples_per_second"])}


def case_b10(repeat: int, tiny: bool) -> list[dict]:
    """A real client's training throughput, np=2 on CPU: the same Hugging Face Trainer function
    through sparkhvd (backend='torch', the drop-in TorchDistributor) and through Spark's
    TorchDistributor, taking turns (samples/s of the training loop; launch excluded)."""
    why = torch_unavailable()
    import importlib.util

    if not why and importlib.util.find_spec("transformers") is None:
        why = "transformers is not installed in this profile"
    if why:
        return [{"case": "B10", "variant": "HF Trainer, sparkhvd vs TorchDistributor",
                 "unit": "samples/s", "skipped": f"{why}: make bench CASE=B10 PROFILE=torch"}]
    from pyspark.ml.torch.distributor import TorchDistributor

    from sparkhvd.torch import TorchDistributor as DropIn

    spark = local_spark()
    out = tempfile.mkdtemp(prefix="bench-b10-")
    steps = 5 if tiny else 300
    return turns("B10", f"HF Trainer (BERT 2x64), {steps} steps", repeat, {
        "sparkhvd.torch.TorchDistributor":
            lambda: DropIn(num_processes=2, local_mode=False, use_gpu=False, spark=spark,
                           output_dir=out).run(_hf_throughput, steps),
        "Spark's TorchDistributor(local_mode=False)":
            lambda: TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
            .run(_hf_throughput, steps)})
