"""The executor side of sweeping a finished run's host copies (and the row groups its ranks
kept): what one Spark task does.

A run that succeeded after using hosts its last attempt did not (a lost host that came back, a
resize) may have left host copies there (``/dev/shm``: several times the model's state) that no
rank of the last attempt could delete (:mod:`sparkhvd.checkpoint.host_copy`'s rules). The
driver's sweep (:mod:`sparkhvd.driver.host_sweep`) runs one task per slot; each deletes the
run's copies on its host that no live process owns, and says its host.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

__side__ = "executor"

#: The rows a sweep task returns.
ROW_SCHEMA = "host string, removed long"


def dirs_of(env: Mapping[str, str]) -> dict[str, str]:
    """Where the run told its ranks to keep host copies and row groups (its ``env=``), where
    it did: the variables and their folders."""
    from sparkhvd.checkpoint.host_copy import DIR_ENV
    from sparkhvd.data.row_group_cache import DIR_ENV as ROWS_DIR_ENV

    return {name: env[name] for name in (DIR_ENV, ROWS_DIR_ENV) if env.get(name)}


def sweep_task(run_id: str, dirs: Mapping[str, str]) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The ``mapInArrow`` function: ``dirs`` are the folders the run set for its ranks
    (:func:`dirs_of`; else the executor's own environment says where, as it did for the
    ranks). It removes the run's host copies and the row groups its ranks kept
    (:mod:`sparkhvd.data.row_group_cache`) that no live process owns."""
    def sweep(_batches: Iterator[Any]) -> Iterator[Any]:
        import os
        import socket

        import pyarrow as pa

        from sparkhvd.checkpoint import host_copy
        from sparkhvd.data import row_group_cache

        before = {name: os.environ.get(name) for name in dirs}
        os.environ.update(dirs)  # for this task only: Spark may reuse this worker for other jobs
        try:
            removed = host_copy.sweep(run_id)
            row_group_cache.sweep(run_id)
        except OSError:
            removed = -1
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        yield pa.RecordBatch.from_pydict({"host": [socket.gethostname()], "removed": [removed]})

    return sweep
