"""Our own copy of the shape of TensorFlow's "Multi-worker training with Keras" tutorial:
the strategy comes from TF_CONFIG, the model is built and compiled in its scope, then fit.
Run as a script (``sparkhvd run --backend tf``) it prints its weights' checksum; imported, its
``main()`` returns it. Nothing here knows about sparkhvd."""
import json
import os
import sys

import numpy as np
import tensorflow as tf


def dataset(global_batch_size):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch_size)


def build_and_compile_model():
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input(shape=(8,)),
                                 tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(learning_rate=0.05), metrics=["accuracy"])
    return model


def main(epochs=3):
    tf_config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(tf_config["cluster"]["worker"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch_size = 32 * num_workers
    data = dataset(global_batch_size)
    with strategy.scope():
        model = build_and_compile_model()
    model.fit(data, epochs=epochs, steps_per_epoch=10, verbose=0)
    return float(sum(np.abs(w).sum() for w in model.get_weights()))


if __name__ == "__main__":
    print(f"worker {json.loads(os.environ['TF_CONFIG'])['task']['index']} "
          f"checksum {main(int(sys.argv[1]) if len(sys.argv) > 1 else 3):.6f}", flush=True)
