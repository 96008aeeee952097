"""Memory snapshots (``st.Checkpoints(..., async_save=True, memory_snapshots=True)``): the
newest step's state kept in memory-mapped files on rank 0's host, so a lost process costs the
step in progress, not the seconds a large save takes to serialise.

A background save of a 1 GB state takes seconds to serialise and write (B15); meanwhile the
saves that come due cannot start, so a rank killed then loses every step since the last one
whose file was whole -- 4 steps a rank with a checkpoint due every step (B12). Copying the
state into host memory takes a tenth of a step. So every due save is first copied into a
*slot*: a file in this rank's host-copy folder (:mod:`sparkhvd.checkpoint.host_copy`;
``$SPARKHVD_HOST_COPY_DIR=/dev/shm`` keeps it in memory) mapped into the process, each tensor
at a fixed offset in a mapping of its own, reused from one snapshot to the next. Then the slot
is named this rank's newest snapshot (``snapshot.json``, with its record: one rename). A save
that is written to the folder is serialised from its slot, which is held until then; a save
due while one is written is a snapshot only. Three slots take turns -- the one named newest,
the one a save is written from, the one being filled -- so the one named is never the one
being filled: a process killed mid-copy leaves the snapshot before it.

The step waits only for what the next step's forward could change (buffers such as
BatchNorm's statistics, the data's position, the extra state): the parameters and the
optimizer's state change only in an optimizer step, so they are copied on a thread (one core)
while the next step's forward and backward run, and every torch optimizer's ``step()`` first
waits for that copy (a global optimizer step pre-hook). A GPU tensor's region is registered
with CUDA (``cudaHostRegister``, as DCP's stager does its shared memory), so its copy runs on a
side stream like a background save's into pinned buffers; it is unregistered before its mapping
goes (a new layout, or the training function's end, which lets every mapping go).

The files outlive the process (not its host): a relaunch on that host restores the newest
snapshot when it is newer than every checkpoint file (:mod:`sparkhvd.checkpoint.nearest_copy`;
ranks elsewhere get its bytes over the process group) -- and the folder never gets it: the
next save that is written goes there. The restore reads the slot in place, mapped into memory:
a process fills only slot files it laid out itself (its first fill of a slot makes a new
file), so an earlier process's snapshot is never rewritten under a rank reading it.

A slot file is the tensors' bytes, then the state's structure (JSON whose tensors name their
offsets, dtypes and shapes: :func:`structure_of`), its length and :data:`MAGIC` -- so one read
gives everything, and a slot that does not end with the marker is not a snapshot. No pickle:
whoever can write the host-copy folder could plant a slot, and reading one back runs nothing;
a state holding anything but tensors, numbers, strings, bytes and containers of them is not
kept as a snapshot (said once; the saves go on as without ``memory_snapshots``). Where the slots are on a disk (a crash of the
host may leave one torn, for a relaunch there to read), the record carries the file's CRC-32,
taken on the copying thread once the copy is done (the optimizer step waits for the copy, not
for the sum) and checked when the snapshot is read back; in memory (``/dev/shm``) a snapshot
dies with its host, and none is taken (:func:`sparkhvd.checkpoint.host_copy.snapshot_entry`).

Bounded: the three slots must fit in half of what their folder has free
(:data:`sparkhvd.checkpoint.host_copy.FREE_SHARE`); otherwise no snapshot is kept (said once)
and the saves go on as without ``memory_snapshots``.
"""
from __future__ import annotations

import base64
import collections
import contextlib
import json
import math
import mmap
import os
import threading
import uuid
import warnings
import weakref
import zlib
from typing import Any, Callable, Collection, Optional, Union

from sparkhvd.checkpoint import host_copy
from sparkhvd.torch.async_save import HostSnapshot, StagingCopies, tensors_of

__side__ = "rank"

