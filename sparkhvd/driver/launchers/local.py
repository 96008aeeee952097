"""``np < 0``: ranks as supervised processes on the driver, no Spark tasks (quick debugging).

The same rank processes as on Spark (:class:`~sparkhvd.common.rankprocess.RankProcess`), the same
rendezvous (the backend's), on the loopback interface. Each rank dies with the driver (its
supervisor gets SIGTERM through ``PR_SET_PDEATHSIG`` and ends the rank's whole tree).
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any

from sparkhvd.common import protocol
from sparkhvd.common.backends import TaskInfo, assign_with_hosts, get_backend
from sparkhvd.common.environment import process_env
from sparkhvd.common.errors import LaunchFailure
from sparkhvd.common.identity import RankIdentity
from sparkhvd.common.netif import PortReservation, collective_iface_env
from sparkhvd.common.protocol import PREEMPTED_EXIT, rank_slots
from sparkhvd.common.rankprocess import RankProcess
from sparkhvd.driver.launchers.base import ThreadedGroup, preempted_now
from sparkhvd.driver.launchers.seam import LaunchSpec, Sink
from sparkhvd.driver.payload import load_result
from sparkhvd.driver.rank_end import EXTERNAL_SIGNALS, signal_of

__side__ = "driver"


class LocalGroup(ThreadedGroup):
    """``spec.size`` ranks as local processes (module docstring); the group reaches them
    itself (stacks, notices: signals to their supervisors)."""

    TIMEOUT = "The training did not finish within {timeout:g} s; the rank processes were stopped."
    THREAD = "sparkhvd-local"

    def __init__(self, spec: LaunchSpec, sink: Sink) -> None:
        super().__init__(spec, sink)
        self.reach = self
        self._backend: Any = None
        self._procs: list[RankProcess] = []
        self._ports = contextlib.ExitStack()  # the ranks' reserved ports, held until they end
        self._exited: dict[int, float] = {}  # rank -> when this group saw it exit

    def _launch(self) -> None:
        self._backend = get_backend(self.spec.backend)
        run_env = {**self._backend.start("127.0.0.1", {"lo"}, self.spec.verbose, self.spec.run),
                   **collective_iface_env({"lo"}, None)}
        _start_ranks(self.spec, self._backend, run_env, self.sink, self._procs, self._ports)

    def _call(self) -> None:
        procs, exited = self._procs, self._exited
        while len(exited) < len(procs):
            for proc in procs:
                if proc.rank not in exited and proc.poll() is not None:
                    proc.finish()
                    exited[proc.rank] = time.monotonic()
                    self.sink.receive(protocol.Exit(rank=proc.rank, code=proc.poll()))
            time.sleep(0.05)

    def _check(self, elapsed_s: float) -> None:
        procs, exited = self._procs, self._exited
        # a rank killed from outside is the cause of its peers' broken collectives,
        # whichever of them this loop saw exit first
        failed = sorted((p for p in procs if p.rank in exited and p.poll() != 0),
                        key=lambda p: (signal_of(p.poll()) not in EXTERNAL_SIGNALS,
                                       exited[p.rank]))
        preempted = preempted_now([(exited[p.rank], p.rank, p.poll()) for p in failed],
                                  len(exited) < len(procs))
        if preempted is None:
            return  # the others are finishing the same step
        if not preempted:
            failed = [p for p in failed if p.poll() != PREEMPTED_EXIT] or failed
        if failed:
            proc = failed[0]  # the first to exit; the others are stopped after it
            how = "stopped on a notice after its checkpoint" if preempted else \
                f"exited with status {proc.poll()}"
            raise LaunchFailure(proc.rank, proc.poll(), f"local rank {proc.rank} {how}",
                                host=socket.gethostname(), preempted=preempted)
        stale = self.sink.stale_error()
        if stale is not None:
            raise stale

    def _results(self, value: Any) -> list[Any]:
        self._check(0.0)
        return _results(self._procs, self.spec.size)

    def _stop(self) -> None:
        for proc in self._procs:
            proc.terminate()

    def _release(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.terminate()
                proc.finish()
            proc.close()
        self._ports.close()
        if self._backend is not None:
            self._backend.stop()

    # -- its reach ------------------------------------------------------------------------
    def ask_stacks(self) -> None:
        for proc in self._procs:
            proc.request_stacks()

    def notify(self, reason: str) -> None:
        for proc in self._procs:
            proc.notice()


LAUNCHER = LocalGroup


def _start_ranks(spec: LaunchSpec, backend: Any, run_env: dict[str, str], sink: Sink,
                 procs: list[RankProcess], held: contextlib.ExitStack) -> None:
    """Start every rank, numbered as Spark tasks of ``ranks_per_task`` would be, into
    ``procs`` (filled as they start, so that a failure stops those already running); the
    ports the backend needs stay reserved in ``held``."""
    slots: dict[int, TaskInfo] = {}
    for task in range(spec.tasks):  # groups of ranks_per_task play the Spark tasks
        ports = held.enter_context(PortReservation(
            spec.ranks_per_task if backend.needs_port else 0)).ports
        slots.update(rank_slots(task, "localhost", "127.0.0.1", ports, spec.ranks_per_task,
                                spec.node_per_task))
    plan = assign_with_hosts(backend, slots)
    for partition in range(spec.size):
        assigned = {**run_env, **plan[partition]}
        rank = RankIdentity.from_env(assigned, default_rank=partition).rank
        procs.append(RankProcess(spec.payload, spec.options.as_dict(),
                                 process_env(os.environ, spec.env, assigned), rank=rank,
                                 on_line=sink.receive, on_event=sink.receive).start())


def _results(procs: list[RankProcess], np: int) -> list[Any]:
    """The ranks' return values, in rank order (None where a rank kept none)."""
    results: list[Any] = [None] * np
    for proc in procs:
        blob = proc.result()
        if blob is not None:
            results[proc.rank] = load_result(proc.rank, blob)
    return results
