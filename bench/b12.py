"""B12: recovery from a lost rank or a notice, vs Ray Train v2 (run by bench.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

from bench_common import ROOT, local_spark, stats, torch_unavailable

#: B15's model for the recovery rows with about 1 GB of state: 5 layers 4096 wide, Adam.
WIDE = (4096, 5)


def model_and_loss(wide: bool):
    """B12's model, optimizer and loss of one step: a small MLP with SGD, or (``wide``) B15's
    5 x 4096 MLP with Adam, 1.01 GB of state -- the same for sparkhvd and for Ray."""
    import torch

    torch.manual_seed(0)
    if not wide:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10))
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        return model, torch.optim.SGD, {"lr": 0.01}, \
            lambda m: torch.nn.functional.cross_entropy(m(x), y)
    width, depth = WIDE
    layers: list = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    batch = torch.randn(64, width)
    return torch.nn.Sequential(*layers), torch.optim.Adam, {"lr": 1e-4}, \
        lambda m: m(batch).square().mean()


def _b12_train(epochs, steps, log_dir, every_steps=None, step_s=0.05, async_save=False,
               wide=False, url=None, storage_options=None, host_copy=True,
               memory_snapshots=False):
    """B12's rank: :func:`model_and_loss` on synthetic data, ``steps`` steps an epoch,
    sparkhvd's checkpoints (epoch ends, and every ``every_steps`` steps when set, written in
    the background with ``async_save``; into ``url`` when given, else the run folder); every
    step logged as ``attempt epoch step wall-time`` in ``<log_dir>/rank-N.txt``, the rank's
    PID in ``pid-N-<pid>``, the wall times of its start's phases (:data:`PHASES`) in
    ``phases-N-<attempt>.json``."""
    import json as _json
    import os
    import time as _time

    import sparkhvd.torch as st

    times = {"called": _time.time()}
    ctx = st.setup()
    times["joined"] = _time.time()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    open(os.path.join(log_dir, f"pid-{ctx.rank}-{os.getpid()}"), "w").close()
    log = open(os.path.join(log_dir, f"rank-{ctx.rank}.txt"), "a")
    module, optimizer, settings, loss_of = model_and_loss(wide)
    times["built"] = _time.time()
    model = ctx.wrap(module)
    times["wrapped"] = _time.time()
    opt = optimizer(model.parameters(), **settings)
    ckpt = st.Checkpoints(model, opt, url=url, storage_options=storage_options,
                          every_steps=every_steps, async_save=async_save, host_copy=host_copy,
                          memory_snapshots=memory_snapshots,
                          keep=2 if wide else None)  # 1 GB a save: the newest two
    start = ckpt.restore()
    times["restored"] = _time.time()
    with open(os.path.join(log_dir, f"phases-{ctx.rank}-{attempt}.json"), "w") as f:
        _json.dump(times, f)  # the first step's end is its line in rank-N.txt
    first = ckpt.restored.get("step", 0) if start == ckpt.restored.get("epoch") else 0
    for epoch in range(start, epochs):
        for step in range(first + 1 if epoch == start else 1, steps + 1):
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()
            log.write(f"{attempt} {epoch} {step} {_time.time():.3f}\n")
            log.flush()
            ckpt.step(epoch)
            _time.sleep(step_s)
        ckpt.save(epoch)
    return 0


#: What a recovery is made of on rank 0, in order, from the loss to the first step's end:
#: the phase's name in RESULTS.md, between the wall times _b12_train notes (and the first
#: step's line in its log).
PHASES = ("the relaunch (the loss to the function's call)",
          "import torch and join the process group (st.setup())",
          "build the model", "DDP(model) (torch imports its compiler on the first one)",
          "ckpt.restore()", "the first step")


def _b12_once(spark, how: str, every_steps, epochs: int, steps: int, at: tuple[int, int],
              async_save: bool = False, **train: object):
    """One B12 round: ``how`` ("SIGKILL" a lost rank, "SIGTERM" a notice) to rank 1 after
    step ``at`` = (epoch, step); recovery s (the signal to the first step after resume, on
    rank 0), steps each rank trained again, (a notice) the seconds from the notice to the
    ranks' stop that run.json records (None for a lost rank), rank 0's steps/s before, and
    the seconds each of :data:`PHASES` took of that recovery on rank 0."""
    import signal as _signal
    import threading

    from sparkhvd import HorovodRunner

    log_dir = tempfile.mkdtemp(prefix="bench-b12-")
    out = tempfile.mkdtemp(prefix="bench-b12-runs-")
    sent: dict = {}

    def lines(rank):
        path = os.path.join(log_dir, f"rank-{rank}.txt")
        if not os.path.exists(path):
            return []
        return [(int(a), int(e), int(s), float(t)) for a, e, s, t in
                (line.split() for line in open(path) if line.count(" ") == 3)]

    def trouble():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(
                (e, s) >= at for a, e, s, _ in lines(1) if a == 0):
            time.sleep(0.02)
        pid = next(int(f.split("-")[2]) for f in os.listdir(log_dir) if f.startswith("pid-1-"))
        sent["at"] = time.time()
        os.kill(pid, getattr(_signal, how))

    thread = threading.Thread(target=trouble, daemon=True)
    thread.start()
    runner = HorovodRunner(np=2, spark=spark, backend="torch", output_dir=out, max_retries=1)
    runner.run(
        _b12_train, epochs=epochs, steps=steps, log_dir=log_dir, every_steps=every_steps,
        async_save=async_save, **train)
    thread.join(10)
    resumed = [t for a, _, _, t in lines(0) if a == 1]
    redone = []
    for rank in (0, 1):
        done = {(e, s) for a, e, s, _ in lines(rank) if a == 0}
        again = {(e, s) for a, e, s, _ in lines(rank) if a == 1}
        redone.append(len(done & again))
    assert runner.last_run_dir is not None
    stopped = runner.last_run_dir.record["attempts"][0].get("preempted") or {}
    speed = steps_per_s([t for a, _, _, t in lines(0) if a == 0])
    with open(os.path.join(log_dir, "phases-0-1.json")) as f:
        marks = [sent["at"], *json.load(f).values(), resumed[0]]
    phases = {name: later - earlier for name, earlier, later in zip(PHASES, marks, marks[1:])}
    for folder in (log_dir, out):
        shutil.rmtree(folder, ignore_errors=True)
    return resumed[0] - sent["at"], max(redone), stopped.get("notice_to_stop_s"), speed, phases


def steps_per_s(times: list[float]) -> float:
    """Rank 0's training speed before the loss, from the wall times of its steps."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def case_b12(repeat: int, tiny: bool) -> list[dict]:
    """Recovery (torch profile, local[2], np=2): from a lost rank (SIGKILL) or a notice
    (SIGTERM) to the first step after the relaunch, and the steps each rank trained twice --
    with epoch checkpoints only (what ``max_retries`` resumed from before step checkpoints),
    with step checkpoints every 10 steps, and for a notice; then the same loop on Ray Train v2
    on Spark, side by side on this machine (:func:`_b12_ray`)."""
    why = torch_unavailable()
    if why:
        return [{"case": "B12", "variant": "recovery from a lost rank or a notice", "unit": "s",
                 "skipped": f"{why}: make bench CASE=B12 PROFILE=torch"}]
    spark = local_spark()
    epochs, steps, at = (2, 12, (1, 7)) if tiny else (2, 64, (1, 45))
    variants = {"lost rank (SIGKILL), epoch checkpoints (max_retries=1)": ("SIGKILL", None, False),
                "lost rank (SIGKILL), step checkpoints every 10": ("SIGKILL", 10, False),
                "lost rank (SIGKILL), async_save checkpoints every step": ("SIGKILL", 1, True),
                "notice (SIGTERM), epoch checkpoints": ("SIGTERM", None, False),
                "notice (SIGTERM), async_save checkpoints every step": ("SIGTERM", 1, True)}
    recovery: dict[str, list[float]] = {k: [] for k in variants}
    lost: dict[str, list[float]] = {k: [] for k in variants}
    to_stop: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(max(1, repeat)):
        for name, (how, every, background) in variants.items():
            seconds, redone, stop_s, _, _ = _b12_once(spark, how, every, epochs, steps, at,
                                                   background)
            recovery[name].append(seconds)
            lost[name].append(float(redone))
            if stop_s is not None:
                to_stop[name].append(stop_s)
    rows = []
    for name in variants:
        rows.append({"case": "B12", "variant": f"{name}: recovery", "unit": "s",
                     **stats(recovery[name])})
        rows.append({"case": "B12", "variant": f"{name}: steps redone per rank",
                     "unit": "steps", **stats(lost[name])})
        if to_stop[name]:
            rows.append({"case": "B12", "variant": f"{name}: notice to the ranks' stop "
                         "(run.json preempted.notice_to_stop_s)", "unit": "s",
                         **stats(to_stop[name])})
    return rows + _b12_ray(repeat, epochs, steps, at) + ([] if tiny else wide_rows(spark, repeat))


