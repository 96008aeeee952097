"""Notebook helpers: a harmless ``%%configure`` outside Synapse/Livy, and inline curves."""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

__side__ = "driver"

log = logging.getLogger(__name__)


def register_configure_magic(ipython: Any = None) -> bool:
    """Define ``%%configure`` when the kernel has none (plain Jupyter), so preset cells run.

    In Synapse/Livy kernels the real magic configures the session and this does nothing. Here the
    cell body is validated as a preset (errors name the key and the fix) and otherwise ignored:
    the session comes from HorovodRunner/``Preset.builder()`` instead. Returns whether it was
    registered.
    """
    if ipython is None:
        from IPython import get_ipython

        ipython = get_ipython()
    if ipython is None or "configure" in ipython.magics_manager.magics.get("cell", {}):
        return False

    def configure(line: str, cell: str) -> None:
        from sparkhvd.spark.presets import Preset

        preset = Preset("notebook-cell", json.loads(cell))
        print(f"%%configure {line.strip()}: not a Synapse/Livy kernel, so the session is not "
              f"reconfigured here (the preset is valid; it allows np <= {preset.max_np()}).")

    ipython.register_magic_function(configure, magic_kind="cell", magic_name="configure")
    return True


def show_curves(run_dir: Any, storage_options: Optional[dict] = None) -> Optional[Any]:
    """Display a run's ``curves.png`` inline, local or remote (returns the Image, or None)."""
    from IPython.display import Image, display

    from sparkhvd import storage

    url = getattr(run_dir, "url", None) or str(run_dir)
    target = f"{url.rstrip('/')}/curves.png"
    if not storage.exists(target, storage_options):
        print(f"no curves at {storage.public_url(target)}: train with "
              "sparkhvd.keras.KerasDistributed")
        return None
    image = Image(data=storage.read_bytes(target, storage_options), format="png")
    display(image)
    return image
