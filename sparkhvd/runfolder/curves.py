"""Training curves on the driver: ``metrics.csv`` and ``curves.png`` from rank 0's epoch records.

``curves.png`` needs matplotlib (``pip install 'sparkhvd[plots]'``); without it only
``metrics.csv`` is written.
"""
from __future__ import annotations

import csv
from typing import Sequence

from sparkhvd.common.fileio import atomic_open

__side__ = "driver"


def write_metrics_csv(path: str, records: Sequence[dict]) -> None:
    """One row per epoch; columns: epoch, then every metric seen, in first-seen order."""
    columns: list[str] = ["epoch"]
    for record in records:
        columns += [k for k in record if k not in columns]
    with atomic_open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for record in records:
            writer.writerow(record)


def can_plot() -> bool:
    """Whether matplotlib is installed (looked up without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken or hidden install: no picture either
        return False


def plot_curves(path: str, records: Sequence[dict]) -> None:
    """``curves.png``: loss, and accuracy when present, per epoch, train and validation."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in records]
    panels = [("loss", "loss")]
    if any("accuracy" in r or "acc" in r for r in records):
        panels.append(("accuracy", "accuracy" if any("accuracy" in r for r in records) else "acc"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, key) in zip(axes[0], panels):
        for name, style in ((key, "-o"), (f"val_{key}", "--s")):
            points = [(e, r[name]) for e, r in zip(epochs, records) if name in r]
            if points:
                ax.plot(*zip(*points), style, label=name, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic_open(path) as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
