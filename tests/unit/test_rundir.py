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
    from sparkhvd.runfolder.checkpoint_store import UrlStore, latest, prune, write_checkpoint

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
