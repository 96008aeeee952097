"""The newest checkpoint kept on the writing rank's host, and restoring from the nearest copy
(sparkhvd.checkpoint.host_copy, sparkhvd.checkpoint.nearest_copy): real files, real torch.save, and
two real processes in a gloo group for a copy sent from the rank that has it."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zlib
from typing import Optional

import pytest

import preloaded
from sparkhvd.checkpoint import host_copy
from sparkhvd.common import protocol
from sparkhvd.common.function_end import function_ended

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def run_env(tmp_path, monkeypatch):
    """A run id and a host-copy folder, as a sparkhvd rank has them; the checkpoint folders
    in ``tmp_path`` count as remote ones (``abfss://``, a run folder on the driver's host),
    for which a host copy is kept."""
    from sparkhvd.checkpoint.stores import UrlStore

    monkeypatch.setenv(protocol.RUN_ID_ENV, "20261126-run")
    monkeypatch.setenv(host_copy.DIR_ENV, str(tmp_path / "host-a"))
    monkeypatch.setattr(UrlStore, "on_this_host", property(lambda self: False))
    return tmp_path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _one_copy():
    """This host's copy of a one-file checkpoint file (None: none kept), not a memory
    snapshot."""
    copies = {k: v for k, v in host_copy.find_all().items() if not k.endswith(".snapshot")}
    assert len(copies) <= 1, copies
    return next(iter(copies.values()), None)


def _damage(copy, how: str) -> None:
    """Delete a host copy, or overwrite 64 bytes in its middle."""
    if how == "deleted":
        os.unlink(copy.path)
    else:
        with open(copy.path, "r+b") as f:
            f.seek(copy.size // 2)
            f.write(b"\0" * 64)


def _keep(file: str, data: bytes, sha256=None):
    """Keep a one-file checkpoint; its copy, or None when it was not kept."""
    return host_copy.keep({file: (data, sha256 or _sha(data))}).get(file)


def test_the_records_every_rank_gathers_leave_out_the_pieces_only_a_folder_read_checks(
        run_env):
    """A sharded checkpoint's record keeps the CRC-32 of every item of every rank's file
    (thousands); a relaunch gathers every rank's kept records, so they are kept without them
    -- written so, not only left out when read."""
    data = b"shard" * 50
    record = {"epoch": 1, "step": 0, "file": "epoch-0001", "files": {
        "epoch-0001/__0_0.distcp": {"size": len(data), "sha256": _sha(data),
                                    "pieces": [[0, 1], [100, 2]], "rank": 0}}}
    host_copy.keep({"epoch-0001/__0_0.distcp": (data, _sha(data))}, record, "the folder")
    kept = {**record, "files": {
        "epoch-0001/__0_0.distcp": {"size": len(data), "sha256": _sha(data), "rank": 0}}}
    assert host_copy.records("the folder") == [kept]
    on_disk = [json.loads(p.read_text()) for p in run_env.rglob("host-copy.json")]
    assert [meta["record"] for meta in on_disk] == [kept]
    assert record["files"]["epoch-0001/__0_0.distcp"]["pieces"]  # the caller's is untouched


def test_only_the_newest_copy_is_kept_and_it_is_checked_when_read(run_env):
    first = _keep("epoch-0001.pt", b"one" * 100)
    second = _keep("epoch-0002.pt", b"two" * 100)
    assert first is not None and second is not None
    assert not os.path.exists(first.path)  # the older copy goes once the newer one is in
    found = _one_copy()
    assert found == second and found.read() == b"two" * 100
    view = found.read(mapped=True)  # the file mapped into memory, checked the same way
    assert isinstance(view, memoryview) and view == b"two" * 100
    view.release()
    with open(found.path, "r+b") as f:
        f.write(b"X")
    for mapped in (False, True):
        with pytest.raises(ValueError, match="corrupt"):
            found.read(mapped)
    os.truncate(found.path, 10)
    for mapped in (False, True):
        with pytest.raises(ValueError, match="truncated"):
            found.read(mapped)
    os.unlink(found.path)
    for mapped in (False, True):
        with pytest.raises(ValueError, match="unreadable"):
            found.read(mapped)


def test_a_copy_over_the_budget_is_not_kept_and_said_once(run_env, monkeypatch, capsys):
    _keep("epoch-0001.pt", b"small")
    monkeypatch.setattr(host_copy, "FREE_SHARE", 1e-15)
    assert _keep("epoch-0002.pt", b"big" * 1000, "x") is None
    assert _keep("epoch-0003.pt", b"big" * 1000, "x") is None
    assert _one_copy() is None  # the older copy went too: never a stale one
    said = [line for line in capsys.readouterr().out.splitlines() if "no host copy" in line]
    assert len(said) == 1 and host_copy.DIR_ENV in said[0]


def test_no_copy_outside_a_run_and_the_folder_goes_when_the_function_returns(
        run_env, monkeypatch):
    from sparkhvd.common.function_end import at_function_return

    _keep("epoch-0001.pt", b"data")
    at_function_return(host_copy.clean)
    function_ended(returned=False)  # raised: a relaunch may want the copy
    assert _one_copy() is not None
    at_function_return(host_copy.clean)
    function_ended()
    assert _one_copy() is None and not os.path.exists(host_copy.folder())
    monkeypatch.delenv(protocol.RUN_ID_ENV)
    assert _keep("epoch-0001.pt", b"data") is None


def test_a_folder_a_failed_run_left_is_deleted_a_day_later(run_env):
    """A run folder whose rank folders were touched within the day is live (a long run saves
    into rank-0/, which does not touch the run's own folder)."""
    stale = os.path.join(host_copy.base_folder(), "old-run")
    fresh = os.path.join(host_copy.base_folder(), "other-live-run")
    saving = os.path.join(host_copy.base_folder(), "long-run-still-saving")
    assert host_copy.private_base()  # what the failed run made: the user's own, 0700
    for folder in (stale, fresh, os.path.join(stale, "rank-0"), os.path.join(saving, "rank-0")):
        os.makedirs(folder)
    for folder in (os.path.join(stale, "rank-0"), stale, saving):
        os.utime(folder, (0, 0))
    _keep("epoch-0001.pt", b"data")
    assert not os.path.exists(stale) and os.path.exists(fresh) and os.path.exists(saving)


@pytest.mark.parametrize("made", ["open to others", "a link"])
def test_a_folder_others_can_write_is_never_used(run_env, made, capsys, monkeypatch):
    """Host copies are pickles: a base folder someone else could have made or could write in
    (mode 0777, or a link to elsewhere) is neither written nor read -- said once, with the fix
    -- and the run folder is read instead. The folder sparkhvd makes is 0700."""
    base = host_copy.base_folder()
    elsewhere = os.path.join(os.path.dirname(base), "elsewhere")
    os.makedirs(elsewhere, mode=0o700)
    if made == "a link":
        os.symlink(elsewhere, base)
    else:
        os.makedirs(base)
        os.chmod(base, 0o777)
    assert _keep("epoch-0001.pt", b"data") is None and host_copy.find_all() == {}
    said = [line for line in capsys.readouterr().out.splitlines() if "no host copy" in line]
    assert len(said) == 1 and "not a folder only this user can write" in said[0], said
    assert host_copy.DIR_ENV in said[0]
    assert os.listdir(elsewhere) == [] and not os.listdir(base)
    monkeypatch.setattr(host_copy.STORE, "_private", set())
    if made == "a link":
        os.unlink(base)
    else:
        os.rmdir(base)
    assert _keep("epoch-0001.pt", b"data") is not None
    assert os.stat(base).st_mode & 0o777 == 0o700


def test_a_killed_ranks_spool_and_upload_hold_go_with_the_next_processs_first_save(run_env):
    """A rank SIGKILLed mid-save leaves its spool, or the hold its upload read from (each as
    big as the checkpoint), in its folder: named by its process, they go once it is gone."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    rank_folder = os.path.join(host_copy.folder(), "rank-0")
    os.makedirs(rank_folder)
    left = [os.path.join(rank_folder, f"sparkhvd-spool-{ended.pid}-epoch-0001.pt{tail}")
            for tail in ("", ".upload")]
    live = os.path.join(rank_folder, f"sparkhvd-spool-{os.getpid()}-epoch-0000.pt.upload")
    for path in (*left, live):
        with open(path, "wb") as f:
            f.write(b"torn")
        os.utime(path, (0, 0))
    assert _keep("epoch-0002.pt", b"data") is not None
    assert [os.path.exists(path) for path in (*left, live)] == [False, False, True]


# -- a checkpoint of several files (Keras: the model and the optimizer's) -------------------
def _two_file_checkpoint(tmp_path, epoch: int):
    """A Keras-shaped checkpoint (model file, optimizer file) written to a folder that counts
    as remote, and kept on this host as its writer keeps it."""
    from sparkhvd.checkpoint.stores import UrlStore
    from sparkhvd.checkpoint.write import write_checkpoint

    store = UrlStore(str(tmp_path / "ckpt"))
    files = {f"epoch-000{epoch}.h5": b"model %d" % epoch * 50,
             f"epoch-000{epoch}.optimizer.npz": b"adam %d" % epoch * 50}
    record = write_checkpoint(store, epoch, files, {"file": f"epoch-000{epoch}.h5"})
    kept = host_copy.keep({n: (d, record["files"][n]["sha256"]) for n, d in files.items()})
    return store, files, kept


def test_a_checkpoint_of_several_files_is_kept_whole_and_replaced_whole(run_env):
    _, _, first = _two_file_checkpoint(run_env, 1)
    _, files, second = _two_file_checkpoint(run_env, 2)
    assert set(second) == set(files) == set(host_copy.find_all())
    assert not any(os.path.exists(c.path) for c in first.values()), "the older set goes"
    assert all(host_copy.find_all()[n].read() == data for n, data in files.items())


def _load(record, files):
    return dict(files)


def _alone(store):
    """The nearest-copy restore of a run of one rank."""
    from sparkhvd.checkpoint import nearest_copy

    return nearest_copy.load_nearest(store, _load, 0, nearest_copy.Alone())


def test_the_nearby_restore_reads_this_hosts_copy_and_says_so(run_env):
    store, files, _ = _two_file_checkpoint(run_env, 1)
    for name in files:  # the folder's files are gone: only the host copy can give them
        os.unlink(str(run_env / "ckpt" / name))
    record, loaded, problems, copy = _alone(store)
    assert (record["epoch"], loaded, problems, copy) == (1, files, [], "host")


@pytest.mark.parametrize("damage", ["corrupt", "deleted", "stale"])
def test_the_nearby_restore_falls_back_to_the_folder_with_a_warning(run_env, damage):
    from sparkhvd.checkpoint.write import write_checkpoint

    store, files, kept = _two_file_checkpoint(run_env, 1)
    optimizer = kept["epoch-0001.optimizer.npz"].path
    if damage == "corrupt":
        with open(optimizer, "r+b") as f:
            f.write(b"X")
    elif damage == "deleted":
        os.unlink(optimizer)
    else:  # a newer checkpoint whose copy was not kept (over the budget, another host)
        files = {"epoch-0002.h5": b"newer", "epoch-0002.optimizer.npz": b"newer adam"}
        write_checkpoint(store, 2, files, {"file": "epoch-0002.h5"})
    record, loaded, problems, copy = _alone(store)
    assert loaded == files and copy == "folder"
    if damage == "stale":
        assert record["epoch"] == 2 and problems == [], "a copy of another checkpoint: unused"
    else:
        assert record["epoch"] == 1 and len(problems) == 1
        assert "host copy" in problems[0] and "instead" in problems[0], problems


# -- st.Checkpoints restoring from the nearest copy (torch) ----------------------------------
def _model_and_opt(torch, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.zero_grad()
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    return model, opt


def _saved_run(torch, tmp_path):
    """A checkpoint folder and rank 0's host copy of it, as a run left them."""
    import sparkhvd.torch as st

    model, opt = _model_and_opt(torch, seed=0)
    ckpt = st.Checkpoints(model, opt, url=str(tmp_path / "ckpt"), resume=False)
    ckpt.save(0, seen=5)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _names_a_copy(line: str) -> bool:
    return "(its copy on this host)" in line or "another rank's host copy" in line


def _restored(torch, tmp_path, capsys):
    import sparkhvd.torch as st

    model, opt = _model_and_opt(torch, seed=1)
    ckpt = st.Checkpoints(model, opt, url=str(tmp_path / "ckpt"), resume=True)
    epoch = ckpt.restore()
    lines = [line for line in capsys.readouterr().out.splitlines() if "resume:" in line]
    return model, ckpt, epoch, lines


def test_no_host_copy_is_kept_of_a_folder_on_this_hosts_disk(tmp_path, monkeypatch):
    """A local checkpoint folder is the nearest copy already: nothing is written twice."""
    torch = pytest.importorskip("torch")
    from sparkhvd.checkpoint.stores import UrlStore

    monkeypatch.setenv(protocol.RUN_ID_ENV, "20261126-run")
    monkeypatch.setenv(host_copy.DIR_ENV, str(tmp_path / "host-a"))
    assert UrlStore(str(tmp_path)).on_this_host and UrlStore(f"file://{tmp_path}").on_this_host
    assert not UrlStore("abfss://c@a.dfs.core.windows.net/x").on_this_host
    _saved_run(torch, tmp_path)
    assert _one_copy() is None


def test_a_relaunch_on_the_same_host_reads_the_host_copy(run_env, capsys):
    torch = pytest.importorskip("torch")
    saved = _saved_run(torch, run_env)
    assert _one_copy() is not None and _one_copy().file == "epoch-0001.pt"
    model, ckpt, epoch, lines = _restored(torch, run_env, capsys)
    assert epoch == 1 and ckpt.restored["seen"] == 5
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert "its copy on this host" in lines[-1], lines


def test_a_torch_restore_reads_this_hosts_copy_in_place(run_env, capsys, monkeypatch):
    """No copy of the file in memory before torch reads it: the restore loads from a view of
    the host copy mapped into memory (0.9 s of a 1 GB restore's 2.5 s on one rank here)."""
    torch = pytest.importorskip("torch")
    from sparkhvd.torch import checkpoints as torch_checkpoints

    saved = _saved_run(torch, run_env)
    given = []
    load_state = torch_checkpoints.load_state
    monkeypatch.setattr(torch_checkpoints, "load_state",
                        lambda data, device, *args, **kwargs: given.append(type(data))
                        or load_state(data, device, *args, **kwargs))
    model, _, epoch, lines = _restored(torch, run_env, capsys)
    assert given == [memoryview] and "its copy on this host" in lines[-1], (given, lines)
    assert epoch == 1 and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_a_bad_host_copy_is_said_and_the_checkpoint_folder_is_read(run_env, capsys, damage):
    torch = pytest.importorskip("torch")
    saved = _saved_run(torch, run_env)
    _damage(_one_copy(), damage)
    model, ckpt, epoch, lines = _restored(torch, run_env, capsys)
    assert epoch == 1 and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert any("WARNING" in line and "host copy" in line for line in lines), lines
    assert lines[-1].startswith("resume: restored") and not _names_a_copy(lines[-1]), lines


def test_a_stale_host_copy_is_never_used(run_env, capsys):
    """The folder's newest checkpoint is newer than the host's copy (it was not kept)."""
    torch = pytest.importorskip("torch")
    import sparkhvd.torch as st

    _saved_run(torch, run_env)
    model, opt = _model_and_opt(torch, seed=2)
    newer = st.Checkpoints(model, opt, url=str(run_env / "ckpt"), resume=False,
                           host_copy=False)
    newer.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model, _, epoch, lines = _restored(torch, run_env, capsys)
    assert epoch == 2 and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert not _names_a_copy(lines[-1]), lines


_RANK = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import sparkhvd.torch as st
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}",
                            rank=int(os.environ["RANK"]), world_size=2)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = st.Checkpoints(model, opt, url=sys.argv[1], resume=True)
    epoch = ckpt.restore()
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    with open(sys.argv[2], "w") as f:
        json.dump({"epoch": epoch, "state": state}, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as a sparkhvd rank leaves: torch 2.13's gloo may abort in the teardown
""")


def _two_ranks(tmp_path, host_dirs: list[str]) -> list[dict]:
    """Two real ranks in a gloo group (met through a file: no port to race for), each with its
    own host-copy folder (its "host"); forked with torch imported (tests/preloaded.py)."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    envs = [{**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "SPARKHVD_RANK": str(rank),
             "SPARKHVD_SIZE": "2", host_copy.DIR_ENV: folder,
             protocol.RUN_ID_ENV: "20261126-run"} for rank, folder in enumerate(host_dirs)]
    ends = preloaded.run_ranks(
        str(script), [[str(tmp_path / "ckpt"), str(tmp_path / f"r{rank}"),
                       str(tmp_path / "rendezvous")] for rank in range(len(host_dirs))],
        envs, [str(tmp_path / f"r{rank}.out") for rank in range(len(host_dirs))])
    assert [status for status, _ in ends] == [0, 0], [out for _, out in ends]
    return [{**json.loads((tmp_path / f"r{rank}").read_text()), "out": out}
            for rank, (_, out) in enumerate(ends)]


