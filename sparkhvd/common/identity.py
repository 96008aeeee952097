"""Which rank this process is: parsed once, from the variables a launcher or backend set.

Every side asks here -- the driver's launchers (to number the tasks a backend assigned), the
Spark task (to label its rank process) and the rank itself (``DataFrameDataset`` shards, the
Keras helpers) -- so ``SPARKHVD_*``, Horovod's ``HOROVOD_*``, MPI's ``OMPI_COMM_WORLD_*`` and
torchrun's names are read in exactly one place.
"""
from __future__ import annotations

import os
from typing import Mapping, NamedTuple, Optional

__side__ = "common"

#: For each field, the variables that carry it, in the order they are trusted.
#: torchrun's names come last: a script using sparkhvd's helpers under a plain ``torchrun``
#: (no sparkhvd launcher) is still rank N of WORLD_SIZE -- not N ranks that each think they
#: are rank 0 and all write the checkpoints.
_NAMES = {
    "rank": ("SPARKHVD_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK"),
    "size": ("SPARKHVD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"),
    "local_rank": ("SPARKHVD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "LOCAL_RANK"),
    "local_size": ("SPARKHVD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                   "LOCAL_WORLD_SIZE"),
}


def _first_int(environ: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        if name in environ:
            return int(environ[name])
    return default


class RankIdentity(NamedTuple):
    """``(rank, size, local_rank, local_size)`` -- a tuple, so it unpacks like one."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, *,
                 default_rank: int = 0) -> "RankIdentity":
        """The identity ``environ`` (default: this process's environment) describes; a rank
        number missing there is ``default_rank`` (a task's partition before ranks exist)."""
        environ = os.environ if environ is None else environ
        return cls(_first_int(environ, _NAMES["rank"], default_rank),
                   _first_int(environ, _NAMES["size"], 1),
                   _first_int(environ, _NAMES["local_rank"], 0),
                   _first_int(environ, _NAMES["local_size"], 1))


    def as_env(self) -> dict[str, str]:
        """The ``SPARKHVD_*`` variables that carry this identity to a rank process."""
        return {names[0]: str(getattr(self, field)) for field, names in _NAMES.items()}


def rank_hosts(size: int, environ: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """The host of each of the attempt's ``size`` ranks, in rank order, as the launcher said
    (``SPARKHVD_RANK_HOSTS``); empty where it did not say, or said it for another size."""
    from sparkhvd.common.protocol import RANK_HOSTS_ENV

    environ = os.environ if environ is None else environ
    hosts = tuple(h for h in environ.get(RANK_HOSTS_ENV, "").split(",") if h)
    return hosts if len(hosts) == size else ()


def current_rank() -> RankIdentity:
    """This process's rank identity (rank 0 of 1 outside a run)."""
    return RankIdentity.from_env()