def wide_rows(spark, repeat: int) -> list[dict]:
    """Recovery with B15's model (1.01 GB of state with Adam; issue 51), np=2: rank 1
    SIGKILLed at step 4 of the second 8-step epoch, ``async_save`` every step into ``abfss://``
    on Azurite -- restored from rank 0's host copy, or (``host_copy=False``) from Azurite --
    against Ray Train v2 on the same machine, a checkpoint every step. Each recovery is split
    into :data:`PHASES`: which of it the nearest copy can shorten (the restore), and which
    every relaunch pays (the ranks' start, the user's imports, model and DDP wrap)."""
    from conftest import Azurite

    epochs, steps, at = 2, 8, (1, 4)
    work = tempfile.mkdtemp(prefix="bench-b12-wide-")
    azurite = Azurite.start(os.path.join(work, "azurite"))
    rows = []
    try:
        azurite.make_container("ckpt")
        variants = {"host copy": (True, False), "abfss:// on Azurite": (False, False),
                    "host copy, memory_snapshots=True (the newest step's state)": (True, True)}
        recovery: dict[str, list[float]] = {k: [] for k in variants}
        redone: dict[str, list[float]] = {k: [] for k in variants}
        speed: dict[str, list[float]] = {k: [] for k in variants}
        phases: dict[str, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in variants}
        for round_ in range(max(1, repeat)):
            for name, (host_copy, snapshots) in variants.items():
                url = azurite.url("ckpt", f"wide-{round_}-{int(host_copy)}{int(snapshots)}")
                seconds, again, _, rate, took = _b12_once(
                    spark, "SIGKILL", 1, epochs, steps, at, True, step_s=0.0, wide=True,
                    url=url, storage_options=azurite.options(), host_copy=host_copy,
                    memory_snapshots=snapshots)
                recovery[name].append(seconds)
                redone[name].append(float(again))
                speed[name].append(rate)
                for phase, phase_s in took.items():
                    phases[name][phase].append(phase_s)
        for name in variants:
            how = (f"lost rank (SIGKILL), 1.01 GB of state, async_save every step to abfss://, "
                   f"restored from the {name}")
            rows.append({"case": "B12", "variant": f"{how}: recovery", "unit": "s",
                         **stats(recovery[name])})
            rows += [{"case": "B12", "variant": f"{how}: of which {phase} on rank 0", "unit": "s",
                      **stats(phases[name][phase])} for phase in PHASES]
            rows.append({"case": "B12", "variant": f"{how}: steps redone per rank",
                         "unit": "steps", **stats(redone[name])})
            rows.append({"case": "B12", "variant": f"{how}: steps/s before the loss",
                         "unit": "steps/s", **stats(speed[name])})
        if recovery["host copy"] and recovery["abfss:// on Azurite"]:
            rows.append({"case": "B12", "variant": "recovery, 1.01 GB of state: host copy / "
                         "abfss:// folder", "unit": "ratio",
                         **stats([a / b for a, b in zip(recovery["host copy"],
                                                        recovery["abfss:// on Azurite"])])})
    finally:
        azurite.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows + _b12_ray(repeat, epochs, steps, at, every=1, wide=True)


