import sparkhvd
from sparkhvd import SparkRunner


def train():  # the shape MirroredStrategyRunner expects: no strategy of its own
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(digits.data / 16.0, digits.target, batch_size=64, epochs=3, verbose=0)
    return model.evaluate(digits.data / 16.0, digits.target, verbose=0)[1]


# before: MirroredStrategyRunner(num_slots=2, local_mode=False, use_gpu=False).run(train)
accuracy = SparkRunner(np=2, backend="tf").run(sparkhvd.keras.in_strategy(train))
print(f"accuracy {accuracy:.3f}")
