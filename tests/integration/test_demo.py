"""The main job (make demo) end to end, with fewer epochs: accuracy, saved and reloaded model."""
import json
import os
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))


@pytest.mark.parametrize("backend", ["horovod", pytest.param("tf", marks=pytest.mark.tf_backend),
                                     pytest.param("torch", marks=pytest.mark.torch_backend)])
def test_demo_trains_saves_and_reloads(spark, tmp_path, rank_lines, capsys, backend):
    """`make demo` (and `make demo PROFILE=modern|torch`: --backend tf|torch)."""
    import demo

    assert demo.main(["--epochs", "15", "--output-dir", str(tmp_path), "--backend", backend]) == 0
    (run,) = list(tmp_path.iterdir())
    record = json.loads((run / "run.json").read_text())
    if backend == "torch":
        model = "model.pt"
    else:
        from sparkhvd.keras.modelio import keras_major

        model = "model.keras" if keras_major() >= 3 else "model.h5"
    assert record["status"] == "succeeded" and record["model"] == model
    assert (run / model).exists()
    assert record["demo"]["test_accuracy"] >= 0.9
    assert (run / "logs" / "rank-0.log").exists() and (run / "logs" / "rank-1.log").exists()
    assert any(line.startswith("[rank 0] epoch 15/15 - loss") for line in rank_lines)
    assert (run / "curves.png").exists() and (run / "metrics.csv").exists()
    assert (run / "checkpoints" / f"epoch-0015{os.path.splitext(model)[1]}").exists()
    assert "DEMO OK" in capsys.readouterr().out
