"""The training function the elastic and notice tests run (pickled by value into the ranks):
a linear model on the ids' rows, sparkhvd's step checkpoints with the data's position, and a
log per attempt and rank of every step's ids (and the bytes the rank's data read so far) --
what tells which ids each attempt trained, at which world size, and how many steps a notice or
a loss cost."""
from __future__ import annotations

import os


def train_ids(data, epochs, log_dir, step_s=0.0, every_steps=1000, notice_at=None,
              sharded=False, async_save=False, url=None, storage_options=None, hold=None):
    """``step_s``: seconds to sleep after each step, or one value per attempt (the last one for
    later attempts) -- a slow attempt leaves the test time to act in it.
    ``notice_at=(epoch, step, rank)``: that rank of the first attempt gets SIGTERM -- a
    node's notice -- right after that step. Logs ``<log_dir>/a<attempt>-r<rank>.txt``: a
    ``world BEFORE NOW pid PID`` line, then ``EPOCH STEP id id ...`` and ``read FILES HOST
    DRIVER`` (bytes from the files, from the rows kept on the host and from the driver's copies)
    per step; with
    ``log_dir=None`` it prints them (``elastic-log a<attempt>-r<rank> ...``: ranks on hosts
    that cannot see the driver's disk), read back by :func:`read_lines`. ``url`` and
    ``storage_options``: a checkpoint folder other than the run folder's.
    ``hold=(attempt, steps)``: that attempt's ranks wait after their ``steps``-th step until a
    notice comes (at most 240 s) -- a resize the test brings about is seen in that attempt,
    however long the cluster takes to bring the capacity."""
    import signal
    import time

    import torch

    import sparkhvd.torch as st
    from sparkhvd.elastic.notices import noticed

    ctx = st.setup()
    change = st.world_size_change()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    kind = st.ShardedCheckpoints if sharded else st.Checkpoints
    ckpt = kind(model, opt, data=data, every_steps=every_steps, keep=3, url=url,
                storage_options=storage_options,
                **({"async_save": True} if async_save else {}))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if isinstance(step_s, (list, tuple)):
        step_s = step_s[min(attempt, len(step_s) - 1)]
    log = open(os.path.join(log_dir, f"a{attempt}-r{ctx.rank}.txt"), "a") if log_dir else \
        _Printed(f"elastic-log a{attempt}-r{ctx.rank}")
    log.write(f"world {change.before} {change.now} pid {os.getpid()}\n")
    log.flush()
    steps_here = 0
    for epoch in range(ckpt.restore(), epochs):
        for features, y in data.torch_batches(4, epoch, shuffle=True, seed=4):
            x, ids = features["x"], features["id"]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            step = data.position.step
            log.write(f"{epoch} {step} {' '.join(str(int(i)) for i in ids)}\n")
            log.flush()
            if attempt == 0 and notice_at == (epoch, step, ctx.rank):
                os.kill(os.getpid(), signal.SIGTERM)
            steps_here += 1
            if hold == (attempt, steps_here):
                waited = time.monotonic()
                while noticed() is None and time.monotonic() - waited < 240:
                    time.sleep(0.05)
            log.write(f"read {data.bytes_read} {data.host_bytes_read} "
                      f"{data.driver_bytes_read}\n")
            ckpt.step(epoch)
            if step_s:
                time.sleep(step_s)
        ckpt.save(epoch)
    return {"world": ctx.world_size, "change": tuple(change)}


class _Printed:
    def __init__(self, prefix):
        self.prefix = prefix

    def write(self, text):
        for line in text.splitlines():
            print(f"{self.prefix} {line}", flush=True)

    def flush(self):
        pass


def read_lines(lines):
    """:func:`read_logs` of what the ranks printed (the driver's ``[rank N] ...`` lines)."""
    out: dict = {}
    for line in list(lines):
        if "elastic-log a" not in line:
            continue
        name, *words = line.split("elastic-log ", 1)[1].split()
        attempt, rank = (int(part[1:]) for part in name.split("-"))
        entry = out.setdefault(attempt, {}).setdefault(rank, {"steps": []})
        _parse(entry, words)
    return out


