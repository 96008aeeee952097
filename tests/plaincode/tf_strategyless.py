"""Our own copy of the shape of spark-tensorflow-distributor's example ``train()``: it builds
and fits a model with no strategy of its own (``MirroredStrategyRunner`` runs it inside one)."""
import numpy as np


def train(epochs=3):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input(shape=(8,)),
                                 tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(learning_rate=0.05), metrics=["accuracy"])
    model.fit(data, epochs=epochs, steps_per_epoch=10, verbose=0)
    return [w.tolist() for w in model.get_weights()]
