"""Other people's PyTorch code, written the way their users write it: a Lightning Trainer, a
Hugging Face Trainer, an accelerate loop, FSDP2 with sharded checkpoints, DeepSpeed ZeRO-1 --
tiny models built from configs (no hub), deterministic, on CPU/gloo.

Each function runs in every rank (through sparkhvd, Spark's TorchDistributor or plain torchrun)
and returns the same kind of record: this rank, the world size its library saw, and the final
weights. Run as a script under torchrun (``python -m torch.distributed.run --nproc-per-node 2
tests/torch_clients.py NAME OUT``), rank 0 writes its record to OUT as JSON: the reference.
"""
from __future__ import annotations

import json
import os
import sys


def leaving_at_exit(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a process that then leaves with ``os._exit`` once Python's
    exit work began -- for Spark's TorchDistributor, whose script writes the result before it
    ends. torch 2.13's gloo sometimes aborts in the interpreter's teardown after DDP
    ("terminate called without an active exception", SIGABRT; seen in 2 of 12 plain torchrun
    runs), and torchrun's agent on the other task then waits out its 300-s exit barrier (no
    option sets it): +300 s for the test, its result unchanged. sparkhvd's ranks leave this
    way already (the supervisor's ``os._exit``)."""
    import atexit

    def leave():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    atexit.register(leave)  # registered last, run first: before any teardown
    return fn(*args, **kwargs)


def _weights(module) -> list[float]:
    return [round(float(v), 6) for p in module.parameters()
            for v in p.detach().flatten().tolist()]


def lightning_fit(devices: int = 1, num_nodes: int = 2, root: str | None = None,
                  accelerator: str = "cpu") -> dict:
    """A LightningModule trained with ``Trainer(strategy="ddp", devices, num_nodes)``; with
    ``root``, Lightning's checkpoints go to ``<run folder>/<root>`` (``sparkhvd.torch.output_dir``).
    """
    import lightning as L
    import torch

    if root is not None:
        import sparkhvd.torch as st

        root = st.output_dir(root)

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    model = Regression()
    trainer = L.Trainer(accelerator=accelerator, strategy="ddp", devices=devices,
                        num_nodes=num_nodes,
                        max_epochs=2, enable_progress_bar=False, enable_model_summary=False,
                        logger=False, enable_checkpointing=root is not None,
                        default_root_dir=root)
    trainer.fit(model, loader)
    return {"rank": trainer.global_rank, "world": trainer.world_size,
            "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "device": str(trainer.strategy.root_device),
            "backend": getattr(trainer.strategy, "process_group_backend", None),
            "weights": _weights(model)}


def fabric_fit(devices: int = 1, num_nodes: int = 2) -> dict:
    """A loop under Lightning Fabric: ``Fabric(strategy="ddp", devices, num_nodes)``."""
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=devices, num_nodes=num_nodes)
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(64, 4)
    for i in range(0, 64, 8):
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x[i:i + 8]), x[i:i + 8].sum(1, True)))
        optimizer.step()
    return {"rank": fabric.global_rank, "world": fabric.world_size,
            "weights": _weights(model)}


def hf_trainer(output_dir: str | None = None, save_steps: int = 0, use_cpu: bool = True) -> dict:
    """A tiny BERT fine-tuned by ``transformers.Trainer`` for 10 steps; with ``output_dir``, its
    checkpoints go to ``<run folder>/<output_dir>`` (``sparkhvd.torch.output_dir``)."""
    import tempfile

    if output_dir is not None:
        import sparkhvd.torch as st

        output_dir = st.output_dir(output_dir)

    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (80, 12), generator=generator)
    labels = (ids[:, 0] % 2).tolist()
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(12, dtype=torch.long),
             "labels": labels[i]} for i in range(80)]
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(), max_steps=10, per_device_train_batch_size=4,
        learning_rate=1e-3, seed=0, report_to=[], use_cpu=use_cpu, disable_tqdm=True,
        logging_steps=100, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return {"rank": args.process_index, "world": args.world_size, "device": str(args.device),
            "weights": _weights(model)}


def accelerate_loop() -> dict:
    """A plain training loop made distributed by ``accelerate.Accelerator``."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(2):
        for xb, yb in loader:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
    return {"rank": accelerator.process_index, "world": accelerator.num_processes,
            "weights": _weights(accelerator.unwrap_model(model))}


def fsdp2(epochs: int = 4, async_save: bool = False) -> dict:
    """FSDP2 (``fully_shard``) with Adam, sharded checkpoints in the run folder
    (:class:`sparkhvd.torch.ShardedCheckpoints`, written in the background with
    ``async_save``) and exact resume."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import sparkhvd.torch as st

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    checkpoints = st.ShardedCheckpoints(model, optimizer, async_save=async_save)
    start = checkpoints.restore()
    for epoch in range(start, epochs):
        data = torch.Generator().manual_seed(1000 * epoch + rank)
        for _ in range(4):
            x = torch.randn(16, 8, generator=data)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            optimizer.step()
        checkpoints.save(epoch)
    full = [round(float(v), 6) for p in model.parameters()
            for v in p.full_tensor().detach().flatten().tolist()]
    world = dist.get_world_size()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "start": start, "weights": full}


def deepspeed_zero1(config: dict | None = None) -> dict:
    """DeepSpeed ZeRO stage 1 with torch's Adam on the accelerator DeepSpeed finds (its CPU one
    over gloo here, CUDA over nccl on a GPU host)."""
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = config or {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                        "zero_optimization": {"stage": 1},
                        "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank = engine.global_rank
    data = torch.Generator().manual_seed(3 + rank)
    for _ in range(5):
        x = torch.randn(8, 6, generator=data).to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
    return {"rank": rank, "world": engine.world_size, "device": str(engine.device),
            "weights": _weights(engine.module)}


def deepspeed_script() -> None:
    """``main()`` of a DeepSpeed script: ``--deepspeed --deepspeed_config ds.json`` as Spark's
    ``DeepspeedTorchDistributor`` passes them; rank 0 prints its record as JSON."""
    import argparse

    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(sys.argv[2:])
    assert args.deepspeed, "--deepspeed did not reach the script"
    with open(args.deepspeed_config) as f:
        record = deepspeed_zero1(json.load(f))
    if record["rank"] == 0:
        print("RECORD " + json.dumps(record), flush=True)


CLIENTS = {"lightning": lightning_fit, "hf": hf_trainer, "accelerate": accelerate_loop,
           "fsdp2": fsdp2, "deepspeed": deepspeed_zero1}


if __name__ == "__main__":
    if sys.argv[1] == "deepspeed_script":
        deepspeed_script()
    else:
        kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        result = CLIENTS[sys.argv[1]](**kwargs)
        if result["rank"] == 0:
            with open(sys.argv[2], "w") as f:
                json.dump(result, f)
        # End as a sparkhvd rank ends: a group the library left open (Lightning does) can make
        # torch 2.13's gloo abort at interpreter exit ("terminate called without an active
        # exception"), which failed the reference run, not the code under test.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