def _as_lists(state) -> dict:
    return {k: v.tolist() for k, v in state.items()}


def test_a_rank_on_a_new_host_gets_the_copy_from_the_rank_that_has_it(run_env):
    torch = pytest.importorskip("torch")
    saved = _as_lists(_saved_run(torch, run_env))
    ranks = _two_ranks(run_env, [str(run_env / "host-b"), str(run_env / "host-a")])
    assert [r["epoch"] for r in ranks] == [1, 1]
    assert ranks[0]["state"] == saved and ranks[1]["state"] == saved
    resume = [line for line in ranks[0]["out"].splitlines() if "resume:" in line]
    assert "another rank's host copy" in resume[-1], ranks[0]["out"]


def test_when_the_only_copy_is_corrupt_every_rank_reads_the_folder(run_env):
    torch = pytest.importorskip("torch")
    saved = _as_lists(_saved_run(torch, run_env))
    with open(_one_copy().path, "r+b") as f:
        f.write(b"garbage")
    ranks = _two_ranks(run_env, [str(run_env / "host-b"), str(run_env / "host-a")])
    assert [r["state"] == saved for r in ranks] == [True, True]
    assert "corrupt" in ranks[1]["out"], ranks[1]["out"]
    resume = [line for line in ranks[0]["out"].splitlines() if "resume: restored" in line]
    assert not _names_a_copy(resume[-1]), ranks[0]["out"]


