"""What a killed rank or task leaves in /tmp is deleted by the next process on the host
(sparkhvd.common.owned_temp): real files and a real process that is gone."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from sparkhvd.common import owned_temp


def _a_pid_that_is_gone() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_what_a_killed_process_left_is_deleted_and_nothing_else(tmp_path):
    """A spool (as big as a checkpoint), DCP's folder and a rank's payload folder of a process
    that is gone are deleted once a minute old -- never a live process' own, a fresh one (its
    writer may be in another process namespace), or a file that is not sparkhvd's."""
    dead, alive = _a_pid_that_is_gone(), os.getpid()
    orphans = [f"sparkhvd-spool-{dead}-a1", f"sparkhvd-dcp-{dead}-b2", f"sparkhvd-rank-{dead}-c3"]
    kept = [f"sparkhvd-spool-{dead}-fresh", f"sparkhvd-rank-{alive}-d4", "sparkhvd-rank-e5f6",
            f"sparkhvd-other-{dead}-g7", "unrelated"]
    for name in orphans + kept:
        path = tmp_path / name
        if "dcp" in name or "rank" in name:
            path.mkdir()
            (path / "inside").write_bytes(b"x")
        else:
            path.write_bytes(b"spooled")
        if "fresh" not in name:
            _age(path, 2 * owned_temp.ORPHAN_AFTER_S)
    assert owned_temp.remove_orphans(str(tmp_path)) == sorted(orphans)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_each_process_names_its_own_and_sweeps_a_folder_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(owned_temp, "_swept", set())
    left = tmp_path / f"sparkhvd-spool-{_a_pid_that_is_gone()}-a1"
    left.write_bytes(b"spooled")
    _age(left, 2 * owned_temp.ORPHAN_AFTER_S)
    fd, path = tempfile.mkstemp(prefix=owned_temp.prefix("spool"))
    os.close(fd)
    assert os.path.basename(path).startswith(f"sparkhvd-spool-{os.getpid()}-")
    assert not left.exists(), "swept by the first spool"
    left.write_bytes(b"spooled")
    _age(left, 2 * owned_temp.ORPHAN_AFTER_S)
    tempfile.mkdtemp(prefix=owned_temp.prefix("dcp"))
    assert left.exists(), "once per process and folder, not once per save"
