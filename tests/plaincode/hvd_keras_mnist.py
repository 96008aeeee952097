"""Our own copy of the shape of Horovod's Keras MNIST example (``model.fit(..., verbose=1)`` on
rank 0, Horovod's callbacks), on generated 28x28 data: nothing here knows about sparkhvd."""
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

hvd.init()
epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 24
rng = np.random.default_rng(hvd.rank())
x = rng.random((2048, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, 2048)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1000).batch(32)
model = tf.keras.Sequential([
    tf.keras.layers.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation="relu"),
    tf.keras.layers.Dense(10, activation="softmax"),
])
opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"], experimental_run_tf_function=False)
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback()]
verbose = 1 if hvd.rank() == 0 else 0
model.fit(dataset, steps_per_epoch=200 // hvd.size(), callbacks=callbacks, epochs=epochs,
          verbose=verbose)