# -- kept on the host first: a relaunch restores what the folder does not have yet -----------
def _upload_held(run_env):
    """``st.Checkpoints`` saving every step in the background into a folder whose uploads wait
    at a gate (a slow ``abfss://``); its store."""
    import sparkhvd.torch as st
    from conftest import gated_store

    torch = pytest.importorskip("torch")
    model, opt = _model_and_opt(torch, seed=0)
    ckpt = st.Checkpoints(model, opt, url=str(run_env / "ckpt"), resume=False,
                          async_save=True, every_steps=1)
    ckpt.store = store = gated_store(str(run_env / "ckpt"))
    return model, opt, ckpt, store


def _train(torch, model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(16, 4)).sum().backward()
    opt.step()


def _train_and_step(torch, model, opt, ckpt, epoch: int) -> str:
    """One optimizer step and ``ckpt.step``; the checkpoint's name, once it is kept here."""
    _train(torch, model, opt)
    name = ckpt.step(epoch)
    ckpt._background.wait()  # serialised and kept on this host; its upload may wait
    return name


def _folder_records(run_env) -> list[str]:
    return sorted(n for n in os.listdir(run_env / "ckpt") if n.startswith("epoch-")
                  and n.endswith(".json"))


@pytest.mark.parametrize("damage", [None, "corrupt"])
def test_a_relaunch_restores_the_newest_checkpoint_kept_here_while_its_upload_waits(
        run_env, capsys, monkeypatch, damage):
    """Saves go on every step while the folder's uploads lag (held at a gate): each is kept on
    this host with its record first, so a relaunch restores the newest -- not the folder's
    older newest -- and says so, in its resume line and in run.json (the folder does not have
    it); a step checkpoint queued behind a newer one is never uploaded (said once), an epoch's
    end always is; once the uploads end the folder has the newest. A corrupt copy falls back
    to the folder's newest, with a warning."""
    from sparkhvd.common import events
    from sparkhvd.runfolder.record import RunRecord

    torch = pytest.importorskip("torch")
    model, opt, ckpt, store = _upload_held(run_env)
    _train_and_step(torch, model, opt, ckpt, 0)
    ckpt._finish_save()  # step 1 is in the folder
    store.writing.clear()
    store.gate.clear()
    _train_and_step(torch, model, opt, ckpt, 0)  # step 2: its upload waits at the gate
    assert store.writing.wait(10)
    for _ in range(2):  # steps 3 and 4 are kept here; 3's upload is superseded by 4's
        _train_and_step(torch, model, opt, ckpt, 0)
    ckpt.save(0)  # epoch 0's end supersedes step 4's upload, and is never superseded
    ckpt._background.wait()
    newest = _train_and_step(torch, model, opt, ckpt, 1)
    assert newest == "epoch-0001-step-0000001.pt"
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    out = capsys.readouterr().out
    assert "epoch-0000-step-0000003.pt is kept on this host only" in out, out
    assert out.count("kept on this host only") == 1, out
    assert _folder_records(run_env) == ["epoch-0000-step-0000001.json"]
    if damage:
        _damage(_one_copy(), damage)

    sent: list = []
    monkeypatch.setattr(events, "emit", sent.append)
    restored, relaunched, epoch, lines = _restored(torch, run_env, capsys)  # the relaunch
    state = restored.state_dict()
    (resumed,) = sent  # what the driver gets, and writes into run.json
    record = RunRecord(str(run_env / "run.json"), run_id="r", output="o", versions={})
    record.attempt_ended({"attempt": 2}, resumed)
    if damage:
        assert relaunched.restored == {"epoch": 0, "step": 1}, relaunched.restored
        assert any("WARNING" in line and "corrupt" in line for line in lines), lines
        assert (resumed.copy, resumed.uploaded) == ("folder", True)
        assert "uploaded" not in record["resume"] and "upload" not in lines[-1], lines
    else:
        assert (epoch, relaunched.restored) == (1, {"epoch": 1, "step": 1})
        assert all(torch.equal(state[k], v) for k, v in saved.items())
        assert any(f"{newest} was kept on the ranks' hosts before its upload" in line
                   and "epoch-0000-step-0000001.pt" in line for line in lines), lines
        assert "its copy on this host" in lines[-1], lines
        assert "its upload had not ended: the folder does not have it" in lines[-1], lines
        assert (record["resume"]["copy"], record["resume"]["uploaded"]) == ("host", False)
        assert record["resume"]["restored"].endswith(newest)

    store.gate.set()
    ckpt._finish_save()
    assert _folder_records(run_env) == [
        "epoch-0000-step-0000001.json", "epoch-0000-step-0000002.json",
        "epoch-0001-step-0000001.json", "epoch-0001.json"]
    assert json.loads((run_env / "ckpt" / "latest.json").read_text())["file"] == newest
    leftovers = [n for n in os.listdir(os.path.dirname(_one_copy().path)) if ".upload" in n]
    assert leftovers == [], "each upload's hold on its file is let go"


