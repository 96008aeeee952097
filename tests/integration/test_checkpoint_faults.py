"""Resume never dies on a bad checkpoint: a truncated newest file, a missing one, a corrupt
``latest.json``, all of them bad -- on the PyTorch helpers (modern profile) and Keras (default
profile). Each is met the way a user meets it: train, damage the run folder, resume_from=True."""
from __future__ import annotations

import json
import os

import pytest

from sparkhvd import HorovodRunner, TrainingError

pytestmark = pytest.mark.timeout(600)


def torch_fit(epochs, killed_once=False):
    """Deterministic per epoch (data seeded by the epoch), rank-0 checkpoints every epoch.
    ``killed_once``: on the first attempt rank 0 leaves a torn temporary (as a writer killed
    mid-write does) and is SIGKILLed after epoch 2's checkpoint."""
    import os
    import signal

    import torch
    import torch.distributed as dist

    import sparkhvd.torch as st

    ctx = st.setup()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = st.Checkpoints(model, opt)
    start = ckpt.restore()
    for epoch in range(start, epochs):
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(epoch * 10 + ctx.rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        ckpt.save(epoch)
        if killed_once and epoch == 1 and ctx.rank == 0 and \
                os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            folder = os.path.join(os.environ["SPARKHVD_RUN_URL"], "checkpoints")
            with open(os.path.join(folder, ".tmp-0a1b2c-epoch-0003.pt"), "wb") as f:
                f.write(b"\0" * 4096)
            os.kill(os.getpid(), signal.SIGKILL)
    weights = [round(float(v), 6) for p in model.parameters() for v in p.detach().flatten()]
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"start": start, "weights": weights,
            "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT")}


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("ckpt")
    straight = HorovodRunner(np=-2, backend="torch", output_dir=str(base / "straight")).run(
        torch_fit, epochs=4)
    return base, straight


def _damaged_run(base, name, damage):
    out = str(base / name)
    runner = HorovodRunner(np=-2, backend="torch", output_dir=out)
    runner.run(torch_fit, epochs=2)
    folder = runner.last_run_dir.file("checkpoints")
    damage(folder)
    return out, folder


