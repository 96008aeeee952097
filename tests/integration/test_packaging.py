"""Installing sparkhvd into a runtime never replaces its Spark (or numpy, pandas, pyarrow,
TensorFlow, MLflow), and a missing or unsupported Spark is named at run() with the fix.

The install check asks pip's own resolver for its plan (``pip install --dry-run --report``) in
the profile's environment: pyspark 3.5 + numpy 1 + pyarrow 10 + MLflow 2 in the default profile,
pyspark 4.3 + numpy 2 + pyarrow 25 + MLflow 3 in the modern one.
"""
import json
import os
import subprocess
import sys

import pytest
import tomllib

import sparkhvd
from sparkhvd import EnvironmentMismatchError
from sparkhvd.spark.installed import SPARK_RANGE, check_spark, spark_features, spark_problem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: What a runtime provides and an install must leave alone.
PROVIDED = {"pyspark", "py4j", "numpy", "pandas", "pyarrow", "tensorflow", "tensorflow-cpu",
            "keras", "tf-keras", "mlflow", "mlflow-skinny", "protobuf", "grpcio"}


def _name(requirement: str) -> str:
    import re

    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_pyspark_is_an_extra_and_the_data_stack_has_no_upper_bounds():
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    deps = {_name(d): d for d in project["dependencies"]}
    assert not {"pyspark", "tensorflow", "tensorflow-cpu", "mlflow"} & set(deps)
    for name in ("numpy", "pandas", "pyarrow"):
        assert "<" not in deps[name] and "==" not in deps[name], deps[name]
    extras = project["optional-dependencies"]
    assert [_name(d) for d in extras["spark"]] == ["pyspark"]
    assert any(d.startswith("pyspark[connect]") for d in extras["connect"])
    assert any(_name(d) == "mlflow" and "<4" in d for d in extras["mlflow"]), "MLflow 3 allowed"


@pytest.mark.timeout(300)
def test_pip_install_changes_nothing_the_environment_provides(tmp_path):
    """pip's plan for `pip install '.[mlflow]'` here installs sparkhvd alone."""
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
         "--disable-pip-version-check", "--report", str(report), f"{ROOT}[mlflow]"],
        capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    planned = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert not PROVIDED & set(planned), f"pip would replace: {planned}"
    assert set(planned) <= {"sparkhvd"}, f"pip would also install: {planned}"


_BLOCK_PYSPARK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "pyspark" or name.startswith("pyspark."):
            raise ImportError("No module named 'pyspark'")
sys.meta_path.insert(0, Block())
"""


@pytest.mark.ranks
@pytest.mark.timeout(180)
def test_without_pyspark_spark_runs_name_the_fix_and_local_runs_work(tmp_path, backend):
    code = _BLOCK_PYSPARK + f"""
from sparkhvd import EnvironmentMismatchError, HorovodRunner
try:
    HorovodRunner(np=2, backend={backend!r}, output_dir={str(tmp_path)!r}).run(lambda: 1)
except EnvironmentMismatchError as exc:
    print("ERROR:", exc)
print("LOCAL:", HorovodRunner(np=-1, backend={backend!r}, output_dir={str(tmp_path)!r}).run(
    lambda: 5))
print("PYSPARK IMPORTED:", any(m.startswith("pyspark") for m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=170, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR: pyspark is not installed" in out.stdout
    assert "pip install 'sparkhvd[spark]'" in out.stdout and SPARK_RANGE in out.stdout
    assert "LOCAL: 5" in out.stdout and "PYSPARK IMPORTED: False" in out.stdout


def test_unsupported_spark_versions_are_named_with_the_range(monkeypatch, backend):
    assert spark_problem("3.5.0") is None and spark_problem("4.3.0") is None
    assert spark_problem("4.0.0.dev2") is None
    for old in ("3.3.2", "3.4.1", "2.4.8"):
        problem = spark_problem(old)
        assert f"pyspark {old} is not supported" in problem and "3.5 to 4.x" in problem
    assert "not supported" in spark_problem("5.0.0")
    import pyspark

    monkeypatch.setattr(pyspark, "__version__", "3.4.1")
    with pytest.raises(EnvironmentMismatchError, match=r"pyspark 3\.4\.1 is not supported"):
        check_spark()
    with pytest.raises(EnvironmentMismatchError, match="not supported"):
        sparkhvd.HorovodRunner(np=2, backend=backend).run(lambda: 1)


def test_horovod_backend_without_horovod_names_both_fixes(tmp_path):
    from conftest import HAS_HOROVOD

    if HAS_HOROVOD:
        pytest.skip("horovod is installed in this profile")
    with pytest.raises(EnvironmentMismatchError, match=r"needs horovod.*backend='tf'"):
        sparkhvd.HorovodRunner(np=-2, output_dir=str(tmp_path)).run(lambda: 1)
    assert not list(tmp_path.iterdir()), "refused before a run folder was made"


def test_doctor_reports_the_spark_version_and_its_features():
    import pyspark

    from sparkhvd.ops import doctor

    row = doctor.check("Spark", doctor.spark_stack, "")
    assert row.ok and row.detail.startswith(f"pyspark {pyspark.__version__}: ")
    assert "DataFrame barrier stage" in row.detail and "job tags" in row.detail
    assert spark_features("3.4.1")["job tags (addTag/interruptTag)"] is False
    assert [c.name for c in doctor.stack_checks()][0] == "Spark"
