"""The digits example used by the demo, the spark-submit job and the notebooks.

scikit-learn's digits ship offline (1,797 8x8 images); the model is a small CNN (Keras) or a
small MLP (PyTorch, :func:`train_torch`).
"""
from __future__ import annotations

__side__ = "public"

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
    """Single-node Keras code made distributed with sparkhvd.keras (seed 004's recipe).

    Runs unchanged on ``HorovodRunner(backend="horovod")`` and ``backend="tf"``.
    """
    import tensorflow as tf

    from sparkhvd.keras import KerasDistributed
    from sparkhvd.keras.modelio import model_bytes

    # Horovod: hvd.init(); tf: the MultiWorkerMirroredStrategy. LR scaled by size, gradients
    # averaged, ranks start equal, metrics global, warm-up, rank-0 progress and checkpoints.
    kd = KerasDistributed(epochs=epochs, batch_size=batch_size, warmup_epochs=1)
    tf.keras.utils.set_random_seed(42)
    # Each rank trains on its own, equally sized, slice (equal steps keep allreduce in step).
    per_rank = len(x_train) // kd.size
    x = x_train[kd.rank::kd.size][:per_rank]
    y = y_train[kd.rank::kd.size][:per_rank]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(per_rank, seed=kd.rank) \
        .repeat().batch(batch_size)
    options = tf.data.Options()  # the rank's own slice: no further sharding by the strategy
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    with kd.scope():
        model = build_model()
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(lr)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(dataset.with_options(options), steps_per_epoch=per_rank // batch_size,
              validation_data=(x_val, y_val), **kd.fit_kwargs(model))
    saved = model_bytes(model)  # every rank saves (tf.distribute may read collectively) ...
    return saved if kd.rank == 0 else None  # ... rank 0's bytes become runs/<id>/model.h5


def train_torch(x_train, y_train, x_val, y_val, epochs: int = 30, batch_size: int = 32,
                lr: float = 0.002):
    """Single-node PyTorch code made distributed with sparkhvd.torch (``backend="torch"``):
    DDP, each rank its slice, rank-averaged metrics, rank-0 checkpoints, TorchScript bytes."""
    import torch

    import sparkhvd.torch as st

    ctx = st.setup()  # init_process_group from the variables every rank got (gloo / nccl)
    torch.manual_seed(42)
    model = ctx.wrap(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64),
                                         torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=ctx.scale_lr(lr))
    per_rank = len(x_train) // ctx.world_size  # equal steps on every rank
    x = torch.from_numpy(x_train[ctx.rank::ctx.world_size][:per_rank].reshape(per_rank, 64))
    y = torch.from_numpy(y_train[ctx.rank::ctx.world_size][:per_rank])
    xv = torch.from_numpy(x_val.reshape(len(x_val), 64))
    yv = torch.from_numpy(y_val)
    ckpt = st.Checkpoints(model, opt)
    shuffle = torch.Generator().manual_seed(ctx.rank)
    for epoch in range(ckpt.restore(), epochs):
        model.train()
        order = torch.randperm(per_rank, generator=shuffle)
        total, correct = 0.0, 0
        for start in range(0, per_rank - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad()
            out = model(x[idx])
            loss = torch.nn.functional.cross_entropy(out, y[idx])
            loss.backward()
            opt.step()
            total += float(loss) * len(idx)
            correct += int((out.argmax(1) == y[idx]).sum())
        model.eval()
        with torch.no_grad():
            val_accuracy = float((model(xv).argmax(1) == yv).float().mean())
        steps = per_rank // batch_size * batch_size
        st.report(epoch, epochs=epochs, loss=total / steps, accuracy=correct / steps,
                  val_accuracy=val_accuracy)
        ckpt.save(epoch)
    return st.model_bytes(model) if ctx.rank == 0 else None  # runs/<id>/model.pt (TorchScript)


def train_elastic(x_train, y_train, x_val, y_val, steps: int = 60, batch_size: int = 32,
                  lr: float = 0.002, pause: float = 0.0):
    """Elastic Horovod training (``HorovodRunner(min_np=..., max_np=...)``), horovod's recipe.

    A custom loop whose progress lives in ``hvd.elastic.TensorFlowState``: when a rank is lost,
    the survivors roll back to the last commit, re-shard by the new size and go on. Rank 0
    returns ``{"model": <.h5 bytes>, "sizes": [world size at each step], "val_accuracy": ...}``.
    """
    import time

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    tf.keras.utils.set_random_seed(42)
    model = build_model()
    optimizer = tf.keras.optimizers.Adam(lr)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def train_step(x, y, allreduce=True):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    # Create the optimizer's slots with one local step, so the state holds every variable
    # (the broadcast in TensorFlowState's constructor then makes all ranks equal).
    train_step(x_train[:1], y_train[:1], allreduce=False)
    opt_vars = optimizer.variables() if callable(optimizer.variables) else optimizer.variables
    state = hvd.elastic.TensorFlowState(variables=model.variables + list(opt_vars),
                                        step=0, sizes=[])

    @hvd.elastic.run
    def loop(state):
        while state.step < steps:
            size, rank = hvd.size(), hvd.rank()
            per_rank = len(x_train) // size  # re-sharded whenever the world changes
            start = rank * per_rank + (state.step * batch_size) % max(per_rank - batch_size, 1)
            train_step(x_train[start:start + batch_size], y_train[start:start + batch_size])
            state.sizes.append(size)
            state.step += 1
            if rank == 0 and state.step % 5 == 0:
                print(f"step {state.step}/{steps} size {size}", flush=True)
            time.sleep(pause)
            state.commit()

    loop(state)
    if hvd.rank() != 0:
        return None
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    _, accuracy = model.evaluate(x_val, y_val, verbose=0)
    from sparkhvd.keras.modelio import model_bytes

    return {"model": model_bytes(model), "sizes": list(state.sizes),
            "val_accuracy": float(accuracy)}
