"""Serialising the user's training function and its arguments for the ranks.

The function and its keyword arguments travel together as one cloudpickle blob, made on the
driver *before* anything is launched, so that an unpicklable argument fails in milliseconds with
a message naming it, instead of deep inside a Spark task.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import io
import logging
import os
import socket
import sys
import sysconfig
import threading
import types
from importlib import metadata
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Optional

import cloudpickle

from sparkhvd.common.errors import PayloadError

__side__ = "driver"

log = logging.getLogger(__name__)

#: Payloads above this size are refused (they travel to every rank through the driver).
MAX_PAYLOAD_BYTES = 1 << 30
#: Payloads above this size log a warning suggesting storage instead.
WARN_PAYLOAD_BYTES = 64 << 20

_SPARK_HINT = (
    "Spark objects (SparkSession, SparkContext, DataFrame, RDD) live on the driver only. "
    "Pass plain data instead: a path or URL the ranks can read, a numpy array, or a "
    "sparkhvd.DataFrameDataset(df) for a DataFrame; create anything else inside the function."
)


def _hint_for(obj: Any) -> str:
    """A fix suggestion for an object that cannot be pickled."""
    mod = type(obj).__module__ or ""
    if mod.startswith("pyspark") or mod.startswith("py4j"):
        return _SPARK_HINT
    if isinstance(obj, io.IOBase):
        return "Open files cannot travel: pass the file's path and open it inside the function."
    if isinstance(obj, (type(threading.Lock()), type(threading.RLock()), threading.Thread,
                        threading.Event, threading.Condition)):
        return "Locks, threads and events belong to one process: create them inside the function."
    return ("Create the object inside the training function, or pass the plain data it is "
            "built from (numbers, strings, numpy arrays, paths).")


def _is_spark_object(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("pyspark.sql") or mod.startswith("pyspark.context") or \
        mod.startswith("pyspark.rdd") or mod.startswith("py4j")


def _try_pickle(obj: Any) -> Exception | None:
    try:
        cloudpickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is reported
        return exc
    return None


def _referenced_names(fn: Callable, include_modules: bool = False
                      ) -> Iterator[tuple[str, str, Any]]:
    """(kind, name, value) of what a function drags along: closure cells, globals, defaults."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield "closure variable", name, cell.cell_contents
        except ValueError:  # empty cell
            continue
    fn_globals = getattr(fn, "__globals__", {})
    for name in _global_names(code):
        if name in fn_globals:
            value = fn_globals[name]
            if inspect.ismodule(value) and not include_modules:
                continue
            yield "global variable", name, value
    for name, value in zip(code.co_varnames, fn.__defaults__ or ()):
        yield "default argument", name, value


def _global_names(code) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _global_names(const)


def _culprits(fn: Callable, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, str, Any, str]]:
    """Yield (kind, name, value, reason) for every piece that cannot travel."""
    for name, value in kwargs.items():
        if _is_spark_object(value):
            yield "argument", name, value, "a driver-only Spark object"
            continue
        exc = _try_pickle(value)
        if exc is not None:
            yield "argument", name, value, f"{type(exc).__name__}: {exc}"
    for kind, name, value in _referenced_names(fn):
        if _is_spark_object(value):
            yield kind, name, value, "a driver-only Spark object"
            continue
        if callable(value) and getattr(value, "__code__", None) is not None and value is not fn:
            # A helper function defined next to the training function: look inside it too.
            for sub in _culprits(value, {}):
                yield sub[0], f"{name} -> {sub[1]}", sub[2], sub[3]
            continue
        exc = _try_pickle(value)
        if exc is not None:
            yield kind, name, value, f"{type(exc).__name__}: {exc}"


def _raise_payload_error(fn: Callable, kwargs: Mapping[str, Any], cause: Exception | None) -> None:
    fn_name = getattr(fn, "__qualname__", repr(fn))
    found = list(_culprits(fn, kwargs))
    if not found:
        raise PayloadError(
            f"The training function {fn_name!r} or its arguments cannot be serialised with "
            f"cloudpickle ({type(cause).__name__}: {cause}). {_hint_for(None)}") from cause
    lines = [f"Cannot send the training function {fn_name!r} to the ranks:"]
    for kind, name, value, reason in found:
        lines.append(f"  - {kind} {name!r} ({type(value).__module__}.{type(value).__qualname__}) "
                     f"cannot be pickled: {reason}")
    lines.append(f"Fix: {_hint_for(found[0][2])}")
    raise PayloadError("\n".join(lines)) from cause


