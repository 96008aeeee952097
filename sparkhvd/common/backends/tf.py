"""The tf.distribute backend: ``TF_CONFIG`` for ``MultiWorkerMirroredStrategy``; no horovod.

Each task reserves a free port on its host and reports ``address:port`` when it registers; once
all are in, every rank gets the same cluster (``{"worker": [...]}``, in rank order) and its own
index. Ranks are contiguous per host, as with horovod, so local ranks (GPU pinning) mean the
same thing on both backends. Nothing here or on the rank side imports horovod.
"""
from __future__ import annotations

import json
from typing import Mapping

from sparkhvd.common.backends import PeerBackend, TaskInfo, host_ranks, hosts_in_order, nodes_of
from sparkhvd.common.identity import RankIdentity

__side__ = "common"


class Backend(PeerBackend):
    """``TF_CONFIG`` per rank; the strategy's own gRPC/collectives do the rest."""

    name = "tf"

    def assign(self, tasks: Mapping[int, TaskInfo]) -> dict[int, dict[str, str]]:
        nodes = nodes_of(tasks)
        by_host = hosts_in_order(nodes)
        order = [p for parts in by_host.values() for p in parts]
        workers = [f"{tasks[p].address or tasks[p].host}:{tasks[p].port}" for p in order]
        shared = sorted({w for w in workers if workers.count(w) > 1})
        if shared:  # two gRPC servers on one port would answer each other's peers: a hang
            raise RuntimeError(f"tf: two ranks were given the same address and port "
                               f"({', '.join(shared)}); each task must reserve its own port "
                               "(sparkhvd.common.netif.PortReservation) -- please report this.")
        envs = {}
        sharing = host_ranks(tasks)
        for rank, partition in enumerate(order):
            local = by_host[nodes[partition]]
            envs[partition] = {
                "TF_CONFIG": json.dumps({"cluster": {"worker": workers},
                                         "task": {"type": "worker", "index": rank}}),
                **RankIdentity(rank, len(order), local.index(partition), len(local)).as_env(),
                **sharing[partition]}
        return envs
