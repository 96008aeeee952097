"""``backend="tf"``: plain TensorFlow code runs unchanged in every rank.

:func:`install` runs in every tf rank before the user's function, and costs nothing: it imports
no TensorFlow or Keras. When the function imports Keras itself, Keras's ``Model`` gets two
guards on its way in (a post-import hook, :mod:`sparkhvd.common.after_import`):

- **Keras 3's multi-worker fix** (:func:`sparkhvd.common.patches.patch_keras_multiworker`) is
  applied before the first ``fit``/``evaluate``/``predict``. Without it TF's own "Multi-worker
  training with Keras" tutorial fails under Keras 3 (``Attempt to convert a value (PerReplica
  ...) to a Tensor``); with it the tutorial's code trains as written.
- **A model built outside a multi-worker strategy is refused** at ``fit``, while there is more
  than one worker. spark-tensorflow-distributor's ``MirroredStrategyRunner`` runs its function
  *inside* a strategy, so such functions build no strategy of their own; run bare, each worker
  would train its own model and rank 0's would come back as if it were the distributed result.
  sparkhvd says so before training, and :func:`in_strategy` runs such a function the way
  ``MirroredStrategyRunner`` does.

Custom training loops (no ``fit``) are not checked: they build their strategy explicitly.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from sparkhvd.common.identity import current_rank

__side__ = "rank"

#: Keras's model class per Keras generation: the module that defines it and its name there.
MODEL_CLASSES = {"keras.src.backend.tensorflow.trainer": "TensorFlowTrainer",  # Keras 3
                 "keras.src.engine.training": "Model"}                          # Keras 2.13+
_GUARDED = ("fit", "evaluate", "predict")


class StrategyMissingError(RuntimeError):
    """``model.fit`` on several tf workers with a model built outside a multi-worker strategy."""


def strategy_missing_message(rank: int, size: int) -> str:
    return (
        f"backend='tf': model.fit() on rank {rank} of {size} trains a model built outside a "
        "tf.distribute.MultiWorkerMirroredStrategy, so each worker would train its own model "
        "and rank 0's would come back as if it were the distributed result. Fix: create "
        "`strategy = tf.distribute.MultiWorkerMirroredStrategy()` first thing in the function "
        "(every rank has its TF_CONFIG) and build and compile the model inside `with "
        "strategy.scope():`; or run a function written for spark-tensorflow-distributor's "
        "MirroredStrategyRunner the way it does: runner.run(sparkhvd.keras.in_strategy(train)); "
        "or use sparkhvd.keras.KerasDistributed.")


def is_multi_worker(strategy: Any) -> bool:
    """Whether ``strategy`` spans the workers (MultiWorkerMirroredStrategy and the like)."""
    extended = getattr(strategy, "extended", None)
    probe = getattr(extended, "_in_multi_worker_mode", None)
    try:
        return bool(probe()) if callable(probe) else False
    except Exception:  # noqa: BLE001 - an unknown strategy: do not stand in the way
        return True


def check_model(model: Any) -> None:
    """Refuse (see the module docstring) -- only when there is more than one worker."""
    me = current_rank()
    if me.size <= 1:
        return
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None or not is_multi_worker(strategy):
        raise StrategyMissingError(strategy_missing_message(me.rank, me.size))


def _guard(cls: Any) -> None:
    """Wrap ``cls.fit``/``evaluate``/``predict`` (once)."""
    if getattr(cls, "_sparkhvd_guarded", False):
        return
    for name in _GUARDED:
        original = getattr(cls, name, None)
        if original is None:
            continue

        def guarded(self: Any, *args: Any, _original: Callable = original, _name: str = name,
                    **kwargs: Any) -> Any:
            from sparkhvd.common.patches import patch_keras_multiworker

            patch_keras_multiworker()  # a no-op on Keras 2 and after the first time
            if _name == "fit":
                check_model(self)
            return _original(self, *args, **kwargs)

        functools.update_wrapper(guarded, original)
        setattr(cls, name, guarded)
    cls._sparkhvd_guarded = True


def install() -> None:
    """Guard Keras's model class in this tf rank (now if Keras is already imported, else when
    it is)."""
    from sparkhvd.common.after_import import when_imported

    for name, cls_name in MODEL_CLASSES.items():
        when_imported(name, functools.partial(_guard_in, cls_name))


def _guard_in(cls_name: str, module: Any) -> None:
    _guard(getattr(module, cls_name))


def in_strategy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` inside a ``MultiWorkerMirroredStrategy`` scope, as spark-tensorflow-
    distributor's ``MirroredStrategyRunner`` runs its function: for code that builds and fits
    a model without creating a strategy itself. ``runner.run(in_strategy(train), ...)``.

    The strategy comes from the rank's ``TF_CONFIG`` (RING collectives on CPU, NCCL on GPU) and
    is created first, before the function starts TensorFlow's runtime.
    """
    @functools.wraps(fn)
    def run_in_strategy(*args: Any, **kwargs: Any) -> Any:
        with multiworker_strategy().scope():
            return fn(*args, **kwargs)

    return run_in_strategy


def multiworker_strategy() -> Any:
    """This rank's ``MultiWorkerMirroredStrategy`` from its ``TF_CONFIG``: RING collectives on
    CPU, NCCL on GPU, Keras 3's multi-worker fix applied. Create it before anything starts
    TensorFlow's runtime."""
    import tensorflow as tf

    from sparkhvd.common.patches import patch_keras_multiworker

    patch_keras_multiworker()
    kind = tf.distribute.experimental.CommunicationImplementation
    gpus = tf.config.list_physical_devices("GPU")  # must not start the runtime yet
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=kind.NCCL if gpus else kind.RING))
