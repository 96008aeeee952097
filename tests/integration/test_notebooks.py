"""The notebooks run top to bottom in a real Jupyter kernel from the project environment."""
import glob
import json
import os
import re

import nbformat
import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_without_outputs_paths_or_secrets(path):
    nb = json.load(open(path))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None
        source = "".join(cell["source"])
        assert not re.search(r"/(work|root|home|Users)/", source), "machine-specific path"
        assert not re.search(r"(?i)(AccountKey=|sig=|sv=20)", source), "secret-looking text"


def _execute(path, tmp_path, **env):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = dict(os.environ)
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def _text(cell):
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif "data" in o and "text/plain" in o["data"]:
            out.append(o["data"]["text/plain"])
    return "".join(out)


def _has_png(cell):
    return any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def _check_common(nb):
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = "\n".join(_text(c) for c in nb.cells)
    assert re.search(r"^\[rank 0\] epoch \d+/\d+ - loss", text, re.M), "rank-prefixed log lines"
    assert any(_has_png(c) for c in nb.cells if "show_curves" in "".join(c.source)), \
        "the curves cell shows a PNG"
    return text


def _no_features_collected(nb):
    """Predictions are computed on the executors: no collect()/toPandas() of the features."""
    code = "\n".join("".join(c.source) for c in nb.cells if c.cell_type == "code")
    assert "sparkhvd.predict(" in code
    assert ".collect()" not in code and "toPandas()" not in code


@pytest.mark.spark
@pytest.mark.notebook
@pytest.mark.timeout(900)
def test_quickstart_notebook(tmp_path):
    nb = _execute(NOTEBOOKS[0], tmp_path, NB_EPOCHS=15)
    text = _check_common(nb)
    accuracy = float(re.search(r"loaded model loss: [\d.]+ accuracy: ([\d.]+)", text).group(1))
    assert accuracy >= 0.9
    assert "not a Synapse/Livy kernel" in text
    model = tmp_path / "runs" / "quickstart" / "mnist-ckpt.h5"
    assert model.exists()
    _no_features_collected(nb)
    scored = float(re.search(r"scored on the executors, accuracy: ([\d.]+)", text).group(1))
    assert scored == pytest.approx(accuracy, abs=1e-4), "the same model, scored by Spark"
    listing = _text(nb.cells[-1])
    assert "FINISHED" in listing, listing
    assert (tmp_path / "mlruns").is_dir()
    import tensorflow as tf

    assert tf.keras.models.load_model(model).count_params() > 0


@pytest.mark.spark
@pytest.mark.notebook
@pytest.mark.timeout(900)
def test_dataframe_notebook(tmp_path):
    nb = _execute(NOTEBOOKS[1], tmp_path, NB_EPOCHS=12)
    text = _check_common(nb)
    assert re.search(r"^\[rank 1\] rank 1: \d+ steps per epoch", text, re.M), "all ranks stream"
    accuracy = float(re.search(r"validation accuracy: ([\d.]+)", text).group(1))
    assert accuracy >= 0.9
    _no_features_collected(nb)
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "model.h5").exists()
