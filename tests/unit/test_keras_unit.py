"""sparkhvd.keras callbacks in one process, with a fake horovod; curves on the driver."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from sparkhvd.keras import LearningRateWarmup, MetricAverage, warmup_lr  # noqa: E402
from sparkhvd.runfolder.curves import plot_curves, write_metrics_csv  # noqa: E402

# every profile: Keras 2 (default profile) and Keras 3 (modern) take different paths
pytestmark = pytest.mark.every_profile


class FakeHvd:
    Average = "average"

    def __init__(self, size, other_keys=None, other_values=None):
        self._size = size
        self.other_keys = other_keys
        self.other_values = other_values

    def size(self):
        return self._size

    def allgather_object(self, obj):
        return [obj, self.other_keys if self.other_keys is not None else obj]

    def allreduce(self, values, op, name):
        assert op == "average"
        return (values + tf.constant(self.other_values, dtype=values.dtype)) / 2


def test_warmup_schedule_values():
    assert warmup_lr(0, 10, 0.4, 4) == pytest.approx(0.1)
    assert warmup_lr(5, 10, 0.4, 4) == pytest.approx(0.25)
    assert warmup_lr(10, 10, 0.4, 4) == pytest.approx(0.4)
    assert warmup_lr(50, 10, 0.4, 4) == pytest.approx(0.4)
    assert warmup_lr(3, 0, 0.4, 4) == 0.4


def _tiny_model(lr):
    model = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(lr), loss="mse")
    return model


def test_warmup_callback_sets_the_documented_lr_per_step():
    model = _tiny_model(0.8)
    warm = LearningRateWarmup(FakeHvd(4), warmup_epochs=1)
    seen = []

    class Spy(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    x = np.zeros((20, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[warm, Spy()])
    assert [lr for *_, lr in warm.recorded] == pytest.approx(
        [warmup_lr(s, 5, 0.8, 4) for s in range(6)])
    assert seen[:6] == pytest.approx([warmup_lr(s, 5, 0.8, 4) for s in range(6)], rel=1e-6)
    assert seen[6:] == pytest.approx([0.8] * 4)


def test_warmup_refuses_schedules():
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    model = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(schedule), loss="mse")
    x = np.zeros((8, 3), "float32")
    with pytest.raises(TypeError, match="warmup_epochs=0"):
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0,
                  callbacks=[LearningRateWarmup(FakeHvd(2), 1)])


def test_metric_average_averages_common_keys_in_place():
    cb = MetricAverage(FakeHvd(2, other_keys=["accuracy", "loss"], other_values=[0.5, 1.0]))
    logs = {"loss": 3.0, "accuracy": 0.9, "val_loss": 7.0}
    cb.on_epoch_end(0, logs)
    assert logs == {"loss": 2.0, "accuracy": pytest.approx(0.7), "val_loss": 7.0}
    assert cb.history == [logs]


def test_curves_files(tmp_path):
    records = [{"epoch": 1, "loss": 1.0, "accuracy": 0.5, "val_loss": 1.2, "val_accuracy": 0.4},
               {"epoch": 2, "loss": 0.5, "accuracy": 0.8, "val_loss": 0.7, "val_accuracy": 0.7}]
    write_metrics_csv(str(tmp_path / "metrics.csv"), records)
    plot_curves(str(tmp_path / "curves.png"), records)
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "epoch,loss,accuracy,val_loss,val_accuracy" and len(lines) == 3
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_strategys_peer_transfer_sizes_files_past_2_gib():
    """tf.distribute sends a host copy's size as summed int32 words: a file of 3 GiB (and the
    -1 that says "none") comes through whole, not wrapped."""
    from sparkhvd.keras.restore_collectives import StrategyCollectives

    collectives = StrategyCollectives(tf.distribute.get_strategy(), 0)
    for size in (-1, 0, 12, (1 << 31) - 1, 3 << 30, 1 << 40):
        assert collectives._sizes(size) == [size]
