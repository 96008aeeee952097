"""The driver's sweep of a succeeded run's host copies on hosts its last attempt did not use.

The last attempt's ranks delete the run's copies on their hosts when the function returns;
copies an earlier attempt kept on another host would stay until a later run there removes them
a day later. So when a run succeeds having used such hosts, one small Spark job -- a task per
slot, so every executor free now gets one -- deletes them
(:mod:`sparkhvd.executor.host_sweep`). A host it does not reach (gone, or its slots busy) is
said, and keeps its copies for the day-later sweep. A run that failed keeps its copies: its
newest checkpoint may be there alone (an upload that failed or was cut short; the docs say
where to find it). A succeeded run's uploads are all done. Never raises: the run's result is
already there.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from sparkhvd.executor.host_sweep import ROW_SCHEMA, dirs_of, sweep_task

if TYPE_CHECKING:
    from sparkhvd.driver.placing import Placer
    from sparkhvd.driver.services import AttemptStart

__side__ = "driver"

log = logging.getLogger(__name__)

#: How long the run's end waits for the sweep's job before cancelling it.
SWEEP_WAIT_S = 30.0


class HostSweep:
    """The sweep as a run service (:class:`sparkhvd.driver.services.RunService`): when the run
    succeeded, the hosts of earlier attempts its last did not use, through the placer (which
    knows how to reach them; ``env``: the run's ``env=`` for its ranks)."""

    def __init__(self, placer: "Placer", run_id: str, env: Mapping[str, str]) -> None:
        self.placer, self.run_id, self.env = placer, run_id, dict(env)

    def attempt_starts(self, start: "AttemptStart") -> Mapping[str, str]:
        return {}

    def attempt_ended(self, hosts: frozenset[str]) -> None:
        return None

    def run_ended(self, succeeded: bool, hosts: Sequence[frozenset[str]]) -> None:
        swept = hosts_to_sweep([set(h) for h in hosts]) if succeeded else set()
        if swept:
            self.placer.sweep_host_copies(self.run_id, swept, self.env)


def hosts_to_sweep(attempt_hosts: list[set[str]]) -> set[str]:
    """The hosts of earlier attempts (each a set of rank hosts, oldest first) that the last
    attempt did not use: its own ranks cleaned theirs."""
    if len(attempt_hosts) < 2:
        return set()
    return set().union(*attempt_hosts[:-1]) - attempt_hosts[-1]


def sweep_hosts(view: Any, run_id: str, hosts: set[str], tasks: int,
                env: Mapping[str, str], wait_s: float = SWEEP_WAIT_S) -> set[str]:
    """Delete run ``run_id``'s host copies on ``hosts`` (one task on each of ``tasks`` slots;
    ``env``: the run's ``env=`` for its ranks, which may say where copies are kept); the hosts
    reached. A job not done in ``wait_s`` (an executor half gone, slots busy) is cancelled."""
    if not hosts:
        return set()
    tasks = max(tasks, len(hosts))
    job = view.job(f"sparkhvd-sweep-{run_id}", f"sparkhvd: sweep run {run_id}'s host copies")
    done: dict[str, Any] = {}

    def collect() -> None:
        try:
            done["rows"] = job.run(lambda: view.spark.range(0, tasks, 1, tasks).mapInArrow(
                sweep_task(run_id, dirs_of(env)), ROW_SCHEMA).collect())
        except Exception as exc:  # noqa: BLE001 - a sweep never fails a finished run
            done["error"] = exc

    worker = threading.Thread(target=collect, daemon=True, name="sparkhvd-host-sweep")
    worker.start()
    worker.join(wait_s)
    if worker.is_alive():
        job.cancel()
        done.setdefault("error", TimeoutError(f"not done in {wait_s:g} s"))
    if "rows" not in done:
        exc = done.get("error")
        log.warning("sparkhvd: the host copies this run kept on %s were not swept (%s); a "
                    "later run there deletes them a day later", ", ".join(sorted(hosts)),
                    (str(exc).splitlines() or [type(exc).__name__])[0])
        return set()
    rows = done["rows"]
    reached = {row["host"] for row in rows}
    removed = sum(max(row["removed"], 0) for row in rows if row["host"] in hosts)
    missed = hosts - reached
    log.info("sparkhvd: swept the host copies earlier attempts kept on %s (%d rank folder(s))",
             ", ".join(sorted(hosts & reached)) or "no host", removed)
    if missed:
        log.warning("sparkhvd: host copies this run kept on %s were not swept (no task ran "
                    "there: the host is gone or its slots are busy); a later run there "
                    "deletes them a day later", ", ".join(sorted(missed)))
    return reached & hosts
