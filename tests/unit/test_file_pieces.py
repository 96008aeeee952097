"""The byte ranges of a checkpoint file a rank's load reads (sparkhvd.runfolder.file_pieces):
what a rank that lacks the file is sent instead of the file."""
from __future__ import annotations

import io

import pytest

from sparkhvd.runfolder.file_pieces import FilePieces, cut, merged, wanted_spans


def test_ranges_are_merged_and_one_whole_reader_takes_the_file_whole():
    assert merged([(10, 5), (0, 4), (4, 2), (12, 10), (30, 1)]) == [(0, 6), (10, 12), (30, 1)]
    assert wanted_spans([[(0, 4)], [(2, 4), (20, 2)]]) == [(0, 6), (20, 2)]
    assert wanted_spans([[(0, 4)], None]) is None


def test_the_pieces_read_like_the_file_where_they_were_cut():
    data = bytes(range(256)) * 4
    spans = [(8, 16), (600, 100)]
    pieces = FilePieces.of(len(data), spans, cut(data, spans))
    assert pieces.nbytes == 116
    stream = pieces.stream()
    stream.seek(610)
    assert stream.read(20) == data[610:630] and stream.tell() == 630
    assert stream.seek(-1024 + 8, io.SEEK_END) == 8 and stream.read(16) == data[8:24]
    stream.seek(30)
    with pytest.raises(ValueError, match="not fetched"):
        stream.read(4)
