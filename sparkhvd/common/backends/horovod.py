"""The Horovod backend: horovod's Gloo rendezvous server and ``HOROVOD_*`` rank variables."""
from __future__ import annotations

from typing import AbstractSet, Any, Mapping, Optional

from sparkhvd.common.backends import RunTag, TaskInfo, hosts_in_order
from sparkhvd.common.netif import IFACE_VARS

__side__ = "common"


def assign_ranks(hosts: Mapping[int, str]) -> tuple[list[Any], dict[int, dict[str, str]]]:
    """partition -> host; returns horovod's slots and partition -> slot variables, in the rank
    order of :func:`~sparkhvd.common.backends.hosts_in_order`."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_slot_env_vars

    by_host = hosts_in_order(hosts)
    spec = ",".join(f"{host}:{len(parts)}" for host, parts in by_host.items())
    slots = get_host_assignments(parse_hosts(spec), len(hosts))
    envs = {by_host[slot.hostname][slot.local_rank]:
            {k: str(v) for k, v in create_slot_env_vars(slot).items()} for slot in slots}
    return slots, envs


class Backend:
    """Gloo rendezvous through horovod's own HTTP server on the driver."""

    name = "horovod"
    needs_port = False
    #: Ranks rendezvous through the driver's server: every task must reach the driver.
    assigns_in_tasks = False

    def __init__(self) -> None:
        self._server: Any = None

    def start(self, driver_host: str, nics: Optional[AbstractSet[str]], verbose: bool,
              run: Optional[RunTag] = None) -> dict[str, str]:
        from horovod.runner.gloo_run import create_run_env_vars
        from horovod.runner.http.http_server import RendezvousServer

        self._server = RendezvousServer(verbose=1 if verbose else 0)
        port = self._server.start()
        # The interface is the launcher's choice (sparkhvd.common.netif), not horovod's.
        return {k: str(v) for k, v in create_run_env_vars(driver_host, {"lo"}, port).items()
                if k not in IFACE_VARS}

    def assign(self, tasks: Mapping[int, TaskInfo]) -> dict[int, dict[str, str]]:
        slots, envs = assign_ranks({p: t.host for p, t in tasks.items()})
        self._server.init(slots)
        return envs

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
