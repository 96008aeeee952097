"""A spark-submit job: train digits with HorovodRunner(np=2) and write the model to a URL.

    sparkhvd submit --preset standalone-cpu --master spark://127.0.0.1:7077 \
        jobs/train_digits.py --output-url /tmp/model.h5 [--np 2] [--epochs 20]

With --min-np the run is elastic (HorovodRunner(min_np=..., max_np=np), examples.digits'
train_elastic): it goes on while at least min-np ranks are alive; --sizes-url receives the world
size seen at each step as JSON.

The SparkSession comes from spark-submit's settings (the preset's resources); the model's
bytes are written atomically to --output-url (a path, file:// or abfss:// URL), then read back
and evaluated on the held-out digits.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-url", required=True, help="where the model (.h5) is written")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--min-np", type=int, help="elastic: carry on down to this many ranks")
    parser.add_argument("--steps", type=int, default=60, help="elastic: training steps")
    parser.add_argument("--pause", type=float, default=0.0, help="elastic: seconds per step")
    parser.add_argument("--sizes-url", help="elastic: where the per-step world sizes go (JSON)")
    parser.add_argument("--runs-dir", default=os.path.join(tempfile.gettempdir(), "sparkhvd-job-runs"))
    parser.add_argument("--backend", choices=["horovod", "tf"], default="horovod")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sparkhvd").setLevel(logging.INFO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from pyspark.sql import SparkSession

    from sparkhvd import HorovodRunner, storage
    from sparkhvd.examples.digits import load_digits_split, train_elastic, train_hvd

    spark = SparkSession.builder.appName("sparkhvd-train-digits").getOrCreate()
    x_train, x_test, y_train, y_test = load_digits_split()
    data = dict(x_train=x_train, y_train=y_train, x_val=x_test, y_val=y_test)
    if args.min_np:
        runner = HorovodRunner(np=args.np, min_np=args.min_np, max_np=args.np, spark=spark,
                               output_dir=args.runs_dir)
        result = runner.run(train_elastic, steps=args.steps, pause=args.pause, **data)
        model_bytes = result["model"]
        if args.sizes_url:
            storage.write_bytes(args.sizes_url, json.dumps(result["sizes"]).encode())
        print(f"ELASTIC: {len(result['sizes'])} steps, world sizes seen "
              f"{sorted(set(result['sizes']), reverse=True)}")
    else:
        runner = HorovodRunner(np=args.np, spark=spark, output_dir=args.runs_dir,
                               backend=args.backend)
        model_bytes = runner.run(train_hvd, epochs=args.epochs, **data)
    storage.write_bytes(args.output_url, model_bytes)

    import tensorflow as tf

    from sparkhvd.keras.modelio import local_file
    from sparkhvd.runfolder.rundir import model_filename

    saved = storage.read_bytes(args.output_url)
    suffix = os.path.splitext(model_filename(saved) or "model.h5")[1]  # HDF5, or Keras 3's zip
    with local_file(saved, suffix) as path:
        _, accuracy = tf.keras.models.load_model(path).evaluate(x_test, y_test, verbose=0)
    print(f"JOB OK: model at {storage.public_url(args.output_url)}, held-out accuracy "
          f"{accuracy:.4f}, master {spark.sparkContext.master}, backend {args.backend}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
