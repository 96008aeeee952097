"""B4: storage on Azurite, sparkhvd.storage vs the Azure blob SDK (run by bench.py)."""
from __future__ import annotations

import os
import tempfile

from bench_common import interleaved, stats


def case_b4(repeat: int, tiny: bool) -> list[dict]:
    from azure.storage.blob import BlobServiceClient

    from conftest import Azurite
    from sparkhvd import storage

    size = (4 << 20) if tiny else (200 << 20)
    data = os.urandom(1 << 20) * (size >> 20)
    az = Azurite.start(tempfile.mkdtemp(prefix="bench-azurite-"))
    try:
        az.make_container("bench")
        client = BlobServiceClient.from_connection_string(az.connection_string())
        blob = client.get_blob_client("bench", "sdk/model.bin")
        url = az.url("bench", "sparkhvd/model.bin")
        opts = az.options()

        def sdk_write():
            blob.upload_blob(data, overwrite=True, max_concurrency=4)

        def sdk_read():
            assert len(blob.download_blob(max_concurrency=4).readall()) == size

        def ours_write():
            storage.write_bytes(url, data, opts)

        def ours_read():
            assert len(storage.read_bytes(url, opts)) == size

        timings = interleaved([("Azure SDK upload", sdk_write),
                                ("sparkhvd.storage write_bytes (atomic)", ours_write),
                                ("Azure SDK download", sdk_read),
                                ("sparkhvd.storage read_bytes", ours_read)],
                               repeat if tiny else max(repeat, 9))
        return [{"case": "B4", "variant": variant, "unit": "MB/s",
                 **stats([size / 1e6 / v for v in runs]), "bytes": size}
                for variant, runs in timings.items()]
    finally:
        az.stop()
