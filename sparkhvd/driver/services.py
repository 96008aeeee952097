"""The seam features plug into a run through: start, an attempt's end, the run's end.

Like Ray Train v2's worker-group callbacks, what a feature needs of a run's lifecycle is one
small interface (:class:`RunService`), so the controller -- :mod:`sparkhvd.driver.run` and
:mod:`sparkhvd.driver.attempt` -- names none of them: when an attempt is about to launch, each
service may start what the ranks reach and say the variables they get; when the attempt ended
(on which hosts its ranks ran), it stops that; when the run ended (whether it succeeded, and the
hosts of each attempt), it cleans up what the run left. The run's services
(:func:`run_services`):

- the run folder's service for the ranks (:class:`~sparkhvd.runfolder.run_services.RunFolder`);
- the driver's row-group copies (:class:`~sparkhvd.runfolder.run_services.RowCopies`);
- the host copies earlier attempts kept on hosts the last did not use
  (:class:`~sparkhvd.driver.host_sweep.HostSweep`);
- the caches of datasets collected meanwhile (:class:`~sparkhvd.data.materialize.DatasetCaches`).

A service never raises out of an end: what it could not do is logged (the run's result, or its
error, is what the caller gets).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

from sparkhvd.driver.launchers import Placement

if TYPE_CHECKING:
    from sparkhvd.driver.placing import Placer
    from sparkhvd.driver.spec import RunSpec
    from sparkhvd.runfolder.rundir import RunDir

__side__ = "driver"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttemptStart:
    """What a service is told of an attempt about to launch."""

    run_id: str
    number: int
    size: int
    placement: Placement
    #: the checkpoints sparkhvd restores from (None: none)
    resume: Optional[str]


class RunService(Protocol):
    """A feature's part in a run's lifecycle."""

    def attempt_starts(self, start: AttemptStart) -> Mapping[str, str]:
        """Start what the attempt's ranks reach; the variables they get."""

    def attempt_ended(self, hosts: frozenset[str]) -> None:
        """The attempt's ranks ended (on ``hosts``): stop what :meth:`attempt_starts`
        started."""

    def run_ended(self, succeeded: bool, hosts: Sequence[frozenset[str]]) -> None:
        """No rank runs any more: clean up what the run left (``hosts``: each attempt's rank
        hosts, oldest first)."""


def run_services(spec: "RunSpec", run_dir: "RunDir", placer: "Placer") -> list[RunService]:
    """The services of a run: the run folder's, row copies, the host sweep, dataset caches."""
    from sparkhvd.data.materialize import DatasetCaches
    from sparkhvd.driver.host_sweep import HostSweep
    from sparkhvd.runfolder.run_services import RowCopies, RunFolder

    env = dict(spec.launch.env or {})
    return [RunFolder(run_dir, spec.config.storage_options, spec.config.timeline, env),
            RowCopies(run_dir.run_id), HostSweep(placer, run_dir.run_id, env), DatasetCaches()]


def ended_quietly(services: Sequence[RunService], succeeded: bool,
                  hosts: Sequence[frozenset[str]]) -> None:
    """Tell every service the run ended; what one could not do is logged, never raised."""
    for service in services:
        try:
            service.run_ended(succeeded, hosts)
        except Exception as exc:  # noqa: BLE001 - the run's outcome is what the caller gets
            log.warning("sparkhvd: %s could not clean up after the run: %s",
                        type(service).__name__, exc)