def _code_reduce_keeping_file(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the file it came from kept: cloudpickle
    3.1.3 names every function it pickles by value ``<dynamic-code>``, so a rank's traceback and
    the hang summary would lose the user's ``train.py:42``."""
    from cloudpickle import cloudpickle as impl

    ctor, args = impl._code_reduce(code)
    return ctor, tuple(code.co_filename if isinstance(a, str) and a == "<dynamic-code>" else a
                       for a in args)


def dumps_keeping_files(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, code objects keeping their file names (see above)."""
    class Pickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap(
            {types.CodeType: _code_reduce_keeping_file}, cloudpickle.Pickler.dispatch_table)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def dumps(fn: Callable, kwargs: Mapping[str, Any], *,
          max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Serialise ``fn`` and ``kwargs`` for the ranks.

    Raises:
        PayloadError: (a ``TypeError``) naming the argument or closure variable that cannot be
            sent, or saying the payload is too large, before anything is launched.
    """
    if not callable(fn):
        raise PayloadError(f"The training function must be callable; got {type(fn).__name__}. "
                           "Pass the function itself, e.g. runner.run(train, epochs=3).")
    kwargs = dict(kwargs)
    # Spark objects sometimes pickle "successfully" into something useless: refuse them first.
    spark_found = [c for c in _culprits(fn, kwargs) if c[3] == "a driver-only Spark object"]
    if spark_found:
        _raise_payload_error(fn, kwargs, None)
    try:
        with _pickled_by_value(_by_value_modules(fn, kwargs)):
            blob = dumps_keeping_files((fn, kwargs))
    except Exception as exc:  # noqa: BLE001
        _raise_payload_error(fn, kwargs, exc)
        raise  # unreachable: _raise_payload_error always raises
    size = len(blob)
    if size > max_bytes:
        sizes = sorted(((len(cloudpickle.dumps(v)), k) for k, v in kwargs.items()), reverse=True)
        biggest = ", ".join(f"{k!r} ({s / 2**20:.0f} MiB)" for s, k in sizes[:3])
        raise PayloadError(
            f"The training payload is {size / 2**20:.0f} MiB, above the {max_bytes / 2**20:.0f} MiB "
            f"limit (largest arguments: {biggest or 'none: the closure itself is large'}). "
            "Every rank downloads it through the driver: write large data to storage and pass its "
            "path, or use sparkhvd.DataFrameDataset for a DataFrame.")
    if size > WARN_PAYLOAD_BYTES:
        log.warning("The training payload is %.0f MiB; every rank downloads it through the "
                    "driver. Consider passing a path to data in storage instead.", size / 2**20)
    return blob


def _top_level(module_name: str) -> str:
    return module_name.split(".", 1)[0]


@functools.lru_cache(maxsize=1)
def _installed_top_levels() -> frozenset[str]:
    return frozenset(metadata.packages_distributions())


def _by_value_modules(fn: Callable, kwargs: Mapping[str, Any]) -> list[ModuleType]:
    """User modules (not part of an installed distribution) that the payload refers to.

    cloudpickle stores functions and classes of importable modules *by reference*; a module
    that exists only next to the driver's script (``from mytrain import train``) cannot be
    imported on the executors, so such modules are pickled by value instead.
    """
    found: dict[str, ModuleType] = {}
    candidates = [fn, *kwargs.values()]
    candidates += [v for _, _, v in _referenced_names(fn, include_modules=True)]
    for obj in candidates:
        name: Optional[str]
        if inspect.ismodule(obj):
            name = obj.__name__
        else:
            name = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", None)
        if not name or name == "__main__" or name.startswith("_") or name in sys.builtin_module_names:
            continue
        module = sys.modules.get(name)
        if module is None or not module.__file__:
            continue
        if _top_level(name) in _installed_top_levels() or _is_stdlib(module.__file__):
            continue
        found[_top_level(name)] = sys.modules.get(_top_level(name), module)
    return list(found.values())


def _is_stdlib(path: str) -> bool:
    stdlib = sysconfig.get_paths()["stdlib"]
    return os.path.abspath(path).startswith(os.path.abspath(stdlib) + os.sep) and \
        "site-packages" not in path


@contextlib.contextmanager
def _pickled_by_value(modules: list[ModuleType]):
    registered = []
    for module in modules:
        try:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        except ValueError:
            log.debug("cannot pickle %s by value", module.__name__)
    try:
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def loads(blob: bytes) -> tuple[Callable, dict]:
    """Inverse of :func:`dumps` (runs inside a rank)."""
    fn, kwargs = cloudpickle.loads(blob)
    return fn, kwargs


def load_result(rank: int, blob: bytes) -> Any:
    """A rank's pickled return value as the driver's object, or a PayloadError with the fix."""
    try:
        return cloudpickle.loads(blob)
    except (ImportError, AttributeError) as exc:
        module = getattr(exc, "name", None)
        where = f"module {module!r}" if module else "a module or class"
        raise PayloadError(
            f"rank {rank} returned an object the driver cannot load: it needs {where}, which "
            f"the ranks have and this driver ({socket.gethostname()}) does not "
            f"({type(exc).__name__}: {exc}). Fix: install {module or 'that module'} on the "
            "driver too, or return plain data (numbers, strings, lists, dicts, numpy arrays) "
            "or bytes.") from None
