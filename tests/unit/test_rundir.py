"""The run folder as a value: what ``print(runner.last_run_dir)`` and ``open(...)`` see."""
import os

import pytest

from sparkhvd.runfolder.rundir import RunDir


def test_a_local_run_folder_reads_as_its_path(tmp_path):
    run_dir = RunDir(str(tmp_path))
    assert str(run_dir) == run_dir.path == os.fspath(run_dir)
    assert isinstance(run_dir, os.PathLike) and repr(run_dir) == f"RunDir({run_dir.path!r})"
    with open(os.path.join(run_dir, "notes.txt"), "w") as f:
        f.write("x")
    assert os.path.exists(run_dir.file("notes.txt"))


def test_a_published_remote_run_folder_is_its_url_not_a_path(tmp_path, monkeypatch):
    """Once published, the folder is only remote: str() is its URL (no secret in it), and using
    it as a local path says how to read it instead."""
    run_dir = RunDir(str(tmp_path))
    url = "abfss://runs@acct.dfs.core.windows.net/x/" + run_dir.run_id
    monkeypatch.setattr(run_dir, "remote", object())
    monkeypatch.setattr(run_dir, "url", url)
    monkeypatch.setattr(run_dir, "path", url)
    assert str(run_dir) == url
    with pytest.raises(TypeError, match="remote, not a local path.*sparkhvd.storage"):
        os.fspath(run_dir)


def test_prune_keeps_the_newest_checkpoints_by_epoch_then_step(tmp_path):
    from sparkhvd.checkpoint.stores import UrlStore, latest
    from sparkhvd.checkpoint.write import prune, write_checkpoint

    store = UrlStore(str(tmp_path))
    for epoch, step in ((1, 0), (1, 5), (1, 10), (2, 0), (2, 5)):
        name = f"e{epoch}s{step}.bin"
        write_checkpoint(store, epoch, {name: b"x" * (epoch + step)}, {"file": name}, step)
    deleted = prune(store, 2)
    assert deleted == ["epoch-0001-step-0000010.json", "epoch-0001-step-0000005.json",
                       "epoch-0001.json"]
    assert sorted(os.listdir(tmp_path)) == ["e2s0.bin", "e2s5.bin", "epoch-0002-step-0000005.json",
                                            "epoch-0002.json", "latest.json"]
    assert latest(store)["file"] == "e2s5.bin"
    assert prune(store, 0) == ["epoch-0002.json"], "the newest always stays"


def test_the_resume_line_numbers_epochs_as_the_checkpoint_files_do(tmp_path, capsys,
                                                                   monkeypatch):
    """epoch-0001-step-0000040 is step 40 of the loop's epoch 1; epoch-0002 (written when
    epoch 1 ended) continues at the loop's epoch 2: the line says the same numbers."""
    from sparkhvd.checkpoint.lineage import checkpoint_name
    from sparkhvd.checkpoint.read import announce_resume
    from sparkhvd.checkpoint.stores import UrlStore
    from sparkhvd.common import events

    monkeypatch.setattr(events, "emit", lambda msg: None)
    store = UrlStore(str(tmp_path))
    announce_resume(store, f"{checkpoint_name(1, 40)}.pt", 1, step=40)
    announce_resume(store, f"{checkpoint_name(2, 0)}.pt", 2)
    mid, end = capsys.readouterr().out.splitlines()
    assert mid.endswith("epoch-0001-step-0000040.pt; continuing at epoch 1 after its step 40")
    assert end.endswith("epoch-0002.pt; continuing at epoch 2")


def test_a_relaunch_resumes_from_the_users_checkpoint_url_and_a_first_attempt_does_not(
        tmp_path, monkeypatch):
    """``url=`` checkpoints are out of the driver's sight: a relaunch of the run (attempt 2 on)
    resumes from them with the default ``resume=None``; the first attempt starts fresh. A
    relaunch with nothing there takes what the driver asked -- and when it asked nothing, its
    own folder still (the ranks' hosts may keep what the folder does not have yet)."""
    from sparkhvd.checkpoint.read import resume_store
    from sparkhvd.checkpoint.stores import UrlStore
    from sparkhvd.checkpoint.write import write_checkpoint
    from sparkhvd.common import protocol

    own = UrlStore(str(tmp_path / "ckpt"))
    empty = UrlStore(str(tmp_path / "none"))
    write_checkpoint(own, 1, {"epoch-0001.pt": b"x"}, {"file": "epoch-0001.pt"})
    monkeypatch.delenv(protocol.RESUME_URL_ENV, raising=False)
    monkeypatch.setenv(protocol.ATTEMPT_ENV, "1")
    assert resume_store(None, own) is None
    monkeypatch.setenv(protocol.ATTEMPT_ENV, "2")
    assert resume_store(None, own) is own
    assert resume_store(False, own) is None
    assert resume_store(None, empty) is empty
    monkeypatch.setenv(protocol.RESUME_URL_ENV, "file:///earlier/checkpoints")
    assert resume_store(None, empty).label == "file:///earlier/checkpoints"
    assert resume_store(None, own) is own


