"""Batches handed out already on the training device: ``torch_batches(..., device="cuda")``.

A batch gathered in ordinary (pageable) memory is copied to a GPU synchronously: the step
waits for the copy, and the copy waits for the step. Here each batch is copied into *pinned*
host buffers (a ring of :data:`PINNED_SETS`, reused, so pinning is paid once), then to the
device with a non-blocking copy on a side stream, one batch ahead: while the model trains on
batch ``k``, batch ``k + 1`` is on its way. The training stream waits on the copy's event
before it touches the batch (no synchronisation of the whole device on the step's path), and
the tensors are marked as used on that stream so the caching allocator does not hand their
memory out early.

The CUDA calls go through :class:`CudaCopies`; ``tests/unit/test_device_batches.py`` swaps it
for a fake that records them (the order of copies, events and waits). No test or bench runs the
real one on a GPU yet.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

__side__ = "rank"

#: Pinned buffer sets in the ring: the one being filled, the one being copied, the one in use.
PINNED_SETS = 3


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every tensor of a batch (a tensor, a tuple or a dict of them)."""
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    return fn(value)


def flat(value: Any) -> list[Any]:
    """The tensors of a batch, in a fixed order."""
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in flat(value[k])]
    if isinstance(value, tuple):
        return [t for v in value for t in flat(v)]
    return [value]


class CudaCopies:
    """The CUDA calls of a one-batch-ahead copy (the seam a test replaces)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def pinned_like(self, tensor: Any) -> Any:
        return self.torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def copy_ahead(self, pinned: list[Any]) -> tuple[list[Any], Any]:
        """Copy pinned tensors to the device on the side stream; the event that marks the end."""
        with self.torch.cuda.stream(self.stream):
            on_device = [t.to(self.device, non_blocking=True) for t in pinned]
            done = self.torch.cuda.Event()
            done.record(self.stream)
        return on_device, done

    def hand_over(self, tensors: list[Any], done: Any) -> None:
        """Make the training stream wait for the copy, and tell the allocator it uses them."""
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in tensors:
            t.record_stream(current)

    def wait(self, done: Any) -> None:
        """The host waits until a copy out of a pinned set ended (before the set is refilled:
        it finished a batch or two ago)."""
        done.synchronize()


def to_device(batches: Iterator[Any], device: Any,
              copies: Optional[CudaCopies] = None) -> Iterator[Any]:
    """``batches`` (torch tensors in host memory) on ``device``, copied one batch ahead on a
    CUDA device (see the module docstring), with ``.to(device)`` on any other."""
    import torch

    device = torch.device(device)
    if copies is None:
        if device.type != "cuda":
            for batch in batches:
                yield map_tensors(batch, lambda t: t.to(device))
            return
        copies = CudaCopies(device)
    ring: list[Optional[tuple[list[Any], Any]]] = [None] * PINNED_SETS  # (pinned, copy done)
    ahead: Optional[tuple[Any, list[Any], Any]] = None  # (batch structure, on device, done)
    for k, batch in enumerate(batches):
        tensors = flat(batch)
        slot = ring[k % PINNED_SETS]
        if slot is None or [t.shape for t in slot[0]] != [t.shape for t in tensors] or \
                [t.dtype for t in slot[0]] != [t.dtype for t in tensors]:
            if slot is not None:
                copies.wait(slot[1])
            pinned = [copies.pinned_like(t) for t in tensors]
        else:
            copies.wait(slot[1])  # its last copy ended before the buffers are refilled
            pinned = slot[0]
        for target, source in zip(pinned, tensors):
            target.copy_(source)
        on_device, done = copies.copy_ahead(pinned)
        ring[k % PINNED_SETS] = (pinned, done)
        if ahead is not None:
            yield _handed_over(copies, *ahead)
        ahead = (batch, on_device, done)
    if ahead is not None:
        yield _handed_over(copies, *ahead)


def _handed_over(copies: CudaCopies, batch: Any, on_device: list[Any], done: Any) -> Any:
    copies.hand_over(on_device, done)
    tensors = iter(on_device)
    order = {id(t): next(tensors) for t in flat(batch)}
    return map_tensors(batch, lambda t: order[id(t)])
