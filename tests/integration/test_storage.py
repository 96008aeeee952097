"""Storage layer on local disk and on a real Azurite (through adlfs, as users reach Azure)."""
import hashlib
import os
import time

import pytest

from sparkhvd import StorageError, storage

pytestmark = pytest.mark.timeout(300)


# -- local and pure ----------------------------------------------------------------------------
@pytest.mark.parametrize("as_url", [False, True])
def test_local_roundtrip(tmp_path, as_url):
    base = ("file://" if as_url else "") + str(tmp_path)
    storage.write_bytes(base + "/a/model.h5", b"weights")
    assert storage.read_bytes(base + "/a/model.h5") == b"weights"
    assert storage.read_range(base + "/a/model.h5", 2, 3) == b"igh"
    assert storage.read_range(base + "/a/model.h5", 5, 10) == b"ts", "fewer at the end"
    assert storage.exists(base + "/a/model.h5")
    assert storage.listdir(base + "/a") == ["model.h5"]
    storage.delete(base + "/a", recursive=True)
    assert not storage.exists(base + "/a")


def test_local_atomic_write_keeps_old_content_on_interrupt(tmp_path):
    target = str(tmp_path / "model.h5")
    storage.write_bytes(target, b"v1")
    with pytest.raises(KeyboardInterrupt):
        with storage.open_atomic(target) as f:
            f.write(b"v2-half")
            raise KeyboardInterrupt
    assert open(target, "rb").read() == b"v1"
    assert os.listdir(tmp_path) == ["model.h5"], "no temp file may be left behind"


def _torn_files_removed(base, options=None):
    """What a killed writer left (``.tmp-*``, in subfolders too) goes once it is older than
    ``before``; a newer one is a write in flight and stays, and so does everything else."""
    for name in ("model.pt", ".tmp-0a1b2c-model.pt", "shards/.tmp-3d4e5f-part-1.bin",
                 "shards/part-0.bin"):
        storage.write_bytes(f"{base}/{name}", b"x", options)
    assert storage.remove_torn(base, time.time() - 3600, options) == []
    removed = storage.remove_torn(base, time.time() + 5, options)
    assert removed == [".tmp-0a1b2c-model.pt", "shards/.tmp-3d4e5f-part-1.bin"], removed
    assert storage.listdir(base, options) == ["model.pt", "shards"]
    assert storage.listdir(f"{base}/shards", options) == ["part-0.bin"]
    assert storage.remove_torn(f"{base}/none-here", time.time(), options) == []


def test_torn_temporaries_are_removed_locally(tmp_path):
    _torn_files_removed(str(tmp_path / "ckpt"))


def test_redact_and_public_url():
    text = ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0a2V5;"
            "EndpointSuffix=core.windows.net https://acct.blob.core.windows.net/c/x?sv=2022&sig=abc%2Fdef "
            "Authorization: Bearer eyJhbGciOi.x.y {'account_key': 'zzzsecret'}")
    clean = storage.redact(text)
    for secret in ("c2VjcmV0a2V5", "abc%2Fdef", "eyJhbGciOi", "zzzsecret"):
        assert secret not in clean
    assert "AccountName=acct" in clean
    assert storage.public_url("abfss://models@acct.dfs.core.windows.net/runs?sv=1&sig=x") == \
        "abfss://models@acct.dfs.core.windows.net/runs"


def test_unsupported_scheme_and_missing_account():
    with pytest.raises(ValueError, match="Unsupported storage URL scheme 's3'"):
        storage.resolve("s3://bucket/x")
    with pytest.raises(ValueError, match="No Azure storage account"):
        storage.resolve("az://models/x", environ={})


def test_credentials_order(monkeypatch):
    from sparkhvd.storage import location

    env = {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_SAS_TOKEN": "sv=1&sig=tok3n"}
    assert location.azure_options(None, {}, env) == {"sas_token": "sv=1&sig=tok3n",
                                                     "account_name": "acct"}
    explicit = location.azure_options("acct", {"account_key": "k3y-given"}, env)
    assert explicit == {"account_key": "k3y-given", "account_name": "acct"}
    assert location.azure_options("acct", {}, {}) == {"anon": False, "account_name": "acct"}


def test_local_preflight_names_the_folder(tmp_path):
    (tmp_path / "not-a-folder").write_text("x")
    with pytest.raises(StorageError, match="pre-flight failed for .*not-a-folder/runs"):
        storage.preflight(str(tmp_path / "not-a-folder" / "runs"))


# -- Azurite -----------------------------------------------------------------------------------
def test_abfss_roundtrip_100mb(azurite):
    url = azurite.url("models", "roundtrip/model.bin")
    data = os.urandom(1 << 20) * 100
    storage.write_bytes(url, data, azurite.options())
    back = storage.read_bytes(url, azurite.options())
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    assert storage.listdir(azurite.url("models", "roundtrip"), azurite.options()) == ["model.bin"]
    part = storage.read_range(url, (50 << 20) - 7, 3 << 20, azurite.options())
    assert part == data[(50 << 20) - 7:(53 << 20) - 7], "a range of a blob, not the blob"


def test_abfss_interrupted_write_is_invisible(azurite):
    url = azurite.url("models", "atomic/model.h5")
    storage.write_bytes(url, b"version-1", azurite.options())
    with pytest.raises(RuntimeError):
        with storage.open_atomic(url, azurite.options()) as f:
            f.write(b"version-2 first half" * 1000)
            raise RuntimeError("connection lost mid-upload")
    assert storage.read_bytes(url, azurite.options()) == b"version-1"
    assert storage.listdir(azurite.url("models", "atomic"), azurite.options()) == ["model.h5"]


def test_torn_temporaries_are_removed_on_abfss(azurite):
    _torn_files_removed(azurite.url("models", "torn"), azurite.options())


def test_preflight_wrong_key_fails_fast_without_the_key(azurite):
    wrong = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="
    with pytest.raises(StorageError) as info:
        storage.preflight(azurite.url("models", "runs"), azurite.options(key=wrong))
    msg = str(info.value)
    assert "credentials were rejected" in msg and "abfss://models@devstoreaccount1" in msg
    assert wrong not in msg and wrong[:12] not in msg


def test_preflight_missing_container(azurite):
    with pytest.raises(StorageError, match="container 'nosuchcontainer' does not exist"):
        storage.preflight(azurite.url("nosuchcontainer", "runs"), azurite.options())


def test_preflight_unreachable_endpoint(azurite):
    from conftest import Azurite, _free_port

    dead = Azurite(_free_port())  # nothing listens there
    with pytest.raises(StorageError, match="reach the storage endpoint"):
        storage.preflight(dead.url("models", "runs"), dead.options(), timeout_s=20)


def test_upload_failure_spills_locally(azurite, tmp_path):
    data = b"precious model bytes"
    with pytest.raises(StorageError) as info:
        storage.write_or_spill(azurite.url("nosuchcontainer", "m/model.h5"), data,
                               str(tmp_path / "spill"), azurite.options())
    spilled = info.value.spilled_to
    assert spilled and open(spilled, "rb").read() == data
    assert spilled in str(info.value)
