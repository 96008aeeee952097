"""The notebooks run top to bottom in a real Jupyter kernel from the project environment."""
import glob
import json
import os
import re

import nbformat
import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


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
    assert _has_png(nb.cells[-1]), "the curves cell shows a PNG"
    return text


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
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "model.h5").exists()
