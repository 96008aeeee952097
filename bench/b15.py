"""B15: what a checkpoint every step costs, written synchronously or in the background
(``st.Checkpoints(async_save=True)``, issue 51).

One process on this machine's CPU (the save path is rank 0's alone: the other ranks only agree
on a flag), a wide MLP with Adam whose state is about 1 GB (``--tiny``: a few KB), steps of
batch 64, checkpoints into a local folder with ``keep=2``. Three runs of the same 24 steps, in
rounds (at least 3; each ratio compares runs of one round), the disk flushed before each:

- no checkpoints;
- ``step()`` with ``every_steps=1``, synchronous: every step waits for serialising and writing;
- the same with ``async_save=True``: a step waits for the host copy; a save due while one is
  still being written is skipped (so "every step" becomes "as often as the disk allows");
- the same with ``memory_snapshots=True`` too (its slot files in ``/dev/shm``): every step's
  state is kept as a memory snapshot, a save due while one is written included.

Reported: training steps/s of each, the last save's write included, and their ratio to none
(goal: async >= 0.95 x none); the time checkpointing holds a step, the mean over every step
(``step()``, and with memory snapshots the optimizer step's wait for the copy); the checkpoints
written to the folder per step and the seconds between them ("every step" is true only where
that is 1); and the steps a SIGKILL at a random step costs (the median and worst of at least 5
kills per mode: a process killed, then the restore a relaunch on its host does). The runs keep
rank 0's host copy, as a sparkhvd run does.

Then the restore a relaunch does (``ckpt.restore()``, the same 1 GB state), from each copy:
this host's copy (``host_copy``), another rank's host copy sent over a gloo process group (two
processes, one "host" each), the checkpoint folder on the local disk, and an ``abfss://``
folder on Azurite (goal: the nearest copy <= 0.5 x the run-folder path); and the same state as a
``ShardedCheckpoints`` (DCP) checkpoint at one rank, from this host's copy and from Azurite.
And a resume of the model sharded by FSDP2 at np=2 on new hosts from Azurite: the bytes each
rank reads of the folder (the items its load plan reads, against every file whole as records
without the items' CRC-32s make it read).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

_log = logging.getLogger(__name__)

#: A run id, so that the checkpoints keep rank 0's host copy as they do in a sparkhvd run.
RUN_ID = "bench-b15"


def _model(tiny: bool, gpu: bool = False) -> tuple[Any, Any, Any, int]:
    """A wide MLP with Adam: about 1 GB of state on the CPU, 6.4 GB on a GPU (``gpu``)."""
    import torch

    torch.manual_seed(0)
    width, depth, rows = (64, 2, 64) if tiny else (8192, 8, 1024) if gpu else (4096, 5, 64)
    device = "cuda" if gpu else "cpu"
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, device=device), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(rows, width, device=device)
    params = sum(p.numel() for p in model.parameters())
    return model, opt, batch, params


def _run(mode: str, steps: int, tiny: bool, gpu: bool = False, sharded: bool = False) -> dict:
    """Steps/s of the B15 loop with checkpoints ``mode`` (none | sync | async | snapshots)
    every step, the last save's write included; how long each step is held by checkpointing
    (``step()``, and the optimizer step's wait for a memory snapshot's copy), and how many
    saves were written (``gpu``: the model on the GPU, so the async hold is the
    device-to-host copy; ``sharded``: ``ShardedCheckpoints``, DCP's staging)."""
    import torch

    import sparkhvd.torch as st
    from sparkhvd.torch.snapshot_ring import SnapshotRing

    model, opt, batch, params = _model(tiny, gpu)
    folder = tempfile.mkdtemp(prefix="bench-b15-")
    host = os.path.join(folder, "host")
    if mode == "snapshots" and os.path.isdir("/dev/shm"):  # as the docs advise for them
        host = tempfile.mkdtemp(prefix="bench-b15-", dir="/dev/shm")
    os.environ.update({"SPARKHVD_RUN_ID": RUN_ID,  # rank 0's host copy, as in a run
                       "SPARKHVD_HOST_COPY_DIR": host})
    kind = st.ShardedCheckpoints if sharded else st.Checkpoints
    snapshots: dict[str, Any] = {"memory_snapshots": True} if mode == "snapshots" else {}
    ckpt = None if mode == "none" else kind(
        model, opt, url=folder, resume=False, every_steps=1, keep=2,
        async_save=mode in ("async", "snapshots"), **snapshots)
    held: list[float] = []  # per step: step() and the optimizer step's wait for a snapshot
    saves = [0]
    waited = [0.0]  # the optimizer steps' waits for a snapshot's copy (the step pre-hook)
    wait_copied = SnapshotRing.wait_copied

    def timed_wait(ring: SnapshotRing) -> None:
        t0 = time.perf_counter()
        try:
            wait_copied(ring)
        finally:
            waited[0] += time.perf_counter() - t0

    SnapshotRing.wait_copied = timed_wait  # type: ignore[method-assign,assignment]
    synchronize = torch.cuda.synchronize if gpu else (lambda: None)
    try:
        def step(i: int) -> None:
            opt.zero_grad()
            model(batch).square().mean().backward()
            before = waited[0]
            opt.step()
            if ckpt is not None:
                synchronize()  # the hold is the save's own, not the step's kernels
                t0 = time.perf_counter()
                if ckpt.step(0):
                    saves[0] += 1
                held.append(time.perf_counter() - t0 + waited[0] - before)

        step(0)  # warm-up (and the first snapshot's buffers)
        if ckpt is not None:
            ckpt._finish_save()
        held.clear()
        saves[0] = 0
        # The previous run's files still being written back by the kernel would take this
        # run's CPU and disk (a synchronous run leaves gigabytes dirty): flushed first.
        os.sync()
        synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        if ckpt is not None:
            ckpt._finish_save()  # the last save written: part of the run's cost
        synchronize()
        elapsed = time.perf_counter() - t0
        state_bytes = params * 4 * 3  # weights + Adam's two moments, float32
        return {"steps_per_s": steps / elapsed, "saves": saves[0], "seconds": elapsed,
                "held_s": statistics.mean(held) if held else 0.0,
                "state_gb": state_bytes / 1e9, "torch": torch.__version__}
    finally:
        SnapshotRing.wait_copied = wait_copied  # type: ignore[method-assign]
        for key in ("SPARKHVD_RUN_ID", "SPARKHVD_HOST_COPY_DIR"):
            os.environ.pop(key, None)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(host, ignore_errors=True)


#: How the killed process says a step is done (its ``step()`` returned).
STEP_LINE = "b15-step "
_KILLED = """
import sys
sys.path.insert(0, sys.argv[4])
import b15
b15.train_until_killed(sys.argv[1], sys.argv[2], sys.argv[3] == "tiny")
"""


def train_until_killed(mode: str, folder: str, tiny: bool) -> None:
    """The B15 loop with checkpoints ``mode`` every step into ``folder``, printing each
    step's number once its ``step()`` returned, until it is killed (a rank process of
    :func:`steps_lost`)."""
    import sparkhvd.torch as st

    model, opt, batch, _ = _model(tiny)
    snapshots: dict[str, Any] = {"memory_snapshots": True} if mode == "snapshots" else {}
    ckpt = st.Checkpoints(model, opt, url=folder, resume=False, every_steps=1, keep=2,
                          async_save=mode != "sync", **snapshots)
    for i in range(1, 100_000):
        opt.zero_grad()
        model(batch).square().mean().backward()
        opt.step()
        ckpt.step(0)
        print(f"{STEP_LINE}{i}", flush=True)


def steps_lost(mode: str, tiny: bool, kill_after: int, rng: Any) -> int:
    """Steps a SIGKILL costs: a process trains with checkpoints ``mode`` every step and is
    killed at a random moment of the step after its ``kill_after``-th; then the restore a
    relaunch on that host does. The steps it had finished, less the step restored."""
    import signal

    import sparkhvd.torch as st

    folder = tempfile.mkdtemp(prefix="bench-b15-kill-")
    host = os.path.join(folder, "host")
    if mode == "snapshots" and os.path.isdir("/dev/shm"):
        host = tempfile.mkdtemp(prefix="bench-b15-kill-", dir="/dev/shm")
    env = {**os.environ, "SPARKHVD_RUN_ID": RUN_ID, "SPARKHVD_HOST_COPY_DIR": host}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, mode, folder,
                             "tiny" if tiny else "full",
                             os.path.dirname(os.path.abspath(__file__))],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        done, began = 0, time.perf_counter()
        for line in proc.stdout:  # (sparkhvd's own lines too: a skipped save, ...)
            if not line.startswith(STEP_LINE):
                continue
            now, done = time.perf_counter(), int(line[len(STEP_LINE):])
            if done >= kill_after:  # somewhere in the next step, or its save
                time.sleep(rng.uniform(0, now - began))
                proc.send_signal(signal.SIGKILL)
                break
            began = now
        finished = [int(line[len(STEP_LINE):]) for line in proc.stdout.read().splitlines()
                    if line.startswith(STEP_LINE)]
        proc.wait(60)
        done = max([done, *finished])
        os.environ.update({"SPARKHVD_RUN_ID": RUN_ID, "SPARKHVD_HOST_COPY_DIR": host})
        model, opt, _, _ = _model(tiny)
        ckpt = st.Checkpoints(model, opt, url=folder, resume=True)
        ckpt.restore()
        return done - int((ckpt.restored or {}).get("step", 0))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for key in ("SPARKHVD_RUN_ID", "SPARKHVD_HOST_COPY_DIR"):
            os.environ.pop(key, None)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(host, ignore_errors=True)


