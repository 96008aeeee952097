"""``st.Checkpoints(async_save=True)``: the step waits only for the host copy; the write goes on
in the background under the documented rules (sparkhvd.torch.async_save). One process, a real
checkpoint folder; a gate on the store holds a write in flight where a rule needs one."""
from __future__ import annotations

import collections
import json
import os
import threading

import pytest

torch = pytest.importorskip("torch")

import sparkhvd.torch as st  # noqa: E402
from conftest import gated_store  # noqa: E402
from sparkhvd.common.function_end import function_ended  # noqa: E402
from sparkhvd.torch.async_save import HostSnapshot, StagingCopies  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train_step(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(16, 4)).sum().backward()
    opt.step()


def _checkpoints(tmp_path, model, opt, **kw):
    ckpt = st.Checkpoints(model, opt, url=str(tmp_path / "ckpt"), resume=False,
                          async_save=True, **kw)
    store = gated_store(str(tmp_path / "ckpt"))
    ckpt.store = store
    return ckpt, store


def _latest(tmp_path) -> dict:
    return json.loads((tmp_path / "ckpt" / "latest.json").read_text())


def test_the_checkpoint_is_the_state_at_the_step_not_at_the_end_of_the_write(tmp_path):
    model, opt = _model_and_opt()
    ckpt, store = _checkpoints(tmp_path, model, opt, every_steps=1)
    _train_step(model, opt)
    at_step = {k: v.clone() for k, v in model.state_dict().items()}
    store.gate.clear()
    name = ckpt.step(0, note=[1])
    assert name == "epoch-0000-step-0000001.pt"
    store.writing.wait(10)
    for _ in range(3):  # training goes on while the write is held
        _train_step(model, opt)
    assert not (tmp_path / "ckpt" / "latest.json").exists()  # nothing half-written is named
    store.gate.set()
    function_ended()  # the function's end waits for the save in flight
    assert _latest(tmp_path)["file"] == name
    saved = torch.load(tmp_path / "ckpt" / name, weights_only=False)
    for key, value in at_step.items():
        assert torch.equal(saved["model"][key], value), key
    assert saved["extra"] == {"note": [1]} and saved["step"] == 1
    assert saved["optimizer"]["state"][0]["step"] == 1  # Adam's state at the step, too


def test_a_save_due_while_one_is_in_flight_is_skipped_and_said_once(tmp_path, capsys):
    model, opt = _model_and_opt()
    ckpt, store = _checkpoints(tmp_path, model, opt, every_steps=1)
    store.gate.clear()
    _train_step(model, opt)
    first = ckpt.step(0)
    store.writing.wait(10)
    skipped = []
    for _ in range(3):
        _train_step(model, opt)
        skipped.append(ckpt.step(0))
    assert skipped == [None, None, None]
    said = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert len(said) == 1 and first in said[0] and "step-0000002" in said[0], said
    store.gate.set()
    ckpt._finish_save()
    _train_step(model, opt)
    assert ckpt.step(0) == "epoch-0000-step-0000005.pt"  # idle again: the next one is taken
    function_ended()
    assert _latest(tmp_path)["step"] == 5


def test_the_background_write_runs_below_the_training_threads_priority():
    """Serialising and writing take the CPU the step leaves idle: on Linux each thread has its
    own nice value, and the writer's is above the caller's."""
    from sparkhvd.checkpoint.background import BackgroundSave

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    if nice() >= 19:
        pytest.skip("this process already runs at the lowest priority")
    seen: list[int] = []
    background = BackgroundSave()
    background.start("probe", lambda: seen.append(nice()))
    background.wait()
    assert seen and seen[0] > nice(), seen


@pytest.mark.parametrize("kind", ["Checkpoints", "ShardedCheckpoints"])
def test_a_dropped_helper_is_freed_but_its_save_in_flight_still_finishes(tmp_path, kind):
    """The function-end and exit waits do not keep a helper (and its host buffers: gigabytes
    for a large model) alive in a process that makes several; a save still in flight holds
    its helper until it is written, so the function's end still waits for it."""
    import gc
    import weakref

    model, opt = _model_and_opt()
    ckpt, store = (_checkpoints if kind == "Checkpoints" else _sharded)(
        tmp_path, model, opt, every_steps=1)
    _train_step(model, opt)
    store.gate.clear()
    name = ckpt.step(0)
    store.writing.wait(10)
    helper = weakref.ref(ckpt)
    del ckpt
    gc.collect()
    assert helper() is not None, "the save in flight holds its helper"
    store.gate.set()
    function_ended()  # waits for it
    assert _latest(tmp_path)["file"] == name
    gc.collect()
    assert helper() is None, "nothing else holds a helper whose saves ended"


