"""Run a function on a module right after it is imported -- or now, if it already is.

How a rank adjusts a library its user imports (Keras's model class on ``backend="tf"``,
DDP's timing hook) without importing the library itself: a rank whose function never imports
it pays nothing. A finder at the front of ``sys.meta_path`` finds nothing itself; for a module
someone waits for, it hands the real spec a loader that runs the real one, then the callbacks.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Callable, Optional

__side__ = "common"

_WAITING: dict[str, list[Callable[[ModuleType], None]]] = {}
#: module name -> callbacks (no argument) run just before the module's own code runs
_STARTING: dict[str, list[Callable[[], None]]] = {}


class _Loader(importlib.abc.Loader):
    """The real loader of a module, then the callbacks waiting for it."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        for started in _STARTING.pop(self._name, []):
            started()
        self._loader.exec_module(module)
        for callback in _WAITING.pop(self._name, []):
            callback(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands a waited-for module's real spec a :class:`_Loader`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[Any]:
        if name not in _WAITING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, name)
        return spec


def when_imported(name: str, callback: Callable[[ModuleType], None],
                  starting: Optional[Callable[[], None]] = None) -> None:
    """``callback(module)`` once module ``name`` is imported (at once if it already is);
    ``starting()`` just before its import begins to run (never, if it already ran)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _WAITING.setdefault(name, []).append(callback)
    if starting is not None:
        _STARTING.setdefault(name, []).append(starting)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
