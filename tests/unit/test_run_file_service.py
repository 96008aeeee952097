"""The driver's run-folder service as a rank on another host meets it: a part of a large file,
from the run folder and from the checkpoints the run resumes from, without the rest; the run's
row-group copies."""
from __future__ import annotations

import os

import pytest

from sparkhvd.checkpoint.stores import RunFolderStore
from sparkhvd.common import protocol
from sparkhvd.runfolder.rank_files import RunFiles
from sparkhvd.runfolder.service import RunFileService


@pytest.fixture
def service(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "earlier").mkdir()
    server = RunFileService("127.0.0.1", str(tmp_path / "run"),
                            resume=(str(tmp_path / "earlier"), {})).start()
    yield server
    server.stop()


def test_a_rank_reads_a_range_of_a_file_in_either_folder_through_the_service(service, tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "run" / "shard.distcp").write_bytes(data)
    (tmp_path / "earlier" / "shard.distcp").write_bytes(data[::-1])
    files = RunFiles({**service.env(), protocol.RUN_URL_ENV: ""})  # a rank on another host
    assert files.read_bytes("shard.distcp", span=(100, 20)) == data[100:120]
    assert files.read_bytes("shard.distcp", root="resume", span=(1000, 50)) == data[::-1][1000:]
    resumed = RunFolderStore("resume")
    resumed.files = files
    assert resumed.read_range("shard.distcp", 0, 8) == data[::-1][:8]
    with pytest.raises(PermissionError, match="bad byte range"):
        files.read_bytes("shard.distcp", span=(-1, 5))
    files.close()


def test_the_driver_keeps_one_copy_of_each_row_group_in_its_budget_and_only_copies(tmp_path):
    """Root ``row-groups``: a copy sent twice is kept once; a name that is not a row group's,
    or a path out of the folder, is refused; past the budget the copies are refused (the rank
    stops sending); a copy not there is missing; the run's end removes them."""
    from sparkhvd.runfolder.rank_files import DriverRowCopies
    from sparkhvd.runfolder.service import remove_row_copies, row_copies_folder

    run_id = f"run-{tmp_path.name}"
    folder = row_copies_folder(run_id)
    server = RunFileService("127.0.0.1", str(tmp_path), row_copies=folder,
                            copies_budget=2500).start()
    try:
        copies = DriverRowCopies(RunFiles({**server.env(), protocol.RUN_URL_ENV: ""}))
        name = "0123456789abcdef01234567-7.arrow"
        kept = tmp_path / "kept.arrow"
        kept.write_bytes(b"a" * 1000)
        copies.put(name, str(kept))
        kept.write_bytes(b"b" * 1000)
        copies.put(name, str(kept))  # another rank's copy of the same row group: not twice
        assert copies.get(name) == b"a" * 1000
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
        with pytest.raises(PermissionError, match="not the name of a row group"):
            copies.put("notes.txt", str(kept))
        with pytest.raises(ValueError, match="outside"):  # refused before it is sent
            copies.put("../0123456789abcdef01234567-7.arrow", str(kept))
        copies.put("0123456789abcdef01234567-8.arrow", str(kept))
        with pytest.raises(PermissionError, match="full"):
            copies.put("0123456789abcdef01234567-9.arrow", str(kept))
        with pytest.raises(FileNotFoundError):
            copies.get("0123456789abcdef01234567-9.arrow")
        copies.files.close()
    finally:
        server.stop()
    remove_row_copies(run_id)
    assert not os.path.exists(folder)


def test_copies_a_dead_driver_left_are_removed_by_the_next_run_s(tmp_path):
    """A driver that died kept its run's copies: the next run's service removes them at its
    first copy; a live driver's stay."""
    import subprocess
    import sys

    from sparkhvd.runfolder.rank_files import DriverRowCopies
    from sparkhvd.runfolder.service import remove_row_copies, row_copies_folder

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    base = os.path.dirname(row_copies_folder("any"))
    os.makedirs(base, mode=0o700, exist_ok=True)
    left, live = os.path.join(base, f"run-left-{gone}"), os.path.join(base, "run-live-1")
    for folder in (left, live):
        os.makedirs(folder, exist_ok=True)
    run_id = f"run-{tmp_path.name}"
    server = RunFileService("127.0.0.1", str(tmp_path), row_copies=row_copies_folder(run_id))
    server.start()
    try:
        (tmp_path / "kept.arrow").write_bytes(b"x")
        copies = DriverRowCopies(RunFiles({**server.env(), protocol.RUN_URL_ENV: ""}))
        copies.put("0123456789abcdef01234567-1.arrow", str(tmp_path / "kept.arrow"))
        copies.files.close()
    finally:
        server.stop()
        remove_row_copies(run_id)
    assert not os.path.exists(left) and os.path.isdir(live)  # pid 1 is alive
    os.rmdir(live)


def test_keep_prunes_through_the_service_from_another_host(service, tmp_path):
    """Rank 0 on another host than the run folder: keep=2 deletes the older checkpoints
    through the driver's service (a sharded one's folder too), and the service deletes only
    files of the run's checkpoints -- nothing else of the run folder, nothing outside it, no
    folder, nothing of the run resumed."""
    from sparkhvd.checkpoint.write import prune, write_checkpoint

    store = RunFolderStore("run")
    store.files = RunFiles({**service.env(), protocol.RUN_URL_ENV: ""})  # another host
    for epoch in range(1, 6):
        write_checkpoint(store, epoch, {f"epoch-{epoch:04d}.pt": b"x" * epoch,
                                        f"epoch-{epoch:04d}/__0_0.distcp": b"y"},
                         {"file": f"epoch-{epoch:04d}.pt"})
        prune(store, 2)
    left = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    assert left == ["epoch-0004", "epoch-0004.json", "epoch-0004.pt", "epoch-0005",
                    "epoch-0005.json", "epoch-0005.pt", "latest.json"]
    (tmp_path / "run" / "run.json").write_text("{}")
    for path, root in (("run.json", "run"), ("checkpoints/../run.json", "run"),
                       ("checkpoints/epoch-0005", "run"), ("../earlier/x", "run"),
                       ("checkpoints/epoch-0005.pt", "resume")):
        with pytest.raises((PermissionError, OSError)):
            store.files._request({"op": "delete", "root": root, "path": path})
    assert (tmp_path / "run" / "run.json").exists()
    assert (tmp_path / "run" / "checkpoints" / "epoch-0005" / "__0_0.distcp").exists()
    store.files.close()
