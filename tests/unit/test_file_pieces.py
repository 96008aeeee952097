"""The byte ranges of a checkpoint file a rank's load reads (sparkhvd.checkpoint.file_pieces):
what a rank that lacks the file is sent instead of the file, and what it reads of the file from
the run folder (the pieces that hold them, each checked against the record's CRC-32)."""
from __future__ import annotations

import hashlib
import io
import zlib

import pytest

from sparkhvd.checkpoint import read as checkpoint_read
from sparkhvd.checkpoint import write as checkpoint_write
from sparkhvd.checkpoint.file_pieces import (
    FilePieces,
    cut,
    index_files,
    load_plan,
    merged,
    wanted_spans,
)
from sparkhvd.checkpoint.stores import UrlStore


def test_ranges_are_merged_and_one_whole_reader_takes_the_file_whole():
    assert merged([(10, 5), (0, 4), (4, 2), (12, 10), (30, 1)]) == [(0, 6), (10, 12), (30, 1)]
    assert wanted_spans([[(0, 4)], [(2, 4), (20, 2)]]) == [(0, 6), (20, 2)]
    assert wanted_spans([[(0, 4)], None]) is None


def test_the_index_comes_first_and_a_plan_that_cannot_be_made_reads_every_file_whole():
    """The one rule the folder's reads and the host copies' share."""

    class Dcp:
        def __init__(self, plan):
            self.plan = plan

        def index(self, record):
            return [".metadata", "not-in-this-checkpoint"]

        def spans(self, record, index):
            if isinstance(self.plan, Exception):
                raise self.plan
            return self.plan

    names = ["__1_0.distcp", ".metadata", "__0_0.distcp"]
    assert index_files(Dcp(None), {}, names) == [".metadata"]
    assert index_files(None, {}, names) == sorted(names), "without needs every file, whole"
    plan = {"__0_0.distcp": [(0, 10)]}
    assert load_plan(Dcp(plan), {}, {".metadata": b""}) == plan
    assert load_plan(Dcp(ValueError("torn .metadata")), {}, {".metadata": b""}) is None


def test_the_pieces_read_like_the_file_where_they_were_cut():
    data = bytes(range(256)) * 4
    spans = [(8, 16), (600, 100)]
    pieces = FilePieces.of(len(data), spans, cut(data, spans))
    stream = pieces.stream()
    stream.seek(610)
    assert stream.read(20) == data[610:630] and stream.tell() == 630
    assert stream.seek(-1024 + 8, io.SEEK_END) == 8 and stream.read(16) == data[8:24]
    stream.seek(30)
    with pytest.raises(ValueError, match="not fetched"):
        stream.read(4)


# -- the same ranges read from the run folder, whole blocks each checked ---------------------
class _CountedStore(UrlStore):
    """A checkpoint folder on this disk that keeps the byte ranges read of it."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ranges: list[tuple[int, int]] = []

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        self.ranges.append((offset, length))
        return super().read_range(name, offset, length)


@pytest.fixture
def shard(tmp_path):
    """A 512-byte shard file of items at 0, 64, 128, ... 448 (DCP's offsets), its record's
    entry, its bytes."""
    data = bytes(range(256)) * 2
    (tmp_path / "shard.distcp").write_bytes(data)
    expected = checkpoint_write.digest_file(str(tmp_path / "shard.distcp"), range(0, 512, 64))
    return _CountedStore(str(tmp_path)), expected, data


def test_a_file_is_checked_in_the_pieces_between_its_items(tmp_path, monkeypatch):
    """Each piece's CRC-32, from each cut to the next, whatever the read size."""
    monkeypatch.setattr(checkpoint_write, "CHECK_BLOCK", 7)  # pieces span reads
    data = bytes(range(256)) * 2
    (tmp_path / "f").write_bytes(data)
    cuts = [100, 3, 511, 600, 0]
    digest = checkpoint_write.digest_file(str(tmp_path / "f"), cuts)
    assert digest["size"] == 512 and digest["sha256"] == hashlib.sha256(data).hexdigest()
    assert digest["pieces"] == [[0, zlib.crc32(data[:3])], [3, zlib.crc32(data[3:100])],
                                [100, zlib.crc32(data[100:511])], [511, zlib.crc32(data[511:])]]
    assert "pieces" not in checkpoint_write.digest_file(str(tmp_path / "f"))


def test_a_part_of_a_shard_is_read_from_the_folder_as_the_pieces_that_hold_it(shard):
    store, expected, data = shard
    assert [offset for offset, _ in expected["pieces"]] == list(range(0, 512, 64))
    problems: list[str] = []
    pieces = checkpoint_read.read_file_checked(store, "shard.distcp", expected, problems,
                                                [(70, 10), (200, 60)])
    assert isinstance(pieces, FilePieces) and not problems
    assert store.ranges == [(64, 64), (192, 128)], "whole pieces, one read per run of them"
    stream = pieces.stream()
    stream.seek(200)
    assert stream.read(60) == data[200:260]
    whole = checkpoint_read.read_file_checked(store, "shard.distcp", {
        k: v for k, v in expected.items() if k != "pieces"}, problems, [(70, 10)])
    assert whole == data and not problems, "a record without the pieces' CRC-32s: the file"


def test_a_changed_piece_is_found_when_it_is_read_and_a_short_file_is_said(shard, tmp_path):
    store, expected, data = shard
    changed = bytearray(data)
    changed[300] ^= 1
    (tmp_path / "shard.distcp").write_bytes(bytes(changed))
    problems: list[str] = []
    assert checkpoint_read.read_file_checked(store, "shard.distcp", expected, problems,
                                              [(70, 10)]) is not None, "not in a piece read"
    assert checkpoint_read.read_file_checked(store, "shard.distcp", expected, problems,
                                              [(290, 4)]) is None
    assert problems == [f"{store.describe('shard.distcp')}: checksum mismatch in bytes "
                        "256-320 (corrupt)"]
    (tmp_path / "shard.distcp").write_bytes(data[:250])
    assert checkpoint_read.read_file_checked(store, "shard.distcp", expected, problems,
                                              [(200, 60)]) is None
    assert "truncated or changed (bytes 192-320 of 512 read as 58)" in problems[-1]
