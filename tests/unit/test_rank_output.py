"""Rank output and reports on the driver: [rank N] lines, verbosity, noise, per-rank files, long
lines; typed reports kept apart from lines; horovod's text output mapped onto the same types."""
import logging
import threading

import pytest

from sparkhvd.common import protocol
from sparkhvd.common.protocol import Line
from sparkhvd.driver.inbox import AttemptInbox
from sparkhvd.driver.launchers.horovod_hooks import OutputStreams
from sparkhvd.driver.launchers.horovod_spark import HorovodOutput, parse_failure
from sparkhvd.driver.logs import RankLogRouter, is_noise


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


def test_horovod_chunks_are_split_into_prefixed_lines(tmp_path, shown):
    logger, lines = shown
    router = RankLogRouter("all", log_dir=str(tmp_path), logger=logger)
    output = HorovodOutput(AttemptInbox(router))
    output.stdout.write("[0]<stdout>:hello\n[1]<stdout>:wor")
    output.stdout.write("ld\n[0]<stdout>:partial")
    assert lines == ["[rank 0] hello", "[rank 1] world"]
    output.drain()
    router.close()
    assert lines[-1] == "[rank 0] partial"
    assert (tmp_path / "rank-0.log").read_text() == "hello\npartial\n"
    assert (tmp_path / "rank-1.log").read_text() == "world\n"


def test_started_event_maps_horovod_index_to_rank(tmp_path, shown):
    logger, lines = shown
    outcome = AttemptInbox(RankLogRouter("all", log_dir=str(tmp_path), logger=logger))
    output = HorovodOutput(outcome)
    started = protocol.as_text(protocol.Started(rank=1, pid=4242, host="h1"))
    output.stderr.write(f"[0]<stderr>:{started}\n")
    output.stdout.write("[0]<stdout>:from task 0\n")
    assert lines == ["[rank 1] from task 0"]
    assert outcome.pid_record() == {"rank_pids": {1: 4242}, "pids": [4242], "hosts": {1: "h1"}}


def test_rank0_verbosity_hides_other_ranks_but_not_their_errors(shown):
    logger, lines = shown
    router = RankLogRouter("rank0", logger=logger)
    for rank, tag, text in [(0, "stdout", "epoch 1"), (1, "stdout", "epoch 1"),
                            (1, "stderr", "Traceback (most recent call last):"),
                            (1, "stderr", '  File "x.py", line 1'),
                            (1, "stderr", "ValueError: boom"), (1, "stderr", "after the block")]:
        router.line(Line(rank, tag, text))
    assert lines == ["[rank 0] epoch 1", "[rank 1] Traceback (most recent call last):",
                     "[rank 1]   File \"x.py\", line 1", "[rank 1] ValueError: boom"]


def test_noise_hidden_unless_verbose(shown):
    logger, lines = shown
    noisy = ("2026-11-22 17:33:33.074970: I tensorflow/core/util/port.cc:113] oneDNN custom "
             "operations are on.")
    assert is_noise(noisy)
    assert not is_noise("Epoch 1/3")
    RankLogRouter("all", logger=logger).line(Line(0, "stderr", noisy))
    assert lines == []
    RankLogRouter("all", logger=logger, verbose=True).line(Line(0, "stderr", noisy))
    assert len(lines) == 1


def test_error_events_are_collected_not_shown(shown):
    logger, lines = shown
    outcome = AttemptInbox(RankLogRouter("all", logger=logger))
    record = protocol.Error(rank=1, exc_type="ValueError", message="boom",
                            traceback="Traceback ...", time=1.0)
    HorovodOutput(outcome).stderr.write(f"[1]<stderr>:{protocol.as_text(record)}\n")
    assert lines == []
    failure = outcome.failures[1]
    assert (failure.exc_type, failure.message, failure.traceback) == ("ValueError", "boom",
                                                                      "Traceback ...")


def test_bad_verbosity():
    with pytest.raises(ValueError, match="rank0"):
        RankLogRouter("some")


