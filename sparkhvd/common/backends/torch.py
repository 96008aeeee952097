"""The PyTorch backend: ``torch.distributed``'s ``env://`` rendezvous, as torchrun sets it up.

Each task reserves a free port on its host and reports ``address:port`` when it registers; once
all are in, every rank gets ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's host and the port it
reserved), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
(the host's index), so ``torch.distributed.init_process_group()`` with the default ``env://``
works unchanged -- also in functions written for Spark's ``TorchDistributor``. Ranks are
contiguous per host, as on the other backends. No horovod, no TensorFlow.
"""
from __future__ import annotations

from typing import Mapping

from sparkhvd.common.backends import PeerBackend, TaskInfo, hosts_in_order
from sparkhvd.common.identity import RankIdentity


class Backend(PeerBackend):
    """torchrun's variables per rank; ``torch.distributed`` does the rest (gloo or nccl)."""

    name = "torch"
    # Every task reserves a port (rank 0 is known only once all registered): MASTER_PORT.

    def assign(self, tasks: Mapping[int, TaskInfo]) -> dict[int, dict[str, str]]:
        by_host = hosts_in_order({p: t.host for p, t in tasks.items()})
        order = [p for parts in by_host.values() for p in parts]
        master = tasks[order[0]]
        hosts = list(by_host)
        envs = {}
        for rank, partition in enumerate(order):
            local = by_host[tasks[partition].host]
            me = RankIdentity(rank, len(order), local.index(partition), len(local))
            envs[partition] = {
                "MASTER_ADDR": master.address or master.host, "MASTER_PORT": str(master.port),
                "RANK": str(me.rank), "WORLD_SIZE": str(me.size),
                "LOCAL_RANK": str(me.local_rank), "LOCAL_WORLD_SIZE": str(me.local_size),
                "GROUP_RANK": str(hosts.index(tasks[partition].host)),
                "NODE_RANK": str(hosts.index(tasks[partition].host)),
                **me.as_env()}
        return envs
