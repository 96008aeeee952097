from sparkhvd import SparkRunner


def train(epochs):
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from sparkhvd.keras import KerasDistributed

    kd = KerasDistributed(epochs=epochs, batch_size=32)  # first: the strategy, from TF_CONFIG
    digits = load_digits()
    x, y = digits.data[kd.rank::kd.size] / 16.0, digits.target[kd.rank::kd.size]
    with kd.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"),
                                     tf.keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(0.003)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=32, **kd.fit_kwargs(model))
    return model.evaluate(x, y, verbose=0)[1]


accuracy = SparkRunner(np=2, backend="tf").run(train, epochs=5)
print(f"accuracy {accuracy:.3f}")
