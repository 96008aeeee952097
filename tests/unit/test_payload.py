"""Serialisation of the training function: what must travel, and errors that name the culprit."""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from sparkhvd import PayloadError
from sparkhvd.driver.payload import dumps, loads

# every profile: cloudpickle and numpy differ by stack
pytestmark = pytest.mark.every_profile

GLOBAL_ARRAY = np.arange(10)


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor


def test_lambdas_closures_globals_and_instances_roundtrip():
    offset = 5

    def helper(x):
        return x + offset

    def train(scale, fn):
        return fn(helper(int(GLOBAL_ARRAY.sum())) * scale.factor)

    fn, kwargs = loads(dumps(train, {"scale": Scaler(2), "fn": lambda v: v + 1}))
    assert fn(**kwargs) == (45 + 5) * 2 + 1


def test_unpicklable_argument_is_named():
    with pytest.raises(PayloadError) as info:
        dumps(lambda lock: None, {"lock": threading.Lock()})
    msg = str(info.value)
    assert "argument 'lock'" in msg and "inside the function" in msg
    assert isinstance(info.value, TypeError)


def test_unpicklable_closure_variable_is_named(tmp_path):
    handle = open(tmp_path / "data.txt", "w")

    def train():
        return handle.name

    try:
        with pytest.raises(PayloadError) as info:
            dumps(train, {})
        msg = str(info.value)
        assert "closure variable 'handle'" in msg
        assert "pass the file's path" in msg
    finally:
        handle.close()


def test_unpicklable_inside_helper_function_is_named():
    lock = threading.Lock()

    def helper():
        return lock

    def train():
        return helper()

    with pytest.raises(PayloadError, match=r"'helper -> lock'"):
        dumps(train, {})


def test_payload_size_limit_names_largest_argument():
    with pytest.raises(PayloadError, match=r"limit \(largest arguments: 'big'"):
        dumps(lambda big: None, {"big": np.zeros(300_000)}, max_bytes=1_000_000)


def _call_in_fresh_process(blob: bytes, tmp_path) -> str:
    """Unpickle and call the payload where the driver's local modules are not importable."""
    (tmp_path / "blob.pkl").write_bytes(blob)
    code = ("import sys; from sparkhvd.driver.payload import loads; "
            "fn, kw = loads(open(sys.argv[1], 'rb').read()); print(fn(**kw))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "blob.pkl")],
                         capture_output=True, text=True, cwd="/", env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_local_module_is_pickled_by_value(tmp_path):
    """A function imported from a module that exists only beside the driver still travels."""
    (tmp_path / "mytrain_mod.py").write_text(textwrap.dedent("""
        FACTOR = 7
        def train(x):
            return x * FACTOR
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        import mytrain_mod

        blob = dumps(mytrain_mod.train, {"x": 6})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mytrain_mod", None)
    assert _call_in_fresh_process(blob, tmp_path) == "42"


def test_local_module_used_as_global_is_pickled_by_value(tmp_path):
    """`import mymod` at the top of the notebook/script, `mymod.fn()` inside the function."""
    (tmp_path / "myhelpers_mod.py").write_text("def triple(x):\n    return 3 * x\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import myhelpers_mod

        def train(x):
            return myhelpers_mod.triple(x)

        blob = dumps(train, {"x": 5})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("myhelpers_mod", None)
    assert _call_in_fresh_process(blob, tmp_path) == "15"
