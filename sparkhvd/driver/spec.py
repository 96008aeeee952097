"""What one run is, frozen when ``run()`` is called: :class:`RunSpec`.

A :class:`~sparkhvd.driver.run.Run` is built from this description -- the runner's four groups
of settings, the backend and what decides the launcher -- never from the
:class:`~sparkhvd.driver.runner.HorovodRunner` itself, so the run cannot change the runner and
the runner's module is the only one that knows both.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparkhvd.driver.launchers import LaunchFacts
from sparkhvd.driver.settings import LaunchConfig, RunConfig, ScalingConfig

__side__ = "driver"


@dataclass(frozen=True)
class RunSpec:
    """One run's settings, as validated when the runner was made."""

    backend: str
    scaling: ScalingConfig
    launch: LaunchConfig
    config: RunConfig
    #: what decides the launcher, as far as the settings tell (the session adds its own)
    facts: LaunchFacts
