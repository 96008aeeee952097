"""``KerasDistributed(async_save=True)``'s checkpoint callback in one process: the step waits
only while the model and optimizer are serialised; the write goes on in the background under
the rules the torch helpers keep (one in flight, skipped and said once, errors raised later,
the function's end waits). A real ``model.fit`` and a real checkpoint folder; a gate on the
store holds a write in flight."""
from __future__ import annotations

import json

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from conftest import gated_store  # noqa: E402
from sparkhvd.common.function_end import function_ended  # noqa: E402
from sparkhvd.keras import checkpoints  # noqa: E402
from sparkhvd.keras.callbacks import RankZeroCheckpoint  # noqa: E402

# every profile: Keras 2's and Keras 3's saves differ
pytestmark = [pytest.mark.timeout(180), pytest.mark.every_profile]


class Held(tf.keras.callbacks.Callback):
    """Holds the first write in flight for ``steps`` more steps, noting the weights at step 1."""

    def __init__(self, store, steps: int) -> None:
        super().__init__()
        self.store, self.steps, self.seen = store, steps, 0
        self.at_step_1: list = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == 1:
            self.at_step_1 = [w.copy() for w in self.model.get_weights()]
            self.store.gate.clear()
        elif self.seen == 1 + self.steps:
            self.store.gate.set()


def _fit(tmp_path, store, *callbacks, steps=6, **kw):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(steps * 4, 3)).astype("float32")
    saver = RankZeroCheckpoint(store, every_steps=1, async_save=True, **kw)
    # the held callback runs first: its gate is shut before step 1's save starts writing
    model.fit(x, x.sum(1), batch_size=4, epochs=1, verbose=0,
              callbacks=[*callbacks, saver], shuffle=False)
    return model, saver


def test_the_checkpoint_is_the_state_at_the_step_and_due_saves_are_skipped_said_once(
        tmp_path, capsys):
    store = gated_store(str(tmp_path / "ckpt"))
    held = Held(store, steps=3)
    model, saver = _fit(tmp_path, store, held)
    function_ended()  # waits for the save in flight
    said = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert len(said) == 1 and "epoch-0000-step-0000001" in said[0], said
    assert saver.saved[0].startswith("epoch-0000-step-0000001."), saver.saved
    held_steps = ("epoch-0000-step-0000002", "epoch-0000-step-0000003")  # the gate was shut
    assert not [n for n in saver.saved if n.startswith(held_steps)], saver.saved
    first = json.loads((tmp_path / "ckpt" / "epoch-0000-step-0000001.json").read_text())
    fresh = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    fresh.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    checkpoints.restore(store, first, fresh)
    for got, want in zip(fresh.get_weights(), held.at_step_1):
        np.testing.assert_array_equal(got, want)  # the state at step 1, not at the write's end
    newest = json.loads((tmp_path / "ckpt" / "latest.json").read_text())
    assert saver.saved[-1].startswith(checkpoints.checkpoint_name(newest["epoch"],
                                                                  newest["step"]))


def test_a_failed_background_write_is_raised_at_the_next_step(tmp_path):
    store = gated_store(str(tmp_path / "ckpt"))
    store.fail = OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        _fit(tmp_path, store, steps=40)
    function_ended(returned=False)  # nothing left in flight to raise
    assert not (tmp_path / "ckpt" / "latest.json").exists()


def test_a_checkpoint_is_kept_on_the_host_with_its_record_before_its_write(
        tmp_path, monkeypatch, capsys):
    """The folder elsewhere (``abfss://``): the writing rank keeps each checkpoint's files and
    record on its host *before* it writes them there, so a write that fails (or never ends)
    still leaves a checkpoint a relaunch restores -- newer than the folder's newest, said in
    the resume line and marked not uploaded."""
    from sparkhvd.checkpoint import host_copy, nearest_copy
    from sparkhvd.checkpoint.read import announce_resume
    from sparkhvd.common import protocol

    monkeypatch.setenv(protocol.RUN_ID_ENV, "20261128-run")
    monkeypatch.setenv(host_copy.DIR_ENV, str(tmp_path / "host"))
    store = gated_store(str(tmp_path / "ckpt"))
    store.__class__ = type("Elsewhere", (type(store),), {"on_this_host": False})
    at_step_2: list = []

    class FailFromStep2(tf.keras.callbacks.Callback):  # runs before the saver's step 2
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == 2:
                at_step_2.extend(w.copy() for w in self.model.get_weights())
                store.fail = OSError(28, "No space left on device")

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    saver = RankZeroCheckpoint(store, every_steps=1)
    with pytest.raises(OSError, match="No space left"):
        model.fit(x, x.sum(1), batch_size=4, epochs=1, verbose=0, shuffle=False,
                  callbacks=[FailFromStep2(), saver])
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text())["step"] == 1
    (kept,) = host_copy.records(store.key)
    assert kept["step"] == 2 and set(kept["files"]) == set(host_copy.find_all())

    store.fail = None
    fresh = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    fresh.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    checkpoints.build_optimizer(fresh.optimizer, fresh)
    record, problems, copy = checkpoints.restore_nearest(store, fresh, 0, nearest_copy.Alone())
    assert (record["step"], copy, record["uploaded"]) == (2, "host", False), (record, problems)
    for got, want in zip(fresh.get_weights(), at_step_2):
        np.testing.assert_array_equal(got, want)  # step 2's state, which the folder never got
    announce_resume(store, record["file"], 0, problems, 2, copy, record["uploaded"])
    assert "its upload had not ended" in capsys.readouterr().out.splitlines()[-1]


