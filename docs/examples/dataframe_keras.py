from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

import sparkhvd
from sparkhvd import DataFrameDataset, HorovodRunner

spark = SparkSession.builder.master("local[2]").getOrCreate()
digits = load_digits()
rows = [(row.tolist(), int(label)) for row, label in zip(digits.data / 16.0, digits.target)]
df = spark.createDataFrame(rows, "features array<double>, label long")
df_train, df_val = df.randomSplit([0.8, 0.2], seed=1)

train = DataFrameDataset(df_train, features="features", label="label")
val = DataFrameDataset(df_val, features="features", label="label")


def train_fn(train, val, epochs):
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    hvd.init()
    model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.006)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # each rank streams its batches of one global order; equal steps on every rank
    with train.tf_dataset(batch_size=32, shuffle=True, seed=1) as ds, \
            val.tf_dataset(batch_size=16) as vds:
        model.fit(ds, steps_per_epoch=train.steps_per_epoch(32), epochs=epochs, verbose=0,
                  validation_data=vds, validation_steps=val.steps_per_epoch(16),
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    from sparkhvd.keras import model_bytes

    return model_bytes(model) if hvd.rank() == 0 else None  # saved as the run's model


runner = HorovodRunner(np=2)
runner.run(train_fn, train=train, val=val, epochs=3)
# --8<-- [start:predict]
scored = sparkhvd.predict(df_val, runner.last_run_dir, features="features", argmax=True)
accuracy = scored.where("prediction = label").count() / scored.count()
print(f"accuracy on the executors {accuracy:.3f}")
# --8<-- [end:predict]