def test_rank_reannounced_after_elastic_reset_follows_the_new_rank(tmp_path, shown):
    logger, lines = shown
    outcome = AttemptInbox(RankLogRouter("rank0", log_dir=str(tmp_path), logger=logger))
    output = HorovodOutput(outcome)

    def started(idx, rank, pid):
        output.stderr.write(f"[{idx}]<stderr>:"
                            f"{protocol.as_text(protocol.Started(rank=rank, pid=pid))}\n")

    started(0, 0, 100)
    started(1, 1, 101)
    output.stdout.write("[1]<stdout>:hidden: rank 1\n")
    started(1, 0, 101)
    output.stdout.write("[1]<stdout>:step 6 size 1\n")
    assert lines == ["[rank 0] step 6 size 1"]
    assert outcome.pid_record()["rank_pids"] == {0: 101, 1: 101}
    assert outcome.pid_record()["pids"] == [100, 101]


def test_long_line_is_cut_on_the_console_and_kept_whole_in_the_log(tmp_path, shown):
    logger, lines = shown
    router = RankLogRouter("all", log_dir=str(tmp_path), logger=logger)
    pieces = ["x" * protocol.MAX_CHUNK_BYTES] * 3 + ["end"]
    for i, piece in enumerate(pieces):
        router.line(Line(0, "stdout", piece, partial=i < len(pieces) - 1))
    router.line(Line(0, "stdout", "next line"))
    router.close()
    total = 3 * protocol.MAX_CHUNK_BYTES + 3
    assert lines[0].startswith("[rank 0] xxxx") and "line cut" in lines[0]
    assert f"{total:,} characters" in lines[0] and len(lines[0]) < protocol.MAX_SHOWN_CHARS + 200
    assert lines[1] == "[rank 0] next line"
    assert (tmp_path / "rank-0.log").read_text() == "".join(pieces) + "\nnext line\n"


def test_horovod_partial_pieces_are_joined_in_the_log(tmp_path, shown):
    logger, lines = shown
    router = RankLogRouter("all", log_dir=str(tmp_path), logger=logger)
    output = HorovodOutput(AttemptInbox(router))
    output.stdout.write("[0]<stdout+>:abc\n[0]<stdout>:def\n")
    router.close()
    assert lines == ["[rank 0] abcdef"]
    assert (tmp_path / "rank-0.log").read_text() == "abcdef\n"


def test_the_end_of_a_horovod_run_waits_for_the_output_still_streaming():
    """horovod's run returns before its output threads end (a 20 MB line was cut short under
    load): the run's end waits until every stream ended, or went quiet."""
    streams = OutputStreams()
    assert streams.wait_until_done(), "nothing open: nothing to wait for"
    opened, finish, ended = threading.Event(), threading.Event(), threading.Event()

    def a_stream_still_bringing_data():
        with streams.streaming():
            opened.set()
            while not finish.wait(0.02):
                streams.received()
        ended.set()

    threading.Thread(target=a_stream_still_bringing_data, daemon=True).start()
    assert opened.wait(30)
    threading.Timer(0.3, finish.set).start()
    assert streams.wait_until_done(quiet_s=30) and ended.is_set()

    with streams.streaming():  # a stream from a host that is gone: no data, never ends
        assert not streams.wait_until_done(quiet_s=0.2)

    streams = OutputStreams()  # a rank quiet for a while before its last lines and its exit
    ended.clear()

    def a_quiet_stream_that_ends_soon():
        with streams.streaming():
            opened.set()
            finish.wait(30)
        ended.set()

    opened.clear()
    finish.clear()
    threading.Thread(target=a_quiet_stream_that_ends_soon, daemon=True).start()
    assert opened.wait(30)
    streams._last_data -= 60  # its last data a minute ago
    threading.Timer(0.3, finish.set).start()
    assert streams.wait_until_done(quiet_s=30) and ended.is_set(), "waited for it to end"


def test_elastic_process_names_are_parsed():
    failure = parse_failure(RuntimeError("... Process name: h2-93fc8a[0]\nExit code: 1\n"))
    assert failure.rank is None and failure.exit_code == 1
    failure = parse_failure(RuntimeError("Process name: 1\nExit code: 3"))
    assert (failure.rank, failure.exit_code) == (1, 3)