RAY_PYTHON = ROOT / ".venv-ray" / "bin" / "python"


def _b12_ray(repeat: int, epochs: int, steps: int, at: tuple[int, int], every: int = 10,
             wide: bool = False) -> list[dict]:
    """The same loop on Ray Train v2 on Spark (bench/ray_b12.py), checkpoints every ``every``
    steps, FailureConfig(max_failures=1): in its own network namespace with only the loopback.
    ``wide``: B15's model, 1.01 GB of state."""
    name = (f"Ray Train v2 on Spark, lost worker (SIGKILL), "
            f"{'1.01 GB of state, ' if wide else ''}checkpoints every "
            f"{'step' if every == 1 else every}")
    if not RAY_PYTHON.exists() or shutil.which("unshare") is None:
        return [{"case": "B12", "variant": name, "unit": "s",
                 "skipped": "no .venv-ray (make bench CASE=B12 PROFILE=torch makes it) or no "
                            "unshare"}]
    recovery, redone, speed = [], [], []
    for _ in range(max(1, repeat)):
        env = {**os.environ, "PATH": f"{RAY_PYTHON.parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(
            ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
             str(RAY_PYTHON), str(ROOT / "bench" / "ray_b12.py"), str(epochs), str(steps),
             str(at[0]), str(at[1]), str(every), "0.0" if wide else "0.05",
             "wide" if wide else "small"],
            capture_output=True, text=True, timeout=900, env=env)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            return [{"case": "B12", "variant": name, "unit": "s",
                     "skipped": f"failed: {done.stderr[-300:]}"}]
        result = json.loads(line[-1][len("RESULT "):])
        recovery.append(result["recovery_s"])
        redone.append(float(result["redone"]))
        speed.append(result["steps_per_s"])
    return [{"case": "B12", "variant": f"{name}: recovery", "unit": "s", **stats(recovery)},
            {"case": "B12", "variant": f"{name}: steps redone per rank", "unit": "steps",
             **stats(redone)}] + ([{"case": "B12", "variant": f"{name}: steps/s before the loss",
                                    "unit": "steps/s", **stats(speed)}] if wide else [])
