"""Nothing read from a checkpoint folder, a host copy, a memory snapshot or a shipped footer
runs code, whoever wrote it: each kind is planted -- a pickle whose loading would run a
command, with the record beside it made to match (what anyone who can write the folder can
do) -- and the resume stops with a ``CheckpointError`` that names the file, or passes it over
for an older good one. The planted command would create a marker file: it never exists."""
from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle

import numpy as np
import pytest

from sparkhvd.checkpoint import host_copy
from sparkhvd.common import protocol

pytestmark = pytest.mark.timeout(180)


class _Planted:
    """What an attacker pickles: unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _replace_in_records(folder, name: str, data: bytes) -> None:
    """Write ``data`` as the checkpoint file ``name`` and make every record that names it
    match (size, SHA-256): the record vouches for nothing."""
    (folder / name).write_bytes(data)
    for record_path in folder.glob("*.json"):
        record = json.loads(record_path.read_text())
        if name in (record.get("files") or {}):
            record["files"][name] = {**record["files"][name], "size": len(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}
            record_path.write_text(json.dumps(record))


def _model_and_opt(torch, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    return model, opt


def _planted_pt(torch, marker) -> bytes:
    out = io.BytesIO()
    torch.save({"model": {}, "epoch": 9, "extra": {"x": _Planted(str(marker))}}, out)
    return out.getvalue()


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_a_planted_torch_checkpoint_never_runs_and_the_older_good_one_is_restored(
        torch, tmp_path, capsys):
    import sparkhvd.torch as st

    marker, folder = tmp_path / "ran", tmp_path / "ckpt"
    model, opt = _model_and_opt(torch)
    ckpt = st.Checkpoints(model, opt, url=str(folder), resume=False)
    ckpt.save(0)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(1)
    _replace_in_records(folder, "epoch-0002.pt", _planted_pt(torch, marker))

    fresh, fresh_opt = _model_and_opt(torch, seed=1)
    epoch = st.Checkpoints(fresh, fresh_opt, url=str(folder), resume=True).restore()
    out = capsys.readouterr().out
    assert not marker.exists()
    assert epoch == 1 and all(torch.equal(fresh.state_dict()[k], v) for k, v in good.items())
    said = next(line for line in out.splitlines() if "epoch-0002.pt" in line)
    assert "UnsafeCheckpoint" in said and "system" in said, said
    assert "safe_types" in said, said


def test_a_planted_only_torch_checkpoint_stops_the_resume_naming_it(torch, tmp_path):
    import sparkhvd.torch as st
    from sparkhvd.common.errors import CheckpointError

    marker, folder = tmp_path / "ran", tmp_path / "ckpt"
    model, opt = _model_and_opt(torch)
    st.Checkpoints(model, opt, url=str(folder), resume=False).save(0)
    _replace_in_records(folder, "epoch-0001.pt", _planted_pt(torch, marker))
    with pytest.raises(CheckpointError) as raised:
        st.Checkpoints(model, opt, url=str(folder), resume=True).restore()
    assert not marker.exists()
    text = str(raised.value)
    assert "epoch-0001.pt" in text and "system" in text and "resume_from=False" in text, text


def test_extra_state_of_a_users_type_loads_when_named_and_only_then(torch, tmp_path):
    import sparkhvd.torch as st
    from sparkhvd.common.errors import CheckpointError

    folder = tmp_path / "ckpt"
    model, opt = _model_and_opt(torch)
    st.Checkpoints(model, opt, url=str(folder), resume=False).save(0, note=_Note("kept"))
    with pytest.raises(CheckpointError, match="_Note"):
        st.Checkpoints(model, opt, url=str(folder), resume=True).restore()
    named = st.Checkpoints(model, opt, url=str(folder), resume=True, safe_types=[_Note])
    assert named.restore() == 1 and named.restored["note"].text == "kept"


def test_numpy_values_in_the_extra_state_restore_and_other_types_are_said_at_save(
        torch, tmp_path, capsys):
    import sparkhvd.torch as st

    folder = tmp_path / "ckpt"
    model, opt = _model_and_opt(torch)
    ckpt = st.Checkpoints(model, opt, url=str(folder), resume=False)
    ckpt.save(0, best=np.float64(0.25), seen=np.arange(3), note=_Note("x"))
    ckpt.save(1, best=np.float64(0.5), note=_Note("y"))
    said = [line for line in capsys.readouterr().out.splitlines() if "safe_types" in line]
    assert len(said) == 1 and "_Note" in said[0] and "numpy.f" not in said[0], said
    restored = st.Checkpoints(model, opt, url=str(folder), resume=True, safe_types=[_Note])
    assert restored.restore() == 2 and restored.restored["best"] == 0.5


def test_a_restore_leaves_the_users_own_allowlist_as_it_was(torch, tmp_path):
    """torch's allowlist is the process's: a restore adds what it lacks and takes only that
    out again -- a type the user allowed themselves stays allowed."""
    import sparkhvd.torch as st

    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals([_Note])
    try:
        model, opt = _model_and_opt(torch)
        st.Checkpoints(model, opt, url=str(tmp_path), resume=False).save(0, note=_Note("a"),
                                                                         best=np.float64(1))
        again = st.Checkpoints(model, opt, url=str(tmp_path), resume=True)
        assert again.restore() == 1 and again.restored["note"].text == "a"
        allowed = torch.serialization.get_safe_globals()
        assert _Note in allowed and not any(g is np.dtype for g in allowed)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


class _Note:
    """A user's own type in the extra state."""

    def __init__(self, text: str) -> None:
        self.text = text