def kill_rows(repeat: int, tiny: bool, stats: Any) -> list[dict]:
    """Steps lost to a SIGKILL at a random step, per mode: the median and the worst of at
    least 5 kills (1 with ``--tiny``)."""
    import random

    rng = random.Random(15)
    kills = 1 if tiny else max(5, repeat)
    rows = []
    for mode in ("sync", "async", "snapshots"):
        lost = [float(steps_lost(mode, tiny, rng.randint(4, 16), rng)) for _ in range(kills)]
        rows.append({"case": "B15", "variant": f"steps lost to a SIGKILL at a random step, "
                     f"{mode}, every_steps=1 ({kills} kills; max is the worst)",
                     "unit": "steps", **stats(lost)})
    return rows


def _restore_s(folder: str, tiny: bool, host_copy: bool,
               storage_options: Any = None, sharded: bool = False) -> tuple[float, str]:
    """Seconds ``Checkpoints.restore()`` (``ShardedCheckpoints``' at one rank: ``sharded``)
    takes from ``folder``, and the copy it read."""
    import sparkhvd.torch as st
    from sparkhvd.common import events

    model, opt, _, _ = _model(tiny)
    said: list = []
    emit = events.emit
    events.emit = said.append  # type: ignore[assignment] # the Resumed message names the copy
    try:
        t0 = time.perf_counter()
        kind = st.ShardedCheckpoints if sharded else st.Checkpoints
        kind(model, opt, url=folder, storage_options=storage_options, resume=True,
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
    empty = tempfile.mkdtemp(prefix="empty-", dir=os.path.dirname(holder_dir))  # removed with it
    for rank, copies in enumerate([empty, holder_dir]):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "SPARKHVD_RANK": str(rank),
               "SPARKHVD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "SPARKHVD_HOST_COPY_DIR": copies, "SPARKHVD_RUN_ID": RUN_ID}
        procs.append(_rank(_PEER, [folder, "tiny" if tiny else "full"], env))
    return float(_last_lines(procs, "peer restore", 600)[0]["s"])


def _rank(script: str, args: list[str], env: dict) -> subprocess.Popen:
    """A rank process running ``script`` with ``args`` (then this folder, to import ``b15``
    from). Its output goes to files, not pipes: a rank that writes much while another is
    waited for cannot block on a full pipe."""
    out, err = (tempfile.TemporaryFile("w+") for _ in range(2))
    proc = subprocess.Popen([sys.executable, "-c", script, *args,
                             os.path.dirname(os.path.abspath(__file__))],
                            env=env, stdout=out, stderr=err, text=True)
    proc.outputs = (out, err)  # type: ignore[attr-defined]
    return proc


def _read_all(f: Any) -> str:
    """All a rank wrote to the file ``f``, which is closed."""
    with f:
        f.seek(0)
        return f.read()


def _last_lines(procs: list, what: str, timeout_s: float) -> list[dict]:
    """Each rank process's (:func:`_rank`) last line of output, as JSON -- or an error that
    names the rank that printed none, its error's last line and its stderr's end (a rank that
    died says why; the log has all of its stderr)."""
    try:
        return [_last_line(proc, rank, what, timeout_s) for rank, proc in enumerate(procs)]
    finally:  # one that failed or timed out leaves none behind (its peer may wait for it)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _last_line(proc: subprocess.Popen, rank: int, what: str, timeout_s: float) -> dict:
    proc.wait(timeout=timeout_s)
    out, err = (_read_all(f) for f in proc.outputs)  # type: ignore[attr-defined]
    lines = out.strip().splitlines()
    if not lines:  # its error's last line first: a failed case keeps 200 characters
        _log.error("%s: rank %d exited %s; its stderr:\n%s", what, rank, proc.returncode, err)
        said = [line for line in err.strip().splitlines() if line.strip()] or ["(nothing)"]
        raise RuntimeError(f"{what}: rank {rank} exited {proc.returncode}: "
                           f"{said[-1][:300]} -- its stderr ends: {err[-1500:]}")
    return json.loads(lines[-1])


_FSDP = """
import json, os, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[4])
import b15, sparkhvd.torch as st
from sparkhvd.checkpoint.stores import UrlStore
dist.init_process_group("gloo")
model, opt, batch, _ = b15._model(sys.argv[3] == "tiny")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
model(batch).square().mean().backward()
opt.step()
read = [0]
for method in ("read", "read_range"):
    def counting(self, name, *span, _original=getattr(UrlStore, method)):
        data = _original(self, name, *span)
        read[0] += len(data)
        return data
    setattr(UrlStore, method, counting)
ckpt = st.ShardedCheckpoints(model, opt, url=sys.argv[2], resume=sys.argv[1] == "restore",
                             storage_options=json.loads(os.environ["B15_OPTIONS"]))
dist.barrier()
t0 = time.perf_counter()
ckpt.restore() if sys.argv[1] == "restore" else ckpt.save(0)
print(json.dumps({"s": time.perf_counter() - t0, "read": read[0]}))
sys.stdout.flush()
os._exit(0)
"""


def _fsdp_ranks(mode: str, url: str, options: dict, tiny: bool, work: str) -> list[dict]:
    """``mode`` ("save" or "restore") a ``ShardedCheckpoints`` of the B15 model under FSDP2
    at np=2 (two processes, gloo), each rank on a "host" with no copies (a new folder in
    ``work``): each rank's seconds and bytes read of the folder."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "SPARKHVD_RANK": str(rank),
               "SPARKHVD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "SPARKHVD_HOST_COPY_DIR": tempfile.mkdtemp(prefix="new-host-", dir=work),
               "SPARKHVD_RUN_ID": RUN_ID, "B15_OPTIONS": json.dumps(options)}
        procs.append(_rank(_FSDP, [mode, url, "tiny" if tiny else "full"], env))
    return _last_lines(procs, f"FSDP2 {mode}", 900)


def _without_item_checksums(azurite: Any, folder: str) -> None:
    """The records of the checkpoint in ``folder`` as written before they kept each item's
    CRC-32: a restore then reads every file it needs whole."""
    from sparkhvd import storage

    options = azurite.options()
    for name in storage.listdir(azurite.url("ckpt", folder), options):
        if name.endswith(".json"):
            url = azurite.url("ckpt", f"{folder}/{name}")
            record = json.loads(storage.read_bytes(url, options))
            for entry in record["files"].values():
                entry.pop("pieces", None)
            storage.write_bytes(url, json.dumps(record).encode(), options)


def fsdp_folder_rows(azurite: Any, repeat: int, tiny: bool, stats: Any) -> list[dict]:
    """A resume on new hosts (no host copies) of an FSDP2 checkpoint at np=2 from ``abfss://``:
    the bytes each rank reads of the folder, per byte of state, and the restore's seconds --
    reading the items its DCP load plan reads, and every file whole as before."""
    options = azurite.options()
    url = azurite.url("ckpt", "b15-fsdp")
    work = tempfile.mkdtemp(prefix="bench-b15-fsdp-")  # the ranks' hosts' copies
    got: dict[str, list[dict]] = {"the items its load plan reads": [], "every file whole": []}
    try:
        _fsdp_ranks("save", url, options, tiny, work)
        state = sum(_sizes(azurite, "b15-fsdp"))
        for how in got:
            if how == "every file whole":
                _without_item_checksums(azurite, "b15-fsdp")
            for _ in range(max(1, min(repeat, 3))):
                got[how].extend(_fsdp_ranks("restore", url, options, tiny, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for how, ranks in got.items():
        variant = (f"resume of an FSDP2 ShardedCheckpoints at np=2 on new hosts from abfss:// "
                   f"on Azurite ({state / 1e9:.2f} GB of files), each rank reading {how}")
        rows.append({"case": "B15", "variant": f"bytes read per rank / the files' bytes, "
                     f"{variant}", "unit": "ratio", **stats([r["read"] / state for r in ranks])})
        rows.append({"case": "B15", "variant": f"restore, {variant}", "unit": "s",
                     **stats([r["s"] for r in ranks])})
    return rows


def _sizes(azurite: Any, folder: str) -> list[int]:
    """The sizes of the newest checkpoint's files in ``folder``, from its record."""
    from sparkhvd import storage

    record = json.loads(storage.read_bytes(azurite.url("ckpt", f"{folder}/latest.json"),
                                           azurite.options()))
    return [int(entry["size"]) for entry in record["files"].values()]


@contextlib.contextmanager
def _host_copies_in(folder: str) -> Iterator[None]:
    """Host copies kept and read in ``folder`` meanwhile (a host of its own)."""
    before = os.environ["SPARKHVD_HOST_COPY_DIR"]
    os.environ["SPARKHVD_HOST_COPY_DIR"] = folder
    try:
        yield
    finally:
        os.environ["SPARKHVD_HOST_COPY_DIR"] = before


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
        with _host_copies_in(os.path.join(work, "sharded-host")):  # rank 0 keeps one copy
            st.ShardedCheckpoints(model, opt, url=azurite.url("ckpt", "b15-sharded"),
                                  storage_options=azurite.options(), resume=False).save(0)
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
            with _host_copies_in(os.path.join(work, "sharded-host")):
                for name, copy in [("this host's copy, ShardedCheckpoints (DCP)", True),
                                   ("abfss:// on Azurite, ShardedCheckpoints (DCP)", False)]:
                    seconds, used = _restore_s(azurite.url("ckpt", "b15-sharded"), tiny, copy,
                                               azurite.options(), sharded=True)
                    assert used == ("host" if copy else "folder"), (name, used)
                    got.setdefault(name, []).append(seconds)
        fsdp = fsdp_folder_rows(azurite, repeat, tiny, stats)
        how = f"{_model(tiny)[3] * 12 / 1e9:.2f} GB of state"
        rows = [{"case": "B15", "variant": f"restore from {name}, {how}", "unit": "s",
                 **stats(values)} for name, values in got.items()]
        base = got["the checkpoint folder, abfss:// on Azurite"]
        for name in ("this host's copy", "another rank's host copy over gloo (np=2, rank 0)"):
            rows.append({"case": "B15", "variant": f"restore: {name} / abfss:// folder",
                         "unit": "ratio", **stats([a / b for a, b in zip(got[name], base)])})
        near, far = (got[f"{name}, ShardedCheckpoints (DCP)"]
                     for name in ("this host's copy", "abfss:// on Azurite"))
        rows.append({"case": "B15", "variant": "restore, ShardedCheckpoints (DCP): this host's "
                     "copy / abfss:// folder", "unit": "ratio",
                     **stats([a / b for a, b in zip(near, far)])})
        return rows + fsdp
    finally:
        if azurite is not None:
            azurite.stop()
        for key in ("SPARKHVD_RUN_ID", "SPARKHVD_HOST_COPY_DIR"):
            os.environ.pop(key, None)
        shutil.rmtree(work, ignore_errors=True)


def _pinned_vs_pageable(tiny: bool) -> dict:
    """Seconds to copy the GPU model's state to host memory: ``HostSnapshot.take`` the first
    time (pinned buffers allocated), again (buffers reused: what every later save pays), and a
    plain ``.cpu()`` of every tensor (pageable memory, new every time)."""
    import torch

    from sparkhvd.torch.async_save import HostSnapshot

    model, opt, batch, _ = _model(tiny, gpu=True)
    opt.zero_grad()
    model(batch).square().mean().backward()
    opt.step()  # Adam's moments exist
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    snapshot = HostSnapshot()
    timings = {}
    for name in ("first take (pinned buffers allocated)", "take (buffers reused)"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copied = snapshot.take(state)
        timings[name] = time.perf_counter() - t0
    same = all(torch.equal(copied["model"][k], v.cpu()) for k, v in state["model"].items())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for tensors in (state["model"], *(s for s in state["optimizer"]["state"].values())):
        {k: v.cpu() for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    timings[".cpu() of every tensor (pageable)"] = time.perf_counter() - t0
    return {"seconds": timings, "bytes": snapshot.nbytes, "equal": same,
            "gpu": torch.cuda.get_device_name(0)}


def gpu_rows(repeat: int, tiny: bool, stats: Any) -> list[dict]:
    """B5's checkpoint rows (issue 51): on a GPU, the device-to-host stall of an async save of
    a model of several GB, next to a synchronous save and none."""
    import torch

    copies = [_pinned_vs_pageable(tiny) for _ in range(max(1, repeat))]
    gb = copies[0]["bytes"] / 1e9
    gpu = copies[0]["gpu"]
    assert all(c["equal"] for c in copies), "the host copy differs from the GPU's state"
    rows = [{"case": "B5", "variant": f"copy of {gb:.2f} GB of GPU state to host: {name}",
             "unit": "s", "gpu": gpu, **stats([c["seconds"][name] for c in copies])}
            for name in copies[0]["seconds"]]
    rows.append({"case": "B5", "variant": "device-to-host GB/s into reused pinned buffers",
                 "unit": "GB/s", "gpu": gpu,
                 **stats([gb / c["seconds"]["take (buffers reused)"] for c in copies])})
    steps = 3 if tiny else 12
    for sharded in (False, True):  # a synchronous save takes seconds: fewer steps of it
        kind = "ShardedCheckpoints" if sharded else "Checkpoints"
        got: dict[str, list[dict]] = {"none": [], "sync": [], "async": [], "snapshots": []}
        try:
            for _ in range(max(1, repeat)):
                for mode in got:
                    got[mode].append(_run(mode, steps if mode != "sync" else max(2, steps // 4),
                                          tiny, gpu=True, sharded=sharded))
                    _log.info("B5 %s %s: %s", kind, mode, got[mode][-1])
                    torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - one kind's failure keeps the other's rows
            _log.exception("B5 %s failed", kind)
            rows.append({"case": "B5", "variant": f"checkpoint every step on a GPU, {kind}",
                         "unit": "-", "skipped": f"failed: {type(exc).__name__}: {exc}"[:300]})
            continue
        how = f"{kind}, {gb:.2f} GB of GPU state, {steps} steps, every_steps=1, local folder"
        for mode in ("sync", "async", "snapshots"):
            rows.append({"case": "B5", "variant": f"a step held by a save, {mode}, {how}",
                         "unit": "s", "gpu": gpu, **stats([r["held_s"] for r in got[mode]])})
            rows.append({"case": "B5", "variant": f"{mode} / none (steps/s), {how}",
                         "unit": "ratio", "gpu": gpu,
                         **stats([a["steps_per_s"] / b["steps_per_s"]
                                  for a, b in zip(got[mode], got["none"])])})
        rows.append({"case": "B5", "variant": f"steps/s, no checkpoints, {how}",
                     "unit": "steps/s", "gpu": gpu,
                     **stats([r["steps_per_s"] for r in got["none"]])})
        rows.append({"case": "B5", "variant": f"saves written, async, {how}", "unit": "saves",
                     "gpu": gpu, **stats([float(r["saves"]) for r in got["async"]])})
    return rows


def case_b15(repeat: int, tiny: bool, stats: Any) -> list[dict]:
    if importlib.util.find_spec("torch") is None:
        return [{"case": "B15", "variant": "checkpoint every step, async vs sync",
                 "unit": "ratio", "skipped": "needs torch (the torch profile)"}]
    steps = 3 if tiny else 24
    got: dict[str, list[dict]] = {"none": [], "sync": [], "async": [], "snapshots": []}
    for _ in range(1 if tiny else max(3, repeat)):  # rounds of the three: the ratios pair runs
        for mode in got:                            # made minutes apart, not a whole case apart
            got[mode].append(_run(mode, steps, tiny))
    gb = got["none"][0]["state_gb"]
    how = f"MLP+Adam, {gb:.2f} GB of state, {steps} steps, every_steps=1, keep=2, local folder"
    rows = [{"case": "B15", "variant": f"steps/s, checkpoints: {mode}, {how} (the last "
             "save's write included)", "unit": "steps/s",
             **stats([r["steps_per_s"] for r in runs])} for mode, runs in got.items()]
    for mode in ("sync", "async", "snapshots"):
        rows.append({"case": "B15", "variant": f"{mode} / none (steps/s)", "unit": "ratio",
                     **stats([a["steps_per_s"] / b["steps_per_s"]
                              for a, b in zip(got[mode], got["none"])])})
        rows.append({"case": "B15", "variant": f"a step held by checkpointing, {mode} (mean "
                     "of every step: step() and the optimizer step's wait for a memory "
                     "snapshot's copy)", "unit": "s",
                     **stats([r["held_s"] for r in got[mode]])})
        rows.append({"case": "B15", "variant": f"checkpoints written to the folder per step, "
                     f"{mode}" + (" (the rest skipped while one was in flight)" if mode ==
                                  "async" else " (the rest kept as memory snapshots only)"
                                  if mode == "snapshots" else ""), "unit": "ratio",
                     **stats([r["saves"] / steps for r in got[mode]])})
        rows.append({"case": "B15", "variant": f"seconds between checkpoints written to the "
                     f"folder, {mode} (the run's seconds / checkpoints written)", "unit": "s",
                     **stats([r["seconds"] / max(1, r["saves"]) for r in got[mode]])})
    rows += kill_rows(repeat, tiny, stats)
    return rows + restore_rows(repeat, tiny, stats)
