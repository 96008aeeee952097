"""The runner's settings: typed groups, today's keywords filed into them, one immutable spec."""
from __future__ import annotations

import dataclasses

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.common.protocol import RankOptions
from sparkhvd.driver.launchers import LaunchSpec, Placement
from sparkhvd.driver.settings import LaunchConfig, RunConfig, ScalingConfig, SessionConfig


def test_keywords_land_in_their_groups():
    hr = HorovodRunner(np=3, min_np=2, output_dir="somewhere", start_timeout=7, nics={"eth0"},
                       env={"A": "1"}, mlflow=None, driver_log_verbosity="all")
    assert hr.scaling == ScalingConfig(np=3, min_np=2) and hr.elastic == (2, 3)
    assert hr.launch_config.start_timeout == 7.0 and hr.launch_config.nics == {"eth0"}
    assert dict(hr.launch_config.env) == {"A": "1"}
    assert hr.run_config.output_dir == "somewhere"
    assert hr.run_config.driver_log_verbosity == "all"


def test_groups_can_be_given_whole_and_a_setting_given_twice_is_refused():
    hr = HorovodRunner(scaling=ScalingConfig(np=-2), run_config=RunConfig(output_dir="x"))
    assert hr.np == -2 and hr.scaling.mode == "local" and hr.run_config.output_dir == "x"
    with pytest.raises(ValueError, match="output_dir given both as keyword.*RunConfig"):
        HorovodRunner(np=2, output_dir="a", run_config=RunConfig(output_dir="b"))
    with pytest.raises(TypeError, match="launch= takes a LaunchConfig"):
        HorovodRunner(np=2, launch=RunConfig())
    with pytest.raises(TypeError, match="HorovodRunner needs np"):
        HorovodRunner()
    with pytest.raises(ValueError, match="np given both as keyword.*ScalingConfig"):
        HorovodRunner(np=2, scaling=ScalingConfig(np=4))
    with pytest.raises(ValueError, match="max_np given both as keyword.*ScalingConfig"):
        HorovodRunner(max_np=4, scaling=ScalingConfig(np=2))
    assert HorovodRunner(np=2, min_np=1, max_np=3).scaling == ScalingConfig(np=2, min_np=1,
                                                                             max_np=3)


def test_settings_are_immutable_and_hide_credentials():
    config = RunConfig(storage_options={"account_key": "SECRETKEY"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.output_dir = "elsewhere"
    with pytest.raises(TypeError):
        config.storage_options["account_key"] = "other"
    assert "SECRETKEY" not in repr(config) and "storage_options=<1 keys>" in repr(config)
    launch = LaunchConfig(env={"A": "1"})
    with pytest.raises(TypeError):
        launch.env["B"] = "2"


@pytest.mark.parametrize("kwargs, message", [
    ({"start_timeout": 0}, "start_timeout must be a positive"),
    ({"heartbeat_timeout": True}, "heartbeat_timeout must be a positive"),
    ({"launcher": "mpi"}, "launcher must be one of"),
    ({"slot_wait_s": -1}, "slot_wait_s must be"),
])
def test_launch_settings_are_checked_where_they_are_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**kwargs)


def test_a_fraction_of_a_second_stays_a_fraction():
    """start_timeout=0.5 used to become int(0.5) == 0: no time at all to start."""
    from sparkhvd.driver.launchers.horovod_spark import whole_seconds

    hr = HorovodRunner(np=2, start_timeout=0.5)
    assert hr.launch_config.start_timeout == 0.5
    assert whole_seconds(0.5) == 1 and whole_seconds(2.0) == 2 and whole_seconds(2.1) == 3


def test_the_launch_spec_is_built_once_and_read_only():
    spec = LaunchSpec(scaling=ScalingConfig(np=2), launch=LaunchConfig(start_timeout=0.5),
                      backend="torch", payload=b"", options=RankOptions(return_all=True),
                      env={"A": "1"}, placement=Placement("local"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.payload = b"x"
    assert spec.size == 2 and spec.tasks == 2 and spec.elastic is None
    with pytest.raises(TypeError):
        spec.env["B"] = "2"
    assert spec.start_timeout == 0.5 and spec.driver_host == "127.0.0.1"
    assert spec.options.as_dict()["return_all"] is True


def test_a_preset_name_is_loaded_with_the_session_settings():
    assert SessionConfig(preset="local-cpu").preset.name == "local-cpu"