def test_a_planted_host_copy_never_runs_and_the_folder_is_read(torch, tmp_path, monkeypatch,
                                                               capsys):
    """Rank 0's copy on its host, replaced with its meta made to match: passed over, the
    checkpoint folder's file restored."""
    import sparkhvd.torch as st
    from sparkhvd.checkpoint.stores import UrlStore

    monkeypatch.setenv(protocol.RUN_ID_ENV, "20261207-run")
    monkeypatch.setenv(host_copy.DIR_ENV, str(tmp_path / "host"))
    monkeypatch.setattr(UrlStore, "on_this_host", property(lambda self: False))
    marker = tmp_path / "ran"
    model, opt = _model_and_opt(torch)
    st.Checkpoints(model, opt, url=str(tmp_path / "ckpt"), resume=False).save(0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    copy = next(iter(host_copy.find_all().values()))
    planted = _planted_pt(torch, marker)
    with open(copy.path, "wb") as f:
        f.write(planted)
    meta_path = os.path.join(os.path.dirname(copy.path), "host-copy.json")
    meta = json.loads(open(meta_path).read())  # the copy's own record, made to match
    for entry in meta["files"]:
        entry.update(size=len(planted), sha256=hashlib.sha256(planted).hexdigest())
    with open(meta_path, "w") as f:
        json.dump(meta, f)

    fresh, fresh_opt = _model_and_opt(torch, seed=1)
    epoch = st.Checkpoints(fresh, fresh_opt, url=str(tmp_path / "ckpt"), resume=True).restore()
    capsys.readouterr()
    assert not marker.exists()
    assert epoch == 1 and all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


# -- memory snapshots: a JSON structure and the tensors' bytes, no pickle ----------------------
def _snapshot_of(torch, state):
    """``state`` written as a slot file writes it (its tensors laid out, the structure after)."""
    from sparkhvd.torch import snapshot_ring

    blob, offsets, held = bytearray(), {}, []

    def lay(value):
        if isinstance(value, torch.Tensor):
            at = len(blob)
            blob.extend(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                        if value.numel() else b"")
            held.append(value)
            offsets[id(value)] = (at, str(value.dtype), tuple(value.shape))
        elif isinstance(value, dict):
            for v in value.values():
                lay(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                lay(v)

    lay(state)
    tail = json.dumps(snapshot_ring.structure_of(state, offsets)).encode()
    return bytes(blob) + tail + len(tail).to_bytes(8, "little") + snapshot_ring.MAGIC


def test_a_snapshot_keeps_a_states_structure_without_a_pickle(torch):
    from sparkhvd.torch import snapshot_ring
    from sparkhvd.torch.serialise import load_state

    model, opt = _model_and_opt(torch)
    weights = model.state_dict()
    state = {"model": weights, "optimizer": opt.state_dict(), "epoch": 3, "step": 7,
             "data": {"epoch": 3, "deal": [[0, 4], [4, 8]], "nan": float("nan")},
             "extra": {"name": "run", "raw": b"\x00\x01", "pair": (1, "a"), "none": None,
                       "empty": torch.zeros(0), "best": np.float32(0.5), "n": np.int64(7)}}
    data = _snapshot_of(torch, state)
    assert b"\x80" not in data[-200:] or b"pickle" not in data  # the structure is JSON
    loaded = load_state(data, "cpu")
    assert type(loaded["model"]) is collections.OrderedDict
    assert loaded["model"]._metadata == weights._metadata
    assert all(torch.equal(loaded["model"][k], v) for k, v in weights.items())
    assert loaded["optimizer"]["state"].keys() == opt.state_dict()["state"].keys()
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert loaded["extra"]["raw"] == b"\x00\x01" and loaded["extra"]["pair"] == (1, "a")
    assert loaded["data"]["deal"] == [[0, 4], [4, 8]] and loaded["epoch"] == 3
    assert type(loaded["extra"]["best"]) is np.float32 and loaded["extra"]["n"] == 7
    with pytest.raises(snapshot_ring.NotPlain, match="_Note"):
        snapshot_ring.structure_of({"x": _Note("n")}, {})


def test_a_planted_snapshot_never_runs(torch, tmp_path):
    """The old pickled structure under the old marker, and a forged structure under the new
    one: neither runs anything; each is an error the restore passes over."""
    from sparkhvd.common.errors import CheckpointError
    from sparkhvd.torch import snapshot_ring
    from sparkhvd.torch.serialise import load_state

    marker = tmp_path / "ran"
    tail = pickle.dumps({"model": _Planted(str(marker))})
    old = b"\0" * 64 + tail + len(tail).to_bytes(8, "little") + b"SPARKHVD-SNAPSHOT-1"
    with pytest.raises((CheckpointError, RuntimeError, pickle.UnpicklingError, ValueError)):
        load_state(old, "cpu")
    forged = [{"t": [0, "float32", [1 << 40]]}, {"t": [0, "os.system", [1]]}, ["bare"],
              {"z": 1}, {"d": [[{"l": []}, 1]]}]
    for structure in forged:
        tail = json.dumps(structure).encode()
        data = b"\0" * 64 + tail + len(tail).to_bytes(8, "little") + snapshot_ring.MAGIC
        with pytest.raises((ValueError, TypeError)):
            load_state(data, "cpu")
    assert not marker.exists()


# -- sharded checkpoints: DCP's .metadata and its non-tensor items ---------------------------
def test_a_planted_sharded_checkpoint_never_runs(torch, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from sparkhvd.common.errors import UnsafeCheckpoint
    from sparkhvd.torch.serialise import reader_of, safe_planner

    marker = tmp_path / "ran"
    model, opt = _model_and_opt(torch)
    folder = tmp_path / "epoch-0001"
    state = {"model": model.state_dict(), "extra": {"lr": 0.1, "steps": [1, 2]}}
    with pytest.warns(UserWarning):  # no process group: DCP saves as one process
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))
    files = {f"epoch-0001/{p.name}": p.read_bytes() for p in folder.iterdir()}

    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
              "extra": {"lr": 0.0, "steps": []}}
    with pytest.warns(UserWarning):
        dcp.load(target, storage_reader=reader_of(files, "epoch-0001"),
                 planner=safe_planner((), "epoch-0001"))
    assert target["extra"] == {"lr": 0.1, "steps": [1, 2]}
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())

    planted = dict(files, **{"epoch-0001/.metadata": pickle.dumps(_Planted(str(marker)))})
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata.*system"):
        reader_of(planted, "epoch-0001").read_metadata()

    with pytest.raises(UnsafeCheckpoint, match="StorageMeta.__init__"):  # a dotted path
        reader_of(dict(files, **{"epoch-0001/.metadata": _dotted_path_pickle(marker)}),
                  "epoch-0001").read_metadata()

    item = io.BytesIO()
    torch.save(_Planted(str(marker)), item)
    item.seek(0)
    planner = safe_planner((), "epoch-0001")
    planner.set_up_planner(target, reader_of(files, "epoch-0001").read_metadata())
    read_item = type("ReadItem", (), {"dest_index": MetadataIndex("extra.lr")})()
    with pytest.raises(UnsafeCheckpoint, match="extra.lr"):
        planner.load_bytes(read_item, item)
    assert not marker.exists()


