"""The digits example used by the demo, the spark-submit job and the notebooks.

scikit-learn's digits ship offline (1,797 8x8 images); the model is a small CNN.
"""
from __future__ import annotations

import os


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
