"""Inside each rank: how long it waits for its peers in collectives a stack sampler cannot see.

DDP -- directly, or under Lightning, HF ``Trainer``, accelerate -- all-reduces the gradients
from inside ``backward()``: bucket by bucket as they are ready, then the autograd engine waits
for the last ones before ``backward()`` returns. A rank whose peers are slower waits there,
and a stack sampler sees only ``loss.backward()``: computing. So the wait is measured where it
happens, at the communication layer:

- every ``DistributedDataParallel`` gets a timing comm hook at its first forward (none is
  registered by sparkhvd when the model already has one -- the user's, or DDP's own for mixed
  precision: then the rank says once that the wait is not measured for that model, and a
  hook the user registers later is wrapped instead of refused). The hook runs DDP's own
  all-reduce (:func:`~torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`)
  and notes when the step's last bucket was launched (the end of this rank's backward
  computation) and when the last one completed: the time between is the time the rank was
  blocked waiting for the slowest peer (plus the last transfer).
- On CUDA tensors (nccl) the two moments are CUDA events on the streams that run them, read
  once both have happened (``Event.query``): nothing waits for the device on the step's path.
- Explicit ``torch.distributed`` calls, horovod, FSDP2 and DeepSpeed wait in Python frames
  named for their collective: the sampler sees those (:mod:`sparkhvd.timing.buckets`).

:data:`CLOCK` collects the waits; the sampler moves them from computing to waiting in
collectives in each report (:mod:`sparkhvd.timing.sampler`), and says how they were measured.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from types import ModuleType
from typing import Any, Callable, Optional

__side__ = "rank"

log = logging.getLogger(__name__)

#: How a wait measured here is named in reports.
DDP = "ddp"
#: Where the moved time is said to be spent (the report's "where" for waiting in collectives).
DDP_PLACE = "DDP's gradient all-reduce (in backward)"


class WaitClock:
    """This rank's measured waits since the last report, and what could not be measured."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._steps = 0
        self._how: set[str] = set()
        self.unmeasured: set[str] = set()
        #: samples in the first step's batch (its first input's first dimension; 0: unknown),
        #: for report.html's samples per second
        self.batch = 0

    def add(self, seconds: float, how: str) -> None:
        """One step's wait, measured by ``how``."""
        with self._lock:
            self._seconds += max(0.0, seconds)
            self._steps += 1
            self._how.add(how)

    def note_unmeasured(self, reason: str, warn: bool = True) -> None:
        """Something waits where this rank cannot measure it (said once; ``warn``: on the
        console too, for what the user chose and may change)."""
        with self._lock:
            if reason in self.unmeasured:
                return
            self.unmeasured.add(reason)
        if warn:
            log.warning("sparkhvd: %s; the time split counts that wait as computing", reason)

    def take(self) -> tuple[float, int, set[str]]:
        """``(seconds, steps, how)`` since the last call."""
        with self._lock:
            taken = (self._seconds, self._steps, set(self._how))
            self._seconds, self._steps, self._how = 0.0, 0, set()
        return taken


CLOCK = WaitClock()


class _CudaWaits:
    """Pairs of CUDA events (the last launch, the last completion), read once both happened."""

    def __init__(self) -> None:
        self.pending: collections.deque = collections.deque()

    def settle(self, clock: WaitClock) -> None:
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.popleft()
            clock.add(start.elapsed_time(end) / 1000.0, DDP)