def _truncate(folder):
    path = os.path.join(folder, "epoch-0002.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


@pytest.mark.torch_backend
@pytest.mark.parametrize("how", ["truncated", "missing", "latest.json corrupt"])
def test_a_bad_newest_checkpoint_is_skipped_for_the_newest_good_one(torch_runs, how, rank_lines):
    base, straight = torch_runs
    damage = {"truncated": _truncate,
              "missing": lambda f: os.unlink(os.path.join(f, "epoch-0002.pt")),
              "latest.json corrupt": lambda f: open(os.path.join(f, "latest.json"), "w").write(
                  '{"epoch": 2, "fi')}[how]
    out, folder = _damaged_run(base, how.replace(" ", "-"), damage)
    resumed = HorovodRunner(np=-2, backend="torch", output_dir=out, resume_from=True)
    result = resumed.run(torch_fit, epochs=4)
    assert result["weights"] == straight["weights"], "continued exactly from what it restored"
    record = resumed.last_run_dir.record["resume"]
    if how == "latest.json corrupt":  # the newest checkpoint itself is fine: found by its record
        assert result["start"] == 2 and record["restored"].endswith("epoch-0002.pt")
        assert "latest.json: unreadable" in record["skipped"][0]
    else:
        assert result["start"] == 1 and record["restored"].endswith("epoch-0001.pt")
        why = "truncated" if how == "truncated" else "missing"
        assert len(record["skipped"]) == 1 and "epoch-0002.pt" in record["skipped"][0] \
            and why in record["skipped"][0], record
        assert any("resume: WARNING" in line and "epoch-0002.pt" in line for line in rank_lines)


@pytest.mark.torch_backend
def test_no_usable_checkpoint_fails_before_training_naming_every_file(torch_runs):
    base, _ = torch_runs

    def ruin(folder):
        for name in ("epoch-0001.pt", "epoch-0002.pt"):
            open(os.path.join(folder, name), "wb").write(b"not a checkpoint")

    out, folder = _damaged_run(base, "all-bad", ruin)
    resumed = HorovodRunner(np=-2, backend="torch", output_dir=out, resume_from=True)
    with pytest.raises(TrainingError) as info:
        resumed.run(torch_fit, epochs=4)
    err = info.value
    assert err.exc_type == "CheckpointError", "the cause, not a peer's consequence"
    message = str(err)
    assert folder in message and "epoch-0002.pt" in message and "epoch-0001.pt" in message
    assert "resume_from=False" in message, "the fix"
    assert not os.path.exists(resumed.last_run_dir.file("checkpoints/epoch-0003.pt"))


def test_a_truncated_keras_checkpoint_falls_back_with_a_warning(data, backend, spark, tmp_path):
    """The h5py 'truncated file' case, as an interrupted copy leaves it: the newest complete
    checkpoint is used instead, and run.json says what was skipped."""
    pytest.importorskip("tensorflow")
    import digits_keras

    out = str(tmp_path)
    first = HorovodRunner(np=2, spark=spark, backend=backend, output_dir=out)
    first.run(digits_keras.train, **data, epochs=2, shuffle=False)
    folder = first.last_run_dir.file("checkpoints")
    newest = json.loads(open(os.path.join(folder, "latest.json")).read())["file"]
    path = os.path.join(folder, newest)
    open(path, "r+b").truncate(os.path.getsize(path) // 2)
    resumed = HorovodRunner(np=2, spark=spark, backend=backend, output_dir=out, resume_from=True)
    resumed.run(digits_keras.train, **data, epochs=3, shuffle=False)
    record = resumed.last_run_dir.record["resume"]
    assert record["epoch"] == 1 and newest in record["skipped"][0] and \
        "truncated" in record["skipped"][0], record


@pytest.mark.torch_backend
def test_a_retry_removes_the_torn_temporary_and_records_each_attempt(torch_runs):
    base, straight = torch_runs
    runner = HorovodRunner(np=-2, backend="torch", output_dir=str(base / "retry"), max_retries=1)
    result = runner.run(torch_fit, epochs=4, killed_once=True)
    assert result["weights"] == straight["weights"] and result["start"] == 2
    assert result["restarts"] == "1", "TORCHELASTIC_RESTART_COUNT says which attempt this is"
    folder = runner.last_run_dir.file("checkpoints")
    assert not [n for n in os.listdir(folder) if n.startswith(".tmp-")], "torn file removed"
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    first, second = record["attempts"]
    assert first["status"] == "failed" and "signal 9" in first["retryable"]
    assert sorted(first["rank_pids"]) == sorted(second["rank_pids"]) == ["0", "1"]
    assert set(first["rank_pids"].values()).isdisjoint(second["rank_pids"].values())
    assert first["hosts"] and second["restored"].endswith("epoch-0002.pt")
    assert record["resume"]["restored"].endswith("epoch-0002.pt"), "resume says what was restored"
    # the run folder is on rank 0's own disk: it is the nearest copy, none is kept beside it
    assert record["resume"]["copy"] == "folder", record["resume"]
    from sparkhvd.checkpoint import host_copy

    assert not os.path.exists(os.path.join(host_copy.base_folder(), runner.last_run_dir.run_id))


def torch_fit_big(epochs):
    """Checkpoints of ~0.7 MB (a 300x300 layer and its momentum)."""
    import torch

    import sparkhvd.torch as st

    ctx = st.setup()
    model = ctx.wrap(torch.nn.Linear(300, 300))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = st.Checkpoints(model, opt)
    for epoch in range(ckpt.restore(), epochs):
        opt.zero_grad()
        model(torch.randn(4, 300)).sum().backward()
        opt.step()
        ckpt.save(epoch)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root, as in CI): a run folder on a disk that fills up."""
    import subprocess

    path = tmp_path / "small"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.torch_backend
def test_a_full_disk_names_the_file_the_free_space_and_the_last_good_checkpoint(small_disk):
    runner = HorovodRunner(np=-2, backend="torch", output_dir=str(small_disk))
    with pytest.raises(TrainingError) as info:
        runner.run(torch_fit_big, epochs=6)
    message = str(info.value)
    assert "No space left on device" in message and "MiB free" in message, message
    folder = runner.last_run_dir.file("checkpoints")
    latest = json.loads(open(os.path.join(folder, "latest.json")).read())
    assert f"last complete checkpoint is {folder}/{latest['file']}" in message, message
    assert "resume_from=True" in message
    names = os.listdir(folder)
    assert not [n for n in names if n.startswith(".tmp-")], "nothing partial left"
    assert f"epoch-{latest['epoch'] + 1:04d}.pt" not in names
    record = json.loads(open(os.path.join(folder, f"epoch-{latest['epoch']:04d}.json")).read())
    size = os.path.getsize(os.path.join(folder, latest["file"]))
    assert record["files"][latest["file"]]["size"] == size, "the named checkpoint is whole"


def torch_fit_on_a_store(url, storage_options, marker):
    """Checkpoints on a blob store (credentials passed on purpose); after epoch 1's, rank 0
    waits until the test has stopped the store."""
    import os
    import time

    import torch

    import sparkhvd.torch as st

    ctx = st.setup()
    model = ctx.wrap(torch.nn.Linear(3, 1))
    ckpt = st.Checkpoints(model, url=url, storage_options=storage_options)
    for epoch in range(3):
        ckpt.save(epoch)
        if epoch == 0 and ctx.rank == 0:
            print("epoch 1 saved", flush=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.1)


@pytest.mark.torch_backend
def test_a_store_that_stops_taking_writes_is_named_with_the_last_good_checkpoint(
        tmp_path, rank_lines):
    import threading

    from conftest import Azurite, wait_for

    store = Azurite.start(str(tmp_path / "azurite"))
    try:
        store.make_container("ckpt")
        marker = tmp_path / "stopped"

        def stop_store():
            if wait_for(lambda: any("epoch 1 saved" in line for line in rank_lines), 120):
                store.stop()
                marker.write_text("")

        threading.Thread(target=stop_store, daemon=True).start()
        runner = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path / "runs"))
        with pytest.raises(TrainingError) as info:
            runner.run(torch_fit_on_a_store, url=store.url("ckpt", "run1"),
                       storage_options=store.options(), marker=str(marker))
        message = str(info.value)
        assert "checkpoint of epoch 2 not written" in message, message
        assert "the last complete checkpoint is abfss://ckpt@" in message and \
            "epoch-0001.pt" in message, message
        assert "AccountKey" not in message, "no secret in the error"
    finally:
        store.stop()


def library_fit(steps=3):
    """A library that keeps its own checkpoints in ``st.output_dir("lib")`` (as an HF Trainer
    does in its output_dir); on the first attempt rank 1 is SIGKILLed after the checkpoint, so
    rank 0's next all_reduce fails as a knock-on (gloo: the peer went away)."""
    import os
    import signal

    import torch
    import torch.distributed as dist

    import sparkhvd.torch as st

    ctx = st.setup()
    folder = st.output_dir("lib")
    resumed = os.path.exists(os.path.join(folder, "checkpoint-1"))
    if ctx.rank == 0 and not resumed:
        os.makedirs(os.path.join(folder, "checkpoint-1"))
        with open(os.path.join(folder, "checkpoint-1", "state.txt"), "w") as f:
            f.write("step 1")
    dist.barrier()
    if ctx.rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(steps):
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    return {"resumed": resumed}


@pytest.mark.torch_backend
def test_a_retry_says_the_library_resumes_from_its_own_checkpoints(tmp_path, caplog, rank_lines):
    """Nothing of sparkhvd's to resume from, but the library's own checkpoints are in the run
    folder: the relaunch line and run.json say so, and rank 0's knock-on traceback (its peer
    was killed) stays in its log, off the console."""
    pytest.importorskip("torch")
    runner = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path), max_retries=1)
    with caplog.at_level("WARNING", logger="sparkhvd"):
        assert runner.run(library_fit) == {"resumed": True}
    lib = runner.last_run_dir.file("lib")
    relaunch = [r.getMessage() for r in caplog.records if "relaunching" in r.getMessage()]
    assert len(relaunch) == 1 and f"your library's own checkpoints in {lib}" in relaunch[0], \
        relaunch
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    first, second = record["attempts"]
    assert first["resumed_from"] is None and first["resumed_by"] is None
    assert second["resumed_from"] == lib and second["resumed_by"] == "library"
    log = open(runner.last_run_dir.file("logs/rank-0.log")).read()
    if "Traceback" in log:  # rank 0 saw its peer go (a knock-on error) before it was stopped
        assert not [line for line in rank_lines if "Traceback" in line], rank_lines
        assert [line for line in rank_lines if "a peer went away" in line], rank_lines


