"""The run folder's parts in a run's lifecycle (:class:`sparkhvd.driver.services.RunService`):
its service for the ranks, started for each attempt, and the driver's row-group copies,
removed when the run ends.
"""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from sparkhvd.common import protocol
from sparkhvd.runfolder.rundir import RunDir
from sparkhvd.runfolder.service import (
    RunFileService,
    connections_for,
    remove_row_copies,
    row_copies_folder,
)

if TYPE_CHECKING:
    from sparkhvd.driver.services import AttemptStart

__side__ = "driver"


class RunFolder:
    """The run folder's service for one attempt's ranks (:mod:`sparkhvd.runfolder.service`):
    started as it launches -- where the ranks read and write the run folder, the checkpoints
    they resume from, their row-group copies -- and stopped when its ranks ended, with the
    stack requests polling ranks read."""

    def __init__(self, run_dir: RunDir, storage_options: Mapping[str, Any], timeline: bool,
                 env: Mapping[str, str]) -> None:
        self.run_dir, self.options = run_dir, dict(storage_options)
        self.timeline, self.env = timeline, dict(env)
        self._files: Optional[RunFileService] = None

    def attempt_starts(self, start: "AttemptStart") -> Mapping[str, str]:
        from sparkhvd.storage import public_url

        run_dir, placement = self.run_dir, start.placement
        self._files = RunFileService(
            placement.driver_host, run_dir.path,
            (start.resume, self.options) if start.resume else None,
            row_copies=row_copies_folder(run_dir.run_id),
            copies_budget=protocol.row_copies_bytes(self.env),
            max_connections=connections_for(start.size)).start()
        env = {**self._files.env(), protocol.RUN_ID_ENV: run_dir.run_id}
        if placement.executors_here:
            env[protocol.RUN_URL_ENV] = run_dir.path
        if start.resume:
            env[protocol.RESUME_URL_ENV] = public_url(start.resume)
        if self.timeline:
            env[protocol.TIMELINE_ENV] = (
                run_dir.file("timeline.json") if placement.executors_here else
                os.path.join("/tmp", f"sparkhvd-timeline-{run_dir.run_id}.json"))
        return env

    def attempt_ended(self, hosts: frozenset[str]) -> None:
        files, self._files = self._files, None
        if files is None:
            return
        files.stop()
        # the stack requests polling ranks read: the run's business only while it runs
        shutil.rmtree(self.run_dir.file(os.path.dirname(protocol.STACKS_REQUEST_FILE)),
                      ignore_errors=True)

    def run_ended(self, succeeded: bool, hosts: Sequence[frozenset[str]]) -> None:
        return None


class RowCopies:
    """The row-group copies the driver kept for the run's ranks: every row of them is in the
    files, so they go when the run ends."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def attempt_starts(self, start: "AttemptStart") -> Mapping[str, str]:
        return {}

    def attempt_ended(self, hosts: frozenset[str]) -> None:
        return None

    def run_ended(self, succeeded: bool, hosts: Sequence[frozenset[str]]) -> None:
        remove_row_copies(self.run_id)
