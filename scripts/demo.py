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


def load_digits_split(seed: int = 0):
    """Digits as float32 images (N, 8, 8, 1) in [0, 1], one 80/20 stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def build_model():
    """A small CNN for 8x8 digit images (plain single-node Keras)."""
    import tensorflow as tf

    return tf.keras.Sequential([
        tf.keras.layers.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])


def train_hvd(x_train, y_train, x_val, y_val, epochs: int = 30, batch_size: int = 32,
              lr: float = 0.002):
    """Single-node Keras code made distributed with sparkhvd.keras (seed 004's recipe)."""
    import tempfile

    import tensorflow as tf

    from sparkhvd.keras import KerasDistributed

    # hvd.init(); LR scaled by size + DistributedOptimizer; broadcast, metric averaging,
    # warm-up, rank-0 progress lines and checkpoints into the run folder.
    kd = KerasDistributed(epochs=epochs, batch_size=batch_size, warmup_epochs=1)
    tf.keras.utils.set_random_seed(42)
    # Each rank trains on its own, equally sized, slice (equal steps keep allreduce in step).
    per_rank = len(x_train) // kd.size
    x = x_train[kd.rank::kd.size][:per_rank]
    y = y_train[kd.rank::kd.size][:per_rank]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(per_rank, seed=kd.rank) \
        .repeat().batch(batch_size)

    model = build_model()
    model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(lr)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(dataset, steps_per_epoch=per_rank // batch_size, validation_data=(x_val, y_val),
              **kd.fit_kwargs(model))
    if kd.rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.h5")
            model.save(path)
            with open(path, "rb") as f:
                return f.read()
    return None


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
