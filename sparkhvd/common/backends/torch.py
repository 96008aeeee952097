"""The PyTorch backend: ``torch.distributed``'s ``env://`` rendezvous, as torchrun sets it up.

Each rank's task reserves a free port on its host and reports ``address:port`` when it
registers; once all are in, every rank gets what torchrun's elastic agent gives its workers
(``torch/distributed/elastic/agent/server/local_elastic_agent.py``), so
``torch.distributed.init_process_group()`` with the default ``env://``,
``torch.distributed.is_torchelastic_launched()`` and the clients that read them (Lightning's
``TorchElasticEnvironment``, Hugging Face ``Trainer``/``accelerate``, DeepSpeed) work
unchanged -- also in functions written for Spark's ``TorchDistributor``:

- ``MASTER_ADDR``/``MASTER_PORT``: rank 0's host and the port its task reserved;
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (= ``NODE_RANK``,
  the node's index), ``GROUP_WORLD_SIZE`` (nodes), ``ROLE_RANK``/``ROLE_WORLD_SIZE``/``ROLE_NAME``
  (one role, ``default``, as torchrun);
- ``TORCHELASTIC_RUN_ID`` (the sparkhvd run's id), ``TORCHELASTIC_RESTART_COUNT`` (the attempt:
  0, then 1 after a retry) and ``TORCHELASTIC_MAX_RESTARTS`` (``max_retries``).

Left out because they would lie: ``TORCHELASTIC_USE_AGENT_STORE`` (there is no agent store:
rank 0 hosts the ``TCPStore``, as under plain ``env://``) and ``TORCHELASTIC_ERROR_FILE``
(sparkhvd reports errors itself). A *node* is a host (torchrun's numbering, the default) or a
Spark task (``local_ranks="task"``, TorchDistributor's; always when a task runs several ranks).
No horovod, no TensorFlow.
"""
from __future__ import annotations

import secrets
from typing import Mapping

from sparkhvd.common.backends import (
    PeerBackend,
    RunTag,
    TaskInfo,
    host_ranks,
    hosts_in_order,
    nodes_of,
)
from sparkhvd.common.identity import RankIdentity

__side__ = "common"


class Backend(PeerBackend):
    """torchrun's variables per rank; ``torch.distributed`` does the rest (gloo or nccl)."""

    name = "torch"

    def run_env(self, run: RunTag) -> dict[str, str]:
        return {"TORCHELASTIC_RUN_ID": run.run_id or f"sparkhvd-{secrets.token_hex(6)}",
                "TORCHELASTIC_RESTART_COUNT": str(run.restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(run.max_restarts)}

    def assign(self, tasks: Mapping[int, TaskInfo]) -> dict[int, dict[str, str]]:
        nodes = nodes_of(tasks)
        by_node = hosts_in_order(nodes)
        order = [p for parts in by_node.values() for p in parts]
        master = tasks[order[0]]
        node_index = {node: i for i, node in enumerate(by_node)}
        sharing = host_ranks(tasks)
        envs = {}
        for rank, slot in enumerate(order):
            local = by_node[nodes[slot]]
            me = RankIdentity(rank, len(order), local.index(slot), len(local))
            group = str(node_index[nodes[slot]])
            envs[slot] = {
                "MASTER_ADDR": master.address or master.host, "MASTER_PORT": str(master.port),
                "RANK": str(me.rank), "WORLD_SIZE": str(me.size),
                "LOCAL_RANK": str(me.local_rank), "LOCAL_WORLD_SIZE": str(me.local_size),
                "GROUP_RANK": group, "NODE_RANK": group, "GROUP_WORLD_SIZE": str(len(by_node)),
                "ROLE_RANK": str(me.rank), "ROLE_WORLD_SIZE": str(me.size),
                "ROLE_NAME": "default", **me.as_env(), **sharing[slot]}
        return envs
