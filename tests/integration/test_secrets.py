"""The driver's secrets never reach a rank, a log, an error or the run folder -- on every launcher."""
import os

import pytest

from conftest import runner_for
from sparkhvd import TrainingError

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(300)]

PLANTED = {"AZURE_STORAGE_ACCOUNT_KEY": "PLANTEDazureKEY0123456789==",
           "MYAPP_DB_PASSWORD": "PLANTEDdbPASSWORD42",
           "MY_API_TOKEN": "PLANTEDapiTOKEN7777"}


def everything_written(run_dir):
    for folder, _, files in os.walk(run_dir):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                yield name, f.read().decode(errors="replace")


def test_ranks_never_see_the_drivers_secrets(mode, spark_for, tmp_path, monkeypatch, capfd):
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)

    def look():
        import os

        return sorted(os.environ)

    runner = runner_for(mode, spark_for, tmp_path, env={"GIVEN_ON_PURPOSE": "yes"})
    seen = runner.run_all(look)
    for names in seen:
        assert "GIVEN_ON_PURPOSE" in names and "PATH" in names
        assert not set(PLANTED) & set(names), f"{mode}: {set(PLANTED) & set(names)}"


def test_secret_values_are_redacted_wherever_rank_text_goes(mode, spark_for, tmp_path,
                                                            monkeypatch, capfd):
    """A rank that prints and raises with a credential's value (here: passed in on purpose)."""
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    token = PLANTED["MY_API_TOKEN"]

    def leaky(token):
        import os
        import sys

        print(f"calling the API with {token}", flush=True)
        print(f"env dump: {token}", file=sys.stderr, flush=True)
        if os.environ.get("HOROVOD_RANK") == "0":
            raise RuntimeError(f"API refused token {token}")
        import time

        time.sleep(30)

    runner = runner_for(mode, spark_for, tmp_path, driver_log_verbosity="all")
    with pytest.raises(TrainingError) as info:
        runner.run(leaky, token=token)
    err = info.value
    assert err.exc_type == "RuntimeError" and "API refused token ***" in err.remote_message
    for text in (str(err), err.remote_message, err.remote_traceback):
        assert token not in text
    out = capfd.readouterr()
    assert token not in out.out + out.err
    assert "calling the API with ***" in out.out + out.err
    for name, text in everything_written(runner.last_run_dir.path):
        assert token not in text, name
