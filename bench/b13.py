"""B13: what the time split costs (run by bench.py)."""
from __future__ import annotations

import tempfile
import time

from b3 import train_synthetic, train_synthetic_torch
from bench_common import local_spark, stats


def _classify_cost(frames, rounds):
    """Microseconds to sample and classify one stack of ``frames`` frames (the sampler's work
    per sample), measured inside a rank at that depth."""
    import time as _time

    from sparkhvd.timing.buckets import bucket_of
    from sparkhvd.timing.sampler import main_thread_frames

    def nest(depth):
        if depth:
            return nest(depth - 1)
        import threading

        ident = threading.main_thread().ident
        start = _time.perf_counter()
        for _ in range(rounds):
            bucket_of(main_thread_frames(ident))
        return 1e6 * (_time.perf_counter() - start) / rounds
    return nest(frames)


def case_b13(repeat: int, tiny: bool) -> list[dict]:
    """B13 the time split's cost: B3's CNN at np=2 (batch 64 per rank, DDP over gloo on torch,
    else horovod) with the sampler on (the default) and off (``time_split=False``), taking
    turns; and the sampler's work per sample."""
    import importlib.util

    from sparkhvd import HorovodRunner

    spark = local_spark()
    backend = "torch" if importlib.util.find_spec("torch") else "horovod"
    fn = train_synthetic_torch if backend == "torch" else train_synthetic
    steps, batch = (10, 16) if tiny else (150, 64)
    out = tempfile.mkdtemp(prefix="bench-b13-")
    env = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1"}

    def train(on):
        res = HorovodRunner(np=2, spark=spark, output_dir=out, env=env, backend=backend,
                            time_split=on).run_all(fn, steps=steps, batch=batch,
                                                   t_start=time.time())
        return sum(r["samples_per_s"] for r in res)

    if not tiny:  # tiny: the code runs (tests), nothing is compared
        train(True)  # warm-up
    got: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(max(5, repeat) if not tiny else 1):
        for on in (False, True):
            got[on].append(train(on))
    how = f"np=2, backend={backend}, batch {batch}/rank"
    rows = [{"case": "B13", "variant": f"training, time split {'on' if on else 'off'}, {how}",
             "unit": "samples/s", **stats(got[on])} for on in (False, True)]
    rows.append({"case": "B13", "variant": f"throughput on / off (per round), {how}",
                 "unit": "ratio", **stats([a / b for a, b in zip(got[True], got[False])])})
    cost = [HorovodRunner(np=-1, output_dir=out, backend=backend).run(_classify_cost, frames=40,
                                                     rounds=200 if tiny else 5000)
            for _ in range(max(1, repeat))]
    rows.append({"case": "B13", "variant": "one sample: read and classify a 40-frame stack",
                 "unit": "us", **stats(cost)})
    if backend == "torch":
        hook = [HorovodRunner(np=-1, output_dir=out, backend=backend).run(
            _ddp_hook_cost, rounds=2000 if tiny else 50000) for _ in range(max(1, repeat))]
        rows.append({"case": "B13", "variant": "the DDP timing hook's own work per bucket "
                     "(launch, completion, the step's wait noted)", "unit": "us",
                     **stats(hook)})
    return rows


def _ddp_hook_cost(rounds):
    """In a rank: microseconds the timing comm hook adds to one bucket's all-reduce (the hook
    around an all-reduce that is already done, against that all-reduce alone)."""
    import time as _time

    import torch

    from sparkhvd.timing.collectives import StepWaits, WaitClock

    class Bucket:
        def is_last(self):
            return True

        def buffer(self):
            return tensor

    tensor = torch.ones(4)

    def done(state, bucket):
        future = torch.futures.Future()
        future.set_result(tensor)
        return future

    timer = StepWaits(done, clock=WaitClock())
    bucket = Bucket()
    t0 = _time.perf_counter()
    for _ in range(rounds):
        done(None, bucket).wait()
    bare = _time.perf_counter() - t0
    t0 = _time.perf_counter()
    for _ in range(rounds):
        timer.hook(None, bucket).wait()
    return (_time.perf_counter() - t0 - bare) / rounds * 1e6
