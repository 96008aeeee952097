"""Run folders on abfss:// (Azurite): pre-flight, publish, load_model, spill, no secret anywhere."""
import json
import os

import pytest

from sparkhvd import HorovodRunner, StorageError, load_model, storage

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

PLANTED_SAS = "sv=2024-01-01&sig=PLANTEDsasSIGNATURE0123456789"


def _everything_under(root):
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                yield os.path.join(folder, name), f.read()


def test_run_lands_in_azurite_and_loads_back(spark, azurite, tmp_path, monkeypatch, capfd):
    from sparkhvd.examples import digits as demo

    # Planted secrets through the documented ways: driver env and storage_options.
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", PLANTED_SAS)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "PLANTEDaccountKEY0123456789abcdef==")
    monkeypatch.setenv("SPARKHVD_STAGING_DIR", str(tmp_path / "staging"))
    key = azurite.connection_string().split("AccountKey=")[1].split(";")[0]

    x_train, x_test, y_train, y_test = demo.load_digits_split()

    def train(**kw):
        import os

        leaked = [k for k in os.environ if "AZURE" in k]
        print("azure variables visible to the rank:", leaked)
        return demo.train_hvd(**kw)

    root = azurite.url("models", "runs")
    runner = HorovodRunner(np=2, spark=spark, output_dir=root, storage_options=azurite.options())
    model_bytes = runner.run(train, x_train=x_train, y_train=y_train, x_val=x_test, y_val=y_test,
                             epochs=12)
    run = runner.last_run_dir
    assert run.url == f"{root}/{run.run_id}"
    names = storage.listdir(run.url, azurite.options())
    assert {"run.json", "model.h5", "logs"} <= set(names)
    assert storage.read_bytes(f"{run.url}/model.h5", azurite.options()) == model_bytes
    assert not os.path.exists(tmp_path / "staging" / run.run_id), "staging removed after publish"

    model = load_model(run.url, azurite.options())
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert accuracy >= 0.9

    captured = capfd.readouterr()
    assert "azure variables visible to the rank: []" in (captured.out + captured.err) or \
        "azure variables visible to the rank: []" in storage.read_bytes(
            f"{run.url}/logs/rank-0.log", azurite.options()).decode()
    produced = [captured.out, captured.err]
    produced += [storage.read_bytes(f"{run.url}/{n}", azurite.options()).decode(errors="replace")
                 for n in ("run.json", "logs/rank-0.log", "logs/rank-1.log")]
    for text in produced:
        for secret in ("PLANTEDsasSIGNATURE", "PLANTEDaccountKEY", key):
            assert secret not in text


def test_bad_credentials_fail_before_training(spark, azurite, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKHVD_STAGING_DIR", str(tmp_path / "staging"))
    wrong = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="
    jobs_before = set(spark.sparkContext.statusTracker().getJobIdsForGroup(None))
    runner = HorovodRunner(np=2, spark=spark, output_dir=azurite.url("models", "runs"),
                           storage_options=azurite.options(key=wrong))
    with pytest.raises(StorageError, match="credentials were rejected") as info:
        runner.run(lambda: 1)
    assert wrong not in str(info.value)
    assert set(spark.sparkContext.statusTracker().getJobIdsForGroup(None)) == jobs_before
    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    assert record["status"] == "failed" and wrong not in json.dumps(record)


def test_publish_failure_keeps_everything_locally(spark, azurite, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKHVD_STAGING_DIR", str(tmp_path / "staging"))
    azurite.make_container("doomed")
    runner = HorovodRunner(np=2, spark=spark, output_dir=azurite.url("doomed", "runs"),
                           storage_options=azurite.options())

    def train():
        import os

        from azure.storage.blob import BlobServiceClient

        if os.environ["HOROVOD_RANK"] == "0":  # storage disappears while we train
            BlobServiceClient.from_connection_string(CONN).delete_container("doomed")
        return b"\x89HDF\r\n\x1a\ntrained-weights"

    global CONN
    CONN = azurite.connection_string()
    try:
        with pytest.raises(StorageError) as info:
            runner.run(train)
    finally:
        CONN = None
    err = info.value
    assert err.result == b"\x89HDF\r\n\x1a\ntrained-weights"
    assert err.spilled_to and err.spilled_to in str(err)
    with open(os.path.join(err.spilled_to, "model.h5"), "rb") as f:
        assert f.read() == b"\x89HDF\r\n\x1a\ntrained-weights"
    assert os.path.exists(os.path.join(err.spilled_to, "logs", "rank-0.log"))


CONN = None


@pytest.mark.timeout(90)  # the hang guard: the SDK's default retries took ~85 s
def test_dead_storage_endpoint_is_given_up_on_quickly(spark, tmp_path, monkeypatch):
    """Azurite dies while the ranks train: publishing gives up on the refused connection
    within the retry budget (sparkhvd.storage.RETRIES) and keeps everything locally."""
    from conftest import Azurite

    monkeypatch.setenv("SPARKHVD_STAGING_DIR", str(tmp_path / "staging"))
    doomed = Azurite.start(str(tmp_path / "azurite"))
    doomed.make_container("models")

    def train(pid):
        import os
        import signal

        if os.environ["HOROVOD_RANK"] == "0":
            os.kill(pid, signal.SIGKILL)  # the storage endpoint goes away
        return b"\x89HDF\r\n\x1a\nweights"

    runner = HorovodRunner(np=2, spark=spark, output_dir=doomed.url("models", "runs"),
                           storage_options=doomed.options())
    try:
        with pytest.raises(StorageError) as info:
            runner.run(train, pid=doomed.proc.pid)
    finally:
        doomed.stop()
    err = info.value
    assert "reach the storage endpoint" in str(err) and err.spilled_to in str(err)
    assert open(os.path.join(err.spilled_to, "model.h5"), "rb").read().endswith(b"weights")
    assert err.result.endswith(b"weights")


def test_load_model_on_a_folder_of_runs_says_what_it_wanted(azurite, tmp_path):
    root = azurite.url("models", "many-runs")
    opts = azurite.options()
    for run_id in ("20260101-000000-aaaa", "20260102-000000-bbbb"):
        storage.write_bytes(f"{root}/{run_id}/run.json",
                            json.dumps({"run_id": run_id, "model": "model.h5"}).encode(), opts)
    with pytest.raises(FileNotFoundError) as info:
        load_model(root, opts)
    msg = str(info.value)
    assert msg.startswith(f"No model at {root}: looked for {root}/run.json")
    assert f"e.g. the newest, {root}/20260102-000000-bbbb" in msg
    with pytest.raises(FileNotFoundError, match="No model file at .*/nope.h5"):
        load_model(f"{root}/nope.h5", opts)