def test_a_resume_reads_the_newest_record_not_every_record_of_the_folder(tmp_path):
    """A run that saved every step keeps a record per step: the resume reads latest.json and
    what it names (and an older one only when the newer is bad), not all of them."""
    from sparkhvd.checkpoint.read import restore_newest
    from sparkhvd.checkpoint.stores import UrlStore
    from sparkhvd.checkpoint.write import write_checkpoint

    class Counting(UrlStore):
        reads: list = []

        def read(self, name):
            self.reads.append(name)
            return super().read(name)

    store = Counting(str(tmp_path))
    for step in range(1, 201):
        name = f"epoch-0000-step-{step:07d}.pt"
        write_checkpoint(store, 0, {name: b"x" * step}, {"file": name}, step)
    store.reads.clear()
    record, loaded, problems = restore_newest(store, lambda r, files: len(files[r["file"]]))
    assert (record["step"], loaded, problems) == (200, 200, [])
    assert len(store.reads) == 2, store.reads  # latest.json, then the file it names
    os.unlink(tmp_path / "epoch-0000-step-0000200.pt")  # the newest is gone: the one before
    record, loaded, problems = restore_newest(store, lambda r, files: len(files[r["file"]]))
    assert (record["step"], loaded) == (199, 199) and "missing" in problems[0]


def test_prune_never_deletes_the_checkpoint_latest_json_names(tmp_path):
    """However the checkpoints' names order, the one committed last (what a relaunch resumes
    from) is never pruned: keep=1 after a newer-named record is left behind by a failure."""
    from sparkhvd.checkpoint.stores import UrlStore, latest
    from sparkhvd.checkpoint.write import prune, write_checkpoint

    store = UrlStore(str(tmp_path))
    write_checkpoint(store, 1, {"s40.bin": b"x" * 40}, {"file": "s40.bin"}, 40)
    write_checkpoint(store, 1, {"s35.bin": b"x" * 35}, {"file": "s35.bin"}, 35)  # committed last
    assert prune(store, 1) == []
    assert latest(store)["file"] == "s35.bin" and os.path.exists(tmp_path / "s35.bin")


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    """A sweep starts runs in the same second: each gets its own id and folder, made
    exclusively -- an id drawn twice is drawn again, and a run id given that exists is
    refused -- so no two runs share a folder, host copies or row cache."""
    import sparkhvd.runfolder.rundir as rundir

    runs = [RunDir(str(tmp_path)) for _ in range(40)]
    assert len({r.run_id for r in runs}) == len({r.path for r in runs}) == 40
    drawn = iter(["20261207-120000-aaaaaaaa", "20261207-120000-aaaaaaaa",
                  "20261207-120000-bbbbbbbb"])
    monkeypatch.setattr(rundir, "new_run_id", lambda: next(drawn))
    first, second = RunDir(str(tmp_path)), RunDir(str(tmp_path))
    assert (first.run_id, second.run_id) == ("20261207-120000-aaaaaaaa",
                                             "20261207-120000-bbbbbbbb")
    with pytest.raises(FileExistsError, match="already exists"):
        RunDir(str(tmp_path), run_id=first.run_id)


def test_a_save_prunes_reading_no_more_than_its_own_record(tmp_path):
    """keep=2 over 60 saves: pruning reads no record this process committed (it knows their
    files); a later process reads an earlier one's record once, when it prunes it."""
    from sparkhvd.checkpoint.stores import UrlStore
    from sparkhvd.checkpoint.write import prune, write_checkpoint

    class Counting(UrlStore):
        def __init__(self, url):
            super().__init__(url)
            self.reads = []

        def read(self, name):
            self.reads.append(name)
            return super().read(name)

    store = Counting(str(tmp_path))
    for step in range(1, 61):
        name = f"epoch-0000-step-{step:07d}.pt"
        write_checkpoint(store, 0, {name: b"x"}, {"file": name}, step)
        prune(store, 2)
    assert store.reads == [] and len(os.listdir(tmp_path)) == 2 * 2 + 1  # + latest.json
    later = Counting(str(tmp_path))  # a relaunch: its first save prunes an earlier one's
    write_checkpoint(later, 0, {"epoch-0000-step-0000061.pt": b"x"},
                     {"file": "epoch-0000-step-0000061.pt"}, 61)
    assert prune(later, 2) == ["epoch-0000-step-0000059.json"]
    assert later.reads == ["epoch-0000-step-0000059.json"]