def test_every_seconds_counts_from_the_step_a_background_save_was_taken_at(tmp_path):
    model, opt = _model_and_opt()
    ckpt, store = _checkpoints(tmp_path, model, opt, every_seconds=3600)
    store.gate.clear()
    _train_step(model, opt)
    ckpt.save(0, step=1)
    taken = ckpt._last_save
    store.writing.wait(10)
    store.gate.set()  # the write ends later ...
    ckpt._finish_save()
    assert ckpt._last_save == taken  # ... and the clock still counts from the step
    function_ended()


def test_an_explicit_save_waits_for_the_one_in_flight_then_starts_its_own(tmp_path):
    model, opt = _model_and_opt()
    ckpt, store = _checkpoints(tmp_path, model, opt)
    store.gate.clear()
    ckpt.save(0)
    store.writing.wait(10)
    done = threading.Event()

    def second() -> None:
        ckpt.save(1)
        done.set()

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    assert not done.wait(0.5)  # held: the first is still being written
    store.gate.set()
    assert done.wait(30)
    function_ended()
    assert _latest(tmp_path)["epoch"] == 2
    assert (tmp_path / "ckpt" / "epoch-0001.pt").exists()


def test_a_failed_background_write_is_raised_by_the_next_call_naming_the_last_good_one(
        tmp_path):
    model, opt = _model_and_opt()
    ckpt, store = _checkpoints(tmp_path, model, opt)
    ckpt.save(0)
    ckpt._finish_save()
    store.fail = OSError(28, "No space left on device")
    ckpt.save(1)
    ckpt._background._thread.join(30)
    with pytest.raises(OSError, match="epoch-0001.pt") as info:
        ckpt.step(2)
    assert "No space left" in str(info.value)
    assert _latest(tmp_path)["epoch"] == 1  # the previous checkpoint is still the newest


def test_the_end_of_the_function_raises_a_failed_last_save(tmp_path):
    model, opt = _model_and_opt()
    ckpt, store = _checkpoints(tmp_path, model, opt)
    store.fail = OSError(5, "the store refused the write")
    ckpt.save(0)
    with pytest.raises(OSError, match="refused"):
        function_ended()


def test_resume_from_an_async_checkpoint_is_exact(tmp_path):
    model, opt = _model_and_opt()
    ckpt, _ = _checkpoints(tmp_path, model, opt, every_steps=2)
    for _ in range(4):
        _train_step(model, opt)
        ckpt.step(0, seen=7)
        ckpt._finish_save()
    function_ended()
    again, opt2 = _model_and_opt()
    back = st.Checkpoints(again, opt2, url=str(tmp_path / "ckpt"), resume=str(tmp_path / "ckpt"))
    assert back.restore() == 0 and back.restored == {"seen": 7, "epoch": 0, "step": 4}
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_a_checkpoint_skips_torchs_crc32s_and_leaves_the_users_option_as_it_was(tmp_path):
    """The record's SHA-256 is the file's check; torch's own CRC-32s would cost a background
    save a core-second per GB (sparkhvd.torch.serialise). torch.load reads the file as is."""
    if not hasattr(torch.serialization, "get_crc32_options"):
        pytest.skip("torch < 2.6 has no CRC-32 option")
    import zipfile

    model, opt = _model_and_opt()
    ckpt, _ = _checkpoints(tmp_path, model, opt, every_steps=1)
    _train_step(model, opt)
    name = ckpt.step(0)
    ckpt._finish_save()
    assert torch.serialization.get_crc32_options() is True  # the user's default, untouched
    with zipfile.ZipFile(tmp_path / "ckpt" / name) as archive:
        assert {info.CRC for info in archive.infolist() if "/data/" in info.filename} == {0}
    state = torch.load(tmp_path / "ckpt" / name, weights_only=False)
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value), key


