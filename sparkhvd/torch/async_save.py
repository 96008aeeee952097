"""Checkpoints that do not hold training up: ``st.Checkpoints(..., async_save=True)``.

A synchronous checkpoint holds every rank while rank 0 serialises the whole state and writes it
through the store -- minutes for a large model on remote storage, so users save rarely and lose
what they trained since. Here (as ``torch.distributed.checkpoint.async_save`` does) the step is
held only while the state is *copied into host memory*: into buffers kept between saves (so they
are allocated once), pinned and filled on a side stream for GPU tensors. ``torch.save`` and the
write to the checkpoint folder then run on a background thread while training goes on.

The rules (:class:`sparkhvd.torch.Checkpoints` applies them; its docstring says them to users):

- **one save in flight per rank.** A save that ``step()``'s cadence makes due while one is being
  written is *skipped* (training never waits for storage; the rank's log says so once per save
  in flight); an explicit ``save()`` waits for the one in flight, then starts its own; a notice
  waits for it and writes its own to the end before every rank stops.
- **what is saved is the state at the step**: model, optimizer, the data's position and the
  extra state are copied when the save starts, not when its write ends.
- **complete or absent**: the file, then its record, then ``latest.json``, as for a synchronous
  save -- a rank killed mid-write leaves the previous complete checkpoint to resume from.
- **errors are not lost**: a failed write is raised by the next ``step()``/``save()``, or when
  the training function ends; the function's end waits for the save in flight
  (:mod:`sparkhvd.common.function_end`), so a rank never reports done before its last checkpoint
  is durable.

The CUDA calls go through :class:`StagingCopies`; a test swaps it for a fake (no GPU here).
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from typing import Any, Callable, Optional

__side__ = "rank"


class StagingCopies:
    """Host buffers for a state's tensors and the copies into them (the seam a test replaces).

    A GPU tensor goes into a pinned buffer with a non-blocking copy on a side stream that first
    waits for the training stream (the values the step produced); the host waits for the side
    stream once per save. A CPU tensor is copied at once.
    """

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    @staticmethod
    def on_gpu(tensor: Any) -> bool:
        return bool(tensor.device.type == "cuda")

    def buffer_like(self, tensor: Any) -> Any:
        import torch

        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                           pin_memory=self.on_gpu(tensor))

    def copy_from_gpu(self, pairs: list[tuple[Any, Any]]) -> None:
        """``buffer.copy_(tensor)`` for each pair, on a side stream per device; returns when
        every copy ended."""
        import torch

        waiting = []
        for device in {t.device for _, t in pairs}:
            stream = self._streams.setdefault(device, torch.cuda.Stream(device))
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for buffer, tensor in pairs:
                    if tensor.device == device:
                        buffer.copy_(tensor, non_blocking=True)
            waiting.append(stream)
        for stream in waiting:
            stream.synchronize()

    @staticmethod
    def copy_on_host(buffer: Any, tensor: Any) -> None:
        buffer.copy_(tensor)


class HostSnapshot:
    """A state (nested dicts, lists and tuples of tensors and plain values) copied into host
    buffers reused from one save to the next (the buffer of a path is replaced only when its
    shape or dtype changed). Plain values are deep-copied."""

    def __init__(self, copies: Optional[StagingCopies] = None) -> None:
        self.copies = copies or StagingCopies()
        self._buffers: dict[tuple, Any] = {}
        self._taken: set[tuple] = set()  # the paths of the take in progress

    @property
    def nbytes(self) -> int:
        """Bytes held in host buffers (one copy of the saved state)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, state: Any) -> Any:
        """A copy of ``state`` in host memory, valid until the next :meth:`take`. Buffers of
        paths the state no longer has are let go."""
        on_gpu: list[tuple[Any, Any]] = []
        copied = self._copy(state, (), on_gpu)
        if on_gpu:
            self.copies.copy_from_gpu(on_gpu)
        for gone in set(self._buffers) - self._taken:
            del self._buffers[gone]
        self._taken = set()
        return copied

    def _copy(self, value: Any, path: tuple, on_gpu: list) -> Any:
        import torch

        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, on_gpu)
        if isinstance(value, dict):
            copied = {k: self._copy(v, (*path, k), on_gpu) for k, v in value.items()}
            if type(value) is dict:
                return copied
            out: Any = type(value)(copied)  # an OrderedDict keeps its kind and its versions
            if hasattr(value, "_metadata"):
                out._metadata = copy.deepcopy(value._metadata)
            return out
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            items = [self._copy(v, (*path, i), on_gpu) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _tensor(self, tensor: Any, path: tuple, on_gpu: list) -> Any:
        tensor = tensor.detach()
        self._taken.add(path)
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[path] = self.copies.buffer_like(tensor)
        if self.copies.on_gpu(tensor):
            on_gpu.append((buffer, tensor))
        else:
            self.copies.copy_on_host(buffer, tensor)
        return buffer


#: The writer thread's nice value: below training, not starved by it (at 19 a CPU-bound loop
#: left it about 1 % of a core and a 1 GB save never finished; B15 measures the trade).
WRITER_NICE = 10


def _yield_cpu() -> None:
    """The calling thread gives way to training for the CPU: on Linux a thread has its own
    nice value, so serialising and writing use the cores the step leaves idle."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


class BackgroundSave:
    """At most one save running on a background thread; its error kept for the caller; the
    host buffers its saves are copied into."""

    def __init__(self) -> None:
        #: the state of the save in flight, in host memory (refilled by the next save only)
        self.snapshot = HostSnapshot()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        #: the save in flight (or the last one): its name
        self.name = ""
        #: seconds the last completed background write took
        self.last_write_s: Optional[float] = None
        #: due saves skipped while :attr:`name` was in flight (the log says so once per save)
        self.skipped = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, name: str, work: Callable[[], None]) -> None:
        """Run ``work`` in the background (the previous save must have ended: :meth:`wait`)."""
        assert not self.busy, "one save in flight at a time"
        self.raise_error()
        self.name, self.skipped = name, 0

        def run() -> None:
            _yield_cpu()
            began = time.monotonic()
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept and raised by the training loop
                self._error = exc
            self.last_write_s = time.monotonic() - began

        self._thread = threading.Thread(target=run, name=f"sparkhvd-save-{name}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the save in flight ended; its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_error()

    def raise_error(self) -> None:
        """The error of a save that failed since the last call, raised once."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def skip(self, due: str) -> None:
        """A save came due while :attr:`name` is being written: skipped, said once per save."""
        self.skipped += 1
        if self.skipped == 1:
            print(f"checkpoint: {due} skipped: {self.name} is still being written "
                  "(async_save: a save that comes due while one is in flight is skipped)",
                  flush=True)
