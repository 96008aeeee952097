from sparkhvd import HorovodRunner


def train(epochs):
    import horovod.tensorflow.keras as hvd  # plain Horovod code runs unchanged
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from sparkhvd.keras import EpochProgress

    hvd.init()
    digits = load_digits()
    x, y = digits.data[hvd.rank()::hvd.size()] / 16.0, digits.target[hvd.rank()::hvd.size()]
    model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.003 * hvd.size())),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if hvd.rank() == 0:  # optional: epoch lines, metrics.csv, curves.png, MLflow metrics
        callbacks.append(EpochProgress(epochs))
    model.fit(x, y, epochs=epochs, batch_size=32, verbose=0, callbacks=callbacks)
    return model.evaluate(x, y, verbose=0)[1]  # rank 0's value comes back


accuracy = HorovodRunner(np=2).run(train, epochs=5)
print(f"accuracy {accuracy:.3f}")