def _dotted_path_pickle(marker) -> bytes:
    """A pickle that reaches the function and code types through a dotted name in DCP's own
    module (protocol 4 follows it attribute by attribute) and calls the function it builds."""
    def payload():
        open(str(marker), "w").close()

    c = payload.__code__
    args = (c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount, c.co_nlocals,
            c.co_stacksize, c.co_flags, c.co_code, c.co_consts, c.co_names, c.co_varnames,
            c.co_filename, c.co_name, c.co_qualname, c.co_firstlineno, c.co_linetable,
            c.co_exceptiontable, c.co_freevars, c.co_cellvars)

    def glob(module: str, name: str) -> bytes:
        def enc(text: str) -> bytes:
            return b"\x8c" + bytes([len(text)]) + text.encode()
        return enc(module) + enc(name) + b"\x93"

    body = pickle.dumps(args, protocol=4)[2:-1]
    if body[:1] == b"\x95":
        body = body[9:]
    module = "torch.distributed.checkpoint.metadata"
    return (b"\x80\x04" + glob(module, "StorageMeta.__init__.__class__")
            + glob(module, "StorageMeta.__init__.__code__.__class__") + body + b"R"
            + b"}" + b"\x86" + b"R" + b")" + b"R" + b".")


def test_dcps_failure_is_an_error_the_restore_skips(torch):
    """DCP wraps a load's errors in ``CheckpointException``, a ``BaseException`` that the
    skip of a bad checkpoint (``except Exception``) would let through: unwrapped."""
    from torch.distributed.checkpoint.api import CheckpointException

    from sparkhvd.common.errors import CheckpointError, UnsafeCheckpoint
    from sparkhvd.torch.serialise import dcp_failure

    unsafe = UnsafeCheckpoint("epoch-0001 holds a pickled posix.system")
    assert dcp_failure(CheckpointException("x", {0: (unsafe, None)}), "epoch-0001") is unsafe
    other = dcp_failure(CheckpointException("x", {1: (KeyError("w"), None)}), "epoch-0001")
    assert isinstance(other, CheckpointError) and "epoch-0001" in str(other)