def test_a_relaunch_restores_a_checkpoint_kept_here_before_the_folder_had_any(
        run_env, capsys, monkeypatch):
    """The run's first checkpoint is kept on this host while its upload waits, and the rank
    is lost: the folder has no ``latest.json`` yet, so the driver asks no resume. The
    relaunch (attempt 2, ``resume=None``) still restores the host's copy; the first attempt
    never resumes; a relaunch with no checkpoint anywhere says it trains from scratch."""
    import sparkhvd.torch as st

    torch = pytest.importorskip("torch")
    monkeypatch.delenv(protocol.RESUME_URL_ENV, raising=False)
    monkeypatch.setenv(protocol.ATTEMPT_ENV, "1")
    model, opt, ckpt, store = _upload_held(run_env)
    store.gate.clear()
    newest = _train_and_step(torch, model, opt, ckpt, 0)  # kept here; its upload waits
    assert store.writing.wait(10) and not (run_env / "ckpt" / "latest.json").exists()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    capsys.readouterr()

    def relaunched(url: str) -> tuple:
        fresh, fresh_opt = _model_and_opt(torch, seed=1)
        again = st.Checkpoints(fresh, fresh_opt, url=url)
        epoch = again.restore()
        lines = [line for line in capsys.readouterr().out.splitlines() if "resume:" in line]
        return fresh, again, epoch, lines

    _, first, epoch, lines = relaunched(str(run_env / "ckpt"))
    assert (first.resume_from, epoch, lines) == (None, 0, [])
    monkeypatch.setenv(protocol.ATTEMPT_ENV, "2")
    fresh, again, epoch, lines = relaunched(str(run_env / "ckpt"))
    assert again.restored == {"epoch": 0, "step": 1}, lines
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    assert any(f"{newest} was kept on the ranks' hosts before its upload" in line
               and "newest (none)" in line for line in lines), lines
    assert "its upload had not ended: the folder does not have it" in lines[-1], lines
    store.gate.set()
    ckpt._finish_save()
    _, nothing, epoch, lines = relaunched(str(run_env / "elsewhere"))
    assert epoch == 0 and nothing.restored == {}
    assert lines == [f"resume: no checkpoint under {run_env / 'elsewhere'}; training from "
                     "scratch"], lines


def test_a_relaunchs_first_upload_holds_no_save_up_when_the_folder_has_a_checkpoint(run_env):
    """A process waits for its first upload before its next save only while the folder has no
    ``latest.json`` to resume from: a relaunch whose folder has an earlier attempt's goes on
    saving while that upload waits."""
    torch = pytest.importorskip("torch")
    model, opt, ckpt, store = _upload_held(run_env)
    _train_and_step(torch, model, opt, ckpt, 0)
    ckpt._finish_save()  # the earlier attempt's checkpoint and latest.json are in the folder
    model, opt, again, store = _upload_held(run_env)  # the relaunched process
    store.gate.clear()
    _train_and_step(torch, model, opt, again, 1)  # its first: the upload waits at the gate
    assert store.writing.wait(10)
    assert _train_and_step(torch, model, opt, again, 1) == "epoch-0001-step-0000002.pt"
    assert _folder_records(run_env) == ["epoch-0000-step-0000001.json"], "nothing waited"
    store.gate.set()
    again._finish_save()
    assert _folder_records(run_env) == ["epoch-0000-step-0000001.json",
                                        "epoch-0001-step-0000001.json",
                                        "epoch-0001-step-0000002.json"]


def test_a_checkpoint_whose_upload_failed_is_sent_to_a_rank_on_a_new_host(run_env):
    """A synchronous save whose upload fails (the folder keeps the epoch before) is still on
    rank 0's host: both ranks of the relaunch restore it, one of them over the process group;
    a run resuming from another folder never takes it."""
    torch = pytest.importorskip("torch")
    import sparkhvd.torch as st
    from conftest import gated_store

    model, opt = _model_and_opt(torch, seed=0)
    ckpt = st.Checkpoints(model, opt, url=str(run_env / "ckpt"), resume=False)
    ckpt.store = store = gated_store(str(run_env / "ckpt"))
    ckpt.save(0)
    _train(torch, model, opt)
    store.fail = OSError(28, "No space left on device")
    with pytest.raises(OSError, match="checkpoint of epoch 2 not written"):
        ckpt.save(1)
    assert _one_copy().file == "epoch-0002.pt" and _folder_records(run_env) == ["epoch-0001.json"]
    saved = _as_lists(model.state_dict())
    ranks = _two_ranks(run_env, [str(run_env / "host-b"), str(run_env / "host-a")])
    assert [r["epoch"] for r in ranks] == [2, 2], [r["out"] for r in ranks]
    assert ranks[0]["state"] == saved and ranks[1]["state"] == saved
    assert "another rank's host copy" in [line for line in ranks[0]["out"].splitlines()
                                          if "resume:" in line][-1], ranks[0]["out"]
    shutil.copytree(run_env / "ckpt", run_env / "elsewhere")
    from sparkhvd.checkpoint import nearest_copy
    from sparkhvd.checkpoint.stores import UrlStore

    record, _, _, _ = nearest_copy.load_nearest(UrlStore(str(run_env / "elsewhere")), _load,
                                                   0, nearest_copy.Alone())
    assert record["file"] == "epoch-0001.pt", "another folder's newest, not this one's copy"


# -- st.ShardedCheckpoints: every rank keeps its own files ----------------------------------
def test_each_rank_keeps_its_own_files_and_a_host_reads_every_ranks(run_env, monkeypatch):
    """Two ranks on one host keep their shards side by side; a relaunched rank -- whatever
    its number now -- finds both ranks' files."""
    for rank in (0, 1):
        monkeypatch.setenv("SPARKHVD_RANK", str(rank))
        _keep(f"epoch-0001/__{rank}_0.distcp", b"shard %d" % rank)
    monkeypatch.setenv("SPARKHVD_RANK", "1")
    _keep("epoch-0002/__1_0.distcp", b"newer shard 1")  # replaces rank 1's own copy only
    monkeypatch.setenv("SPARKHVD_RANK", "3")
    copies = host_copy.find_all()
    assert set(copies) == {"epoch-0001/__0_0.distcp", "epoch-0002/__1_0.distcp"}, copies
    assert copies["epoch-0002/__1_0.distcp"].read() == b"newer shard 1"


