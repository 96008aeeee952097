"""What one run is, frozen when the runner is made: :class:`RunSpec` (:func:`run_spec`).

A :class:`~sparkhvd.driver.run.Run` is built from this description -- the runner's four groups
of settings, the backend, what decides the launcher and the policies that decide its size and
its relaunches -- never from the :class:`~sparkhvd.driver.runner.HorovodRunner` itself, so the
run cannot change the runner and the runner's module is the only one that knows both. The
policies are decided from the settings alone, so a runner decides them once, when it is made:
a setting that cannot make a run is refused there, not at ``run()``.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparkhvd.driver.launchers import LaunchFacts
from sparkhvd.driver.retry import RetryPolicy
from sparkhvd.driver.settings import LaunchConfig, RunConfig, ScalingConfig
from sparkhvd.elastic.scaling import ScalingPolicy, scaling_policy

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
    #: how many ranks each attempt gets (the run places them)
    scaling_policy: ScalingPolicy
    #: whether a failed attempt is relaunched (the run counts and relaunches)
    retry_policy: RetryPolicy


def run_spec(backend: str, scaling: ScalingConfig, launch: LaunchConfig, config: RunConfig,
             facts: LaunchFacts) -> RunSpec:
    """The description of a run with these settings, its policies decided from them."""
    size = scaling.size
    # horovod's elastic mode resizes inside one attempt (horovod.spark.run_elastic)
    elastic = None if facts.horovod_elastic else scaling.elastic
    sizes = scaling_policy(size, elastic, scaling.resize_check_s)
    retries = RetryPolicy.of(config.max_retries, config.max_preemptions, sizes.elastic)
    return RunSpec(backend, scaling, launch, config, facts, sizes, retries)
