"""Presets: every shipped preset, every validation error, renderings, runner np check."""
import json

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.spark.presets import Preset, PresetError, list_preset_names, load_preset

BASE = {"driverMemory": "2g", "driverCores": 1, "executorMemory": "2g", "executorCores": 2,
        "numExecutors": 2, "conf": {}}


def test_shipped_presets_load_with_expected_max_np():
    assert set(list_preset_names()) >= {"gpu-large", "gpu-small", "local-cpu", "standalone-cpu"}
    expected = {"gpu-large": 3, "gpu-small": 2, "local-cpu": 2, "standalone-cpu": 2,
                "standalone-elastic": 3}
    for name, max_np in expected.items():
        assert load_preset(name).max_np() == max_np, name


def test_gpu_large_is_seed_001():
    body = load_preset("gpu-large").body
    assert (body["driverMemory"], body["driverCores"], body["executorMemory"],
            body["executorCores"], body["numExecutors"]) == ("30g", 4, "60g", 12, 3)
    assert body["conf"]["spark.rapids.memory.gpu.reserve"] == "10g"
    assert body["conf"]["spark.executorEnv.TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert body["conf"]["spark.kryoserializer.buffer.max"] == "2000m"


@pytest.mark.parametrize("change,message", [
    ({"executorMemroy": "2g"}, r"unknown key\(s\) \['executorMemroy'\]"),
    ({"driverMemory": "2 GB"}, r"driverMemory='2 GB' is not a Spark memory size"),
    ({"executorMemory": 2048}, r"executorMemory=2048 is not a Spark memory size"),
    ({"numExecutors": 0}, r"numExecutors=0 must be a positive whole number"),
    ({"executorCores": -1}, r"executorCores=-1 must be a positive"),
    ({"driverCores": 1.5}, r"driverCores=1.5 must be a positive"),
    ({"conf": {"spark.executor.resource.gpu.amount": "1"}}, r"discoveryScript is not"),
    ({"conf": {"spark.task.resource.gpu.amount": "1"}}, r"needs spark.executor.resource.gpu"),
    ({"conf": {"spark.sparkhvd.nodes": "1"}}, r"numExecutors=2 is larger than the 1 node"),
    ({"conf": {"spark.sparkhvd.nodes": "many"}}, r"must be a whole number of nodes"),
    ({"conf": ["x"]}, r"\"conf\" must be an object"),
])
def test_validation_errors_name_key_and_fix(change, message):
    with pytest.raises(PresetError, match=message):
        Preset("bad", {**BASE, **change})


def test_renderings():
    p = Preset("p", {**BASE, "conf": {"spark.task.cpus": "1", "spark.master": "local[2]"}})
    cell = p.configure_cell()
    assert cell.startswith("%%configure -f\n") and json.loads(cell.split("\n", 1)[1]) == p.body
    conf = p.spark_conf()
    assert conf["spark.executor.instances"] == "2" and conf["spark.driver.memory"] == "2g"
    args = p.spark_submit_args("spark://127.0.0.1:7077")
    assert args[:2] == ["--master", "spark://127.0.0.1:7077"]
    assert "--total-executor-cores" in args and "--num-executors" not in args
    assert "--num-executors" in p.spark_submit_args("yarn")
    assert "spark.master=local[2]" not in " ".join(args)


def test_unknown_preset_lists_known():
    with pytest.raises(PresetError, match=r"No preset named 'huge' \(known: .*local-cpu"):
        load_preset("huge")


def test_runner_checks_np_against_preset():
    with pytest.raises(PresetError, match=r"np=3 does not fit preset 'local-cpu'.*at most 2"):
        HorovodRunner(np=3, preset="local-cpu")
    assert HorovodRunner(np=2, preset="local-cpu").session_config.preset.name == "local-cpu"
    assert HorovodRunner(np=-4, preset="local-cpu").np == -4  # local processes need no slots


def test_the_projects_presets_are_found_from_any_folder(tmp_path, monkeypatch):
    """A notebook's or a job's working folder is rarely the checkout: conf/ is found anyway."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPARKHVD_PRESETS_DIR", raising=False)
    assert load_preset("local-cpu").name == "local-cpu"