#: How a snapshot file ends (1 was a pickled structure: no longer read as a snapshot).
MAGIC = b"SPARKHVD-SNAPSHOT-2"
_OLD_MAGIC = b"SPARKHVD-SNAPSHOT-1"
#: Slots taking turns: one named newest, one a save is written from, one being filled.
SLOTS = 3
_ALIGN = mmap.ALLOCATIONGRANULARITY  # every tensor's offset: where a mapping may begin


def is_old_snapshot(data: Union[bytes, memoryview]) -> bool:
    """Whether ``data`` is a snapshot of an earlier sparkhvd's format (its structure pickled:
    never read)."""
    return bytes(data[-len(_OLD_MAGIC):]) == _OLD_MAGIC


def is_snapshot(data: Union[bytes, memoryview]) -> bool:
    """Whether ``data`` (a file's bytes, or a view of it) is a whole snapshot file."""
    return bytes(data[-len(MAGIC):]) == MAGIC


def load_snapshot(data: Union[bytes, memoryview]) -> Any:
    """The state a snapshot file holds, its tensors copies on the CPU (nothing shares ``data``,
    and nothing holds it once this returns: a view of a mapped slot file is let go with it).

    Raises:
        ValueError: ``data`` is not a whole snapshot, or its structure is not one we write.
    """
    if not is_snapshot(data):
        raise ValueError("not a whole snapshot (its end marker is missing)")
    end = len(data) - len(MAGIC)
    length = int.from_bytes(data[end - 8:end], "little")
    if not 0 < length <= end - 8:
        raise ValueError(f"not a snapshot: its structure's length ({length}) is out of the file")
    structure = json.loads(bytes(data[end - 8 - length:end - 8]))
    return _decode(structure, data, end - 8 - length)


class NotPlain(ValueError):
    """A state holds a value a snapshot's structure does not keep (its type named)."""


def structure_of(value: Any, offsets: dict[int, tuple[int, str, tuple]]) -> Any:
    """``value`` as JSON: tensors (the slot's buffers, by ``id``) as ``{"t": [offset, dtype,
    shape]}``, every container as a one-key object (``d`` a dict's pairs, with ``o`` for an
    ``OrderedDict`` and ``m`` its ``_metadata``; ``l`` a list, ``u`` a tuple, ``b`` bytes,
    ``n`` a numpy number: its dtype and value);
    None, booleans, numbers and strings as they are.

    Raises:
        NotPlain: anything else (a tensor not in the slot, an object of another type).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    place = offsets.get(id(value))
    if place is not None:
        offset, dtype, shape = place
        return {"t": [offset, dtype, list(shape)]}
    if isinstance(value, dict) and type(value) in (dict, collections.OrderedDict):
        out: dict = {"d": [[structure_of(k, offsets), structure_of(v, offsets)]
                           for k, v in value.items()]}
        if type(value) is collections.OrderedDict:
            out["o"] = 1
        if getattr(value, "_metadata", None) is not None:
            out["m"] = structure_of(value._metadata, offsets)  # type: ignore[attr-defined]
        return out
    if type(value) in (list, tuple):
        return {"l" if type(value) is list else "u": [structure_of(v, offsets) for v in value]}
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode()}
    kind: Any = getattr(value, "dtype", None)
    if type(value).__module__ == "numpy" and getattr(kind, "kind", "") in ("b", "i", "u", "f") \
            and getattr(value, "ndim", None) == 0:  # a numpy scalar: its dtype and value
        return {"n": [kind.str, value.item()]}
    raise NotPlain(f"{type(value).__module__}.{type(value).__qualname__}")


def _decode(value: Any, data: Union[bytes, memoryview], tensors_end: int) -> Any:
    """What :func:`structure_of` wrote, its tensors copied out of ``data`` (which they must lie
    inside: before ``tensors_end``)."""
    if not isinstance(value, (dict, list)):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise ValueError(f"not a snapshot's structure: {type(value).__name__}")
    if isinstance(value, list) or len(value) not in (1, 2, 3):
        raise ValueError("not a snapshot's structure: a bare container")
    if "t" in value:
        return _tensor(value["t"], data, tensors_end)
    if "d" in value:
        pairs = [(_decode(k, data, tensors_end), _decode(v, data, tensors_end))
                 for k, v in value["d"]]
        out: Any = collections.OrderedDict(pairs) if value.get("o") else dict(pairs)
        if "m" in value:
            out._metadata = _decode(value["m"], data, tensors_end)
        return out
    if "l" in value or "u" in value:
        items = [_decode(v, data, tensors_end) for v in value["l" if "l" in value else "u"]]
        return items if "l" in value else tuple(items)
    if "b" in value:
        return base64.b64decode(value["b"])
    if "n" in value:
        import numpy as np

        dtype = np.dtype(str(value["n"][0]))
        if dtype.kind not in ("b", "i", "u", "f"):
            raise ValueError(f"not a snapshot's number: {value['n']!r}")
        return dtype.type(value["n"][1])
    raise ValueError(f"not a snapshot's structure: {sorted(value)}")


def _tensor(place: Any, data: Union[bytes, memoryview], tensors_end: int) -> Any:
    """The tensor at ``place`` (offset, dtype, shape) in ``data``, copied: a dtype is a torch
    dtype's name, the bytes must lie before the structure."""
    import torch

    offset, dtype, shape = place
    kind = getattr(torch, str(dtype).split(".")[-1], None)
    if not isinstance(kind, torch.dtype) or not isinstance(offset, int) or \
            not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"not a snapshot's tensor: {place!r}")
    count = math.prod(shape)
    if not count:
        return torch.empty(shape, dtype=kind)
    if offset < 0 or offset + count * kind.itemsize > tensors_end:
        raise ValueError(f"not a snapshot's tensor: {place!r} lies outside its bytes")
    with warnings.catch_warnings():  # read-only bytes: only copied from
        warnings.simplefilter("ignore", UserWarning)
        view = torch.frombuffer(data, dtype=kind, count=count, offset=offset)
    return view.reshape(shape).clone()