_SHARDED_RANK = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import sparkhvd.torch as st
    from sparkhvd.checkpoint.stores import UrlStore
    UrlStore.on_this_host = property(lambda self: False)  # as abfss:// is (see run_env)
    mode, url, out, rendezvous, world = sys.argv[1:6]
    if int(world) > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}",
                                rank=int(os.environ["RANK"]), world_size=int(world))
    torch.manual_seed(0 if mode == "save" else 1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
    if os.environ.get("FSDP"):  # each rank holds its shard of every parameter (FSDP2)
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (int(world),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(16, 256)).sum().backward()
    opt.step()
    from sparkhvd.torch import restore_collectives
    got = []  # bytes this rank got from another rank's host copy
    broadcast_bytes = restore_collectives.TorchCollectives.broadcast_bytes
    def counted(self, data, source, rank):
        sent = broadcast_bytes(self, data, source, rank)
        if rank != source and sent is not None:
            got.append(len(sent))
        return sent
    restore_collectives.TorchCollectives.broadcast_bytes = counted
    read = {}  # bytes this rank read of each file of the folder
    for method in ("read", "read_range"):
        def counting(self, name, *span, _original=getattr(UrlStore, method)):
            data = _original(self, name, *span)
            read[name] = read.get(name, 0) + len(data)
            return data
        setattr(UrlStore, method, counting)
    if mode == "save-fail" and os.environ["RANK"] == "1":  # its upload fails: a full disk
        def write_file(self, name, path):
            raise OSError(28, "No space left on device")
        UrlStore.write_file = write_file
    ckpt = st.ShardedCheckpoints(model, opt, url=url, resume=mode == "restore")
    failed = None
    try:
        epoch = ckpt.restore() if mode == "restore" else ckpt.save(0, seen=5) and 0
    except OSError as exc:
        epoch, failed = None, str(exc)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist()
             for k, v in model.state_dict().items()}
    with open(out, "w") as f:
        json.dump({"epoch": epoch, "state": state, "restored": ckpt.restored,
                   "failed": failed, "got": got, "read": read}, f)
    if int(world) > 1:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as a sparkhvd rank leaves: torch 2.13's gloo may abort in the teardown
""")


def _sharded_ranks(tmp_path, mode: str, host_dirs: list[str], fsdp: bool = False) -> list[dict]:
    """``mode`` ("save" or "restore") a ShardedCheckpoints in ``tmp_path/ckpt`` with one real
    rank per host-copy folder (its "host"), in a gloo group met through a file (``fsdp``: the
    model sharded by FSDP2); each rank's result, with
    ``got``: the sizes of what it got from other ranks' host copies, and ``read``: the bytes
    it read of each file of the folder."""
    script = tmp_path / "sharded_rank.py"
    script.write_text(_SHARDED_RANK)
    world, rendezvous = len(host_dirs), tmp_path / f"rendezvous-{mode}-{len(os.listdir(tmp_path))}"
    envs = [{**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
             "SPARKHVD_RANK": str(rank), "SPARKHVD_SIZE": str(world),
             host_copy.DIR_ENV: folder, protocol.RUN_ID_ENV: "20261126-run",
             **({"FSDP": "1"} if fsdp else {})} for rank, folder in enumerate(host_dirs)]
    ends = preloaded.run_ranks(
        str(script), [[mode, str(tmp_path / "ckpt"), str(tmp_path / f"{mode}-r{rank}"),
                       str(rendezvous), str(world)] for rank in range(world)],
        envs, [str(tmp_path / f"{mode}-r{rank}.out") for rank in range(world)])
    assert [status for status, _ in ends] == [0] * world, [out for _, out in ends]
    return [{**json.loads((tmp_path / f"{mode}-r{rank}").read_text()), "out": out}
            for rank, (_, out) in enumerate(ends)]


def test_a_sharded_checkpoint_is_kept_on_the_hosts_before_its_upload(run_env):
    """Every rank keeps its shards on its host with the checkpoint's record -- gathered from
    every rank -- before uploading them: rank 1's upload fails (a full disk), so the folder
    never gets the checkpoint and both ranks raise; a relaunch on the same hosts restores it
    from the hosts whole, saying its upload had not ended."""
    pytest.importorskip("torch")
    hosts = [str(run_env / "host-a"), str(run_env / "host-b")]
    saved = _sharded_ranks(run_env, "save-fail", hosts)
    assert all(r["failed"] and "No space left" in r["failed"] for r in saved), saved
    assert not (run_env / "ckpt" / "latest.json").exists()
    ranks = _sharded_ranks(run_env, "restore", hosts)
    assert [(r["epoch"], r["state"] == saved[0]["state"]) for r in ranks] == [(1, True)] * 2
    assert ranks[0]["restored"]["seen"] == 5
    line = _resume_line(ranks[0])
    assert "its upload had not ended: the folder does not have it" in line, ranks[0]["out"]


def test_an_fsdp_relaunch_gets_only_what_each_ranks_load_reads_of_the_other_ranks_files(
        run_env):
    """FSDP2 shards every parameter, and DCP writes each replicated item (the optimizer's
    settings, Adam's step counts) into one rank's file. Relaunched on the same hosts, each rank
    reads its own file on its host and gets from the other rank only the byte ranges its load
    plan reads of that rank's file -- a few kilobytes, not the file -- and none from the folder
    (its shard files are deleted); the state is the one saved. On a new host, rank 0 gets the
    ranges it reads of both ranks' files from rank 1, whose host now has them."""
    pytest.importorskip("torch")
    hosts = [str(run_env / "host-a"), str(run_env / "host-b")]
    saved = _sharded_ranks(run_env, "save", hosts, fsdp=True)
    assert saved[0]["state"] == saved[1]["state"]
    folder = run_env / "ckpt" / "epoch-0001"
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    for name in sizes:
        if name != ".metadata":
            (folder / name).unlink()
    ranks = _sharded_ranks(run_env, "restore", hosts, fsdp=True)
    assert [(r["epoch"], r["state"] == saved[0]["state"]) for r in ranks] == [(1, True)] * 2
    shard_file = min(size for name, size in sizes.items() if name != ".metadata")
    for r in ranks:  # rank 1 also gets the .metadata, which rank 0 keeps
        assert sum(n for n in r["got"] if n != sizes[".metadata"]) < shard_file / 10, \
            (sizes, [x["got"] for x in ranks])
    assert "(its copy on this host)" not in _resume_line(ranks[0])  # ranges from rank 1
    _move_copies(run_env, "host-a", "host-b")
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "host-new"), hosts[1]], fsdp=True)
    assert [r["state"] == saved[0]["state"] for r in ranks] == [True, True]
    assert "another rank's host copy" in _resume_line(ranks[0]), ranks[0]["out"]


def test_an_fsdp_resume_on_new_hosts_reads_of_the_folder_the_items_each_ranks_load_reads(
        run_env):
    """No host has a copy (the run resumed on a new cluster): each rank reads its own shard
    file from the folder and, of the other rank's, only the items its load plan reads (each
    checked against the CRC-32 the record keeps of it) -- the state once, not every file to
    every rank; the state is the one saved."""
    pytest.importorskip("torch")
    saved = _sharded_ranks(run_env, "save", [str(run_env / "host-a"), str(run_env / "host-b")],
                           fsdp=True)
    record = json.loads((run_env / "ckpt" / "latest.json").read_text())
    owner = {name: int(f["rank"]) for name, f in record["files"].items()
             if name.endswith(".distcp")}
    assert sorted(owner.values()) == [0, 1] and all(
        len(f["pieces"]) > 1 for name, f in record["files"].items() if name in owner), record
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "new-a"), str(run_env / "new-b")],
                           fsdp=True)
    assert [(r["epoch"], r["state"] == saved[0]["state"]) for r in ranks] == [(1, True)] * 2
    assert not _names_a_copy(_resume_line(ranks[0])), ranks[0]["out"]
    for rank, r in enumerate(ranks):
        own = [n for name, n in r["read"].items() if owner.get(name) == rank]
        others = sum(n for name, n in r["read"].items() if owner.get(name) not in (None, rank))
        size = record["files"][next(name for name, o in owner.items() if o != rank)]["size"]
        assert own and others < size / 10, (rank, r["read"], size)


