"""Keras integration: the distributed optimizer, our callbacks, rank-0 checkpoints and resume,
and Keras models to and from bytes.

    from sparkhvd.keras import KerasDistributed

    def train_fn(epochs):
        kd = KerasDistributed(epochs=epochs, batch_size=64, warmup_epochs=2)   # hvd.init()
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(1e-3)), loss=..., metrics=[...])
        model.fit(ds, steps_per_epoch=..., **kd.fit_kwargs(model))

Rank side: :mod:`~sparkhvd.keras.distributed`, :mod:`~sparkhvd.keras.callbacks`,
:mod:`~sparkhvd.keras.checkpoints`, :mod:`~sparkhvd.keras.plain` (plain TF code on
``backend="tf"``); shared: :mod:`~sparkhvd.keras.modelio` (public as ``sparkhvd.kerasio``).
Names are imported on first use, so the driver never imports TensorFlow for nothing.
"""
from sparkhvd.common.faces import lazy_face

__side__ = "public"

_CALLBACKS = ("BroadcastInitialState", "EpochProgress", "LearningRateWarmup", "MetricAverage",
              "RankZeroCheckpoint", "RunFolderTensorBoard", "latest_checkpoint", "warmup_lr")
#: an elastic run's old and new world size; the exception of a rank stopped on a notice
_ELASTIC = ("world_size_change", "WorldSizeChange", "Preempted")
__all__ = ["KerasDistributed", *_CALLBACKS, *_ELASTIC, "in_strategy", "StrategyMissingError",
           "model_bytes", "checkpoint_bytes"]
__getattr__, __dir__ = lazy_face(__name__, {
    "KerasDistributed": "distributed", **{name: "callbacks" for name in _CALLBACKS},
    **{name: "distributed" for name in _ELASTIC},
    "in_strategy": "plain", "StrategyMissingError": "plain",
    "model_bytes": "modelio", "checkpoint_bytes": "modelio"})