def torch_fit_killed_mid_upload(url, storage_options, epochs=3, host_copy=False, kill=True,
                                sharded=False):
    """Rank 0 saves in the background to ``url`` (``abfss://`` on Azurite), a 2048x2048 layer
    with momentum (about 33 MB); on the first attempt it is SIGKILLed while epoch 2's save is
    being written (serialised and uploaded). Deterministic per epoch, as :func:`torch_fit`.
    ``host_copy``: rank 0 also keeps its newest checkpoint on its host, and is killed once
    epoch 2's is kept there, while it uploads. ``sharded``: every
    rank saves its part with DCP (ShardedCheckpoints, each keeping its files on its host), and
    rank 1 is the one killed."""
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    import sparkhvd.torch as st

    ctx = st.setup()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(2048, 2048))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kind = st.ShardedCheckpoints if sharded else st.Checkpoints
    ckpt = kind(model, opt, url=url, storage_options=storage_options, resume=True,
                async_save=True, host_copy=host_copy)
    start = ckpt.restore()
    for epoch in range(start, epochs):
        x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(epoch * 10 + ctx.rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        ckpt.save(epoch)
        if kill and epoch == 1 and ctx.rank == int(sharded) and \
                os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            if host_copy and not sharded:  # kept on this host, with its record: its upload
                ckpt._background.wait()  # is under way (or just ended) when the kill comes
            else:
                while not ckpt._background.busy:  # the write of epoch-0002.pt has started...
                    time.sleep(0.001)
                time.sleep(0.05)  # ... and is under way
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt._finish_save()
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"start": start, "digest": round(digest, 6)}


