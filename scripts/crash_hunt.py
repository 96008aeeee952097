"""Count crashes of a plain Keras + ``tf.distribute`` run with sparkhvd's time-split sampler on
and off: is the sampler (a thread that reads the main thread's frames every 0.1 s) why a TF 2.21
rank dies of SIGSEGV now and then?

Each trial starts two workers of a ``MultiWorkerMirroredStrategy`` on this machine (TF_CONFIG,
loopback ports) that fit a small model for several epochs -- each epoch resets Keras's
``EpochIterator``, where the crashes were seen -- with the sampler's own code
(:class:`sparkhvd.timing.sampler.Sampler`, its real loop and buckets) running on a thread, or
not. ``--load N`` keeps N busy processes beside them (the 2-core machine busy, as in CI).
A trial crashed when a worker ended by a signal; the counts and each crash's signal are
printed, and written as JSON with ``--out``.

    .venv-modern/bin/python scripts/crash_hunt.py --trials 30 --load 2 --out crashes.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

log = logging.getLogger("crash_hunt")

WORKER = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf

if os.environ["SAMPLER"] == "1":
    from sparkhvd.timing.sampler import Sampler
    sampler = Sampler()
    sampler._send = lambda: None  # nowhere to send it: the sampling is what is tested
    sampler.thread.start()

from sparkhvd.keras.plain import multiworker_strategy  # as a rank makes it (Keras 3's fix)

strategy = multiworker_strategy()
rng = np.random.default_rng(int(os.environ["TRIAL"]))
x = rng.normal(size=(2048, 64)).astype("float32")
y = rng.integers(0, 10, size=2048)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=1).batch(64).repeat()
for _ in range(2):  # two fits: the iterator reset on each epoch and on each new fit
    model.fit(data, epochs=int(os.environ["EPOCHS"]), steps_per_epoch=16, verbose=0)
print("ok", flush=True)
"""


def _ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def trial(index: int, sampler: bool, epochs: int, timeout_s: float) -> dict:
    """One two-worker run: each worker's exit status (negative: killed by that signal)."""
    ports = _ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for task in range(2):
        env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {
            "type": "worker", "index": task}}), "SAMPLER": "1" if sampler else "0",
            "TRIAL": str(index), "EPOCHS": str(epochs), "PYTHONFAULTHANDLER": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    codes, outputs, hung = [], [], []
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # hung: its threads' stacks (faulthandler), then gone
            proc.send_signal(signal.SIGABRT)
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            hung.append(proc.pid)
        codes.append(proc.returncode)
        outputs.append(out.decode(errors="replace")[-2000:])
    crashed = [c for c in codes if c is not None and c < 0] if not hung else []
    return {"sampler": sampler, "codes": codes, "crashed": bool(crashed), "hung": bool(hung),
            "signals": [signal.Signals(-c).name for c in crashed],
            "tail": outputs if crashed or hung or any(codes) else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30, help="trials per setting")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside them")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per trial")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--only", choices=["on", "off"], help="one setting of the sampler")
    args = parser.parse_args()
    args.settings = [s == "on" for s in ([args.only] if args.only else ["on", "off"])]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results = []
    try:
        for index in range(args.trials):
            for sampler in args.settings:  # interleaved: the load and the machine alike
                result = trial(index, sampler, args.epochs, args.timeout)
                results.append(result)
                log.info("trial %d sampler=%s codes=%s %s", index, sampler, result["codes"],
                         " ".join(result["signals"]))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    summary = {f"sampler {'on' if on else 'off'}": {
        "trials": sum(r["sampler"] is on for r in results),
        "crashed": sum(r["crashed"] for r in results if r["sampler"] is on),
        "hung": sum(r["hung"] for r in results if r["sampler"] is on),
        "failed otherwise": sum(any(r["codes"]) and not r["crashed"] and not r["hung"]
                                for r in results if r["sampler"] is on)}
        for on in args.settings}
    log.info("%s", json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "trials": results}, f, indent=1)


if __name__ == "__main__":
    main()
