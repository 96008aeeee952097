"""The driver's run-folder service as a rank on another host meets it: a part of a large file,
from the run folder and from the checkpoints the run resumes from, without the rest."""
from __future__ import annotations

import pytest

from sparkhvd.common import protocol
from sparkhvd.runfolder.checkpoint_store import RunFolderStore
from sparkhvd.runfolder.rank_files import RunFiles
from sparkhvd.runfolder.service import RunFileService


@pytest.fixture
def service(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "earlier").mkdir()
    server = RunFileService("127.0.0.1", str(tmp_path / "run"),
                            resume=(str(tmp_path / "earlier"), {})).start()
    yield server
    server.stop()


def test_a_rank_reads_a_range_of_a_file_in_either_folder_through_the_service(service, tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "run" / "shard.distcp").write_bytes(data)
    (tmp_path / "earlier" / "shard.distcp").write_bytes(data[::-1])
    files = RunFiles({**service.env(), protocol.RUN_URL_ENV: ""})  # a rank on another host
    assert files.read_bytes("shard.distcp", span=(100, 20)) == data[100:120]
    assert files.read_bytes("shard.distcp", root="resume", span=(1000, 50)) == data[::-1][1000:]
    resumed = RunFolderStore("resume")
    resumed.files = files
    assert resumed.read_range("shard.distcp", 0, 8) == data[::-1][:8]
    with pytest.raises(PermissionError, match="bad byte range"):
        files.read_bytes("shard.distcp", span=(-1, 5))
    files.close()