class StepWaits:
    """One DDP model's comm hook: DDP's all-reduce (or the user's hook), timed per step."""

    def __init__(self, inner: Callable, inner_state: Any = None,
                 clock: Optional[WaitClock] = None,
                 now: Callable[[], float] = time.perf_counter,
                 cuda: Optional[Any] = None) -> None:
        self.inner, self.inner_state = inner, inner_state
        self.clock, self.now = clock or CLOCK, now
        self.cuda: Any = cuda  # torch.cuda, or a fake
        self._lock = threading.Lock()
        self._pending = 0
        self._last_launch: Optional[float] = None
        self._last_done = 0.0
        self._cuda_waits = _CudaWaits()
        self._cuda_start: Any = None

    def hook(self, state: Any, bucket: Any) -> Any:
        """DDP's comm hook (``register_comm_hook(None, timer.hook)``)."""
        launch = self.now()
        on_cuda = self.cuda is not None and bool(getattr(bucket.buffer(), "is_cuda", False))
        last = bool(bucket.is_last())
        if on_cuda:
            self._cuda_waits.settle(self.clock)
            if last:
                self._cuda_start = self.cuda.Event(enable_timing=True)
                self._cuda_start.record()
        with self._lock:
            self._pending += 1
            if last:
                self._last_launch = launch
        future = self.inner(self.inner_state, bucket)

        def done(fut: Any) -> Any:
            value = fut.value()
            if on_cuda:
                if last and self._cuda_start is not None:
                    end = self.cuda.Event(enable_timing=True)
                    end.record()  # on the stream the all-reduce ran on
                    self._cuda_waits.pending.append((self._cuda_start, end))
                    self._cuda_start = None
                return value
            finished = self.now()
            with self._lock:
                self._pending -= 1
                self._last_done = max(self._last_done, finished)
                if self._pending == 0 and self._last_launch is not None:
                    self.clock.add(self._last_done - self._last_launch, DDP)
                    self._last_launch, self._last_done = None, 0.0
            return value

        return future.then(done)


#: Why a tf.distribute rank's wait is not measured (in its reports and the run's report).
TF_GRAPH = ("tf.distribute runs a step's collectives and its tf.data input inside TensorFlow's "
            "graph and threads, so a rank's wait for the others cannot be told from computing")


def install_ddp_timing() -> None:
    """Time every ``DistributedDataParallel`` this rank builds (when torch's DDP module is
    imported, or now if it is)."""
    from sparkhvd.common.after_import import when_imported

    when_imported("torch.nn.parallel.distributed", _patch_ddp)


def _patch_ddp(module: ModuleType) -> None:
    ddp = module.DistributedDataParallel
    if getattr(ddp, "_sparkhvd_timed", False):
        return
    original_init = ddp.__init__
    original_register = ddp.register_comm_hook
    original_builtin: Any = getattr(ddp, "_register_builtin_comm_hook", None)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._sparkhvd_pre = self.register_forward_pre_hook(_attach_at_first_forward)

    def register_comm_hook(self: Any, state: object, hook: Callable) -> None:
        timer = getattr(self, "_sparkhvd_timer", None)
        if timer is None:
            return original_register(self, state, hook)
        timer.inner, timer.inner_state = hook, state  # the user's hook, timed
        return None

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self._sparkhvd_builtin = True
        if getattr(self, "_sparkhvd_timer", None) is not None:
            CLOCK.note_unmeasured("a built-in DDP comm hook registered after training began "
                                  "cannot be combined with the timing hook; it is not used")
            return None
        return original_builtin(self, comm_hook_type)

    ddp.__init__ = __init__
    ddp.register_comm_hook = register_comm_hook
    if original_builtin is not None:
        ddp._register_builtin_comm_hook = _register_builtin_comm_hook
    ddp._sparkhvd_timed = True


def _attach_at_first_forward(model: Any, inputs: Any) -> None:
    """Register the timing hook before the first backward -- unless the model has a hook."""
    from sparkhvd.timing.start_times import mark

    mark("first_step")
    shape = next((getattr(x, "shape", None) for x in inputs if getattr(x, "shape", None)), None)
    if shape and not CLOCK.batch:
        CLOCK.batch = int(shape[0])
    handle = getattr(model, "_sparkhvd_pre", None)
    if handle is not None:
        handle.remove()
        model._sparkhvd_pre = None
    if getattr(model, "_comm_hooks", None) or getattr(model, "_sparkhvd_builtin", False):
        CLOCK.note_unmeasured("a DDP model has its own comm hook, so its wait for the other "
                              "ranks in backward() is not measured")
        return
    try:
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        group = getattr(model, "process_group", None)
        timer = StepWaits(allreduce_hook, group,
                          cuda=torch.cuda if torch.cuda.is_available() else None)
        model.register_comm_hook(None, _bound(timer))  # DDP's own, while no timer is set
        model._sparkhvd_timer = timer
    except Exception as exc:  # noqa: BLE001 - timing must never stop training
        CLOCK.note_unmeasured(f"the DDP timing hook could not be registered ({exc})")


def _bound(timer: StepWaits) -> Callable:
    """The hook as DDP checks it: a function of ``(state, bucket)`` whose annotations are
    absent (DDP compares them with its own types, and this module's are strings)."""
    def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        return timer.hook(state, bucket)

    return timed_allreduce
