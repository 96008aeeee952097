"""What every case shares: timing, statistics, the local session, turn-taking."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the Azurite launcher shared with the tests


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": [round(v, 4) for v in values]}


def timed(fn: Callable[[], object], repeat: int) -> dict:
    values = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        values.append(time.perf_counter() - t0)
    return stats(values)


def interleaved(variants: list[tuple[str, Callable[[], object]]], repeat: int,
                primed: bool = False) -> dict:
    """Seconds per run of each variant: one untimed warm-up each, then the variants take turns
    (so drifting caches and noisy neighbours hit them all alike). ``primed``: each timed run
    comes right after an untimed run of the same variant -- what a user who runs a cell again
    sees (a launcher that uses up the executor's idle Python workers, TorchDistributor's,
    otherwise slows whichever variant runs after it)."""
    for _, fn in variants:
        fn()
    values: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(repeat):
        for name, fn in variants:
            if primed:
                fn()
            t0 = time.perf_counter()
            fn()
            values[name].append(time.perf_counter() - t0)
    return values


def local_spark():
    from sparkhvd.spark.session import get_or_create_session

    return get_or_create_session(2)


def torch_unavailable() -> str:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed in this profile"
    try:
        from pyspark.ml.torch.distributor import TorchDistributor  # noqa: F401
    except ImportError as exc:
        return f"pyspark has no TorchDistributor ({exc})"
    return ""


def turns(case: str, label: str, repeat: int, sides: dict) -> list[dict]:
    """Each side's ``samples_per_s``, the sides taking turns ``repeat`` times."""
    results: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(max(1, repeat)):
        for name, run in sides.items():
            results[name].append(run()["samples_per_s"])
    return [{"case": case, "variant": f"{label}, {name}", "unit": "samples/s", **stats(values)}
            for name, values in results.items()]
