"""Parts of a checkpoint file: the byte ranges a rank's load reads, without the rest.

A DCP checkpoint spreads the items every rank holds -- an optimizer's settings and step
counts -- over the ranks' files (DCP writes each replicated item once), so with FSDP's shards a
rank's load reads its own shards' file and a few kilobytes of every other rank's. Sending it
those files whole would make a restore move ``np`` times the state; sending the ranges it reads
moves the state once (:mod:`sparkhvd.checkpoint.nearest_copy`), and so does reading them from the
run folder, each item checked against the CRC-32 its record keeps
(:func:`sparkhvd.checkpoint.read.read_file_checked`). :class:`FilePieces` holds such
ranges where they sit in the file, and reads like the file as long as only they are read.
"""
from __future__ import annotations

import bisect
import io
from typing import Any, Collection, Iterable, Mapping, Optional, Protocol, Sequence, Union

__side__ = "rank"

#: A range of a file: (offset, length).
Span = tuple[int, int]
#: What a rank's load reads of a checkpoint's files: each file it reads with its byte ranges
#: (None: the whole file; a file not named is not read); None: every file whole.
Plan = Optional[dict[str, Optional[list[Span]]]]


class Needs(Protocol):
    """What of a checkpoint's files a rank's load reads, where that is less than all of them
    (:class:`sparkhvd.torch.restore_collectives.DcpNeeds`)."""

    def index(self, record: dict) -> Collection[str]:
        """The files every loading rank reads whole first (a DCP checkpoint's ``.metadata``)."""

    def spans(self, record: dict, index: dict[str, bytes]) -> Plan:
        """From the index files' bytes: the files this rank's load reads, each with the byte
        ranges it reads (None: the whole file); None: every file whole."""


def index_files(needs: Optional[Needs], record: dict, names: Iterable[str]) -> list[str]:
    """Which of a checkpoint's files (``names``) a rank reads first, whole: ``needs``' index
    files -- every file without ``needs``. The one rule for the folder
    (:func:`sparkhvd.checkpoint.read.restore_newest`) and for the host copies
    (:func:`sparkhvd.checkpoint.nearest_copy.load_nearest`)."""
    names = set(names)
    return sorted(names & set(needs.index(record)) if needs is not None else names)


def load_plan(needs: Needs, record: dict, index: dict[str, Any]) -> Plan:
    """What this rank's load reads of the rest, from the index files' bytes -- every file whole
    when ``needs`` cannot say (a broken index: the load that reads it then says why)."""
    try:
        return needs.spans(record, index)
    except Exception:  # noqa: BLE001 - every file whole, as without needs; the load says why
        return None


def merged(spans: Iterable[Span]) -> list[Span]:
    """``spans`` sorted, the overlapping and touching ones merged."""
    out: list[Span] = []
    for offset, length in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            start = out[-1][0]
            out[-1] = (start, max(out[-1][1], offset + length - start))
        else:
            out.append((offset, length))
    return out


def wanted_spans(wants: Sequence[Optional[list[Span]]]) -> Optional[list[Span]]:
    """The ranges that cover what each of ``wants`` reads (None: the whole file, as soon as one
    of them reads it whole)."""
    if any(want is None for want in wants):
        return None
    return merged(span for want in wants if want is not None for span in want)


def cut(data: Union[bytes, memoryview], spans: list[Span]) -> bytes:
    """``data``'s ``spans``, one after the other (what :meth:`FilePieces.of` takes back)."""
    return b"".join(data[offset:offset + length] for offset, length in spans)


def as_stream(data: Union[bytes, memoryview, FilePieces]) -> io.IOBase:
    """A seekable stream that reads like the file ``data`` holds -- its bytes, a view of it
    mapped into memory, or the :class:`FilePieces` of it that are here -- without a copy of
    them (a reader that reads into its own buffers copies each byte once)."""
    if isinstance(data, FilePieces):
        return data.stream()
    if isinstance(data, bytes):
        return io.BytesIO(data)  # shares an immutable bytes object
    return FilePieces(len(data), {0: data}).stream()


class FilePieces:
    """A file of ``size`` bytes of which only ``pieces`` (offset -> bytes, or views of a
    mapped file) are here."""

    def __init__(self, size: int, pieces: Mapping[int, Union[bytes, memoryview]]) -> None:
        self.size = size
        self._offsets = sorted(pieces)
        self._pieces = pieces

    @classmethod
    def of(cls, size: int, spans: list[Span], joined: bytes) -> FilePieces:
        """The pieces :func:`cut` joined from ``spans`` of a file of ``size`` bytes."""
        pieces, at = {}, 0
        for offset, length in spans:
            pieces[offset] = joined[at:at + length]
            at += length
        return cls(size, pieces)

    def stream(self) -> io.RawIOBase:
        """A seekable stream that reads like the file, within the pieces (reading outside
        them is an error: the load plan asked for less than it reads)."""
        return _PiecesStream(self)

    def read(self, offset: int, size: int) -> Union[bytes, memoryview]:
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i >= 0:
            start = self._offsets[i]
            piece = self._pieces[start]
            if offset + size <= start + len(piece):
                return piece[offset - start:offset - start + size]
        raise ValueError(f"bytes {offset}-{offset + size} of the file were not fetched")


class _PiecesStream(io.RawIOBase):
    def __init__(self, pieces: FilePieces) -> None:
        self._pieces, self._at = pieces, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._pieces.size}[whence]
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        size = max(0, min(len(buffer), self._pieces.size - self._at))
        if size:
            buffer[:size] = self._pieces.read(self._at, size)
            self._at += size
        return size
