"""Every private detail of a third-party library that sparkhvd patches still exists (so an
upgrade fails here, loudly, in one place: sparkhvd/common/patches.py)."""
import importlib

import pytest

from sparkhvd.common import patches

# every profile: the libraries' internals this patches differ by stack (horovod, Keras 2 or 3)
pytestmark = pytest.mark.every_profile


def _resolve(module, path):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.horovod
@pytest.mark.parametrize("module,path", patches.PATCHED, ids=[f"{m}:{p}" for m, p in patches.PATCHED])
def test_horovod_details_still_exist(module, path):
    patches.check_horovod_version()
    assert _resolve(module, path) is not None


@pytest.mark.horovod
@pytest.mark.parametrize("module,cls,attr", patches.PATCHED_INSTANCE,
                         ids=[f"{m}:{c}.{a}" for m, c, a in patches.PATCHED_INSTANCE])
def test_horovod_instance_details_still_exist(module, cls, attr):
    import inspect

    assert f"self.{attr} =" in inspect.getsource(_resolve(module, cls))


def test_keras3_trainer_details_exist_where_keras3_is_installed():
    from sparkhvd.keras.modelio import keras_major

    if keras_major() < 3:
        pytest.skip("Keras 2 here: the Keras 3 patch is not used (see the modern profile)")
    for module, path in patches.PATCHED_KERAS3:
        assert _resolve(module, path) is not None, f"{module}:{path}"


def test_untested_horovod_is_refused(monkeypatch):
    import sys
    import types

    from sparkhvd import EnvironmentMismatchError

    monkeypatch.setitem(sys.modules, "horovod", types.SimpleNamespace(__version__="0.29.0"))
    with pytest.raises(EnvironmentMismatchError, match="horovod 0.29.0 is installed; .*0.28.x"):
        patches.check_horovod_version()