def _resume_line(rank_zero: dict) -> str:
    return [line for line in rank_zero["out"].splitlines() if "resume: restored" in line][-1]


@pytest.fixture(scope="module")
def _sharded_saved_once(tmp_path_factory):
    """The saved run of :func:`sharded_save`, made once for the tests below."""
    pytest.importorskip("torch")
    where = tmp_path_factory.mktemp("sharded-save")
    saved = _sharded_ranks(where, "save", [str(where / "host-a"), str(where / "host-b")])
    assert saved[0]["state"] == saved[1]["state"]
    return where, saved[0]["state"]


@pytest.fixture
def sharded_save(_sharded_saved_once, run_env):
    """Two ranks on two hosts (a, b) saved a sharded checkpoint to a folder that counts as
    remote: each host keeps its rank's files (a copy of one save for each test: they damage
    or move them)."""
    where, state = _sharded_saved_once
    for name in ("ckpt", "host-a", "host-b"):
        shutil.copytree(where / name, run_env / name)
    return state


def test_a_sharded_relaunch_on_the_same_hosts_needs_no_file_from_the_folder(sharded_save,
                                                                           run_env, monkeypatch):
    """Each rank back on its host: it reads its own files there and gets the other rank's from
    it (DCP writes a replicated tensor into one rank's file only) -- the folder's shard files
    are deleted, so they can only have come from the copies."""
    hosts = [str(run_env / "host-a"), str(run_env / "host-b")]
    for host in hosts:
        monkeypatch.setenv(host_copy.DIR_ENV, host)
        assert host_copy.find_all(), f"{host} keeps its rank's files"
    shards = [p for p in (run_env / "ckpt" / "epoch-0001").iterdir()]
    assert len(shards) >= 3, shards  # .metadata and one file per rank
    for shard in shards:
        shard.unlink()
    ranks = _sharded_ranks(run_env, "restore", hosts)
    assert [(r["epoch"], r["state"] == sharded_save) for r in ranks] == [(1, True)] * 2
    assert ranks[0]["restored"]["seen"] == 5
    assert _resume_line(ranks[0]).endswith("continuing at epoch 1"), ranks[0]["out"]
    assert "another rank's host copy" in _resume_line(ranks[0]), ranks[0]["out"]


def test_a_sharded_relaunch_with_every_file_on_its_host_reads_them_there(sharded_save, run_env):
    """Both ranks' files on host a (two ranks there when it saved, as in local mode)."""
    _move_copies(run_env, "host-b", "host-a")
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "host-a")] * 2)
    assert [r["state"] == sharded_save for r in ranks] == [True, True]
    assert "(its copy on this host)" in _resume_line(ranks[0]), ranks[0]["out"]


def _move_copies(run_env, source: str, target: str) -> None:
    """Every rank's copies kept on host ``source`` to host ``target``."""
    run = os.path.join(os.path.basename(host_copy.base_folder()), "20261126-run")
    for rank_folder in (run_env / source / run).iterdir():
        os.rename(rank_folder, run_env / target / run / rank_folder.name)


def test_a_sharded_relaunch_on_new_hosts_gets_the_files_from_the_ranks_that_have_them(
        sharded_save, run_env):
    """Rank 0 on a new host, rank 1 on host b (which has only rank 1's files from the save):
    rank 0's files come from the folder, so the resume says the folder; every file read
    from some copy is checked."""
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "host-new"),
                                                str(run_env / "host-b")])
    assert [r["state"] == sharded_save for r in ranks] == [True, True]
    assert not _names_a_copy(_resume_line(ranks[0])), ranks[0]["out"]
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "host-new"),
                                                str(run_env / "host-a")])
    assert [r["state"] == sharded_save for r in ranks] == [True, True]


def test_a_sharded_relaunch_where_one_host_has_every_file_sends_them_to_the_other(
        sharded_save, run_env):
    _move_copies(run_env, "host-b", "host-a")  # both ranks' files on host a now
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "host-new"),
                                                str(run_env / "host-a")])
    assert [r["state"] == sharded_save for r in ranks] == [True, True]
    assert "another rank's host copy" in _resume_line(ranks[0]), ranks[0]["out"]


@pytest.mark.parametrize("damage", ["corrupt", "deleted"])
def test_a_bad_shard_copy_is_said_and_that_file_read_from_the_folder(sharded_save, run_env,
                                                                      damage, monkeypatch):
    monkeypatch.setenv(host_copy.DIR_ENV, str(run_env / "host-b"))
    _damage(next(iter(host_copy.find_all().values())), damage)
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "host-a"),
                                                str(run_env / "host-b")])
    assert [r["state"] == sharded_save for r in ranks] == [True, True]
    assert "WARNING" in ranks[1]["out"] and "host copy" in ranks[1]["out"], ranks[1]["out"]
    assert not _names_a_copy(_resume_line(ranks[0])), ranks[0]["out"]


def test_a_sharded_checkpoint_restores_at_one_rank_from_both_hosts_copies(sharded_save,
                                                                         run_env):
    """The run shrinks to one rank on host a, which has only rank 0's files: rank 1's come
    from the folder; the state is the saved one."""
    ranks = _sharded_ranks(run_env, "restore", [str(run_env / "host-a")])
    assert ranks[0]["state"] == sharded_save and ranks[0]["epoch"] == 1


# -- memory snapshots of the saves due while one is written (sparkhvd.torch.snapshot_ring) ------
def test_a_snapshots_copy_names_it_by_its_identity_and_crc_not_a_sha256(run_env):
    """A memory snapshot's record and its copy's list say what it is: its identity and (on a
    disk) its file's CRC-32, each in a field of its own, and no ``sha256``. A copy listed in
    the form from before (``"sha256": "snapshot:<id>:crc32=..."``) is no valid copy: its
    check fails when read, and a restore passes it over as it does a damaged one."""
    data = b"slot" * 100
    path = host_copy.snapshot_slot(0)
    with open(path, "wb") as f:
        f.write(data)
    entry = host_copy.snapshot_entry(len(data), "ab12", zlib.crc32(data))
    record = {"epoch": 0, "step": 4, "file": "e.snapshot", "snapshot": True,
              "files": {"e.snapshot": entry}}
    assert host_copy.commit_snapshot("e.snapshot", path, len(data), record, "the folder")
    copy = host_copy.find_all()["e.snapshot"]
    assert (copy.sha256, copy.snapshot, copy.crc32) == (None, "ab12", zlib.crc32(data))
    assert copy.content == host_copy.content_of(entry) != host_copy.content_of({"sha256": "ab12"})
    assert copy.read() == data
    meta_path = os.path.join(os.path.dirname(path), "snapshot.json")
    meta = json.loads(open(meta_path).read())
    assert "sha256" not in meta["files"][0]
    assert "sha256" not in meta["record"]["files"]["e.snapshot"]
    with open(path, "r+b") as f:
        f.write(b"X")
    with pytest.raises(ValueError, match="corrupt"):
        copy.read()

    meta["files"][0] = {"file": "e.snapshot", "size": len(data), "name": "snapshot-0",
                        "sha256": f"snapshot:ab12:crc32={zlib.crc32(data):08x}"}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ValueError, match="corrupt"):
        host_copy.find_all()["e.snapshot"].read()


