"""Digits + a small Keras model, trained through sparkhvd.keras (shared by the Keras tests)."""
import hashlib

import numpy as np


def digits_split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype("float32")[..., None]
    return train_test_split(x, d.target.astype("int64"), test_size=0.2, random_state=0,
                            stratify=d.target)


def weights_hash(model):
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def train(x_train, y_train, x_val, y_val, epochs, batch_size=32, warmup_epochs=0, resume=None,
          lr=0.002, shuffle=True, weights=False, tensorboard=False, model_bytes=False,
          async_save=False):
    """Returns a dict per rank: weights hash, averaged metrics, warm-up record, start state.

    ``shuffle=False``: every epoch sees the same batches in the same order, so a resumed run can
    be compared with an uninterrupted one; ``weights=True`` also returns the final weights.
    ``async_save``: checkpoints every 2 steps too, written in the background.
    """
    import tensorflow as tf

    from sparkhvd.keras import KerasDistributed

    kw = {} if resume is None else {"resume": resume}
    if async_save:
        kw.update(async_save=True, every_steps=2)
    kd = KerasDistributed(epochs=epochs, batch_size=batch_size, warmup_epochs=warmup_epochs,
                          tensorboard=tensorboard, **kw)
    tf.keras.utils.set_random_seed(1234 + kd.rank)  # different init per rank: broadcast must fix
    per_rank = len(x_train) // kd.size
    x = x_train[kd.rank::kd.size][:per_rank]
    y = y_train[kd.rank::kd.size][:per_rank]
    with kd.scope():  # the strategy's scope on backend="tf"; nothing to do on Horovod
        model = tf.keras.Sequential([
            tf.keras.layers.Input((8, 8, 1)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(lr)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    start = {}

    class StartState(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            start["hash"] = weights_hash(self.model)

    fit = kd.fit_kwargs(model, callbacks=[StartState()])  # after the broadcast of rank 0's state
    steps = per_rank // batch_size
    if shuffle:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=kd.rank).repeat() \
            .batch(batch_size)
    else:
        n = steps * batch_size
        ds = tf.data.Dataset.from_tensor_slices((x[:n], y[:n])).repeat().batch(batch_size)
    options = tf.data.Options()  # each rank's own slice: the strategy must not shard it again
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    model.fit(ds.with_options(options), steps_per_epoch=steps, validation_data=(x_val, y_val),
              **fit)
    _, accuracy = model.evaluate(x_val, y_val, verbose=0)
    if model_bytes:  # what a user returns: the driver saves it as the run's model file
        from sparkhvd.keras.modelio import model_bytes as saved

        data = saved(model)  # every rank saves (tf.distribute may read collectively)
        return data if kd.rank == 0 else None
    return {"hash": weights_hash(model), "accuracy": float(accuracy),
            "weights": model.get_weights() if weights else None,
            "metrics": kd.metric_average.history if kd.metric_average else None,
            "start_hash": start.get("hash"), "backend": kd.backend,
            "initial_epoch": kd.initial_epoch,
            "warmup": kd.warmup.recorded if kd.warmup else [],
            "target_lr": kd.warmup.target_lr if kd.warmup else None, "size": kd.size}


def pausing_data():
    """1,024 digits as (8, 8, 1) floats for :func:`train_pausing`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return dict(x_train=(digits.images / 16.0).astype("float32")[..., None][:1024],
                y_train=digits.target.astype("int64")[:1024])


def train_pausing(x_train, y_train, epochs, pause_at=None):
    """Deterministic Keras training with per-epoch checkpoints (KerasDistributed); on a fresh
    start it waits at ``pause_at`` -- after that epoch's checkpoint -- so a test can kill a rank
    there. A retried attempt resumes past it and does not wait."""
    import os
    import socket
    import time

    import tensorflow as tf

    from sparkhvd.keras import KerasDistributed

    kd = KerasDistributed(epochs=epochs, batch_size=32)
    tf.keras.utils.set_random_seed(7)
    n = (len(x_train) // kd.size // 32) * 32
    x, y = x_train[kd.rank::kd.size][:n], y_train[kd.rank::kd.size][:n]
    with kd.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((8, 8, 1)), tf.keras.layers.Flatten(),
                                     tf.keras.layers.Dense(32, activation="relu"),
                                     tf.keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.SGD(0.01)),
                      loss="sparse_categorical_crossentropy")

    class Pause(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if pause_at is not None and kd.initial_epoch == 0 and epoch == pause_at:
                print(f"pid {os.getpid()} on {socket.gethostname()} paused", flush=True)
                time.sleep(600)

    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    fit = kd.fit_kwargs(model)
    fit["callbacks"] = [*fit["callbacks"], Pause()]
    model.fit(ds.with_options(options), steps_per_epoch=n // 32, **fit)
    return {"weights": model.get_weights(), "initial_epoch": kd.initial_epoch}
