"""The main job: train a Keras model on scikit-learn's digits with HorovodRunner(np=2).

Runs on a local-mode Spark session (2 task slots); rank 0 prints per-epoch metrics on the driver,
the model comes back as bytes, is saved under runs/<run-id>/, reloaded and evaluated again.
Exit status 1 if the held-out accuracy is below --min-accuracy.

    python scripts/demo.py [--np 2] [--epochs 30] [--output-dir runs]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger("demo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2, help="ranks (negative: local processes)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--output-dir", default="runs")
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("sparkhvd", "demo"):
        logging.getLogger(name).setLevel(logging.INFO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from sparkhvd import HorovodRunner
    from sparkhvd.examples.digits import load_digits_split, train_hvd

    x_train, x_test, y_train, y_test = load_digits_split()
    runner = HorovodRunner(np=args.np, output_dir=args.output_dir)
    model_bytes = runner.run(train_hvd, x_train=x_train, y_train=y_train, x_val=x_test,
                             y_val=y_test, epochs=args.epochs)
    run_dir = runner.last_run_dir
    model_path = run_dir.file("model.h5")
    log.info("rank 0 returned %d bytes; saved as %s", len(model_bytes), model_path)

    import tensorflow as tf

    model = tf.keras.models.load_model(model_path)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    log.info("reloaded model: held-out loss %.4f, accuracy %.4f (%d test images)",
                 loss, accuracy, len(x_test))
    run_dir.update(demo={"test_accuracy": round(float(accuracy), 4), "test_loss": float(loss)})
    if accuracy < args.min_accuracy:
        log.error("accuracy %.4f is below %.2f", accuracy, args.min_accuracy)
        return 1
    print(f"DEMO OK: accuracy {accuracy:.4f} >= {args.min_accuracy}; run folder {run_dir.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
