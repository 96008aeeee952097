"""Every change sparkhvd makes to a third-party library's private details -- in one place.

Each patch names what it replaces in :data:`PATCHED`; ``tests/unit/test_patches.py`` checks every one
of those attributes still exists in the installed versions, and :func:`check_horovod_version` refuses a
horovod release these patches were not written for, so an upgrade fails loudly here, not as an
odd hang somewhere else.

horovod (0.28), driver side, for ``launcher="horovod"`` (:func:`sparkhvd.driver.launchers.horovod_hooks.horovod_driver_hooks`):
  ``launch_gloo``'s SIGINT/SIGTERM handlers (they swallow a notebook's stop button), the Spark job
  group name (to cancel exactly it), output streaming (horovod holds it in 64 KiB blocks),
  fail-fast when a rank exits non-zero, and the task function Spark runs.
horovod, task side (:func:`patch_horovod_task`): a 1 s instead of 3 s command lifetime, an output
  forwarder that survives binary output and bounds endless lines, and the executor's own Python
  for the rank instead of the driver's path.
horovod, rank side (:func:`follow_elastic_resets`): re-announce the rank after an elastic reset.
adlfs / Azure SDK (:func:`set_storage_retries`): a retry budget that gives up on a refused
  connection in seconds instead of ~85 s.
Keras 3, rank side (:func:`patch_keras_multiworker`): ``model.fit`` under
  ``MultiWorkerMirroredStrategy`` (``backend="tf"``) -- two reductions that fail there.
pyarrow < 14.0.1, every side (:func:`forbid_pickled_arrow_types`): a table whose schema names
  ``arrow.py_extension_type`` unpickles its type when read (CVE-2023-47248); the type is
  registered as one that refuses to load, as pyarrow 14.0.1 and ``pyarrow_hotfix`` do.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from sparkhvd.common.errors import EnvironmentMismatchError

__side__ = "common"

#: horovod releases the patches below were written for and tested with.
HOROVOD_TESTED = ("0.28.",)

#: (module, attribute path) of every private detail patched or relied on.
PATCHED = [
    ("horovod.runner.gloo_run", "register_shutdown_event"),
    ("horovod.spark.driver.job_id", "next_job_id"),
    ("horovod.spark.gloo_run", "_exec_command_fn"),
    ("horovod.spark.runner", "_make_mapper"),
    ("horovod.spark.runner", "_task_fn"),
    ("horovod.spark.runner", "MINIMUM_COMMAND_LIFETIME_S"),
    ("horovod.runner.common.util.network", "BasicClient._send_one"),
    ("horovod.spark.gloo_run", "launch_gloo"),
    ("horovod.runner.util.network", "get_driver_ip"),
    ("horovod.runner.common.util.safe_shell_exec", "prefix_connection"),
    ("horovod.spark.task.task_service", "SparkTaskService._run_command"),
    ("horovod.common.elastic", "State.on_reset"),
]
#: Attributes those patches read that horovod sets on its instances (class, attribute).
PATCHED_INSTANCE = [
    ("horovod.runner.common.util.network", "BasicClient", "_wire"),
    ("horovod.runner.common.util.network", "BasicClient", "_attempts"),
    ("horovod.common.elastic", "State", "_rank"),
]


#: The same for Keras 3's TensorFlow trainer (checked only where Keras 3 is installed).
PATCHED_KERAS3 = [
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._maybe_symbolic_build"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._symbolic_build"),
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica"),
    ("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker"),
    ("keras.src.backend.tensorflow.trainer", "_is_per_replica_instance"),
    ("keras.src.tree", "map_structure"),
]


def check_horovod_version() -> str:
    """horovod's version, or EnvironmentMismatchError if sparkhvd's patches do not cover it."""
    import horovod

    version = str(horovod.__version__)
    if not version.startswith(HOROVOD_TESTED):
        raise EnvironmentMismatchError(
            f"horovod {version} is installed; sparkhvd's launcher patches are written for "
            f"horovod {', '.join(v + 'x' for v in HOROVOD_TESTED)} (see sparkhvd/common/patches.py). "
            "Fix: install horovod==0.28.1 (make setup), or use backend='tf'.")
    return version


# -- horovod, task side ------------------------------------------------------------------------
#: How long a Spark task keeps a finished rank's command for the driver to collect its exit code;
#: horovod uses 3 s from the command's start, which a short run pays in full.
COMMAND_LIFETIME_S = 1.0
_task_state: dict[str, Any] = {"patched": False, "driver_python": None}


def _prefix_connection(src_connection: Any, dst_stream: Any, prefix: str, index: Any,
                       prefix_output_with_timestamp: bool) -> None:
    """horovod's ``safe_shell_exec.prefix_connection``, made robust.

    horovod's decoder is strict, so one non-UTF-8 byte from a rank kills the forwarder thread and
    the rank then blocks on a full pipe forever; and a line without a newline grows without
    bound. Here bytes decode with replacement characters, a line longer than
    :data:`sparkhvd.common.protocol.MAX_CHUNK_BYTES` goes out in pieces tagged ``<stdout+>`` (the
    driver joins them back in the rank log), and a progress update (``\r``) as its own line
    tagged ``<stdout~>`` (:mod:`sparkhvd.common.outputlines`).
    """
    import codecs
    import os
    import time

    from sparkhvd.common.outputlines import OUTPUT_FLAGS, OutputSplitter
    from sparkhvd.common.protocol import MAX_CHUNK_BYTES

    gone: list[bool] = []

    def write(text: str, flag: str) -> None:
        if gone:  # the driver stopped listening: keep draining the rank, drop its output
            return
        if index is not None and prefix is not None:
            stamp = time.asctime() if prefix_output_with_timestamp else ""
            text = f"{stamp}[{index}]<{prefix}{flag}>:{text}"
        try:
            dst_stream.write(text + "\n")
            dst_stream.flush()
        except Exception:  # noqa: BLE001 - horovod's stream raises once it is closed
            gone.append(True)

    decoder = codecs.getincrementaldecoder("utf8")("replace")
    splitter = OutputSplitter()
    try:
        while True:
            buf = os.read(src_connection.fileno(), MAX_CHUNK_BYTES)
            pieces = splitter.feed(decoder.decode(buf or b"", final=not buf))
            for kind, text in pieces + (splitter.close() if not buf else []):
                write(text, OUTPUT_FLAGS[kind])
            if not buf:
                break
    finally:
        src_connection.close()


def patch_horovod_task(driver_python: Optional[str]) -> None:
    """Apply the task-side patches inside a Spark task of ``horovod.spark.run``."""
    import shlex
    import sys

    import horovod.spark.runner as hvd_runner
    from horovod.runner.common.util import safe_shell_exec
    from horovod.spark.task.task_service import SparkTaskService

    _task_state["driver_python"] = driver_python
    hvd_runner.MINIMUM_COMMAND_LIFETIME_S = COMMAND_LIFETIME_S
    safe_shell_exec.prefix_connection = _prefix_connection
    if _task_state["patched"]:
        return
    original = SparkTaskService._run_command

    def run_command(self: Any, command: str, env: Any, event: Any, *args: Any,
                    **kwargs: Any) -> Any:
        # horovod starts the rank as "<the driver's sys.executable> -m horovod.spark.task...":
        # a path that need not exist on this host. Use the Python this task runs in.
        driver = _task_state["driver_python"]
        if driver and driver != sys.executable:
            command = command.replace(f"{shlex.quote(driver)} -m horovod.spark.task",
                                      f"{shlex.quote(sys.executable)} -m horovod.spark.task")
        return original(self, command, env, event, *args, **kwargs)

    SparkTaskService._run_command = run_command
    _task_state["patched"] = True


# -- horovod, rank side ------------------------------------------------------------------------
def follow_elastic_resets(announce: Callable[[int], None]) -> None:
    """Call ``announce(new_rank)`` after each elastic reset (horovod renumbers the survivors)."""
    try:
        from horovod.common.elastic import State
    except ImportError:  # pragma: no cover - horovod is there wherever elastic ranks run
        return
    if getattr(State.on_reset, "_sparkhvd", False):
        return
    original = State.on_reset

    def on_reset(self: Any) -> None:
        original(self)
        announce(int(self._rank()))

    on_reset._sparkhvd = True  # type: ignore[attr-defined]
    State.on_reset = on_reset


# -- adlfs / Azure SDK ---------------------------------------------------------------------------
def set_storage_retries(fs: Any, *, total: int, connect: int, backoff_s: float) -> None:
    """Give an adlfs filesystem's Azure client a bounded retry budget.

    adlfs builds its client with the SDK's default policy (exponential, 15 s base): a dead
    endpoint takes ~85 s to report. adlfs has no option for it, so the policy object in the
    client's pipeline is adjusted in place: ``connect`` retries for refused/unreachable
    connections, ``total`` for everything (throttling and 5xx keep being retried).
    """
    policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None),
                     "retry_policy", None)
    if policy is None:
        return
    policy.total_retries = total
    policy.connect_retries = connect
    policy.read_retries = min(getattr(policy, "read_retries", total), total)
    policy.status_retries = min(getattr(policy, "status_retries", total), total)
    if hasattr(policy, "initial_backoff"):
        policy.initial_backoff = backoff_s
        policy.increment_base = max(1, int(backoff_s))
    elif hasattr(policy, "backoff"):
        policy.backoff = backoff_s


# -- Keras 3, rank side ----------------------------------------------------------------------------
_keras_state = {"patched": False}


def patch_keras_multiworker() -> None:
    """Make Keras 3's ``model.fit`` work under ``MultiWorkerMirroredStrategy``.

    Keras 3 (checked up to 3.15) fails twice there: before training it *reduces* a distributed
    input batch across workers only to learn its shapes (``strategy.reduce("MEAN", PerReplica,
    axis=None)`` cannot convert the batch), and each step it reduces the scalar logs with
    ``axis=0``. Here the shapes come from this worker's own replica, and scalars are averaged
    over replicas with ``axis=None``. Training itself (gradients, variables) is untouched:
    tests check that workers end with identical weights and match one worker's training.
    """
    if _keras_state["patched"]:
        return
    import tensorflow as tf

    if int(str(getattr(tf.keras, "__version__", "2")).split(".")[0]) < 3:
        return
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as ktr

    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> None:
        if self._distribute_strategy is None:
            return
        if iterator is not None:
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tree.map_structure(
                    lambda v: self.distribute_strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v, batch)
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    original_reduce = ktr.reduce_per_replica

    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if not (ktr._collective_all_reduce_multi_worker(strategy) and
                reduction in ("mean", "auto")):
            return original_reduce(values, strategy, reduction)

        def one(v: Any) -> Any:
            if ktr._is_per_replica_instance(v):
                rank = v.values[0].shape.rank
            elif isinstance(v, tf.Tensor):
                rank = v.shape.rank
            else:
                return v
            return strategy.reduce("MEAN", v, axis=0 if rank else None)

        return tree.map_structure(one, values)

    ktr.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    ktr.reduce_per_replica = reduce_per_replica
    _keras_state["patched"] = True


_arrow_guarded: list[bool] = []
_arrow_lock = threading.Lock()


def forbid_pickled_arrow_types() -> None:
    """On pyarrow < 14.0.1, make reading a Parquet or Arrow IPC schema that names
    ``arrow.py_extension_type`` an error instead of an unpickle (CVE-2023-47248: a row copy,
    a table read in place, whoever wrote it); nothing on later pyarrow, which refuses it
    itself. Once per process; called before sparkhvd reads Arrow or Parquet."""
    if _arrow_guarded:
        return
    with _arrow_lock:  # a concurrent first caller waits until the guard is in place
        if not _arrow_guarded:
            _forbid_pickled_arrow_types()
            _arrow_guarded.append(True)


def _forbid_pickled_arrow_types() -> None:
    import pyarrow as pa

    version = tuple(int(p) for p in pa.__version__.split(".")[:3] if p.isdigit())
    if version >= (14, 0, 1):
        return

    class ForbiddenExtensionType(pa.ExtensionType):  # type: ignore[misc]
        def __arrow_ext_serialize__(self) -> bytes:
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type: Any, serialized: bytes) -> Any:
            raise pa.ArrowInvalid(
                "refused to read a column of type arrow.py_extension_type: reading it would "
                "unpickle data (CVE-2023-47248). Fix: write the table without pickled "
                "extension types, or upgrade pyarrow to 14.0.1 or later.")

    try:
        pa.unregister_extension_type("arrow.py_extension_type")
    except Exception:  # noqa: BLE001 - not registered in this build: register ours
        pass
    try:
        pa.register_extension_type(ForbiddenExtensionType(pa.null(),
                                                          "arrow.py_extension_type"))
    except Exception:  # noqa: BLE001 - one registered already (pyarrow_hotfix's)
        pass
