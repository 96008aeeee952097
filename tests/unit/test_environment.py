"""What the ranks' environment holds, and the Keras 3 refusal."""
import pytest

from sparkhvd import EnvironmentMismatchError
from sparkhvd.common.environment import process_env, rank_env
from sparkhvd.spark.installed import check_keras, keras_problem
from sparkhvd.spark.session import is_loopback_master

# every profile: what is installed differs by stack
pytestmark = pytest.mark.every_profile


def test_rank_env_is_driver_settings_plus_user_env():
    driver = {"PATH": "/venv/bin", "TF_USE_LEGACY_KERAS": "1", "HOROVOD_TIMELINE": "/t.json",
              "AZURE_STORAGE_ACCOUNT_KEY": "c2VjcmV0", "HOROVOD_SECRET_KEY": "abc",
              "MY_APP_SETTING": "x", "AWS_SECRET_ACCESS_KEY": "y"}
    env = rank_env({"EPOCHS": "3"}, environ=driver)
    assert env["TF_USE_LEGACY_KERAS"] == "1"
    assert env["HOROVOD_TIMELINE"] == "/t.json" and env["EPOCHS"] == "3"
    for hidden in ("AZURE_STORAGE_ACCOUNT_KEY", "HOROVOD_SECRET_KEY", "MY_APP_SETTING",
                   "AWS_SECRET_ACCESS_KEY", "PATH"):  # PATH comes from the rank's own host
        assert hidden not in env
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "2"
    assert "TF_CPP_MIN_LOG_LEVEL" not in rank_env({}, verbose=True, environ={})


def test_process_env_filters_where_the_rank_starts():
    executor = {"PATH": "/exec/bin", "HOME": "/home/spark", "MYAPP_DB_PASSWORD": "hunter2hunter",
                "AZURE_STORAGE_ACCOUNT_KEY": "c2VjcmV0", "SPARK_SECRET": "s", "RANDOM": "r",
                "TF_NUM_INTRAOP_THREADS": "4"}
    env = process_env(executor, {"TF_CPP_MIN_LOG_LEVEL": "2", "MY_TOKEN": "given on purpose"},
                      {"HOROVOD_RANK": "1"})
    assert env["PATH"] == "/exec/bin" and env["HOME"] == "/home/spark"
    assert env["MY_TOKEN"] == "given on purpose" and env["HOROVOD_RANK"] == "1"
    assert env["TF_NUM_INTRAOP_THREADS"] == "4"
    for hidden in ("MYAPP_DB_PASSWORD", "AZURE_STORAGE_ACCOUNT_KEY", "SPARK_SECRET", "RANDOM"):
        assert hidden not in env


def test_loopback_masters():
    assert is_loopback_master("local[2]")
    assert is_loopback_master("spark://127.0.0.1:7077")
    assert not is_loopback_master("spark://10.1.2.3:7077")
    assert not is_loopback_master("yarn")


@pytest.mark.parametrize("versions,environ,bad", [
    ({"tensorflow-cpu": "2.15.1", "keras": "2.15.0"}, {}, None),
    ({"tensorflow": "2.18.0", "keras": "3.8.0", "tf-keras": "2.18.0"},
     {"TF_USE_LEGACY_KERAS": "1"}, None),
    ({"tensorflow": "2.18.0", "keras": "3.8.0"}, {}, "Keras 3"),
    ({"tensorflow": "2.18.0", "keras": "3.8.0", "tf-keras": "2.18.0"}, {}, "Keras 3"),
    ({"tensorflow": "2.18.0", "keras": "3.8.0"}, {"TF_USE_LEGACY_KERAS": "1"},
     "tf-keras is not installed"),
])
def test_keras_problem(versions, environ, bad):
    problem = keras_problem(versions, environ)
    if bad is None:
        assert problem is None
    else:
        assert bad in problem and "TF_USE_LEGACY_KERAS=1" in problem and "tf-keras==2.18" in problem
        assert "backend='tf'" in problem, "Keras 3 points to the tf backend"


@pytest.mark.horovod
def test_installed_stack_passes_keras_check():
    check_keras()  # the installed profile, with this environment (tf218 sets TF_USE_LEGACY_KERAS)


def test_check_keras_raises(monkeypatch):
    from sparkhvd.spark import installed as stack

    monkeypatch.setattr(stack, "package_version",
                        lambda n: {"tensorflow": "2.18.0", "keras": "3.8.0"}.get(n))
    with pytest.raises(EnvironmentMismatchError, match="gradients would silently not be averaged"):
        stack.check_keras({})
