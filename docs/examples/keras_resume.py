import tensorflow as tf

from sparkhvd import HorovodRunner
from sparkhvd.examples.digits import build_model, load_digits_split
from sparkhvd.keras import KerasDistributed

x_train, x_val, y_train, y_val = load_digits_split()


def train_fn(x, y, x_val, y_val, epochs):
    kd = KerasDistributed(epochs=epochs, batch_size=32, warmup_epochs=1)  # hvd.init()
    per_rank = len(x) // kd.size  # equal steps on every rank keep allreduce in step
    ds = tf.data.Dataset.from_tensor_slices(
        (x[kd.rank::kd.size][:per_rank], y[kd.rank::kd.size][:per_rank])).repeat().batch(32)
    with kd.scope():  # the strategy's scope on backend="tf"; nothing on Horovod
        model = build_model()
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(0.002)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(ds, steps_per_epoch=per_rank // 32, validation_data=(x_val, y_val),
              **kd.fit_kwargs(model))  # warm-up, averaged metrics, checkpoints, progress
    return model.evaluate(x_val, y_val, verbose=0)[1]


data = dict(x=x_train, y=y_train, x_val=x_val, y_val=y_val)
HorovodRunner(np=2).run(train_fn, **data, epochs=1)
runner = HorovodRunner(np=2, resume_from=True)  # continue from the latest checkpoint
accuracy = runner.run(train_fn, **data, epochs=2)
print(f"accuracy {accuracy:.3f}; run folder {runner.last_run_dir.url}")
print(open(runner.last_run_dir.file("metrics.csv")).read())
