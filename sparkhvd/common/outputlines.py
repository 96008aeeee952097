"""A rank's output stream cut into lines -- where a carriage return is a line *update*.

Progress bars (Keras' ``verbose=1``, tqdm) redraw one line with ``\\r`` (Keras also backs up with
``\\b``). Joined into one "line", an epoch's bar is tens of kilobytes and its final state -- the
epoch's summary -- gets lost. So a ``\\r`` ends an *update* (shown live where the console can
redraw, never written to the rank log) and a ``\\n`` ends a line (the bar's final state, kept like
any line). ``\\r\\n`` is a plain newline. Every launcher's output reader uses this one splitter.
"""
from __future__ import annotations

import re

from sparkhvd.common.protocol import MAX_CHUNK_BYTES

__side__ = "common"

LINE, UPDATE, PARTIAL = "line", "update", "partial"
#: How horovod's launcher tags each kind after ``<stdout``/``<stderr`` (see sparkhvd.common.patches).
OUTPUT_FLAGS = {LINE: "", PARTIAL: "+", UPDATE: "~"}
_SPLIT = re.compile(r"(\r\n|\r|\n)")


class OutputSplitter:
    """Feed decoded text, get ``(kind, text)`` pieces: whole lines, updates, and pieces of lines
    longer than :data:`~sparkhvd.common.protocol.MAX_CHUNK_BYTES` (``partial``)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._held_cr = False  # a chunk ended in "\r": it may be the first half of "\r\n"

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._held_cr:
            self._held_cr = False
            text = "\r" + text
        if text.endswith("\r"):
            self._held_cr, text = True, text[:-1]
        for piece in _SPLIT.split(text):
            if piece in ("\r\n", "\n"):
                out.append((LINE, _clean(self._buffer)))
                self._buffer = ""
            elif piece == "\r":
                out.append((UPDATE, _clean(self._buffer)))
                self._buffer = ""
            else:
                self._buffer += piece
                while len(self._buffer) >= MAX_CHUNK_BYTES:
                    out.append((PARTIAL, _clean(self._buffer[:MAX_CHUNK_BYTES])))
                    self._buffer = self._buffer[MAX_CHUNK_BYTES:]
        return out

    def close(self) -> list[tuple[str, str]]:
        """What is left when the stream ends (an unterminated last line)."""
        out = [(UPDATE if self._held_cr else LINE, _clean(self._buffer))] \
            if self._buffer or self._held_cr else []
        self._buffer, self._held_cr = "", False
        return [(kind, text) for kind, text in out if text or kind == LINE]


def _clean(text: str) -> str:
    return text.replace("\b", "")
