"""The collective library ranks use: what each rank needs to find its peers.

A backend is what the launchers do not care about: it starts whatever the ranks rendezvous
through, and turns the tasks that registered (host, address, a port each reserved) into one
environment per rank. Like Ray Train's ``Backend.on_start``:

- ``horovod`` (default): Gloo rendezvous through horovod's server, ``HOROVOD_*`` variables;
- ``tf``: ``TF_CONFIG`` for ``tf.distribute.MultiWorkerMirroredStrategy`` -- no horovod, so it
  runs on current TensorFlow, Keras 3 and numpy 2;
- ``torch``: torchrun's ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
  for ``torch.distributed``'s ``env://`` -- no horovod, no TensorFlow.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import AbstractSet as Set
from typing import Mapping, Optional, Protocol

from sparkhvd.common.protocol import TaskInfo

__side__ = "common"

__all__ = ["BACKENDS", "Backend", "RunTag", "TaskInfo", "assign_with_hosts", "get_backend",
           "hosts_in_order", "nodes_of"]

BACKENDS = ("horovod", "tf", "torch")


@dataclass(frozen=True)
class RunTag:
    """Which run and which attempt the ranks belong to (for backends that tell their ranks, as
    torchrun's ``TORCHELASTIC_RUN_ID``/``TORCHELASTIC_RESTART_COUNT`` do)."""

    run_id: str = ""
    #: 0 for the first attempt, 1 for the first retry (``max_retries``), ...
    restart_count: int = 0
    max_restarts: int = 0


class Backend(Protocol):
    """Rendezvous for one run's ranks."""

    name: str
    #: Whether each task must reserve a port for its rank before it registers.
    needs_port: bool
    #: Whether tasks can run :meth:`assign` themselves when they cannot reach the driver.
    assigns_in_tasks: bool

    def start(self, driver_host: str, nics: Optional[Set[str]], verbose: bool,
              run: RunTag = RunTag()) -> dict[str, str]:
        """Start what the ranks rendezvous through; variables every rank gets."""

    def assign(self, tasks: Mapping[int, TaskInfo]) -> dict[int, dict[str, str]]:
        """Ranks for the registered tasks: partition -> that rank's own variables."""

    def stop(self) -> None:
        """Stop what :meth:`start` started."""


class PeerBackend:
    """A backend whose ranks find each other themselves (``tf``, ``torch``): nothing runs on
    the driver; each task reserves a port for its rank, and :meth:`assign` is pure, so tasks
    that cannot reach the driver run it themselves."""

    name = ""
    needs_port = True
    assigns_in_tasks = True

    def start(self, driver_host: str, nics: Optional[Set[str]], verbose: bool,
              run: RunTag = RunTag()) -> dict[str, str]:
        from sparkhvd.common.protocol import BACKEND_ENV

        return {BACKEND_ENV: self.name, **self.run_env(run)}

    def run_env(self, run: RunTag) -> dict[str, str]:
        """Variables about the run itself that every rank gets (none by default)."""
        return {}

    def assign(self, tasks: Mapping[int, TaskInfo]) -> dict[int, dict[str, str]]:
        raise NotImplementedError

    def stop(self) -> None:
        pass


def nodes_of(tasks: Mapping[int, TaskInfo]) -> dict[int, str]:
    """slot -> the node its rank belongs to (the host, unless the launcher made every Spark
    task its own node: :func:`~sparkhvd.common.protocol.node_of`)."""
    return {p: t.node or t.host for p, t in tasks.items()}


def host_ranks(tasks: Mapping[int, TaskInfo]) -> dict[int, dict[str, str]]:
    """slot -> the variable that says how many ranks share its host's cores (a node may be a
    Spark task, so ``LOCAL_WORLD_SIZE`` need not say it)."""
    from collections import Counter

    from sparkhvd.common.protocol import HOST_RANKS_ENV

    count = Counter(t.host for t in tasks.values())
    return {p: {HOST_RANKS_ENV: str(count[t.host])} for p, t in tasks.items()}


def assign_with_hosts(backend: "Backend", tasks: Mapping[int, TaskInfo]
                      ) -> dict[int, dict[str, str]]:
    """``backend.assign(tasks)``, each rank also told the host of every rank
    (:data:`~sparkhvd.common.protocol.RANK_HOSTS_ENV`: a resize deals each host the rows its
    ranks were reading, :mod:`sparkhvd.data.deal`)."""
    from sparkhvd.common.identity import RankIdentity
    from sparkhvd.common.protocol import RANK_HOSTS_ENV

    plan = backend.assign(tasks)
    ranks = {RankIdentity.from_env(env, default_rank=slot).rank: slot
             for slot, env in plan.items()}
    hosts = ",".join(tasks[ranks[r]].host for r in sorted(ranks))
    return {slot: {**env, RANK_HOSTS_ENV: hosts} for slot, env in plan.items()}


def hosts_in_order(hosts: Mapping[int, str]) -> dict[str, list[int]]:
    """node (host) -> its slots: the one rank order every backend follows.

    Ranks are contiguous per node (so local ranks, GPU pinning and ``LOCAL_RANK`` mean the same
    on every backend); nodes are ordered by their lowest slot and slots keep their order within
    a node, so the assignment is deterministic. Ranks are the slots in the order of
    ``[p for parts in hosts_in_order(...).values() for p in parts]``.
    """
    by_host: dict[str, list[int]] = {}
    for partition in sorted(hosts):
        by_host.setdefault(hosts[partition], []).append(partition)
    return by_host


def get_backend(name: str) -> Backend:
    """A fresh backend object for one run."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {name!r}")
    backend: Backend = importlib.import_module(f".{name}", __name__).Backend()
    return backend
