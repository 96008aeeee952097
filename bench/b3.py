"""B3: scaling on every backend (np=1 vs np=2, taking turns) (run by bench.py)."""
from __future__ import annotations

import contextlib
import tempfile
import time

from bench_common import local_spark, stats


def train_synthetic(steps, batch, t_start, allreduce=True):
    """One rank of B3 on a TF backend (horovod or tf, as the runner set it): a small CNN on
    synthetic data, ``batch`` rows per rank per step; samples/s from step 5 on. Without
    ``allreduce`` it is plain Keras (no KerasDistributed): the machine ceiling."""
    import os as _os
    import time as _time

    import numpy as _np
    import tensorflow as tf

    kd = None
    if allreduce:
        from sparkhvd.keras import KerasDistributed

        kd = KerasDistributed(epochs=1, progress=False, checkpoint=False, average_metrics=False)
    rank = int(_os.environ.get("RANK", 0))
    first = {}

    class Clock(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, b, logs=None):
            if b == 5:
                first.setdefault("t5", _time.time())
            first.setdefault("first", _time.time())

        def on_train_end(self, logs=None):
            first["end"] = _time.time()

    rng = _np.random.default_rng(rank)
    x = rng.random((batch * 8, 28, 28, 1), dtype=_np.float32)
    y = rng.integers(0, 10, batch * 8)
    workers = kd.size if kd is not None and kd.backend == "tf" else 1
    # the strategy splits a global batch among its workers; each keeps its own data
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch * workers)
    if workers > 1:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(options)
    with kd.scope() if kd is not None else contextlib.nullcontext():
        model = tf.keras.Sequential([
            tf.keras.layers.Input((28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Conv2D(64, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax")])
        optimizer = tf.keras.optimizers.SGD(0.01)
        model.compile(optimizer=kd.optimizer(optimizer) if kd is not None else optimizer,
                      loss="sparse_categorical_crossentropy")
    fit = kd.fit_kwargs(model, callbacks=[Clock()]) if kd is not None else \
        {"callbacks": [Clock()], "verbose": 0}
    model.fit(ds, steps_per_epoch=steps, **fit)
    return {"samples_per_s": (steps - 5) * batch / (first["end"] - first["t5"]),
            "to_first_step_s": first["first"] - t_start}


def train_synthetic_torch(steps, batch, t_start, allreduce=True):
    """B3's rank on backend='torch': the same CNN in PyTorch, DDP over gloo (or, without
    ``allreduce``, no process group at all: the machine ceiling)."""
    import os as _os
    import time as _time

    import torch
    import torch.distributed as dist

    rank = int(_os.environ.get("RANK", 0))
    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(9216, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))
    if allreduce:
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.rand(batch * 8, 1, 28, 28), torch.randint(0, 10, (batch * 8,))
    first = t5 = None
    for step in range(steps):
        if step == 5:
            t5 = _time.time()
        i = (step % 8) * batch
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + batch]), y[i:i + batch]).backward()
        opt.step()
        first = first or _time.time()
    end = _time.time()
    if allreduce:
        dist.destroy_process_group()
    return {"samples_per_s": (steps - 5) * batch / (end - t5), "to_first_step_s": first - t_start}


def _allreduce_cost(backend, floats, rounds):
    """B3's profile: ms per allreduce of ``floats`` float32 (the CNN's gradients) between the
    ranks of ``backend``, nothing else running -- the communication a step adds."""
    import time as _time

    if backend == "torch":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(floats)

        def once():
            dist.all_reduce(t)
    elif backend == "horovod":
        import horovod.tensorflow as hvd
        import tensorflow as tf

        hvd.init()
        t = tf.ones([floats])

        def once():
            hvd.allreduce(t, op=hvd.Average)
    else:
        import tensorflow as tf

        from sparkhvd.keras.plain import multiworker_strategy

        strategy = multiworker_strategy()
        t = tf.ones([floats])

        @tf.function
        def step():
            return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", t))

        def once():
            step()
    once()
    start = _time.perf_counter()
    for _ in range(rounds):
        once()
    return {"ms": 1000 * (_time.perf_counter() - start) / rounds}


#: B3's CNN has 1,199,882 parameters: what one step's gradient allreduce carries.
B3_GRADIENT_FLOATS = 1_199_882


def case_b3(repeat: int, tiny: bool) -> list[dict]:
    """B3 on every backend in one run: np=1, np=2 and two independent ranks (the machine
    ceiling), taking turns per round; each backend's efficiency and its ceiling; the profile
    (compute per step vs the gradient allreduce alone) and a few settings at batch 64."""
    import importlib.util

    from sparkhvd import HorovodRunner

    spark = local_spark()
    steps = 10 if tiny else 60
    out = tempfile.mkdtemp(prefix="bench-b3-")
    one_thread = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
                  "OMP_NUM_THREADS": "1"}
    # tf's ceiling is launched by horovod's backend (below): both need the default profile
    backends = [b for b, module in (("horovod", "horovod"), ("tf", "horovod"),
                                    ("torch", "torch"))
                if importlib.util.find_spec(module) is not None]
    if tiny:  # the code runs (tests): every backend takes the same path through it
        backends = backends[:1]
    rows: list[dict] = []

    def train(backend, np_, batch, allreduce=True, env=one_thread):
        fn = train_synthetic_torch if backend == "torch" else train_synthetic
        if backend == "tf" and not allreduce:
            # backend="tf" refuses Keras without the strategy (sparkhvd.keras.plain), so tf's
            # ceiling -- the same plain TF program as horovod's -- is launched by horovod's
            backend = "horovod"
        res = HorovodRunner(np=np_, spark=spark, output_dir=out, env=env, backend=backend)\
            .run_all(fn, steps=steps, batch=batch, t_start=time.time(), allreduce=allreduce)
        return sum(r["samples_per_s"] for r in res), max(r["to_first_step_s"] for r in res)

    for backend in backends:
        for batch in ((16,) if tiny else (64, 256)):
            how = f"backend={backend}, batch {batch}/rank"
            got: dict = {1: [], 2: [], "ceiling": []}
            for _ in range(repeat):  # the three take turns: a round shares its conditions
                got[1].append(train(backend, 1, batch))
                got[2].append(train(backend, 2, batch))
                got["ceiling"].append(train(backend, 2, batch, allreduce=False))
            thr = {k: [t for t, _ in v] for k, v in got.items()}
            rows += [{"case": "B3", "variant": f"np={n} training, {how}", "unit": "samples/s",
                      **stats(thr[n])} for n in (1, 2)]
            rows.append({"case": "B3", "variant": f"2 independent ranks, no allreduce, {how}",
                         "unit": "samples/s", **stats(thr["ceiling"])})
            eff = [t2 / (2 * t1) for t1, t2 in zip(thr[1], thr[2])]
            ceiling = [c / (2 * t1) for t1, c in zip(thr[1], thr["ceiling"])]
            rows.append({"case": "B3", "variant": f"scaling efficiency thr(2)/(2*thr(1)), {how}",
                         "unit": "ratio", **stats(eff)})
            rows.append({"case": "B3", "variant": f"machine ceiling of the efficiency, {how}",
                         "unit": "ratio", **stats(ceiling)})
            rows.append({"case": "B3", "variant": f"efficiency / ceiling (per round), {how}",
                         "unit": "ratio", **stats([e / c for e, c in zip(eff, ceiling)])})
            rows.append({"case": "B3", "variant": f"compute per step at np=1, {how}",
                         "unit": "ms", **stats([1000 * batch / t for t in thr[1]])})
            rows.append({"case": "B3", "variant": f"np=2 run() to first step, {how}",
                         "unit": "s", **stats([f for _, f in got[2]])})
        cost = [HorovodRunner(np=2, spark=spark, output_dir=out, env=one_thread,
                              backend=backend).run(_allreduce_cost, backend=backend,
                                                   floats=B3_GRADIENT_FLOATS,
                                                   rounds=5 if tiny else 50)["ms"]
                for _ in range(repeat)]
        rows.append({"case": "B3", "variant": f"gradient allreduce alone (1.2 M float32), "
                     f"np=2, backend={backend}", "unit": "ms", **stats(cost)})
    if "horovod" in backends and not tiny:  # settings a user could turn, where they matter most
        batch = 16 if tiny else 64
        for label, env in (("2 threads per rank (oversubscribed)",
                            {"TF_NUM_INTRAOP_THREADS": "2", "OMP_NUM_THREADS": "2"}),
                           ("HOROVOD_CYCLE_TIME=1 ms (horovod's default)",
                            {**one_thread, "HOROVOD_CYCLE_TIME": "1"}),
                           ("tensor fusion off (HOROVOD_FUSION_THRESHOLD=0)",
                            {**one_thread, "HOROVOD_FUSION_THRESHOLD": "0"})):
            thr = [train("horovod", 2, batch, env=env)[0] for _ in range(repeat)]
            rows.append({"case": "B3", "variant": f"np=2 training, backend=horovod, batch "
                         f"{batch}/rank, {label}", "unit": "samples/s", **stats(thr)})
    return rows