def _parse(entry, words):
    if words[0] == "world":
        entry.update(world=(int(words[1]), int(words[2])), pid=int(words[4]))
    elif words[0] == "read":  # bytes from the files, the rows kept on the host, the driver
        entry["read"] = tuple(int(w) for w in words[1:4])
    elif len(words) >= 2:
        entry["steps"].append((int(words[0]), int(words[1]), [int(w) for w in words[2:]]))


def read_logs(log_dir):
    """``{attempt: {rank: {"world": (before, now), "pid": pid, "steps": [(epoch, step, ids)]}}}``."""
    out: dict = {}
    for name in sorted(os.listdir(log_dir)):
        attempt, rank = (int(part[1:]) for part in name[:-4].split("-"))
        entry: dict = {"steps": []}
        for line in open(os.path.join(log_dir, name)):
            _parse(entry, line.split())
        out.setdefault(attempt, {})[rank] = entry
    return out


def ids_of_epoch(logs, epoch):
    """Every id trained in ``epoch``, over every attempt and rank (a list: repeats show)."""
    return [i for ranks in logs.values() for entry in ranks.values()
            for e, _, ids in entry["steps"] if e == epoch for i in ids]


def _mark(log_dir, name):
    """A file per rank process, ``<name>-<rank>-<pid>``: where the test finds whom to kill."""
    open(os.path.join(log_dir, f"{name}-{os.environ.get('RANK', '0')}-{os.getpid()}"),
         "w").close()


def _held_until_killed(step, hold_from):
    """On the run's first attempt, from step ``hold_from`` on, wait to be killed (the test
    kills this rank once the job it waited behind ended): the run cannot end before the
    relaunch it tests, however long that job takes to end (a 2-minute cap)."""
    import time

    if hold_from is None or step < hold_from or \
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


def hf_elastic(log_dir, max_steps=12, hold_from=None):
    """A Hugging Face Trainer that resumes from its own checkpoints in the run folder after any
    relaunch, at any world size -- the one line: ``resume_from_checkpoint=
    st.last_checkpoint(output_dir)`` (the newest *complete* one: a rank killed while the Trainer
    wrote one leaves it torn). Logs each step's global step and world size; ``hold_from``:
    :func:`_held_until_killed`."""
    import time

    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    import sparkhvd.torch as st

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _mark(log_dir, "hf")
    out = st.output_dir("hf")
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2))
    ids = torch.randint(0, 64, (256, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(12, dtype=torch.long),
             "labels": int(ids[i, 0] % 2)} for i in range(len(ids))]

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            with open(os.path.join(log_dir, f"steps-{args.process_index}.txt"), "a") as f:
                f.write(f"{state.global_step} {args.world_size}\n")
            time.sleep(0.2)
            _held_until_killed(state.global_step, hold_from)

    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=2, learning_rate=1e-3, seed=0,
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=100,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Slow()])
    trainer.train(resume_from_checkpoint=st.last_checkpoint(out))  # the one line
    return {"world": args.world_size, "step": trainer.state.global_step}


def lightning_elastic(log_dir, max_steps=12, hold_from=None):
    """Lightning's Trainer resuming from its own ``last.ckpt`` in the run folder -- the one
    line: ``trainer.fit(..., ckpt_path="last")`` -- with devices and nodes as this attempt's
    world has them; ``hold_from``: :func:`_held_until_killed`."""
    import time

    import lightning as L
    import torch

    import sparkhvd.torch as st

    _mark(log_dir, "lightning")
    root = st.output_dir("lightning")

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def on_train_batch_end(self, *_):
            with open(os.path.join(log_dir, f"steps-{self.global_rank}.txt"), "a") as f:
                f.write(f"{self.global_step} {self.trainer.world_size}\n")
            time.sleep(0.2)
            _held_until_killed(self.global_step, hold_from)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(512, 4)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    saves = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True,
                                                every_n_train_steps=2)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp",
                        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), max_steps=max_steps,
                        enable_progress_bar=False, enable_model_summary=False, logger=False,
                        callbacks=[saves], default_root_dir=root)
    trainer.fit(Regression(), loader, ckpt_path="last")  # the one line
    return {"world": trainer.world_size, "step": trainer.global_step}


def read_steps(log_dir):
    """Every ``(global step, world size)`` rank 0 logged, in order."""
    path = os.path.join(log_dir, "steps-0.txt")
    return [tuple(int(w) for w in line.split()) for line in open(path)] \
        if os.path.exists(path) else []
