"""A spark-submit job: train digits with HorovodRunner(np=2) and write the model to a URL.

    sparkhvd submit --preset standalone-cpu --master spark://127.0.0.1:7077 \
        jobs/train_digits.py --output-url /tmp/model.h5 [--np 2] [--epochs 20]

The SparkSession comes from spark-submit's settings (the preset's resources); the model's
bytes are written atomically to --output-url (a path, file:// or abfss:// URL), then read back
and evaluated on the held-out digits.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-url", required=True, help="where the model (.h5) is written")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--runs-dir", default=os.path.join(tempfile.gettempdir(), "sparkhvd-job-runs"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sparkhvd").setLevel(logging.INFO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from pyspark.sql import SparkSession

    from sparkhvd import HorovodRunner, storage
    from sparkhvd.examples.digits import load_digits_split, train_hvd

    spark = SparkSession.builder.appName("sparkhvd-train-digits").getOrCreate()
    x_train, x_test, y_train, y_test = load_digits_split()
    runner = HorovodRunner(np=args.np, spark=spark, output_dir=args.runs_dir)
    model_bytes = runner.run(train_hvd, x_train=x_train, y_train=y_train, x_val=x_test,
                             y_val=y_test, epochs=args.epochs)
    storage.write_bytes(args.output_url, model_bytes)

    import tensorflow as tf

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.h5")
        with open(path, "wb") as f:
            f.write(storage.read_bytes(args.output_url))
        _, accuracy = tf.keras.models.load_model(path).evaluate(x_test, y_test, verbose=0)
    print(f"JOB OK: model at {storage.public_url(args.output_url)}, held-out accuracy "
          f"{accuracy:.4f}, master {spark.sparkContext.master}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
