"""Keras integration: the distributed optimizer, our callbacks, rank-0 checkpoints and resume.

    from sparkhvd.keras import KerasDistributed

    def train_fn(epochs):
        kd = KerasDistributed(epochs=epochs, batch_size=64, warmup_epochs=2)   # hvd.init()
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(1e-3)), loss=..., metrics=[...])
        model.fit(ds, steps_per_epoch=..., **kd.fit_kwargs(model))
"""
from sparkhvd.rank.keras.callbacks import (BroadcastInitialState, EpochProgress,
    LearningRateWarmup, MetricAverage, RankZeroCheckpoint, RunFolderTensorBoard,
    latest_checkpoint, warmup_lr)
from sparkhvd.rank.keras.distributed import KerasDistributed
from sparkhvd.rank.keras.plain import StrategyMissingError, in_strategy

__all__ = ["KerasDistributed", "BroadcastInitialState", "MetricAverage", "LearningRateWarmup",
           "EpochProgress", "RankZeroCheckpoint", "RunFolderTensorBoard", "latest_checkpoint",
           "warmup_lr", "in_strategy", "StrategyMissingError"]