class _Slot(HostSnapshot):
    """A :class:`HostSnapshot` whose buffers are regions of one file, each mapped into
    memory on its own."""

    def __init__(self, path: str, copies: Optional[StagingCopies] = None) -> None:
        super().__init__(copies or StagingCopies())
        self.path = path
        self._pinned: list = []  # buffers page-locked for copies from the GPU
        self._layout: list = []
        self._offsets: dict[int, tuple[int, str, tuple]] = {}  # id(buffer) -> its place
        self.end = 0  # bytes of tensors (the structure follows)
        self._later: set[int] = set()
        self._pairs: list = []

    def plan(self, state: Any, room: Callable[[], float]) -> bool:
        """Lay the file out for ``state``'s tensors when their shapes or dtypes changed (a new
        file: an old mapping still read stays valid). False when the slots at this size would
        take more than ``room()`` (asked only then: the layout rarely changes)."""
        import torch

        layout = [(path, tuple(t.shape), t.dtype, t.numel() * t.element_size(),
                   self.copies.on_gpu(t)) for path, t in tensors_of(state)]
        if layout == self._layout:
            return True
        places, end = {}, 0
        for path, _, _, size, _ in layout:
            end = -(-end // _ALIGN) * _ALIGN
            places[path] = end
            end += size
        if SLOTS * end > room():
            return False
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.unmap()
        try:
            os.ftruncate(fd, end)
            for path, shape, dtype, size, on_gpu in layout:
                at = places[path]
                # a mapping of its own: each buffer has its own storage, so torch.save of
                # the slot's tensors (the save written from it) writes each on its own
                buffer = (torch.frombuffer(mmap.mmap(fd, size, offset=at), dtype=torch.uint8)
                          if size else torch.empty(0, dtype=torch.uint8)).view(dtype).view(shape)
                self._buffers[path] = buffer
                self._offsets[id(buffer)] = (at, str(dtype), shape)
                if on_gpu and size and self.copies.pin(buffer):  # a GPU copy: asynchronous
                    self._pinned.append(buffer)
        finally:
            os.close(fd)
        self._layout, self.end = layout, end
        return True

    def unmap(self) -> None:
        """Let go of the mappings (the file stays as it is; page-locked ones are unlocked
        first); the next :meth:`plan` lays a new file out."""
        for buffer in self._pinned:
            self.copies.unpin(buffer)
        self._pinned = []
        self._buffers, self._offsets, self._layout = {}, {}, []

    def take_now(self, state: Any, later: Collection[int]) -> tuple[Any, list]:
        """:meth:`take` of what may change before the next optimizer step (buffers, plain
        values); the tensors whose data pointers are in ``later`` (parameters, the optimizer's
        state: only an optimizer step changes them) are left as (buffer, tensor) pairs for
        :meth:`copy_later`. The state's copy (its later tensors' buffers not yet filled), and
        those pairs."""
        self._later, self._pairs = set(later) - {0}, []
        try:
            taken = self.take(state)
            return taken, self._pairs
        finally:
            self._later, self._pairs = set(), []  # the caller's now: the tensors are not kept

    def _tensor(self, tensor: Any, path: tuple, on_gpu: list) -> Any:
        if tensor.data_ptr() in self._later:
            self._taken.add(path)
            buffer = self._buffers[path]  # laid out by plan()
            self._pairs.append((buffer, tensor.detach()))
            return buffer
        return super()._tensor(tensor, path, on_gpu)

    def copy_later(self, pairs: list) -> None:
        """Fill the buffers :meth:`take_now` left (GPU tensors on a side stream)."""
        on_gpu = [(b, t) for b, t in pairs if self.copies.on_gpu(t)]
        for buffer, tensor in pairs:
            if not self.copies.on_gpu(tensor):
                self.copies.copy_on_host(buffer, tensor)
        if on_gpu:
            self.copies.copy_from_gpu(on_gpu)

    def structure(self, taken: Any) -> bytes:
        """What follows the tensors in the file: ``taken``'s structure
        (:func:`structure_of`), its length and :data:`MAGIC`.

        Raises:
            NotPlain: ``taken`` holds a value a snapshot does not keep."""
        tail = json.dumps(structure_of(taken, self._offsets), separators=(",", ":")).encode()
        return tail + len(tail).to_bytes(8, "little") + MAGIC

    def checksum(self, size: int) -> int:
        """The CRC-32 of the file's first ``size`` bytes (from memory: the mappings' pages)."""
        with open(self.path, "rb") as f, \
                mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as view:
            return zlib.crc32(view)

    def write_tail(self, tail: bytes) -> int:
        """Write :meth:`structure` after the tensors; the file's size."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, tail, self.end)
            os.ftruncate(fd, self.end + len(tail))
        finally:
            os.close(fd)
        return self.end + len(tail)


_RINGS: weakref.WeakSet = weakref.WeakSet()  # the rings whose copies an optimizer step awaits


def _before_optimizer_step(*_: Any) -> None:
    """Every torch optimizer's step first waits for the snapshots being copied (their
    parameters and optimizer state are what it changes) -- not for their checksums."""
    for ring in list(_RINGS):
        ring.wait_copied()


_hooked: list = []


class SnapshotRing:
    """Rank 0's newest step states, in :data:`SLOTS` slot files taking turns (see the module)."""

    def __init__(self, paths: list[str]) -> None:
        self._slots = [_Slot(path) for path in paths]
        #: slots in memory die with the host: no crash leaves one torn, no CRC taken
        self._in_memory = bool(paths) and host_copy.in_memory(os.path.dirname(paths[0]))
        named = host_copy.committed_snapshot()  # an earlier process's: not overwritten first
        #: the slot named newest, and the one a save is being written from: never filled
        self._named = next((i for i, path in enumerate(paths) if path == named), None)
        self._held: Optional[int] = None
        self._copying: Optional[threading.Thread] = None
        self._copied = threading.Event()  # the one being copied has its tensors
        self._copied.set()
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        #: why :meth:`keep` kept nothing (said once by the caller)
        self.why = ""

    @classmethod
    def here(cls) -> Optional[SnapshotRing]:
        """The ring of this rank in this run's host-copy folder; None outside a run."""
        paths = [host_copy.snapshot_slot(i) for i in range(SLOTS)]
        return cls([p for p in paths if p]) if all(paths) else None

    def keep(self, state: Any, file: str, record: dict, store: str,
             later: Collection[int] = (), hold: bool = False) -> Optional[Any]:
        """Copy ``state`` into a free slot and name it this rank's newest snapshot, the copy of
        ``file`` (``record``'s, without its files: added here); the state's copy there (its
        tensors the slot's), or None when the slots do not fit or the state holds a value a
        snapshot does not keep (nothing written; :attr:`why` says which).

        The tensors whose data pointers are in ``later`` (the parameters and the optimizer's
        state) are copied on a thread while training goes on, and every torch optimizer's next
        ``step()`` waits for them (:meth:`wait` too); the rest now. ``hold``: the slot is
        not filled again until :meth:`release` (a save is written from the copy)."""
        self.wait()  # the snapshot before is named first
        index = next(i for i in range(SLOTS) if i not in (self._named, self._held))
        slot = self._slots[index]
        def room() -> float:  # what the slots take counts as free
            return host_copy.FREE_SHARE * (
                host_copy.free_bytes(slot.path) + sum(s.end for s in self._slots))

        if not slot.plan(state, room):
            self.why = (f"{SLOTS} more copies of the state do not fit in half the free space "
                        f"of the host-copy folder; a save due while one is written is "
                        f"skipped. Set {host_copy.DIR_ENV} to a larger folder.")
            return None
        taken, pairs = slot.take_now(state, later)
        try:
            tail = slot.structure(taken)  # the step's plain values, written down now
        except NotPlain as exc:  # nothing named: the slot is filled again next time
            self.why = (f"the state holds a {exc}, which a snapshot does not keep (tensors, "
                        f"numbers, strings, bytes and containers of them; nothing that "
                        f"unpickles); a save due while one is written is skipped.")
            return None
        if hold:
            self._held = index

        copied = threading.Event()

        def finish() -> None:
            try:
                slot.copy_later(pairs)
            finally:
                copied.set()  # the next optimizer step may change the parameters now
            size = slot.write_tail(tail)
            crc = None if self._in_memory else slot.checksum(size)
            named = {**record, "file": file, "snapshot": True, "files": {
                file: host_copy.snapshot_entry(size, uuid.uuid4().hex, crc)}}
            if host_copy.commit_snapshot(file, slot.path, size, named, store):
                self._named = index

        if not pairs:
            finish()
            return taken
        self._copied = copied
        if not _hooked:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hooked.append(register_optimizer_step_pre_hook(_before_optimizer_step))
        _RINGS.add(self)

        def run() -> None:
            import torch

            # one core: a second OpenMP team beside training's would oversubscribe the cores,
            # and their spinning cost training half its speed on two cores (B15)
            torch.set_num_threads(1)
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 - raised by the next wait()
                self._error = exc

        self._copying = threading.Thread(target=run, name="sparkhvd-snapshot", daemon=True)
        self._copying.start()
        return taken

    def wait(self) -> None:
        """Until the snapshot being copied is named newest (on any thread); its error, once."""
        copying = self._copying
        if copying is not None:
            copying.join()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_copied(self) -> None:
        """Until the tensors of the snapshot being copied are in its slot (its checksum and
        its naming may still run); errors are :meth:`wait`'s."""
        self._copied.wait()

    def release(self) -> None:
        """The save written from the held slot has read it: it may be filled again."""
        self._held = None

    def close(self) -> None:
        """The training function ended: the slots' mappings go now, not with the process (a
        process that makes many Checkpoints would hold them all). The files stay -- the
        newest is what a relaunch restores -- and a later :meth:`keep` maps a slot again."""
        self.wait()
        _RINGS.discard(self)
        for slot in self._slots:
            slot.unmap()

    @property
    def nbytes(self) -> int:
        """Bytes one slot's tensors take."""
        return max(s.end for s in self._slots)