@pytest.fixture(scope="module")
def uploads_store(tmp_path_factory):
    """An Azurite of the mid-upload tests, and the digest of the run they must all end with:
    4 epochs straight through, no rank killed."""
    pytest.importorskip("torch")
    from conftest import Azurite

    base = tmp_path_factory.mktemp("uploads")
    store = Azurite.start(str(base / "azurite"))
    try:
        store.make_container("ckpt")
        straight = HorovodRunner(np=-2, backend="torch", output_dir=str(base / "a")).run(
            torch_fit_killed_mid_upload, url=store.url("ckpt", "straight"),
            storage_options=store.options(), kill=False)
        yield store, straight["digest"]
    finally:
        store.stop()


@pytest.mark.torch_backend
@pytest.mark.azurite
@pytest.mark.parametrize("host_copy,sharded", [(False, False), (True, False), (True, True)],
                         ids=["from-abfss", "host-copy", "sharded-host-copy"])
def test_a_rank_killed_while_its_save_uploads_to_abfss_resumes_from_a_complete_checkpoint(
        tmp_path, host_copy, sharded, uploads_store):
    """async_save to abfss:// (Azurite): rank 0 SIGKILLed in the middle of a background save.
    The relaunch reads the newest checkpoint whose record was written -- the one before, or the
    one cut off if its upload had finished -- never a torn file, and ends with the weights of
    an uninterrupted run. With the host copy, each checkpoint is kept on this host with its
    record before its upload begins: rank 0 is killed once epoch 2's is, and the relaunch reads
    it from this host's disk whether or not its upload had ended. Sharded
    (DCP), rank 1 is killed: every rank kept its own files, each rank of the relaunch reads
    every file from this host, whichever checkpoint was the newest complete one."""
    store, straight_digest = uploads_store
    folder = f"killed-{int(host_copy)}{int(sharded)}"  # each variant's own checkpoints
    runner = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path / "b"), max_retries=1)
    result = runner.run(torch_fit_killed_mid_upload, url=store.url("ckpt", folder),
                        storage_options=store.options(), host_copy=host_copy, sharded=sharded)
    first, second = runner.last_run_dir.record["attempts"]
    assert first["status"] == "failed" and "signal 9" in first["retryable"], first
    restored = second["restored"].rsplit("/", 1)[-1]
    suffix = "" if sharded else ".pt"
    assert restored in (f"epoch-0001{suffix}", f"epoch-0002{suffix}"), second
    assert result["start"] == int(restored[6:10])
    assert result["digest"] == straight_digest, "the same weights as straight through"
    copy = runner.last_run_dir.record["resume"]["copy"]
    if sharded:  # each rank's part is kept before the commit: whichever is the newest
        assert copy == "host", (copy, restored)
        from sparkhvd.checkpoint import host_copy as copies

        run_id = runner.last_run_dir.run_id
        assert not os.path.exists(os.path.join(copies.base_folder(), run_id)), "cleaned"
    elif host_copy:
        assert (copy, restored) == ("host", "epoch-0002.pt")
    else:
        assert copy == "folder", (copy, restored)