def test_uploads_lag_behind_the_saves_on_the_host_and_a_superseded_step_stays_there(
        tmp_path, monkeypatch, capsys):
    """``async_save`` with the folder elsewhere: a save ends once its files are kept on the
    host, and their write to the folder is queued behind -- so a slow folder (a gate holds step
    2's write) skips no save. A step checkpoint superseded before its write began stays on
    the host only (said once); the epoch's end is always written; the function's end waits."""
    from sparkhvd.checkpoint import host_copy
    from sparkhvd.common import protocol

    monkeypatch.setenv(protocol.RUN_ID_ENV, "20261128-run")
    monkeypatch.setenv(host_copy.DIR_ENV, str(tmp_path / "host"))
    store = gated_store(str(tmp_path / "ckpt"))
    store.__class__ = type("Elsewhere", (type(store),), {"on_this_host": False})
    savers: list = []

    class SlowFolder(tf.keras.callbacks.Callback):  # runs before the saver's save of the step
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            saver = savers[0]
            saver._background.wait()  # a real step outlasts keeping the last save on the host
            if self.seen == 2:
                saver._uploads.wait()  # step 1 is in the folder ...
                store.writing.clear()
                store.gate.clear()  # ... and step 2's write will wait here
            if self.seen == 3:  # step 2's write began before step 3 is saved (a write not
                assert store.writing.wait(30)  # begun yet is superseded by the next save)

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(24, 3)).astype("float32")
    savers.append(RankZeroCheckpoint(store, every_steps=1, async_save=True))
    model.fit(x, x.sum(1), batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[SlowFolder(), savers[0]])
    saver = savers[0]
    saver._background.wait()  # the epoch's save is kept on the host in the background too
    saved = [n.rsplit(".", 1)[0] for n in saver.saved]
    assert saved == [f"epoch-0000-step-000000{k}" for k in range(1, 7)] + ["epoch-0001"], saved
    assert store.writing.is_set() and _records(tmp_path) == ["epoch-0000-step-0000001.json"]
    (kept,) = host_copy.records(store.key)  # the newest, with its record, for a relaunch
    assert (kept["epoch"], kept["step"]) == (1, 0), kept
    out = capsys.readouterr().out
    assert out.count("is kept on this host only") == 1, out
    assert "epoch-0000-step-0000003" in out and "skipped" not in out, out

    store.gate.set()
    function_ended()  # waits for the uploads queued
    assert _records(tmp_path) == ["epoch-0000-step-0000001.json",
                                  "epoch-0000-step-0000002.json", "epoch-0001.json"]
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text())["epoch"] == 1


def _records(tmp_path) -> list:
    return sorted(n for n in (p.name for p in (tmp_path / "ckpt").iterdir())
                  if n.startswith("epoch-") and n.endswith(".json"))


def test_a_callback_whose_saves_ended_is_freed(tmp_path):
    """The function-end and exit waits do not keep the callback (and the files it holds in
    memory) alive in a process that fits several models, such as a notebook's kernel."""
    import gc
    import weakref

    store = gated_store(str(tmp_path / "ckpt"))
    model, saver = _fit(tmp_path, store)
    function_ended()
    callback = weakref.ref(saver)
    del saver, model
    gc.collect()
    assert callback() is None


def test_the_writing_rank_removes_what_a_killed_writer_left_in_its_url_folder(tmp_path):
    """As for torch's Checkpoints: a ``.tmp-*`` file older than the writing rank's process
    goes when its callback is made; a newer one may be in flight and stays, and a rank that
    does not write leaves the folder alone."""
    import os
    import time

    from sparkhvd.checkpoint.stores import TORN_MARGIN_S

    folder = tmp_path / "ckpt"
    folder.mkdir()
    torn, fresh = folder / ".tmp-0a1b2c-epoch-0001.h5", folder / ".tmp-3d4e5f-epoch-0002.h5"
    for path in (torn, fresh):
        path.write_bytes(b"x")
    old = time.time() - 3600 - TORN_MARGIN_S
    os.utime(torn, (old, old))
    RankZeroCheckpoint(str(folder), write=False)
    assert torn.exists()
    RankZeroCheckpoint(str(folder))
    assert not torn.exists() and fresh.exists()
