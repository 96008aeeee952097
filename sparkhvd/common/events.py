"""What a rank reports: typed events (:mod:`sparkhvd.common.protocol`), apart from its output.

They go to the launcher's event pipe (its descriptor is taken out of the environment at once, so
a child process the user starts cannot write into it), else as marker lines on stderr.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
import traceback
from typing import Any, Mapping, Optional

from sparkhvd.common import protocol

__side__ = "rank"


class _Events:
    """Where :func:`emit` writes: the launcher's event pipe, else marker lines on stderr."""

    def __init__(self) -> None:
        self.fd: Optional[int] = None
        self.lock = threading.Lock()
        self.rank = 0

    def take_from_env(self) -> None:
        # Taken out of the environment at once: a child process the user starts must not
        # inherit the number and write into whatever file it names there.
        raw = os.environ.pop(protocol.EVENTS_FD_ENV, None)
        if raw and self.fd is None:
            with contextlib.suppress(ValueError):
                self.fd = int(raw)

    def send(self, msg: Any) -> None:
        if self.fd is not None:
            data = protocol.encode(msg)
            try:
                with self.lock:
                    while data:
                        data = data[os.write(self.fd, data):]
                return
            except OSError:
                self.fd = None
        with contextlib.suppress(OSError, ValueError):
            print(protocol.as_text(msg), file=sys.__stderr__, flush=True)


#: This process's event sender (the rank it reports as, after elastic resets).
events = _Events()


def emit(msg: Any) -> None:
    """Send an event (a :mod:`sparkhvd.common.protocol` message) to the driver."""
    events.send(msg)


def error_event(rank: int, exc: BaseException) -> protocol.Error:
    """The :class:`~sparkhvd.common.protocol.Error` event for an exception that ended a rank
    (with the fix, where the cause is known: :func:`known_fix`)."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    fix = known_fix(exc, trace, os.environ)
    return protocol.Error(rank=rank, exc_type=type(exc).__name__,
                          message=f"{exc}{fix}" if fix else str(exc), traceback=trace,
                          time=time.time())


def known_fix(exc: BaseException, trace: str, environ: Mapping[str, str]) -> str:
    """The fix for a failure whose cause sparkhvd knows better than the library that raised it.

    - Lightning's ``Trainer(devices=1, num_nodes=N)`` -- TorchDistributor's shape, where every
      Spark task is a node -- indexes its one device with ``LOCAL_RANK``, so under torchrun's
      numbering (several ranks on a host) rank 1 fails with a bare ``IndexError``.
    - ``tf.distribute.MultiWorkerMirroredStrategy`` must be created before TensorFlow runs any
      op; a ``tf.data`` pipeline (or a model) built first makes TensorFlow raise a bare
      ``RuntimeError: Collective ops must be configured at program startup``.
    """
    if isinstance(exc, RuntimeError) and "Collective ops must be configured at program " \
            "startup" in str(exc):
        return (" -- on backend='tf' the strategy must exist before TensorFlow runs anything. "
                "Fix: create sparkhvd.keras.KerasDistributed(...) (or "
                "tf.distribute.MultiWorkerMirroredStrategy()) first in the training function, "
                "then build the tf.data pipeline and the model.")
    if isinstance(exc, IndexError) and "lightning" in trace and "root_device" in trace and \
            environ.get("LOCAL_RANK", "0") != "0":
        # The same shape fails in the Trainer's strategy (lightning/pytorch, pytorch_lightning)
        # and in Fabric's (lightning/fabric, lightning_fabric): name what the user wrote.
        what = "Trainer" if re.search(r"lightning[/\\]pytorch|pytorch_lightning", trace) \
            else "Fabric"
        return (f" -- Lightning's {what} has fewer devices than this host's ranks "
                f"(LOCAL_RANK={environ['LOCAL_RANK']}, LOCAL_WORLD_SIZE="
                f"{environ.get('LOCAL_WORLD_SIZE')}): {what}(devices=1, num_nodes=N) is "
                "TorchDistributor's shape, every Spark task its own node. Fix: "
                "HorovodRunner(..., local_ranks='task') (or sparkhvd.torch.TorchDistributor, or "
                f"`sparkhvd run --local-ranks task`), or {what}(devices=<ranks per host>).")
    return ""


def announce(rank: int) -> None:
    """Tell the driver which rank this process is (again, after an elastic reset)."""
    events.rank = rank
    emit(protocol.Started(rank=rank, pid=os.getpid(), host=socket.gethostname()))