def torch_fit_with_memory_snapshots(url, epochs=2, steps=6, kill_at=None):
    """Adam and BatchNorm under DDP, a checkpoint due every step with ``memory_snapshots``,
    data seeded by (epoch, step, rank). ``kill_at`` = (epoch, step): on the first attempt rank
    0's first save is written and its second never ends (a slow disk: every later due save is
    a memory snapshot), and rank 1 is SIGKILLed after that step."""
    import os
    import signal
    import threading

    import torch
    import torch.distributed as dist

    import sparkhvd.torch as st
    from sparkhvd.torch import checkpoints as torch_checkpoints

    ctx = st.setup()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if kill_at and first_attempt and ctx.rank == 0:
        write, calls = torch_checkpoints.save_state, []

        def slow_disk(state, f):
            calls.append(1)
            if len(calls) > 1:
                threading.Event().wait()  # never ends: the rank is torn down first
            write(state, f)

        torch_checkpoints.save_state = slow_disk
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                         torch.nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = st.Checkpoints(model, opt, url=url, every_steps=1, async_save=True,
                          memory_snapshots=True)
    start = ckpt.restore()
    after = ckpt.restored.get("step", 0) if start == ckpt.restored.get("epoch") else 0
    for epoch in range(start, epochs):
        for step in range(after + 1 if epoch == start else 1, steps + 1):
            seed = epoch * 1000 + step * 10 + ctx.rank
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            ckpt.step(epoch)
            if first_attempt and kill_at == (epoch, step) and ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save(epoch)
    ckpt._finish_save()
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"start": start, "digest": round(digest, 6)}


@pytest.mark.torch_backend
def test_a_lost_rank_costs_at_most_the_step_in_progress_with_memory_snapshots(tmp_path):
    """np=2 on local Spark, Adam + BatchNorm, a checkpoint due every step with
    ``memory_snapshots=True``; rank 0's second save never finishes writing, so steps 3 on are
    kept as memory snapshots only; rank 1 is SIGKILLed after step 4. The relaunch restores the
    newest snapshot from rank 0's host -- step 4, or step 3 when step 4's copy was still in
    flight -- not the folder's step 1, and ends with the weights of an uninterrupted run
    (model, Adam's moments and BatchNorm's statistics restored exactly)."""
    pytest.importorskip("torch")
    straight = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path / "a")).run(
        torch_fit_with_memory_snapshots, url=str(tmp_path / "straight"))
    runner = HorovodRunner(np=-2, backend="torch", output_dir=str(tmp_path / "b"), max_retries=1)
    result = runner.run(torch_fit_with_memory_snapshots, url=str(tmp_path / "killed"),
                        kill_at=(0, 4))
    first, second = runner.last_run_dir.record["attempts"]
    assert first["status"] == "failed" and "signal 9" in first["retryable"], first
    restored = second["restored"].rsplit("/", 1)[-1]
    assert restored in ("epoch-0000-step-0000003.snapshot",
                        "epoch-0000-step-0000004.snapshot"), second
    resume = runner.last_run_dir.record["resume"]
    assert (resume["copy"], resume["uploaded"]) == ("host", False), resume
    assert result["digest"] == straight["digest"], "the same weights as straight through"


