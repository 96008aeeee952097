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
the async run wrote and skipped. The runs keep rank 0's host copy, as a sparkhvd run does.

Then the restore a relaunch does (``ckpt.restore()``, the same 1 GB state), from each copy:
this host's copy (``host_copy``), another rank's host copy sent over a gloo process group (two
processes, one "host" each), the checkpoint folder on the local disk, and an ``abfss://``
folder on Azurite (goal: the nearest copy <= 0.5 x the run-folder path).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

#: A run id, so that the checkpoints keep rank 0's host copy as they do in a sparkhvd run.
RUN_ID = "bench-b15"


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
    os.environ.update({"SPARKHVD_RUN_ID": RUN_ID,  # rank 0's host copy, as in a run
                       "SPARKHVD_HOST_COPY_DIR": os.path.join(folder, "host")})
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
        for key in ("SPARKHVD_RUN_ID", "SPARKHVD_HOST_COPY_DIR"):
            os.environ.pop(key, None)
        shutil.rmtree(folder, ignore_errors=True)


def _restore_s(folder: str, tiny: bool, host_copy: bool,
               storage_options: Any = None) -> tuple[float, str]:
    """Seconds ``Checkpoints.restore()`` takes from ``folder``, and the copy it read."""
    import sparkhvd.torch as st
    from sparkhvd.rank import events

    model, opt, _, _ = _model(tiny)
    said: list = []
    emit = events.emit
    events.emit = said.append  # type: ignore[assignment] # the Resumed message names the copy
    try:
        t0 = time.perf_counter()
        st.Checkpoints(model, opt, url=folder, storage_options=storage_options, resume=True,
                       host_copy=host_copy).restore()
        return time.perf_counter() - t0, said[-1].copy
    finally:
        events.emit = emit  # type: ignore[assignment]


_PEER = """
import json, sys, time
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import b15, sparkhvd.torch as st
dist.init_process_group("gloo")
model, opt, _, _ = b15._model(sys.argv[2] == "tiny")
ckpt = st.Checkpoints(model, opt, url=sys.argv[1], resume=True)
dist.barrier()
t0 = time.perf_counter()
ckpt.restore()
print(json.dumps({"s": time.perf_counter() - t0}))
"""


def _peer_restore_s(folder: str, tiny: bool, holder_dir: str) -> float:
    """Rank 0's restore when only rank 1's host has the copy (two processes, gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, copies in enumerate([tempfile.mkdtemp(prefix="bench-b15-empty-"), holder_dir]):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "SPARKHVD_RANK": str(rank),
               "SPARKHVD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "SPARKHVD_HOST_COPY_DIR": copies, "SPARKHVD_RUN_ID": RUN_ID}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _PEER, folder, "tiny" if tiny else "full",
             os.path.dirname(os.path.abspath(__file__))], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return float(json.loads(outs[0].strip().splitlines()[-1])["s"])


def restore_rows(repeat: int, tiny: bool, stats: Any) -> list[dict]:
    """The restore from each copy of one checkpoint of the B15 model."""
    import sparkhvd.torch as st
    from conftest import Azurite

    work = tempfile.mkdtemp(prefix="bench-b15-restore-")
    azurite = None
    os.environ.update({"SPARKHVD_RUN_ID": RUN_ID,
                       "SPARKHVD_HOST_COPY_DIR": os.path.join(work, "host")})
    try:
        azurite = Azurite.start(os.path.join(work, "azurite"))
        azurite.make_container("ckpt")
        remote = azurite.url("ckpt", "b15")
        model, opt, _, _ = _model(tiny)
        st.Checkpoints(model, opt, url=remote, storage_options=azurite.options(),
                       resume=False).save(0)  # the host copy too
        st.Checkpoints(model, opt, url=os.path.join(work, "local"), resume=False,
                       host_copy=False).save(0)
        got: dict[str, list[float]] = {}
        for _ in range(max(1, min(repeat, 3))):
            for name, folder, copy, options in [
                    ("this host's copy", remote, True, azurite.options()),
                    ("the checkpoint folder, abfss:// on Azurite", remote, False,
                     azurite.options()),
                    ("the checkpoint folder, local disk", os.path.join(work, "local"), False,
                     None)]:
                seconds, used = _restore_s(folder, tiny, copy, options)
                assert used == ("host" if copy else "folder"), (name, used)
                got.setdefault(name, []).append(seconds)
            got.setdefault("another rank's host copy over gloo (np=2, rank 0)", []).append(
                _peer_restore_s(os.path.join(work, "local"), tiny, os.path.join(work, "host")))
        how = f"{_model(tiny)[3] * 12 / 1e9:.2f} GB of state"
        rows = [{"case": "B15", "variant": f"restore from {name}, {how}", "unit": "s",
                 **stats(values)} for name, values in got.items()]
        base = got["the checkpoint folder, abfss:// on Azurite"]
        for name in ("this host's copy", "another rank's host copy over gloo (np=2, rank 0)"):
            rows.append({"case": "B15", "variant": f"restore: {name} / abfss:// folder",
                         "unit": "ratio", **stats([a / b for a, b in zip(got[name], base)])})
        return rows
    finally:
        if azurite is not None:
            azurite.stop()
        for key in ("SPARKHVD_RUN_ID", "SPARKHVD_HOST_COPY_DIR"):
            os.environ.pop(key, None)
        shutil.rmtree(work, ignore_errors=True)


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
    return rows + restore_rows(repeat, tiny, stats)
