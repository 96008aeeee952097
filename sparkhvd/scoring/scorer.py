"""Scoring a DataFrame with a trained Keras model, on the executors.

``sparkhvd.predict(df, model, features=...)`` returns ``df`` with a prediction column, computed
by Spark's own vectorised path (``pyspark.ml.functions.predict_batch_udf``): Arrow batches of
rows go to each executor's Python worker, which loads the model **once** and reuses it for every
batch and task it runs (Spark's model cache, per worker process). Nothing is collected on the
driver; the model travels to the executors as its bytes (:func:`ship_bytes`: a Spark broadcast on
classic sessions; on Spark Connect, which has no broadcast, inside the UDF for models up to
:data:`CLOSURE_LIMIT` and as a session artifact above), so executors need no access to the run
folder or its credentials.

Columns are handled as in :class:`~sparkhvd.data.DataFrameDataset`: numeric scalars, arrays, Spark
ML vectors (dense or sparse), ``shapes`` to reshape rows (default: the model's input shape), and
the same early errors for missing or unsupported columns, nulls, NaNs and ragged arrays.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence, Union

__side__ = "driver"

log = logging.getLogger(__name__)


#: Spark Connect: models up to this size travel inside the UDF (its plan); larger ones as a
#: session artifact (Connect's own file shipping), below the server's 128 MB message limit.
CLOSURE_LIMIT = 32 << 20


def ship_bytes(spark: Any, data: bytes, suffix: str) -> Any:
    """Send ``data`` to the executors once; returns a function that reads it there.

    Classic sessions broadcast it. Spark Connect has no broadcast: small data rides in the
    function's closure (cloudpickled into the plan), large data is added as a session artifact
    (``addArtifacts(file=True)``) and read with ``SparkFiles`` on the executors.
    """
    from sparkhvd.spark.sparkview import is_connect

    if not is_connect(spark):
        broadcast = spark.sparkContext.broadcast(data)
        return lambda: broadcast.value
    if len(data) <= CLOSURE_LIMIT:
        return lambda: data
    import hashlib
    import os
    import tempfile

    name = f"sparkhvd-model-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
    folder = tempfile.mkdtemp(prefix="sparkhvd-artifact-")
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(data)
    try:
        spark.addArtifacts(path, file=True)
    except Exception as exc:  # noqa: BLE001 - added before in this session (same bytes)
        if "already exists" not in str(exc).lower():
            raise
    finally:
        os.remove(path)
        os.rmdir(folder)

    def read() -> bytes:
        from pyspark import SparkFiles

        with open(SparkFiles.get(name), "rb") as f:
            return f.read()

    return read


def _model_bytes(model: Any, storage_options: Optional[Mapping[str, Any]]) -> tuple[bytes, str]:
    """The saved model's bytes and file suffix, from a run folder, a model URL or a RunDir."""
    from sparkhvd import storage
    from sparkhvd.keras.modelio import suffix_of
    from sparkhvd.scoring.models import model_url

    url = getattr(model, "url", None) or str(model)
    loc = model_url(url, storage_options)
    return storage.read_bytes(loc), suffix_of(loc.path)


def _output(model: Any, argmax: bool) -> tuple[Any, bool]:
    """Spark return type for the model's output, and whether to flatten a 1-wide output."""
    from pyspark.sql.types import ArrayType, FloatType, LongType

    shape = model.output_shape
    if isinstance(shape, list):
        raise TypeError("sparkhvd.predict supports models with one output; this one has "
                        f"{len(shape)}. Wrap it in a model that returns one tensor.")
    width = 1
    for d in shape[1:]:
        width *= int(d or 1)
    if argmax:
        if width < 2:
            raise ValueError("argmax=True needs a model with a vector output (one score per "
                             f"class); this one outputs shape {shape}.")
        return LongType(), False
    return (FloatType(), True) if width == 1 else (ArrayType(FloatType()), False)