def keras_fit_killed(url, storage_options, epochs=4, kill=True, hosts=None, async_save=False):
    """A small deterministic Keras fit checkpointing to ``url`` every epoch; on the run's first
    attempt rank 0 is SIGKILLed as epoch 3 begins (epoch 2's checkpoint written, or with
    ``async_save`` perhaps still being kept). ``hosts``: a folder of two "hosts" whose
    host-copy folders the ranks swap in the relaunch (rank 0 lands where rank 1 was)."""
    import os
    import signal

    import numpy as np
    import tensorflow as tf

    from sparkhvd.common import protocol
    from sparkhvd.keras import KerasDistributed

    kd = KerasDistributed(epochs=epochs, batch_size=16, checkpoint=url,
                          storage_options=storage_options, async_save=async_save)
    if hosts:
        from sparkhvd.checkpoint import host_copy

        first = os.environ.get(protocol.ATTEMPT_ENV) == "1"
        os.environ[host_copy.DIR_ENV] = os.path.join(
            hosts, f"host-{kd.rank if first else 1 - kd.rank}")
    tf.keras.utils.set_random_seed(7)
    x = np.random.RandomState(kd.rank).rand(64, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with kd.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((4,)), tf.keras.layers.Dense(8),
                                     tf.keras.layers.Dense(1)])
        model.compile(optimizer=kd.optimizer(tf.keras.optimizers.Adam(0.01)), loss="mse")

    class KillRankZero(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if kill and epoch == 2 and kd.rank == 0 and \
                    os.environ.get(protocol.ATTEMPT_ENV) == "1":
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(x, y, batch_size=16, shuffle=False,
              **kd.fit_kwargs(model, callbacks=[KillRankZero()]))
    return {"start": kd.initial_epoch, "weights": [w.tolist() for w in model.get_weights()]}


@pytest.mark.every_profile  # Keras 2 (.h5) on Horovod, and Keras 3 (.keras) on tf.distribute
@pytest.mark.ranks
@pytest.mark.azurite
@pytest.mark.parametrize("moved, async_save", [(False, False), (True, False), (False, True)],
                         ids=["same-host", "rank-0-moved", "same-host-async"])
def test_a_keras_relaunch_restores_rank_0s_host_copy(tmp_path, backend, moved, async_save):
    """Keras checkpoints to abfss:// (Azurite): rank 0 keeps the newest one's files (model and
    optimizer) on its host too. Killed, the run relaunches and reads them from that host, not
    from Azurite -- rank 0 itself, or (rank 0 moved to the other host) the rank now on it sends
    them -- and ends with the weights of an uninterrupted run; the host copies go when the
    function returns. With ``async_save`` (uploads behind the saves) the kill may come before
    epoch 2's checkpoint is kept: the relaunch starts from epoch 1's or 2's, the same weights."""
    from conftest import Azurite
    from sparkhvd.checkpoint import host_copy

    store = Azurite.start(str(tmp_path / "azurite"))
    try:
        store.make_container("ckpt")
        straight = HorovodRunner(np=-2, backend=backend, output_dir=str(tmp_path / "a")).run(
            keras_fit_killed, url=store.url("ckpt", "straight"),
            storage_options=store.options(), kill=False)
        runner = HorovodRunner(np=-2, backend=backend, output_dir=str(tmp_path / "b"),
                               max_retries=1)
        hosts = str(tmp_path / "hosts") if moved else None
        result = runner.run(keras_fit_killed, url=store.url("ckpt", "killed"),
                            storage_options=store.options(), hosts=hosts,
                            async_save=async_save)
    finally:
        store.stop()
    record = runner.last_run_dir.record
    first, _ = record["attempts"]
    assert first["status"] == "failed" and "signal 9" in first["retryable"], first
    starts = (1, 2) if async_save else (2,)
    assert result["start"] in starts and record["resume"]["epoch"] == result["start"], \
        record["resume"]
    assert record["resume"]["copy"] == ("peer" if moved else "host"), record["resume"]
    assert result["weights"] == straight["weights"], "the same weights as straight through"
    bases = [os.path.join(hosts, f"host-{n}", host_copy.BASE_NAME) for n in (0, 1)] \
        if hosts else [host_copy.base_folder()]
    assert not any(os.path.exists(os.path.join(base, runner.last_run_dir.run_id))
                   for base in bases)


def keras_copy_sent_between_ranks():
    """Rank 1 sends rank 0 what a host copy's restore sends, over the backend's collectives,
    in pieces of 12 bytes (many, and a last one that is not whole)."""
    from sparkhvd.keras import KerasDistributed, restore_collectives

    kd = KerasDistributed(epochs=1, checkpoint=False)
    restore_collectives.CHUNK = 12
    world, rank = kd.flavour.copies(), kd.rank
    data = bytes(range(256)) * 3 + b"xyz"
    return {
        "held": world.gather({"epoch-0001.h5": f"sha of rank {rank}" * (rank + 1)}),
        "sent": world.broadcast_bytes(data if rank == 1 else None, 1, rank) == data,
        "nothing": world.broadcast_bytes(None, 1, rank),
        "record": world.broadcast_record({"epoch": 3} if rank == 0 else None, 0),
        "everyone": [world.everyone(True), world.everyone(rank == 0)],
    }


@pytest.mark.every_profile  # Horovod's collectives, and a tf.distribute strategy's
@pytest.mark.ranks
def test_a_keras_host_copy_travels_between_ranks_whole(backend):
    result = HorovodRunner(np=-2, backend=backend).run(keras_copy_sent_between_ranks)
    assert result == {"held": [{"epoch-0001.h5": "sha of rank 0"},
                               {"epoch-0001.h5": "sha of rank 1" * 2}],
                      "sent": True, "nothing": None, "record": {"epoch": 3},
                      "everyone": [True, False]}


@pytest.mark.every_profile
def test_the_sweep_after_a_run_deletes_dead_ranks_copies_on_the_executors_hosts(
        spark, tmp_path, caplog):
    """The job a succeeded run starts when its earlier attempts used hosts the last did not
    (sparkhvd.driver.host_sweep), on real executors: the run's rank folders no live process
    owns go, a live one stays, the run's ``env=`` says where copies are; a host no task
    reached is said."""
    import socket
    import subprocess
    import sys

    from sparkhvd.checkpoint import host_copy
    from sparkhvd.driver.host_sweep import sweep_hosts
    from sparkhvd.spark.sparkview import SparkView

    run = tmp_path / host_copy.BASE_NAME / "20261203-swept"
    tmp_path.joinpath(host_copy.BASE_NAME).mkdir(mode=0o700)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        for rank, owner in ((0, ended.pid), (1, live.pid)):
            (run / f"rank-{rank}").mkdir(parents=True)
            (run / f"rank-{rank}" / "epoch-0001.pt").write_bytes(b"state")
            (run / f"rank-{rank}" / "owner.pid").write_text(str(owner))
        here = socket.gethostname()
        with caplog.at_level("INFO", logger="sparkhvd"):
            reached = sweep_hosts(SparkView(spark), "20261203-swept", {here, "gone-host"}, 2,
                                  {host_copy.DIR_ENV: str(tmp_path), "OTHER": "x"})
        assert reached == {here}
        assert sorted(p.name for p in run.iterdir()) == ["rank-1"]
        said = caplog.text
        assert f"swept the host copies earlier attempts kept on {here} (1 rank folder(s))" in said
        assert "kept on gone-host were not swept" in said
    finally:
        live.kill()
        live.wait()
