"""Checkpoints that do not hold training up: ``st.Checkpoints(..., async_save=True)``.

A synchronous checkpoint holds every rank while rank 0 serialises the whole state and writes it
through the store -- minutes for a large model on remote storage, so users save rarely and lose
what they trained since. Here (as ``torch.distributed.checkpoint.async_save`` does) the step is
held only while the state is *copied into host memory*: into buffers kept between saves (so they
are allocated once), pinned and filled on a side stream for GPU tensors. ``torch.save`` and the
write to the checkpoint folder then run on a background thread while training goes on.

The rules (:class:`sparkhvd.torch.Checkpoints` applies them; its docstring says them to users):

- **one save in flight per rank.** A save that ``step()``'s cadence makes due while one is being
  written is *skipped* -- or, with ``memory_snapshots``, kept as a memory snapshot on the host
  (:mod:`sparkhvd.torch.snapshot_ring`) -- training never waits for storage; the rank's log says
  which once per save in flight; an explicit ``save()`` waits for the one in flight, then starts its own; a notice
  waits for it and writes its own to the end before every rank stops.
- **what is saved is the state at the step**: model, optimizer, the data's position and the
  extra state are copied when the save starts, not when its write ends.
- **complete or absent**: the file, then its record, then ``latest.json``, as for a synchronous
  save -- a rank killed mid-write leaves the previous complete checkpoint to resume from.
  With a host copy and the folder elsewhere, "complete" comes twice: on rank 0's host (the
  file and its record kept there, :mod:`sparkhvd.checkpoint.host_copy`) and then in the folder,
  uploaded behind the saves (:class:`~sparkhvd.checkpoint.background.UploadQueue`), so the
  one in flight is the serialisation, not the upload.
- **errors are not lost**: a failed write is raised by the next ``step()``/``save()``, or when
  the training function ends; the function's end waits for the save in flight
  (:mod:`sparkhvd.common.function_end`), so a rank never reports done before its last checkpoint
  is durable.

The CUDA calls go through :class:`StagingCopies`; a test swaps it for a fake (no GPU here).

Sharded checkpoints (:class:`ShardedStaging`) stage with DCP's own stager (DTensors and
sharded tensors keep their layout) and write with ``torch.distributed.checkpoint.async_save``;
the rules above hold for them too, with every rank's part committed together.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterator, Optional

from sparkhvd.checkpoint.background import BackgroundSave

__side__ = "rank"

__all__ = ["BackgroundSave", "HostSnapshot", "ShardedStaging", "StagingCopies"]


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

    @staticmethod
    def pin(buffer: Any) -> bool:
        """Page-lock a host buffer torch did not allocate (a memory snapshot's slot mapping),
        as DCP's stager does its shared memory (``cudaHostRegister``), so a copy from the GPU
        into it runs on the side stream without holding the host; False where CUDA refuses
        (the copy into it is then a pageable one)."""
        import torch

        size = buffer.numel() * buffer.element_size()
        return bool(size) and int(torch.cuda.cudart().cudaHostRegister(
            buffer.data_ptr(), size, 1)) == 0  # 1: cudaHostRegisterPortable

    @staticmethod
    def unpin(buffer: Any) -> None:
        """Undo :meth:`pin` (before the mapping goes)."""
        import torch

        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


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
        if _walked_sequence(value):
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


def _walked_sequence(value: Any) -> bool:
    """A list or tuple whose items a state's walk goes into (a named tuple is a plain value,
    deep-copied whole)."""
    return isinstance(value, (list, tuple)) and not hasattr(value, "_fields")


def tensors_of(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Each tensor of a state and its path, as :meth:`HostSnapshot.take` walks it."""
    import torch

    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors_of(item, (*path, key))
    elif _walked_sequence(value):
        for i, item in enumerate(value):
            yield from tensors_of(item, (*path, i))


class ShardedStaging:
    """``torch.distributed.checkpoint.async_save`` for :class:`sparkhvd.torch.ShardedCheckpoints`:
    DCP's own stager copies each rank's shards (DTensors stay DTensors) into host buffers it keeps
    between saves -- pinned, with non-blocking copies, when there is a GPU -- and DCP writes them
    from its thread, its collectives on a gloo group of their own, so they never interleave with
    the training's or the helpers' collectives on other threads."""

    def __init__(self, finish: Callable[[], None]) -> None:
        """``finish``: waits for the save in flight; it must run before the process group is
        destroyed (its commit gathers on it), so ``destroy_process_group`` runs it first."""
        self._stager: Any = None
        self._group: Any = None
        _finish_before_destroy(finish)

    def save(self, state: Any, folder: str) -> Any:
        """Stage ``state`` (the step waits for this) and start writing it into ``folder``; the
        future of the write. Every rank calls it, in the same order."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is not None and _spent(self._stager):
            self._stager = None  # torch 2.11: a stager stages once (new buffers every save)
        if self._stager is None:
            gpu = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=gpu))
            if dist.is_initialized():
                self._group = dist.new_group(backend="gloo")
        return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(folder),
                              process_group=self._group, async_stager=self._stager)

    @property
    def group(self) -> Any:
        """The gloo group the background commit gathers on (None: one process)."""
        return self._group

    def close(self) -> None:
        """Let the host buffers go (the function ended; a later save stages anew)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _spent(stager: Any) -> bool:
    """Whether DCP's ``DefaultStager`` can no longer stage. torch 2.11's closes its inner
    stager after every stage (its copy table emptied: the next stage fails with ``KeyError:
    <class 'type'>``, seen on a GPU), so there each save needs a new one and allocates new
    host buffers; torch 2.13's keeps them between saves."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


_BEFORE_DESTROY: list[Callable[[], None]] = []


def _finish_before_destroy(finish: Callable[[], None]) -> None:
    """Make ``torch.distributed.destroy_process_group`` wait for ``finish`` first: a script that
    destroys its group right after its last save (torchrun's usual ending) would otherwise cut
    that save's commit off. The wrapper is installed once; a failed save is raised after the
    group is destroyed."""
    import torch.distributed as dist

    _BEFORE_DESTROY.append(finish)
    if getattr(dist.destroy_process_group, "_sparkhvd_waits", False):
        return
    original = dist.destroy_process_group

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        first: Optional[BaseException] = None
        for pending in list(_BEFORE_DESTROY):
            try:
                pending()
            except BaseException as exc:  # noqa: BLE001 - the group is destroyed anyway
                first = first or exc
        _BEFORE_DESTROY.clear()
        result = original(*args, **kwargs)
        if first is not None:
            raise first
        return result

    destroy_process_group._sparkhvd_waits = True  # type: ignore[attr-defined]
    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
