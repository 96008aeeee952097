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
from sparkhvd.common.identity import RankIdentity
from sparkhvd.common.netif import PortReservation, collective_iface_env
from sparkhvd.common.protocol import rank_slots
from sparkhvd.common.rankprocess import RankProcess
from sparkhvd.driver.launchers.seam import GroupStatus, LaunchSpec, RankFact, Sink
from sparkhvd.driver.payload import load_result

__side__ = "driver"

#: How often a poll looks at the rank processes while it waits.
LOOK_S = 0.02


class LocalGroup:
    """``spec.size`` ranks as local processes (module docstring), polled directly; the group
    reaches them itself (stacks, notices: signals to their supervisors)."""

    recovers = False

    def __init__(self, spec: LaunchSpec, sink: Sink) -> None:
        self.spec, self.sink = spec, sink
        self.timeout_message = ("The training did not finish within {timeout:g} s; the rank "
                                "processes were stopped.").format(timeout=spec.timeout or 0)
        self.reach = self
        self._backend: Any = None
        self._procs: list[RankProcess] = []
        self._ports = contextlib.ExitStack()  # the ranks' reserved ports, held until they end
        self._facts: dict[int, RankFact] = {}  # rank -> how it exited
        self._host = socket.gethostname()
        self._released = False

    def start(self) -> None:
        try:
            self._backend = get_backend(self.spec.backend)
            run_env = {**self._backend.start("127.0.0.1", {"lo"}, self.spec.verbose,
                                             self.spec.run),
                       **collective_iface_env({"lo"}, None)}
            _start_ranks(self.spec, self._backend, run_env, self.sink, self._procs,
                         self._ports)
        except BaseException:
            self.shutdown()
            raise

    def poll(self, wait_s: float, elapsed_s: float) -> GroupStatus:
        """Wait up to ``wait_s`` for the rank processes to end; each one's exit, as a fact."""
        deadline = time.monotonic() + wait_s
        while True:
            for proc in self._procs:
                code = proc.poll()
                if code is not None and proc.rank not in self._facts:
                    proc.finish()  # its output drained before its exit is told
                    self._facts[proc.rank] = RankFact(
                        proc.rank, "exited", time.monotonic(), exit_code=code, host=self._host,
                        detail=f"local rank {proc.rank} exited with status {code}")
                    self.sink.receive(protocol.Exit(rank=proc.rank, code=code))
            running = len(self._facts) < len(self._procs)
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(LOOK_S)
        facts = tuple(self._facts.values())
        done = not running and all(fact.exit_code == 0 for fact in facts)
        return GroupStatus(facts, running=running, done=done,
                           results=tuple(_results(self._procs, self.spec.size)) if done else ())

    def shutdown(self, stop: bool = False) -> None:
        if self._released:
            return
        self._released = True
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
