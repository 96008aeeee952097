"""The main job: train on scikit-learn's digits with HorovodRunner(np=2) (Keras, or PyTorch).

Runs on a local-mode Spark session (2 task slots); rank 0 prints per-epoch metrics on the driver,
the model comes back as bytes, is saved under runs/<run-id>/, and scores the held-out images as
a Spark DataFrame on the executors (sparkhvd.predict).
Exit status 1 if the held-out accuracy is below --min-accuracy.

    python scripts/demo.py [--np 2] [--epochs 30] [--output-dir runs] [--backend horovod|tf|torch]
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
    parser.add_argument("--backend", choices=["horovod", "tf", "torch"], default="horovod",
                        help="horovod (Gloo), tf (tf.distribute; the modern profile's) or torch "
                             "(torch.distributed; make demo PROFILE=torch)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("sparkhvd", "demo"):
        logging.getLogger(name).setLevel(logging.INFO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from sparkhvd import HorovodRunner
    from sparkhvd.examples.digits import load_digits_split, train_hvd, train_torch

    x_train, x_test, y_train, y_test = load_digits_split()
    runner = HorovodRunner(np=args.np, output_dir=args.output_dir, backend=args.backend)
    train = train_torch if args.backend == "torch" else train_hvd
    model_bytes = runner.run(train, x_train=x_train, y_train=y_train, x_val=x_test,
                             y_val=y_test, epochs=args.epochs)
    run_dir = runner.last_run_dir
    log.info("rank 0 returned %d bytes; saved as %s", len(model_bytes),
             run_dir.file(run_dir.record["model"]))  # model.h5, model.keras (Keras 3), model.pt

    # Score the held-out images as a Spark DataFrame, on the executors (the model is loaded once
    # per executor Python worker; nothing is collected on the driver).
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from sparkhvd import predict

    spark = SparkSession.builder.getOrCreate()  # the session HorovodRunner started
    test_df = spark.createDataFrame(
        [(x.reshape(-1).tolist(), int(y)) for x, y in zip(x_test, y_test)], ["pixels", "label"])
    scored = predict(test_df, run_dir, features="pixels", argmax=True)
    accuracy = scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))
                             ).first()[0]
    log.info("reloaded model, scored on the executors: held-out accuracy %.4f (%d test images)",
             accuracy, len(x_test))
    run_dir.record.annotate(demo={"test_accuracy": round(float(accuracy), 4)})
    if accuracy < args.min_accuracy:
        log.error("accuracy %.4f is below %.2f", accuracy, args.min_accuracy)
        return 1
    print(f"DEMO OK: accuracy {accuracy:.4f} >= {args.min_accuracy}; run folder {run_dir.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
