"""B15: what a checkpoint every step costs, written synchronously or in the background
(``st.Checkpoints(async_save=True)``, issue 51).

One process on this machine's CPU (the save path is rank 0's alone: the other ranks only agree
on a flag), a wide MLP with Adam whose state is about 1 GB (``--tiny``: a few KB), steps of
batch 64, checkpoints into a local folder with ``keep=2``. Three runs of the same steps:

- no checkpoints;
- ``step()`` with ``every_steps=1``, synchronous: every step waits for serialising and writing;
- the same with ``async_save=True``: a step waits for the host copy; a save due while one is
  still being written is skipped (so "every step" becomes "as often as the disk allows").

Reported: training steps/s of each and their ratio to none (goal: async >= 0.95 x none), the
time a step is held by a save (host copy vs the whole synchronous save), and how many saves
the async run wrote and skipped.
"""
from __future__ import annotations

import importlib.util
import shutil
import statistics
import tempfile
import time
from typing import Any


def _model(tiny: bool) -> tuple[Any, Any, Any, int]:
    import torch

    torch.manual_seed(0)
    width, depth = (64, 2) if tiny else (4096, 5)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(64, width)
    params = sum(p.numel() for p in model.parameters())
    return model, opt, batch, params


def _run(mode: str, steps: int, tiny: bool) -> dict:
    import torch

    import sparkhvd.torch as st

    model, opt, batch, params = _model(tiny)
    folder = tempfile.mkdtemp(prefix="bench-b15-")
    ckpt = None if mode == "none" else st.Checkpoints(
        model, opt, url=folder, resume=False, every_steps=1, keep=2,
        async_save=mode == "async")
    held: list[float] = []
    try:
        def step(i: int) -> None:
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
            if ckpt is not None:
                t0 = time.perf_counter()
                if ckpt.step(0):
                    held.append(time.perf_counter() - t0)

        step(0)  # warm-up (and the first snapshot's buffers)
        if ckpt is not None:
            ckpt._finish_save()
        held.clear()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        elapsed = time.perf_counter() - t0
        if ckpt is not None:
            ckpt._finish_save()
        state_bytes = params * 4 * 3  # weights + Adam's two moments, float32
        return {"steps_per_s": steps / elapsed, "saves": len(held),
                "held_s": statistics.median(held) if held else 0.0,
                "state_gb": state_bytes / 1e9, "torch": torch.__version__}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def case_b15(repeat: int, tiny: bool, stats: Any) -> list[dict]:
    if importlib.util.find_spec("torch") is None:
        return [{"case": "B15", "variant": "checkpoint every step, async vs sync",
                 "unit": "ratio", "skipped": "needs torch (the torch profile)"}]
    steps = 3 if tiny else 12
    got: dict[str, list[dict]] = {"none": [], "sync": [], "async": []}
    for _ in range(1 if tiny else max(2, repeat)):
        for mode in got:
            got[mode].append(_run(mode, steps, tiny))
    gb = got["none"][0]["state_gb"]
    how = f"MLP+Adam, {gb:.2f} GB of state, {steps} steps, every_steps=1, keep=2, local folder"
    rows = [{"case": "B15", "variant": f"steps/s, checkpoints: {mode}, {how}",
             "unit": "steps/s", **stats([r["steps_per_s"] for r in runs])}
            for mode, runs in got.items()]
    for mode in ("sync", "async"):
        rows.append({"case": "B15", "variant": f"{mode} / none (steps/s)", "unit": "ratio",
                     **stats([a["steps_per_s"] / b["steps_per_s"]
                              for a, b in zip(got[mode], got["none"])])})
        rows.append({"case": "B15", "variant": f"a step held by a save, {mode}", "unit": "s",
                     **stats([r["held_s"] for r in got[mode]])})
    rows.append({"case": "B15", "variant": f"saves written in {steps} steps, async "
                 "(the rest skipped while one was in flight)", "unit": "saves",
                 **stats([float(r["saves"]) for r in got["async"]])})
    return rows