def test_control_server_ignores_a_connection_with_a_wrong_token(shown):
    import json
    import socket
    import threading

    from sparkhvd.driver.launchers.control import ControlServer

    logger, _ = shown
    server = ControlServer("127.0.0.1", 1, "right-token",
                           AttemptInbox(RankLogRouter("all", logger=logger)), {}, backend=None)
    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    try:
        with socket.create_connection(server.server_address, timeout=5) as sock:
            sock.sendall(json.dumps({"t": "hello", "token": "wrong", "partition": 0,
                                     "host": "h"}).encode() + b"\n")
            assert sock.recv(100) == b""  # closed without an answer
        assert server.tasks == {}
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("code,status", [(None, 0), (0, 0), (3, 3), ("bad input", 1)])
def test_sys_exit_codes_map_to_the_status_python_would_exit_with(code, status):
    assert protocol.exit_status(SystemExit(code)) == status


def test_carriage_returns_are_updates_and_newlines_end_lines():
    from sparkhvd.common.outputlines import LINE, UPDATE, OutputSplitter

    s = OutputSplitter()
    keras = "Epoch 1/2\n" + "".join(f"\r{i}/3 [..]\b\b\b" for i in range(1, 3)) + "\r3/3 [==] - loss: 1\n"
    pieces = s.feed(keras[:17]) + s.feed(keras[17:]) + s.close()
    assert pieces == [(LINE, "Epoch 1/2"), (UPDATE, ""), (UPDATE, "1/3 [..]"),
                      (UPDATE, "2/3 [..]"), (LINE, "3/3 [==] - loss: 1")]
    # "\r\n" is a newline, even split across reads
    assert s.feed("a\r") + s.feed("\nb") + s.close() == [(LINE, "a"), (LINE, "b")]


def test_progress_updates_are_drawn_live_and_only_final_states_are_kept(tmp_path, monkeypatch):
    import io

    from sparkhvd.common.protocol import Line
    from sparkhvd.driver import logs as logs_module
    from sparkhvd.driver.logs import RankLogRouter

    console = io.StringIO()
    monkeypatch.setattr(logs_module.sys, "stdout", console)
    monkeypatch.setattr(logs_module, "LIVE_INTERVAL_S", 0.0)
    router = RankLogRouter(log_dir=str(tmp_path), live=True)
    router.line(Line(0, "stdout", "1/3 [..]", update=True))
    router.line(Line(0, "stdout", "2/3 [..]", update=True))
    router.line(Line(0, "stdout", "3/3 [==] - loss: 1"))
    router.close()
    shown = console.getvalue()
    assert "\r[rank 0] 1/3 [..]" in shown and "\r[rank 0] 2/3 [..]" in shown
    assert shown.rstrip().endswith("[rank 0] 3/3 [==] - loss: 1")
    assert open(tmp_path / "rank-0.log").read() == "3/3 [==] - loss: 1\n"
    quiet = RankLogRouter(log_dir=str(tmp_path / "q"), live=False)  # a pipe, a CI log
    console.truncate(0)
    quiet.line(Line(0, "stdout", "1/3 [..]", update=True))
    quiet.close()
    assert console.getvalue() == ""


def test_a_knock_on_traceback_is_one_line_on_the_console_and_whole_in_the_log(tmp_path, shown):
    """Rank 0's collective saw its peer go: the console gets the exception line and where the
    traceback is; the rank log keeps every line. A traceback of the rank's own stays whole."""
    logger, lines = shown
    router = RankLogRouter("rank0", log_dir=str(tmp_path), logger=logger)
    knock_on = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>',
                "    dist.all_reduce(t)",
                "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:4: Connection reset by peer"]
    own = ["Traceback (most recent call last):", '  File "train.py", line 3', "KeyError: 'x'"]
    for text in knock_on + own:
        router.line(Line(0, "stderr", text))
    router.close()
    assert lines == [f"[rank 0] {knock_on[-1]} (a peer went away; traceback in "
                     "logs/rank-0.log)"] + [f"[rank 0] {text}" for text in own]
    assert open(tmp_path / "rank-0.log").read().splitlines() == knock_on + own


def test_a_traceback_cut_short_is_shown_when_the_run_ends(shown):
    logger, lines = shown
    router = RankLogRouter("rank0", logger=logger)
    router.line(Line(1, "stderr", "Traceback (most recent call last):"))
    router.line(Line(1, "stderr", '  File "train.py", line 3'))
    router.close()
    assert lines == ["[rank 1] Traceback (most recent call last):",
                     '[rank 1]   File "train.py", line 3']
