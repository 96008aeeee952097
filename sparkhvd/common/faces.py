"""How a feature package shows its public names without importing both of its halves.

A feature folder (``data/``, ``runfolder/``, ``scoring/``, ``ops/``) holds driver and rank
modules side by side; its ``__init__`` is the public face. Importing the face must not import
the driver half into every rank (a rank imports ``sparkhvd.data.shard``, which imports
``sparkhvd.data`` first), so a face lists its names here and each is imported on first use.
"""
from __future__ import annotations

__side__ = "common"

import importlib
from typing import Any, Callable, Mapping


def lazy_face(package: str, names: Mapping[str, str]
              ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each public name to the
    module (relative to ``package``) that defines it."""
    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        importlib.import_module(package).__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(importlib.import_module(package).__dict__) | set(names))

    return __getattr__, __dir__
