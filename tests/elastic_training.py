"""The training function the elastic and notice tests run (pickled by value into the ranks):
a linear model on the ids' rows, sparkhvd's step checkpoints with the data's position, and a
log per attempt and rank of every step's ids -- what tells which ids each attempt trained, at
which world size, and how many steps a notice or a loss cost."""
from __future__ import annotations

import os


def train_ids(data, epochs, log_dir, step_s=0.0, every_steps=1000, notice_at=None,
              sharded=False):
    """``notice_at=(epoch, step, rank)``: that rank of the first attempt gets SIGTERM -- a
    node's notice -- right after that step. Logs ``<log_dir>/a<attempt>-r<rank>.txt``: a
    ``world BEFORE NOW pid PID`` line, then ``EPOCH STEP id id ...`` per step; with
    ``log_dir=None`` it prints them (``elastic-log a<attempt>-r<rank> ...``: ranks on hosts
    that cannot see the driver's disk), read back by :func:`read_lines`."""
    import signal
    import time

    import torch

    import sparkhvd.torch as st

    ctx = st.setup()
    change = st.world_size_change()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    kind = st.ShardedCheckpoints if sharded else st.Checkpoints
    ckpt = kind(model, opt, data=data, every_steps=every_steps, keep=3)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(os.path.join(log_dir, f"a{attempt}-r{ctx.rank}.txt"), "a") if log_dir else \
        _Printed(f"elastic-log a{attempt}-r{ctx.rank}")
    log.write(f"world {change.before} {change.now} pid {os.getpid()}\n")
    log.flush()
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