def test_host_buffers_are_reused_between_saves_and_replaced_when_a_shape_changes():
    snapshot = HostSnapshot()
    state = {"w": torch.ones(3), "groups": [{"lr": 0.1, "params": [0]}]}
    first = snapshot.take(state)
    state["w"].add_(1)
    state["groups"][0]["lr"] = 0.2
    assert torch.equal(first["w"], torch.ones(3)) and first["groups"][0]["lr"] == 0.1
    second = snapshot.take(state)
    assert second["w"] is first["w"] and torch.equal(second["w"], torch.full((3,), 2.0))
    state["w"] = torch.zeros(5)
    third = snapshot.take(state)
    assert third["w"] is not first["w"] and third["w"].shape == (5,)
    assert snapshot.nbytes == 5 * 4


def test_a_state_dicts_kind_and_versions_are_kept():
    model, _ = _model_and_opt()
    state = model.state_dict()
    copied = HostSnapshot().take(state)
    assert isinstance(copied, collections.OrderedDict)
    assert copied._metadata == state._metadata  # load_state_dict reads the module versions


class FakeGpuCopies(StagingCopies):
    """Every tensor is "on the GPU": records the pinned buffers and the one batched copy."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned, self.batches = 0, []

    @staticmethod
    def on_gpu(tensor) -> bool:
        return True

    def buffer_like(self, tensor):
        self.pinned += 1
        return torch.empty(tensor.shape, dtype=tensor.dtype)

    def copy_from_gpu(self, pairs) -> None:
        self.batches.append(len(pairs))
        for buffer, tensor in pairs:
            buffer.copy_(tensor)


def test_gpu_tensors_go_into_pinned_buffers_in_one_side_stream_copy_per_save():
    copies = FakeGpuCopies()
    snapshot = HostSnapshot(copies)
    state = {"a": torch.ones(2), "b": {"c": torch.zeros(3)}, "n": 4}
    snapshot.take(state)
    snapshot.take(state)
    assert copies.pinned == 2  # pinned once, reused
    assert copies.batches == [2, 2]  # one wait for the side stream per save


class FakeRegisteringCopies(FakeGpuCopies):
    """... and records the buffers page-locked (``cudaHostRegister``) and unlocked."""

    def __init__(self) -> None:
        super().__init__()
        self.locked: dict[int, int] = {}  # data pointer -> bytes

    def pin(self, buffer) -> bool:
        assert buffer.data_ptr() not in self.locked
        self.locked[buffer.data_ptr()] = buffer.numel() * buffer.element_size()
        return True

    def unpin(self, buffer) -> None:
        del self.locked[buffer.data_ptr()]


def test_a_snapshot_slots_mappings_are_page_locked_for_gpu_copies_and_unlocked_first(tmp_path):
    """A memory snapshot's slot is a file mapped into memory, not torch's pinned memory: its
    regions are registered with CUDA (as DCP's stager does its shared memory) so the copies
    from the GPU are asynchronous, and unregistered before their mappings go -- when the
    layout changes and when the function ends."""
    from sparkhvd.torch.snapshot_ring import _Slot

    copies = FakeRegisteringCopies()
    slot = _Slot(str(tmp_path / "snapshot-0"), copies)
    state = {"w": torch.ones(1024), "b": torch.zeros(3), "empty": torch.zeros(0), "n": 4}
    assert slot.plan(state, lambda: 1e12)
    assert sorted(copies.locked.values()) == [12, 4096]  # the empty one has nothing to lock
    taken, pairs = slot.take_now(state, {state["w"].data_ptr()})
    slot.copy_later(pairs)
    assert torch.equal(taken["w"], state["w"]) and copies.batches == [2, 1]  # now, later
    assert slot.plan(state, lambda: 1e12) and len(copies.locked) == 2, "same layout: kept"
    state["w"] = torch.ones(2048)
    assert slot.plan(state, lambda: 1e12)
    assert sorted(copies.locked.values()) == [12, 8192]
    slot.unmap()
    assert copies.locked == {}


def _sharded(tmp_path, model, opt, **kw):
    ckpt = st.ShardedCheckpoints(model, opt, url=str(tmp_path / "ckpt"), resume=False,
                                 async_save=True, **kw)
    store = gated_store(str(tmp_path / "ckpt"))
    ckpt.store = store
    return ckpt, store


def test_a_sharded_save_is_the_state_at_the_step_and_committed_only_when_written(tmp_path):
    """DCP's async_save: staged at the step, written and committed in the background; nothing
    is named until every file is in, and a resume loads exactly the state at the step."""
    model, opt = _model_and_opt()
    ckpt, store = _sharded(tmp_path, model, opt, every_steps=1)
    _train_step(model, opt)
    at_step = {k: v.clone() for k, v in model.state_dict().items()}
    store.gate.clear()
    name = ckpt.step(0, note=[2])
    assert name == "epoch-0000-step-0000001"
    store.writing.wait(10)
    for _ in range(2):
        _train_step(model, opt)
        assert ckpt.step(0) is None  # due, skipped: one save in flight
    assert not (tmp_path / "ckpt" / "latest.json").exists()
    store.gate.set()
    function_ended()
    assert ckpt._staging._stager is None, "the function's end lets the host buffers go"
    record = _latest(tmp_path)
    assert record["file"] == name and record["extra"] == {"note": [2]} and record["step"] == 1
    assert all(entry["rank"] == 0 for entry in record["files"].values())

    fresh, fresh_opt = _model_and_opt()
    _train_step(fresh, fresh_opt)
    back = st.ShardedCheckpoints(fresh, fresh_opt, url=str(tmp_path / "ckpt"), resume=True)
    assert back.restore() == 0 and back.restored["step"] == 1
    for key, value in at_step.items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_a_failed_sharded_write_commits_nothing_and_is_raised_by_the_next_step(tmp_path):
    model, opt = _model_and_opt()
    ckpt, store = _sharded(tmp_path, model, opt, every_steps=1)
    _train_step(model, opt)
    assert ckpt.step(0) == "epoch-0000-step-0000001"
    ckpt._finish_save()
    store.fail = OSError(28, "No space left on device")
    _train_step(model, opt)
    assert ckpt.step(0) == "epoch-0000-step-0000002"
    ckpt._background._thread.join(30)
    with pytest.raises(OSError, match="No space left.*epoch-0000-step-0000001"):
        ckpt.step(0)
    assert _latest(tmp_path)["file"] == "epoch-0000-step-0000001"  # the one before stays


def test_a_sharded_save_still_works_where_dcps_stager_stages_only_once(tmp_path):
    """torch 2.11's ``DefaultStager`` closes its inner stager after every stage (seen on a GPU:
    the next save failed with ``KeyError: <class 'type'>``); a spent stager is replaced."""
    model, opt = _model_and_opt()
    ckpt, _ = _sharded(tmp_path, model, opt, every_steps=1)
    for step in (1, 2, 3):
        _train_step(model, opt)
        assert ckpt.step(0) == f"epoch-0000-step-000000{step}"
        ckpt._finish_save()
        ckpt._staging._stager._state_dict_stager.close()  # what torch 2.11 does
    assert _latest(tmp_path)["step"] == 3
    ckpt._staging.close()
    assert ckpt._staging._stager is None


def test_the_writing_rank_removes_what_a_killed_writer_left_in_its_url_folder(tmp_path):
    """A ``.tmp-*`` file older than the rank's process (by a margin: a blob store's clock)
    is a write nobody finishes; a newer one may be in flight, and stays."""
    import time

    from sparkhvd.checkpoint.stores import TORN_MARGIN_S

    folder = tmp_path / "ckpt"
    (folder / "shards").mkdir(parents=True)
    torn, fresh = folder / "shards" / ".tmp-0a1b2c-part-1.bin", folder / ".tmp-3d4e5f-model.pt"
    for path in (torn, fresh, folder / "epoch-0001.pt"):
        path.write_bytes(b"x")
    old = time.time() - 3600 - TORN_MARGIN_S
    os.utime(torn, (old, old))
    model, opt = _model_and_opt()
    st.Checkpoints(model, opt, url=str(folder), resume=False)
    assert not torn.exists() and fresh.exists() and (folder / "epoch-0001.pt").exists()
