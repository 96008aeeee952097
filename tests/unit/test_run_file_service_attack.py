"""The driver's run-folder service under attack from anyone who can reach its port: a flood of
silent sockets, slow, wrong and replayed hellos, and -- from a client that holds the key --
generated requests (bad sizes and names, path traversal, truncated and oversized frames). The
service never crashes, never writes outside its folders or over the driver's files, keeps its
threads and descriptors bounded, and an honest rank beside the attack gets its files through.
A real service on loopback, in this process; the hello deadline cut to 0.5 s to keep it short."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkhvd.common import protocol
from sparkhvd.runfolder import service as service_module
from sparkhvd.runfolder.rank_files import RunFiles
from sparkhvd.runfolder.service import MAX_WAITING, RunFileService, row_copies_folder
from sparkhvd.runfolder.wire import proof

pytestmark = pytest.mark.timeout(180)

COPY = "0123456789abcdef01234567-3.arrow"  # a name a row group's copy may have


def _until(condition, what: str = "") -> None:
    """Wait for ``condition`` (``what`` it is, for a reader); the test's timeout guards it."""
    while not condition():
        time.sleep(0.01)


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A service over ``tmp_path/run`` (with the driver's own files in it) and row copies,
    beside a folder no one may write (``outside``); yields the service."""
    monkeypatch.setattr(service_module, "HELLO_TIMEOUT_S", 0.5)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text('{"status": "running"}')
    (run / "logs" / "rank-0.log").write_text("the driver's\n")
    (tmp_path / "outside").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    server = RunFileService("127.0.0.1", str(run), row_copies=row_copies_folder("attack-run"),
                            copies_budget=1 << 20).start()
    yield server
    server.stop()


def _honest(server) -> RunFiles:
    return RunFiles({protocol.FILES_ADDR_ENV: f"127.0.0.1:{server.server_address[1]}",
                     protocol.FILES_TOKEN_ENV: server.token})


def _raw(server, key=None, timeout: float = 5.0):
    """A connection (and its reader) -- proved with ``key`` when given."""
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=timeout)
    rfile = sock.makefile("rb")
    if key is not None:
        nonce = json.loads(rfile.readline())["nonce"]
        sock.sendall(json.dumps({"proof": proof(key, nonce)}).encode() + b"\n")
        assert json.loads(rfile.readline())["ok"]
    return sock, rfile


def _close(sock, rfile) -> None:
    """Close a connection: its reader holds the socket open until it is closed too."""
    rfile.close()
    sock.close()


def _closed(sock, rfile) -> bool:
    """Whether the service closed the connection (anything it sent before is skipped); False
    when it is still open 5 s on -- a hang guard, not a measure (the deadline is 0.5 s)."""
    try:
        sock.settimeout(5)
        while True:
            if not rfile.readline():
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def _files(folder) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def _honest_round_trip(server, name: str = "checkpoints/honest.pt") -> None:
    files = _honest(server)
    try:
        data = os.urandom(3000)
        files.write_bytes(name, data)
        assert files.read_bytes(name) == data
    finally:
        files.close()


def test_a_flood_of_silent_sockets_holds_no_threads_and_an_honest_rank_gets_through(served):
    before_threads = threading.active_count()
    before_fds = len(os.listdir("/proc/self/fd"))
    peaks = {"waiting": 0, "threads": 0}
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            peaks["waiting"] = max(peaks["waiting"], served.connections()[0])
            peaks["threads"] = max(peaks["threads"], threading.active_count() - before_threads)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    flood = [socket.create_connection(("127.0.0.1", served.server_address[1]))
             for _ in range(300)]
    try:
        _honest_round_trip(served)  # beside the flood
        _until(lambda: served.connections() == (0, 0), what="the flood let go")
        _until(lambda: threading.active_count() <= before_threads + 2, what="threads back")
        fds = len(os.listdir("/proc/self/fd")) - len(flood) - before_fds
        assert fds <= 4, f"the service holds {fds} descriptors after the flood"
    finally:
        watching.set()
        watcher.join()
        for sock in flood:
            sock.close()
    assert peaks["waiting"] <= MAX_WAITING and peaks["threads"] <= MAX_WAITING + 8, peaks
    assert served.refused >= 300 - MAX_WAITING


def test_slow_wrong_and_replayed_hellos_are_refused_and_said_once(served, caplog):
    slow, slow_file = _raw(served)
    slow_file.readline()  # the nonce
    try:
        for byte in b'{"proof": "':  # a byte every 0.1 s: the deadline is the hello's, whole
            slow.sendall(bytes([byte]))
            time.sleep(0.1)
    except OSError:
        pass
    assert _closed(slow, slow_file)

    wrong, wrong_file = _raw(served)
    wrong_file.readline()
    wrong.sendall(b'{"proof": "00"}\n')
    assert _closed(wrong, wrong_file)

    seen, seen_file = _raw(served)  # an honest hello, overheard
    nonce = json.loads(seen_file.readline())["nonce"]
    overheard = proof(served.token, nonce)
    seen.sendall(json.dumps({"proof": overheard}).encode() + b"\n")
    assert json.loads(seen_file.readline())["ok"]
    replay, replay_file = _raw(served)
    assert json.loads(replay_file.readline())["nonce"] != nonce
    replay.sendall(json.dumps({"proof": overheard}).encode() + b"\n")
    assert _closed(replay, replay_file)
    token, token_file = _raw(served)  # the old bearer hello: the key itself is no proof
    token_file.readline()
    token.sendall(json.dumps({"token": served.token}).encode() + b"\n")
    assert _closed(token, token_file)
    for sock, rfile in ((slow, slow_file), (wrong, wrong_file), (seen, seen_file),
                        (replay, replay_file), (token, token_file)):
        _close(sock, rfile)
    said = [r for r in caplog.records if "Refused" in r.getMessage()]
    assert served.refused >= 4 and len(said) <= 1, [r.getMessage() for r in said]
    _honest_round_trip(served)


# -- generated requests from a client that holds the key ---------------------------------
PATHS = st.one_of(
    st.sampled_from(["checkpoints/a.pt", "../outside/x", "/etc/passwd", "run.json",
                     "logs/rank-0.log", "control/stacks-request.json", "model.h5", "result.pkl",
                     "checkpoints/../../outside/y", "checkpoints/\x00z", "", ".", "..",
                     COPY, "../" + COPY, "timeline.json", "tensorboard/x/y", "checkpoints"]),
    st.text(max_size=40), st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))
SIZES = st.one_of(st.sampled_from([-1, -(1 << 40), 0, 7, 1 << 20, (1 << 40) + 1, 1 << 62]),
                  st.booleans(), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
                  st.integers(min_value=0, max_value=4096))
REQUESTS = st.fixed_dictionaries(
    {"op": st.sampled_from(["put", "get", "exists", "list", "delete", "rm", None, 3]),
     "root": st.sampled_from(["run", "resume", "row-groups", "etc", "", None]),
     "path": PATHS, "size": SIZES},
    optional={"span": st.one_of(st.lists(st.integers(-5, 1 << 40), max_size=3), st.text())})
BODIES = st.sampled_from(["exact", "short", "none", "long"])


@settings(max_examples=int(os.environ.get("SPARKHVD_ATTACK_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(REQUESTS, BODIES), min_size=1, max_size=4),
       oversized=st.booleans())
def test_generated_requests_never_crash_it_nor_write_outside_its_folders(served, requests,
                                                                         oversized):
    run, parent = served.run_path, os.path.dirname(served.run_path)
    driver_files = {k: v for k, v in _files(run).items() if k in ("run.json", "logs/rank-0.log")}
    outside = _files(os.path.join(parent, "outside"))
    sock, rfile = _raw(served, served.token)
    try:
        for request, body in requests:
            line = json.dumps(request).encode()
            sock.sendall(line + b"\n")
            size = request["size"] if type(request["size"]) is int else 0
            if request["op"] == "put" and 0 < size <= 4096 and body != "none":
                sent = {"exact": size, "short": size // 2, "long": size + 10}[body]
                sock.sendall(b"x" * sent)
                if body == "short":
                    break  # the connection ends mid-body
        if oversized:
            sock.sendall(b"{" + b" " * (1 << 17) + b"}\n")  # a frame past the line limit
    except OSError:
        pass  # the service ended the connection: what a bad request earns
    finally:
        _close(sock, rfile)
    assert served._thread.is_alive()
    _honest_round_trip(served)
    _until(lambda: served.connections() == (0, 0), what="every connection ended")
    assert {k: v for k, v in _files(run).items() if k in driver_files} == driver_files
    assert _files(os.path.join(parent, "outside")) == outside
    written = set(_files(run)) - set(driver_files)
    assert all(("/" in name or name == "timeline.json")
               and not name.startswith(("logs/", "control/")) for name in written), written
    assert not any(os.path.basename(name).startswith(".tmp-") for name in written), written
    copies = served.row_copies
    assert not os.path.isdir(copies) or set(os.listdir(copies)) <= {COPY}


def test_stop_ends_live_connections_and_nothing_is_written_after(served):
    sock, rfile = _raw(served, served.token)
    sock.sendall(json.dumps({"op": "put", "root": "run", "path": "checkpoints/latest.json",
                             "size": 100}).encode() + b"\n" + b"{" * 50)
    folder = os.path.join(served.run_path, "checkpoints")
    _until(lambda: os.path.isdir(folder) and any(n.startswith(".tmp-")
                                                 for n in os.listdir(folder)),
           what="the put began")
    served.stop()
    try:
        sock.sendall(b"}" * 50)  # the rest, after the stop
    except OSError:
        pass
    assert _closed(sock, rfile)
    _close(sock, rfile)
    _until(lambda: not os.listdir(folder), what="the partial file removed")
    with pytest.raises(PermissionError, match="ended"):
        with served.receiving("row-groups", COPY, 10) as f:
            f.write(b"x" * 10)
    assert not os.path.exists(os.path.join(served.row_copies, COPY))


def test_sizes_and_the_copies_budget_are_kept_exactly(served, tmp_path):
    served.copies_budget = 2500
    files = _honest(served)
    try:
        sock, rfile = _raw(served, served.token)
        sock.sendall(json.dumps({"op": "put", "root": "row-groups", "path": COPY,
                                 "size": -5}).encode() + b"\n")
        assert json.loads(rfile.readline())["ok"] is False and _closed(sock, rfile)
        _close(sock, rfile)
        # an upload that breaks off gives its share back
        sock, rfile = _raw(served, served.token)
        sock.sendall(json.dumps({"op": "put", "root": "row-groups", "path": COPY,
                                 "size": 2000}).encode() + b"\n" + b"x" * 100)
        _close(sock, rfile)
        _until(lambda: served._copies_held == 0 and not served._copies_coming,
               what="the broken upload's budget given back")
        local = tmp_path / "copy"
        local.write_bytes(b"y" * 2000)
        files.write_file(COPY, str(local), root="row-groups")  # fits again
        files.write_file(COPY, str(local), root="row-groups")  # the same name: counted once
        assert served._copies_held == 2000
        other = "0123456789abcdef01234567-4.arrow"
        with pytest.raises(PermissionError, match="full"):
            files.write_file(other, str(local), root="row-groups")
    finally:
        files.close()


def test_a_get_is_sent_in_bounded_pieces(served):
    data = os.urandom(5 * (1 << 20) + 17)
    path = os.path.join(served.run_path, "checkpoints", "big.pt")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(data)
    size, pieces = served.open_read("run", "checkpoints/big.pt")
    lengths = [len(p) for p in pieces]
    assert size == len(data) and sum(lengths) == size
    assert max(lengths) <= service_module.CHUNK
    files = _honest(served)
    try:
        assert files.read_bytes("checkpoints/big.pt") == data
        assert files.read_bytes("checkpoints/big.pt", span=(10, 1 << 21)) == data[10:10 + (1 << 21)]
    finally:
        files.close()


def test_the_control_channel_closes_slow_hellos_and_pushes_a_flood_out(monkeypatch):
    """The barrier launcher's control server stands on the same guard: a hello a byte at a
    time is cut at its deadline, whole; a flood of silent sockets holds at most
    ``max_waiting`` of them."""
    from sparkhvd.driver.launchers.control import ControlServer

    class Sink:
        def receive(self, msg) -> None:
            pass

    monkeypatch.setattr(ControlServer, "hello_timeout_s", 0.5)
    large = ControlServer("127.0.0.1", 100, "t", Sink(), {}, backend=None)
    large.server_close()
    assert large.max_waiting >= 100, "every task of a launch connects at once: none pushed out"
    server = ControlServer("127.0.0.1", 1, "right-token", Sink(), {}, backend=None)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        drip = socket.create_connection(server.server_address, timeout=5)
        try:
            for byte in b'{"t": "hello", "token": "right-':
                drip.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass
        drip_file = drip.makefile("rb")
        assert _closed(drip, drip_file)
        _close(drip, drip_file)
        flood = [socket.create_connection(server.server_address) for _ in range(100)]
        try:
            peak = 0
            for _ in range(50):
                peak = max(peak, server.connections()[0])
                time.sleep(0.01)
            assert peak <= server.max_waiting
            _until(lambda: server.connections() == (0, 0), what="the flood let go")
        finally:
            for sock in flood:
                sock.close()
        assert server.refused >= 100 - server.max_waiting and server.tasks == {}
    finally:
        server.end_all()
        server.shutdown()
        server.server_close()
