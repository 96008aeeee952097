"""Rank output routing: parsing, [rank N] prefixes, verbosity, noise, per-rank files."""
import json
import logging

import pytest

from sparkhvd.logs import RankLogRouter, is_noise
from sparkhvd.rank import ERROR_MARKER, RANK_MARKER


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def shown():
    logger = logging.getLogger("test.sparkhvd.ranks")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = _ListHandler()
    logger.addHandler(handler)
    yield logger, handler.lines
    logger.removeHandler(handler)


def test_chunks_are_split_into_prefixed_lines(tmp_path, shown):
    logger, lines = shown
    router = RankLogRouter("all", log_dir=str(tmp_path), logger=logger)
    router.stdout.write("[0]<stdout>:hello\n[1]<stdout>:wor")
    router.stdout.write("ld\n[0]<stdout>:partial")
    assert lines == ["[rank 0] hello", "[rank 1] world"]
    router.close()
    assert lines[-1] == "[rank 0] partial"
    assert (tmp_path / "rank-0.log").read_text() == "hello\npartial\n"
    assert (tmp_path / "rank-1.log").read_text() == "world\n"


def test_marker_maps_task_index_to_rank(tmp_path, shown):
    logger, lines = shown
    router = RankLogRouter("all", log_dir=str(tmp_path), logger=logger)
    router.stdout.write(f"[0]<stdout>:{RANK_MARKER} 1\n[1]<stdout>:{RANK_MARKER} 0\n")
    router.stdout.write("[0]<stdout>:from task 0\n")
    assert lines == ["[rank 1] from task 0"]


def test_rank0_verbosity_hides_other_ranks_but_not_their_errors(shown):
    logger, lines = shown
    router = RankLogRouter("rank0", logger=logger)
    router.stdout.write("[0]<stdout>:epoch 1\n[1]<stdout>:epoch 1\n")
    router.stderr.write("[1]<stderr>:Traceback (most recent call last):\n"
                        "[1]<stderr>:  File \"x.py\", line 1\n"
                        "[1]<stderr>:ValueError: boom\n"
                        "[1]<stderr>:after the block\n")
    assert lines == ["[rank 0] epoch 1", "[rank 1] Traceback (most recent call last):",
                     "[rank 1]   File \"x.py\", line 1", "[rank 1] ValueError: boom"]


def test_noise_hidden_unless_verbose(shown):
    logger, lines = shown
    noisy = ("2026-11-22 17:33:33.074970: I tensorflow/core/util/port.cc:113] oneDNN custom "
             "operations are on.")
    assert is_noise(noisy)
    assert not is_noise("Epoch 1/3")
    RankLogRouter("all", logger=logger).stderr.write(f"[0]<stderr>:{noisy}\n")
    assert lines == []
    RankLogRouter("all", logger=logger, verbose=True).stderr.write(f"[0]<stderr>:{noisy}\n")
    assert len(lines) == 1


def test_error_records_are_collected_not_shown(shown):
    logger, lines = shown
    router = RankLogRouter("all", logger=logger)
    record = json.dumps({"rank": 1, "type": "ValueError", "message": "boom",
                         "traceback": "Traceback ...", "time": 1.0})
    router.stderr.write(f"[1]<stderr>:{ERROR_MARKER} {record}\n")
    assert lines == []
    failure = router.failures[1]
    assert (failure.exc_type, failure.message, failure.traceback) == ("ValueError", "boom",
                                                                      "Traceback ...")


def test_bad_verbosity():
    with pytest.raises(ValueError, match="rank0"):
        RankLogRouter("some")


def test_rank_reannounced_after_elastic_reset_follows_the_new_rank(tmp_path, shown):
    logger, lines = shown
    router = RankLogRouter("rank0", log_dir=str(tmp_path), logger=logger)
    router.stdout.write(f"[0]<stdout>:{RANK_MARKER} 0 100\n[1]<stdout>:{RANK_MARKER} 1 101\n")
    router.stdout.write("[1]<stdout>:hidden: rank 1\n")
    router.stdout.write(f"[1]<stdout>:{RANK_MARKER} 0 101\n[1]<stdout>:step 6 size 1\n")
    assert lines == ["[rank 0] step 6 size 1"]
    assert router.pid_record() == {"rank_pids": {0: 101, 1: 101}, "pids": [100, 101]}


def test_control_server_ignores_a_connection_with_a_wrong_token(shown):
    import socket

    from sparkhvd.barrier import ControlServer

    logger, _ = shown
    server = ControlServer("127.0.0.1", 1, "right-token", RankLogRouter("all", logger=logger),
                           {}, rendezvous=None)
    import threading
    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    try:
        with socket.create_connection(server.server_address, timeout=5) as sock:
            sock.sendall(json.dumps({"token": "wrong", "partition": 0, "host": "h"}).encode()
                         + b"\n")
            assert sock.recv(100) == b""  # closed without an answer
        assert server.tasks == {}
    finally:
        server.shutdown()
        server.server_close()