def _bn_model_and_opt(torch, seed: int):
    """A model with an int64 buffer (BatchNorm's count) and Adam's state, trained one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(torch, model, opt)
    return model, opt


def _full_state(model, opt) -> dict:
    """Model and optimizer state, copied (tensors as lists: comparable after a reload)."""
    def plain(value):
        if hasattr(value, "tolist"):
            return value.tolist()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return plain({"model": model.state_dict(), "optimizer": opt.state_dict()})


def test_saves_due_while_one_is_written_are_memory_snapshots_and_a_relaunch_restores_the_newest(
        run_env, capsys, monkeypatch):
    """With ``memory_snapshots``, while a save is serialised (held here at a gate: a 1 GB state
    takes seconds), the saves ``step()`` makes due are not skipped: each step's state is copied into a slot file on this
    host and named the newest snapshot (said once). A relaunch restores the newest one --
    model, Adam's moments, BatchNorm's int64 count, the extra state -- newer than any file,
    and says it came from a snapshot on this host; a snapshot changed since (its CRC-32 no
    longer matches) falls back, with a warning, to the newest checkpoint file. The restore reads the slot in place (a view of it
    mapped into memory, not a copy): a relaunched process lays its own slot files out anew."""
    torch = pytest.importorskip("torch")
    from sparkhvd.torch import checkpoints as torch_checkpoints

    model, opt = _bn_model_and_opt(torch, seed=0)
    assert host_copy.in_memory("/dev/shm") or not os.path.isdir("/dev/shm")
    # slots on a disk, where a crash may leave one torn: each snapshot's CRC-32 is taken
    monkeypatch.setattr(host_copy, "in_memory", lambda path: False)
    ckpt, gate, saved = _snapshots_while_a_save_is_held(torch, run_env, monkeypatch, model, opt)
    given = []
    load_state = torch_checkpoints.load_state
    monkeypatch.setattr(torch_checkpoints, "load_state",
                        lambda data, device, *args, **kwargs: given.append(type(data))
                        or load_state(data, device, *args, **kwargs))
    out = capsys.readouterr().out
    assert out.count("kept in memory on this host only") == 1, out
    assert "epoch-0000-step-0000002.snapshot kept in memory" in out, out
    slots = sorted(n for n in os.listdir(os.path.dirname(host_copy.snapshot_slot(0)))
                   if n.startswith("snapshot-"))
    # step 1 is written from slot 0 (held while it is), steps 2-4 take turns in the others
    assert slots == ["snapshot-0", "snapshot-1", "snapshot-2"]
    snapshot = host_copy.find_all()["epoch-0000-step-0000004.snapshot"]
    assert snapshot.path.endswith("snapshot-1")
    # named by its identity and CRC-32, not a SHA-256 (that of every step would cost more)
    assert snapshot.sha256 is None and snapshot.snapshot and snapshot.crc32 is not None

    restored, relaunched, epoch, lines = _relaunched(torch, run_env, capsys)
    assert (epoch, relaunched.restored) == (0, {"seen": 4, "epoch": 0, "step": 4})
    assert _full_state(*restored) == saved[4]
    assert any("a snapshot of that step's state kept in memory on the ranks' hosts" in line
               for line in lines), lines
    assert "epoch-0000-step-0000004.snapshot (its copy on this host); a memory snapshot of " \
        "that step: the folder does not have it" in lines[-1], lines
    assert given == [memoryview], given

    gate.set()
    ckpt._finish_save()  # step 1's file: now the newest checkpoint *file*
    with open(snapshot.path, "r+b") as f:  # a byte of a tensor changed, the end marker whole
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    restored, relaunched, epoch, lines = _relaunched(torch, run_env, capsys)
    assert relaunched.restored == {"seen": 1, "epoch": 0, "step": 1}, lines
    assert any("WARNING" in line and "snapshot" in line and "checksum mismatch" in line
               for line in lines), lines

    # the function ends (raising: the run relaunches): its slot mappings go, the files stay
    mapped = [os.path.join(os.path.dirname(snapshot.path), n) for n in slots]
    assert any(path in open("/proc/self/maps").read() for path in mapped)
    function_ended(returned=False)
    assert not [path for path in mapped if path in open("/proc/self/maps").read()]
    assert all(os.path.exists(path) for path in mapped)


def _snapshots_while_a_save_is_held(torch, run_env, monkeypatch, model, opt):
    """``Checkpoints(async_save=True, every_steps=1)``: step 1's save held while it is
    serialised (at a gate), steps 2-4 due meanwhile. The Checkpoints, the gate, and the full
    state after steps 2, 3 and 4."""
    import threading

    import sparkhvd.torch as st
    from sparkhvd.torch import checkpoints as torch_checkpoints

    gate, serialising = threading.Event(), threading.Event()
    real_save = torch_checkpoints.save_state

    def held_save(state, f):
        serialising.set()
        assert gate.wait(60)
        real_save(state, f)

    monkeypatch.setattr(torch_checkpoints, "save_state", held_save)
    ckpt = st.Checkpoints(model, opt, url=str(run_env / "ckpt"), resume=False,
                          async_save=True, every_steps=1, memory_snapshots=True)
    _train(torch, model, opt)
    assert ckpt.step(0, seen=1) == "epoch-0000-step-0000001.pt"
    assert serialising.wait(10)  # step 1 is being serialised: held
    saved = {}
    for step in (2, 3, 4):
        _train(torch, model, opt)
        assert ckpt.step(0, seen=step) is None  # kept in memory, no file
        saved[step] = _full_state(model, opt)
    # The parameters and Adam's moments are copied while the next step computes: its
    # optimizer step waits for that copy, so step 4's snapshot has step 4's values.
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    assert _full_state(model, opt) != saved[4]
    ckpt._ring.wait()  # named once copied (and, where taken, its CRC-32 after the copy)
    return ckpt, gate, saved


def test_a_rank_on_a_new_host_gets_the_newest_snapshot_from_the_rank_that_has_it(
        run_env, monkeypatch):
    """Relaunched at two ranks on two hosts, where only rank 1's host has the snapshot: rank 0
    gets its bytes over the process group, and both load step 4's state. (Slots in memory, as
    in /dev/shm: gone with their host, so no CRC-32 is taken of them.)"""
    torch = pytest.importorskip("torch")
    model, opt = _model_and_opt(torch, seed=0)
    monkeypatch.setattr(host_copy, "in_memory", lambda path: True)
    ckpt, gate, saved = _snapshots_while_a_save_is_held(torch, run_env, monkeypatch, model, opt)
    kept = host_copy.find_all()["epoch-0000-step-0000004.snapshot"]
    assert kept.sha256 is None and kept.snapshot and kept.crc32 is None, kept
    ranks = _two_ranks(run_env, [str(run_env / "host-b"), str(run_env / "host-a")])
    assert [r["epoch"] for r in ranks] == [0, 0]
    assert ranks[0]["state"] == ranks[1]["state"] == saved[4]["model"]
    assert "step-0000004.snapshot (another rank's host copy" in ranks[0]["out"], ranks[0]["out"]
    gate.set()
    ckpt._finish_save()


def _relaunched(torch, run_env, capsys):
    """A relaunched rank 0's model and optimizer after ``restore()``, its Checkpoints, the
    epoch and its resume lines."""
    import sparkhvd.torch as st

    model, opt = _bn_model_and_opt(torch, seed=7)
    ckpt = st.Checkpoints(model, opt, url=str(run_env / "ckpt"), resume=True)
    epoch = ckpt.restore()
    lines = [line for line in capsys.readouterr().out.splitlines() if "resume:" in line]
    return (model, opt), ckpt, epoch, lines


_KILLED_MID_COPY = textwrap.dedent("""
    import json, os, signal, sys, threading
    import torch
    import sparkhvd.torch as st
    from sparkhvd.torch import checkpoints as torch_checkpoints, snapshot_ring

    torch_checkpoints.save_state = lambda state, f: threading.Event().wait()  # never serialised
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = st.Checkpoints(model, opt, url=sys.argv[1], resume=False, async_save=True,
                          every_steps=1, memory_snapshots=True)
    kill_at = int(sys.argv[3])
    copy_later = snapshot_ring._Slot.copy_later
    snapshots = []

    def copy_half_then_die(slot, pairs):  # on the thread that copies a snapshot's parameters
        snapshots.append(len(pairs))
        if len(snapshots) == kill_at:  # every step's save is a snapshot: step kill_at's
            copy_later(slot, pairs[:len(pairs) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        copy_later(slot, pairs)

    snapshot_ring._Slot.copy_later = copy_half_then_die
    for step in range(1, kill_at + 1):
        opt.zero_grad()
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
        if step == kill_at - 1:
            with open(sys.argv[2], "w") as f:
                json.dump({k: v.tolist() for k, v in model.state_dict().items()}, f)
        ckpt.step(0, seen=step)
    model(torch.randn(16, 4)).sum().backward()
    opt.step()  # waits for step 6's copy, which the kill cuts short
    os._exit(3)
""")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_copy_read_in_place_is_unmapped_once_its_state_is_loaded(run_env):
    """A snapshot's slot, a checkpoint's copy and a DCP checkpoint's files, each read as a
    mapped view and loaded: no mapping of any is left once the load returns -- not held by a
    reference cycle until a garbage collection (on /dev/shm a replaced copy still mapped holds
    its memory)."""
    torch = pytest.importorskip("torch")
    import io

    import torch.distributed.checkpoint as dcp

    from sparkhvd.torch.serialise import load_state, reader_of, save_state
    from sparkhvd.torch.snapshot_ring import SnapshotRing

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return str(run_env) in maps.read()

    state = {f"w{i}": torch.randn(1 << 12) for i in range(3)}
    ring = SnapshotRing.here()
    ring.keep(state, "epoch-0000-step-0000001.snapshot", {"epoch": 0}, "the folder")
    ring.close()
    saved = io.BytesIO()
    save_state(state, saved)
    _keep("epoch-0001.pt", saved.getvalue())
    copies = host_copy.find_all()
    for name in ("epoch-0000-step-0000001.snapshot", "epoch-0001.pt"):
        loaded = load_state(copies[name].read(mapped=True), "cpu")
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), name
        assert not mapped(), name

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(run_env / "dcp")))
    host_copy.keep({f"epoch-0002/{p.name}": (p.read_bytes(), _sha(p.read_bytes()))
                    for p in (run_env / "dcp").iterdir()})
    views = {name: copy.read(mapped=True) for name, copy in host_copy.find_all().items()
             if name.startswith("epoch-0002/")}
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=reader_of(views, "epoch-0002"))
    del views
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert not mapped()


def test_a_rank_killed_while_copying_a_snapshot_restores_the_one_before(run_env, capsys):
    """A real process SIGKILLed in the middle of copying step 6's state into a slot (on the
    thread that copies the parameters and Adam's moments while the next step runs): the
    relaunch restores step 5's snapshot whole (the slot being filled was never named), not
    a torn step 6."""
    torch = pytest.importorskip("torch")
    script = run_env / "killed.py"
    script.write_text(_KILLED_MID_COPY)
    env = {**os.environ, host_copy.DIR_ENV: os.environ[host_copy.DIR_ENV],
           protocol.RUN_ID_ENV: os.environ[protocol.RUN_ID_ENV]}
    [(status, out)] = preloaded.run_ranks(
        str(script), [[str(run_env / "ckpt"), str(run_env / "step5.json"), "6"]], [env],
        [str(run_env / "killed.out")])
    assert status == -9, out
    assert "kept in memory on this host only" in out, out
    (model, _), relaunched, epoch, lines = _relaunched(torch, run_env, capsys)
    assert (epoch, relaunched.restored) == (0, {"seen": 5, "epoch": 0, "step": 5}), lines
    expected = json.loads((run_env / "step5.json").read_text())
    assert _as_lists(model.state_dict()) == expected


@pytest.mark.parametrize("settings", [{}, {"async_save": True, "host_copy": False}])
def test_memory_snapshots_without_a_background_save_on_the_host_is_a_clear_error(
        tmp_path, settings):
    torch = pytest.importorskip("torch")
    import sparkhvd.torch as st

    model, opt = _model_and_opt(torch, seed=0)
    with pytest.raises(ValueError, match="memory_snapshots=True needs async_save=True and "
                                         "host_copy=True"):
        st.Checkpoints(model, opt, url=str(tmp_path), memory_snapshots=True, **settings)


def test_a_rank_that_ends_deletes_its_own_and_dead_ranks_copies_never_a_live_ranks(run_env):
    """Two ranks on one host end at different times: the first to end must not delete the
    folder of the other, which may still be finishing its last save; a rank folder an earlier
    attempt's process left (its owner gone) goes with whichever rank ends first. The run's
    folder goes with the last one."""
    assert _keep("epoch-0001.pt", b"mine") is not None  # this process, rank 0
    run = host_copy.folder()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        for rank, owner in ((1, live.pid), (2, ended.pid)):
            os.makedirs(os.path.join(run, f"rank-{rank}"))
            with open(os.path.join(run, f"rank-{rank}", "owner.pid"), "w") as f:
                f.write(str(owner))
        host_copy.clean()
        assert sorted(os.listdir(run)) == ["rank-1"], "the live rank's folder is left to it"
    finally:
        live.kill()
        live.wait()
    host_copy.clean()
    assert not os.path.exists(run)


def _planted_run(base: str, run_id: str, owners: dict[int, Optional[int]]) -> str:
    """Run ``run_id``'s rank folders under ``base``'s private folder, each owned as said."""
    run = os.path.join(base, host_copy.BASE_NAME, run_id)
    os.makedirs(os.path.dirname(run), mode=0o700, exist_ok=True)
    for rank, owner in owners.items():
        os.makedirs(os.path.join(run, f"rank-{rank}"))
        with open(os.path.join(run, f"rank-{rank}", "epoch-0001.pt"), "wb") as f:
            f.write(b"state")
        if owner is not None:
            with open(os.path.join(run, f"rank-{rank}", "owner.pid"), "w") as f:
                f.write(str(owner))
    return run


def test_the_sweep_of_a_finished_run_deletes_what_no_live_process_owns(tmp_path, monkeypatch):
    """What the driver's sweep runs on a host an earlier attempt used: the dead ranks' folders
    (and one whose owner was never said) go, a live process's stays; another run's is left."""
    monkeypatch.setenv(host_copy.DIR_ENV, str(tmp_path))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        run = _planted_run(str(tmp_path), "20261203-swept", {0: ended.pid, 1: live.pid, 2: None})
        other = _planted_run(str(tmp_path), "20261203-other", {0: ended.pid})
        assert host_copy.sweep("20261203-swept") == 2
        assert os.listdir(run) == ["rank-1"] and os.listdir(other) == ["rank-0"]
    finally:
        live.kill()
        live.wait()
    assert host_copy.sweep("20261203-swept") == 1 and not os.path.exists(run)
    assert host_copy.sweep("20261203-never") == 0


def test_sweeps_on_one_host_at_once_count_each_folder_once(tmp_path, monkeypatch):
    """The driver's sweep runs a task per slot, so several sweep one host together: each rank
    folder is removed by one of them and counted once (the run's log says how many went)."""
    import concurrent.futures

    monkeypatch.setenv(host_copy.DIR_ENV, str(tmp_path))
    run = _planted_run(str(tmp_path), "20261204-together", {r: None for r in range(200)})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        counts = list(pool.map(lambda _: host_copy.sweep("20261204-together"), range(8)))
    assert sum(counts) == 200 and not os.path.exists(run)
