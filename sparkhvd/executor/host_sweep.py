"""The executor side of sweeping a finished run's host copies: what one Spark task does.

A run that succeeded after using hosts its last attempt did not (a lost host that came back, a
resize) may have left host copies there (``/dev/shm``: several times the model's state) that no
rank of the last attempt could delete (:mod:`sparkhvd.runfolder.host_copy`'s rules). The
driver's sweep (:mod:`sparkhvd.driver.host_sweep`) runs one task per slot; each deletes the
run's copies on its host that no live process owns, and says its host.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional

__side__ = "executor"

#: The rows a sweep task returns.
ROW_SCHEMA = "host string, removed long"


def copy_dir_of(env: Mapping[str, str]) -> Optional[str]:
    """Where the run told its ranks to keep host copies (its ``env=``), if it did."""
    from sparkhvd.runfolder.host_copy import DIR_ENV

    return env.get(DIR_ENV) or None


def sweep_task(run_id: str, copy_dir: Optional[str]) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The ``mapInArrow`` function: ``copy_dir`` is the ranks' ``SPARKHVD_HOST_COPY_DIR`` when
    the run set one (else the executor's own environment says where, as it did for the ranks)."""
    def sweep(_batches: Iterator[Any]) -> Iterator[Any]:
        import os
        import socket

        import pyarrow as pa

        from sparkhvd.runfolder import host_copy

        before = os.environ.get(host_copy.DIR_ENV)
        if copy_dir:  # for this task only: Spark may reuse this worker for other jobs
            os.environ[host_copy.DIR_ENV] = copy_dir
        try:
            removed = host_copy.sweep(run_id)
        except OSError:
            removed = -1
        finally:
            if before is None:
                os.environ.pop(host_copy.DIR_ENV, None)
            else:
                os.environ[host_copy.DIR_ENV] = before
        yield pa.RecordBatch.from_pydict({"host": [socket.gethostname()], "removed": [removed]})

    return sweep