def predict(df: Any, model: Any, features: Union[str, Sequence[str]], *,
            output_col: str = "prediction", batch_size: int = 1024,
            shapes: Optional[Mapping[str, Sequence[int]]] = None, argmax: bool = False,
            check: bool = True, storage_options: Optional[Mapping[str, Any]] = None,
            safe_mode: bool = True) -> Any:
    """``df`` with ``output_col`` holding the model's output for each row (see the module doc).

    Args:
        df: the DataFrame to score (lazy: nothing runs until an action).
        model: a run folder (URL, local path or :class:`~sparkhvd.RunDir`) whose run.json names
            the model, or a model file URL (``.h5`` / ``.keras``; local, ``file://``,
            ``abfss://``).
        features: the feature column, or a list of them (the model gets a dict by name).
        output_col: the new column: ``float`` for a single output, ``array<float>`` for a vector.
        batch_size: rows per model call on the executors.
        shapes: per-column shape of one row (default: the model's input shape).
        argmax: a classifier's class index (``long``) instead of its scores.
        check: count nulls, NaNs and ragged arrays first (one Spark job over the features;
            ``False`` skips it for data you trust).
        storage_options: credentials to read the model (driver only).
        safe_mode: a Keras model loads in Keras's safe mode (a ``Lambda`` layer's code is
            refused: whoever can write the model's folder wrote the file); ``False`` for a
            model you wrote that needs it.

    Example::

        scored = sparkhvd.predict(test_df, runner.last_run_dir, features="features",
                                  argmax=True)
        scored.where("prediction = label").count() / scored.count()
    """
    from pyspark.ml.functions import predict_batch_udf

    from sparkhvd.data.materialize import check_column_type, check_profile, profile
    from sparkhvd.keras.modelio import load_keras_model, local_file
    from sparkhvd.spark.session import SCORING_MODULES, check_worker_python
    from sparkhvd.spark.sparkview import SparkView

    check_worker_python(SparkView(df.sparkSession), modules=SCORING_MODULES,
                        purpose="predict's Spark jobs")
    names = [features] if isinstance(features, str) else list(features)
    existing = list(df.columns)
    missing = [c for c in names if c not in existing]
    if missing:
        raise KeyError(f"Column(s) {missing} not in the DataFrame; it has: {existing}")
    if output_col in existing:
        raise ValueError(f"The DataFrame already has a column {output_col!r}: pass another "
                         "output_col.")
    schema = {f.name: f.dataType for f in df.schema.fields}
    kinds = {c: check_column_type(c, schema[c]) for c in names}
    lengths: dict[str, tuple[int, int]] = {}
    if check:
        found = profile(df, names, kinds, schema)
        check_profile(found, names, allow_nan=False)
        lengths = found["lengths"]
    data, suffix = _model_bytes(model, storage_options)
    columns = _feature_columns(names, kinds)
    if suffix == ".pt":
        return _predict_torch(df, data, names, kinds, dict(shapes or {}), columns,
                              output_col=output_col, batch_size=batch_size, argmax=argmax,
                              lengths=lengths)

    with local_file(data, suffix) as path:
        keras_model = load_keras_model(path, compile=False, safe_mode=safe_mode)
    return_type, flatten = _output(keras_model, argmax)
    input_shapes = keras_model.input_shape if isinstance(keras_model.input_shape, list) \
        else [keras_model.input_shape]
    shapes = dict(shapes or {})
    model_shape = [list(input_shapes[i][1:]) if i < len(input_shapes) else []
                   for i in range(len(names))]
    # arrays are reshaped by Spark; a scalar column feeds a (batch, 1) input as a column
    tensor_shapes = [list(shapes.get(c) or model_shape[i]) if kinds[c] != "scalar" else None
                     for i, c in enumerate(names)]
    as_column = [kinds[c] == "scalar" and model_shape[i] == [1] for i, c in enumerate(names)]
    del keras_model
    shipped = ship_bytes(df.sparkSession, data, suffix)
    del data
    single = len(names) == 1

    def make_predict_fn():
        import os

        # in the executors' Python workers: TensorFlow's C++ start-up lines (oneDNN, absl)
        # would land in the driver's console of a local session; what the user set wins
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import numpy as np

        from sparkhvd.keras.modelio import load_keras_model, local_file

        with local_file(shipped(), suffix) as path:
            loaded = load_keras_model(path, compile=False, safe_mode=safe_mode)

        def predict_batch(*arrays):
            arrays = [a.reshape(-1, 1) if column else a for a, column in zip(arrays, as_column)]
            x = arrays[0] if single else dict(zip(names, arrays))
            out = np.asarray(loaded(x, training=False))
            if argmax:
                return out.reshape(len(out), -1).argmax(axis=1).astype("int64")
            out = out.astype("float32")
            return out.reshape(len(out)) if flatten else out.reshape(len(out), -1)

        return predict_batch

    udf = predict_batch_udf(make_predict_fn, return_type=return_type, batch_size=batch_size,
                            input_tensor_shapes=tensor_shapes)
    return df.withColumn(output_col, udf(*columns))