# -- Keras files: Keras's safe mode for every format, arrays without pickles -------------------
@pytest.mark.every_profile  # Keras 2's HDF5 loader and Keras 3's .keras one differ
def test_a_keras_model_with_code_in_it_does_not_load_unless_asked(tmp_path):
    """A ``Lambda`` layer's marshalled bytecode would run as the model is rebuilt: refused in
    both formats (Keras 2's HDF5 loader ignores ``safe_mode`` itself), loaded when the user
    says ``safe_mode=False``."""
    tf = pytest.importorskip("tensorflow")
    from sparkhvd.keras.modelio import load_keras_model, model_bytes

    inputs = tf.keras.Input((2,))
    model = tf.keras.Model(inputs, tf.keras.layers.Lambda(lambda x: x * 2.0)(inputs))
    for suffix in (".h5", ".keras"):
        path = tmp_path / f"model{suffix}"
        path.write_bytes(model_bytes(model, suffix))
        with pytest.raises(Exception, match="(?i)safe_mode|unsafe"):
            load_keras_model(str(path), compile=False)
        loaded = load_keras_model(str(path), compile=False, safe_mode=False)
        assert np.allclose(loaded(np.ones((1, 2), "float32")), 2.0), suffix


def test_a_keras_checkpoints_optimizer_arrays_never_unpickle(tmp_path, monkeypatch):
    from sparkhvd.checkpoint.stores import UrlStore
    from sparkhvd.keras import checkpoints

    marker = tmp_path / "ran"
    out = io.BytesIO()
    np.savez(out, v0=np.array([_Planted(str(marker))], dtype=object))
    store = UrlStore(str(tmp_path))

    class Model:
        optimizer = object()

        def load_weights(self, path):
            pass

    monkeypatch.setattr(checkpoints, "build_optimizer", lambda optimizer, model: None)
    monkeypatch.setattr(checkpoints, "optimizer_variables", lambda optimizer: [])
    with pytest.raises(ValueError, match="allow_pickle"):
        checkpoints.restore(store, {"file": "epoch-0001.h5", "optimizer": "opt.npz"}, Model(),
                            {"epoch-0001.h5": b"x", "opt.npz": out.getvalue()})
    assert not marker.exists()


# -- the footers the driver ships to the ranks ----------------------------------------------
@pytest.mark.every_profile  # pyarrow 10 and 25
def test_a_shipped_footer_is_a_parquet_footer_or_an_error():
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparkhvd.data.footers import footer_bytes, footer_of

    buffer = io.BytesIO()
    pq.write_table(pa.table({"a": [1, 2, 3]}), buffer, row_group_size=2)
    meta = pq.read_metadata(pa.BufferReader(buffer.getvalue()))
    assert footer_of(footer_bytes(meta)).num_row_groups == 2
    with pytest.raises((OSError, ValueError)):
        footer_of(pickle.dumps(_Planted("/nonexistent/ran")))


@pytest.mark.every_profile  # pyarrow 10 unpickles such a type itself; 14.0.1 on refuse it
def test_a_table_with_a_pickled_arrow_type_is_refused_not_unpickled(tmp_path):
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    from sparkhvd.common.patches import forbid_pickled_arrow_types

    if not hasattr(pa, "PyExtensionType"):
        pytest.skip("this pyarrow cannot even write a pickled extension type")
    marker = tmp_path / "ran"

    class Planted(pa.PyExtensionType):
        def __init__(self):
            super().__init__(pa.int64())

        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    table = pa.table({"a": pa.ExtensionArray.from_storage(Planted(), pa.array([1, 2]))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    pq.write_table(table, str(tmp_path / "t.parquet"))
    forbid_pickled_arrow_types()
    with pytest.raises(pa.ArrowInvalid, match="CVE-2023-47248"):
        pa.ipc.open_file(pa.py_buffer(sink.getvalue())).read_all()
    with pytest.raises(pa.ArrowInvalid, match="CVE-2023-47248"):
        pq.ParquetFile(str(tmp_path / "t.parquet")).read_row_group(0)
    assert not marker.exists()