def _feature_columns(names: Sequence[str], kinds: Mapping[str, str]) -> list:
    """The feature columns as float32 (arrays and vectors as ``array<float>``)."""
    from pyspark.ml.functions import vector_to_array

    from sparkhvd.data.materialize import quoted

    columns = []
    for c in names:
        col = quoted(c)
        if kinds[c] == "vector":
            col = vector_to_array(col, dtype="float32")
        elif kinds[c] == "array":
            col = col.cast("array<float>")
        else:
            col = col.cast("float")
        columns.append(col)
    return columns


def _predict_torch(df: Any, data: bytes, names: Sequence[str], kinds: Mapping[str, str],
                   shapes: Mapping[str, Sequence[int]], columns: list, *, output_col: str,
                   batch_size: int, argmax: bool,
                   lengths: Optional[Mapping[str, tuple[int, int]]] = None) -> Any:
    """:func:`predict` for a TorchScript model (``model.pt``): each feature column is one
    positional input of ``forward``, ``(batch, *shape)`` (``shapes``, else flat; scalars
    ``(batch, 1)``). The output's width is learnt from one row on the driver: zeros of each
    column's length when the profile (``lengths``) or ``shapes`` tell it -- a ``limit(1)`` over
    a Python-made DataFrame leaves Spark 4's Python daemon printing a BrokenPipeError -- else
    the DataFrame's first row."""
    import numpy as np
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import ArrayType, FloatType, LongType

    from sparkhvd.scoring.models import load_torch

    module = load_torch(data)
    if not hasattr(module, "forward"):
        raise TypeError("This run's model is a PyTorch state_dict: scoring needs the module. "
                        "Fix: return sparkhvd.torch.model_bytes(model) from rank 0 (TorchScript), "
                        "or load the state_dict into your model and score it yourself.")
    lengths = lengths or {}
    known = {c: (tuple(shapes[c]) if shapes.get(c) else
                 (lengths[c][0],) if c in lengths else (1,) if kinds[c] == "scalar" else None)
             for c in names}
    if all(shape is not None for shape in known.values()):
        row = [[np.zeros(int(np.prod(known[c] or (1,))), dtype="float32") for c in names]]
    else:
        row = df.select(*columns).limit(1).collect()
    if not row:
        raise ValueError("The DataFrame to score is empty.")

    def one_row(values: Sequence[Any]) -> list:
        """The first row as a batch of one, shaped as the executors will shape theirs."""
        out = []
        for c, value in zip(names, values):
            array = np.asarray(value, dtype="float32").reshape(1, -1)
            out.append(array.reshape((1,) + tuple(shapes.get(c) or array.shape[1:])))
        return out

    def run(module: Any, arrays: list) -> Any:
        import torch

        with torch.no_grad():
            out = module(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])
        return out.detach().cpu().numpy() if hasattr(out, "detach") else np.asarray(out)

    example = run(module, one_row(list(row[0])))
    del module
    width = int(np.prod(example.shape[1:])) if example.ndim > 1 else 1
    if argmax and width < 2:
        raise ValueError("argmax=True needs a model with a vector output (one score per class); "
                         f"this one outputs shape {tuple(example.shape)}.")
    return_type = LongType() if argmax else FloatType() if width == 1 else ArrayType(FloatType())
    shipped = ship_bytes(df.sparkSession, data, ".pt")
    del data

    def make_predict_fn():
        from sparkhvd.scoring.models import load_torch as load

        module = load(shipped())
        module.eval()

        def predict_batch(*arrays):
            shaped = [a.reshape((len(a),) + tuple(shapes.get(c) or (-1,))) for a, c in
                      zip(arrays, names)]
            out = run(module, shaped)
            if argmax:
                return out.reshape(len(out), -1).argmax(axis=1).astype("int64")
            out = out.astype("float32")
            return out.reshape(len(out)) if width == 1 else out.reshape(len(out), -1)

        return predict_batch

    # Spark needs each array column's shape: the one given, else the first row's length.
    tensor_shapes = [None if kinds[c] == "scalar" else list(shapes.get(c) or [len(value)])
                     for c, value in zip(names, row[0])]
    udf = predict_batch_udf(make_predict_fn, return_type=return_type, batch_size=batch_size,
                            input_tensor_shapes=tensor_shapes)
    return df.withColumn(output_col, udf(*columns))
