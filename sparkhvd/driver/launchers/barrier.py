"""The default Spark launcher: one barrier stage, one supervised rank process per task.

``horovod.spark.run`` spends ~6 s on a no-op (task services, NIC discovery between tasks, a
``python -m horovod.spark.task...`` start per rank, a 3 s minimum command lifetime). This
launcher does what it needs directly:

1. The driver starts the backend's rendezvous (horovod's Gloo server) and a small *control
   server* (TCP, :mod:`sparkhvd.common.protocol` messages, a per-run random token).
2. One Spark **barrier** stage runs ``np`` tasks at once (all or none; the slot check before the
   launch guarantees they fit) -- a DataFrame barrier stage (``mapInArrow(..., barrier=True)``),
   the same call on classic and Spark Connect sessions (:class:`~sparkhvd.spark.sparkview.SparkView`).
   Each task registers (:mod:`sparkhvd.executor.barrier`); once all ``np`` are in, the backend
   assigns ranks host by host and each task gets its variables.
3. Each task starts its rank, forwards its output and events, sends a heartbeat every second,
   reports its exit status and returns the pickled result in its rows of ``collect()``.

When some task cannot reach the control server (a Spark Connect client the executors cannot
reach), the tasks run without it and return the ranks' output and events in their rows;
:func:`replay_rows` delivers them to the sink after the job, so errors are decided as when live.

A failed rank, a vanished one (its connection drops without an exit status: executor lost) or a
silent one (no heartbeat for ``heartbeat_timeout``: host off the network) makes the driver abort
the others over their connections and cancel the job group. A failing rank does not fail its
Spark task, so Spark never retries a training run by itself. Barrier stages cannot run with
dynamic allocation: there a horovod run goes through ``horovod.spark.run``, and the other
backends are refused with the fix (the rules in :mod:`sparkhvd.driver.launchers`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
import time
from typing import Any, Optional

from sparkhvd.common import protocol
from sparkhvd.common.backends import TaskInfo, get_backend
from sparkhvd.common.errors import LaunchFailure
from sparkhvd.common.netif import bind_address, collective_iface_env
from sparkhvd.common.protocol import TaskSpec
from sparkhvd.driver.launchers.base import ThreadedGroup, kill_local_ranks
from sparkhvd.driver.launchers.control import ControlServer, TaskState
from sparkhvd.driver.launchers.seam import LaunchSpec, Sink
from sparkhvd.driver.payload import load_result
from sparkhvd.spark.sparkview import stopped_session_error

__side__ = "driver"

log = logging.getLogger(__name__)

#: How often a running launch checks that its session is still there (a Spark Connect server).
LIVENESS_S = 3.0
#: A run whose tasks did not all register this long after the first did goes on without the
#: channel (a task gives up connecting after ``task.barrier.CONNECT_TIMEOUT_S``).
DETACH_AFTER_S = 15.0


class BarrierGroup(ThreadedGroup):
    """``np`` ranks in one DataFrame barrier stage of the run's session, classic or Spark
    Connect (module docstring); reached through the control server."""

    THREAD = "sparkhvd-barrier"

    def __init__(self, spec: LaunchSpec, sink: Sink) -> None:
        super().__init__(spec, sink)
        self._view = spec.session
        self._backend: Any = None
        self._server: Optional[ControlServer] = None
        self._job: Any = None
        self._mapper: Any = None
        #: the session's liveness: when last probed, and whether the no-channel warning was said
        self._probed, self._warned = 0.0, False

    def _launch(self) -> None:
        from sparkhvd.executor.barrier import arrow_barrier_task

        spec = self.spec
        self._backend = get_backend(spec.backend)
        # nics given: every rank uses them; else each task picks its way to the driver.
        run_env = {**self._backend.start(spec.driver_host, spec.nics, spec.verbose, spec.run),
                   **collective_iface_env(spec.nics, None)}
        token = secrets.token_hex(16)
        bind = "127.0.0.1" if spec.placement.executors_here else bind_address(spec.driver_host)
        server = self._server = ControlServer(bind, spec.tasks, token, self.sink, run_env,
                                              self._backend, spec.ranks_per_task,
                                              spec.node_per_task)
        self.reach = server
        threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True,
                         name="sparkhvd-control").start()
        self._job = self._view.job(spec.job,
                                   f"sparkhvd: {spec.size} rank(s) of run {spec.run.run_id}")
        self._mapper = functools.partial(arrow_barrier_task, TaskSpec(
            payload=spec.payload, options=spec.options.as_dict(), env=dict(spec.env),
            driver=control_address(spec, server), token=token,
            start_timeout=float(spec.start_timeout), backend=spec.backend,
            run_env=dict(run_env), ranks_per_task=spec.ranks_per_task,
            node_per_task=spec.node_per_task, start_by=time.time() + spec.start_timeout))

    def _call(self) -> list:
        from sparkhvd.executor.barrier import ROW_SCHEMA

        return self._job.run(lambda: self._view.barrier_collect(self.spec.tasks, self._mapper,
                                                                ROW_SCHEMA))

    def _check(self, elapsed_s: float) -> None:
        """A stopped or lost session, a lost or failed rank, tasks that never reached the
        control channel (then the run goes on in rows mode)."""
        spec, view, server = self.spec, self._view, self._control()
        if view.stopped():
            raise stopped_session_error(during=True)
        failure = server.failure(spec.heartbeat_timeout) or self.sink.stale_error()
        if failure is not None or elapsed_s - self._probed >= LIVENESS_S:
            # a rank lost, or time to look: is it the session that is gone? (a lost
            # Connect server takes its executors' ranks with it, and says nothing)
            self._probed = elapsed_s
            lost = view.lost()
            if lost is not None:
                view.abandon()
                raise lost
        if failure is not None:
            raise failure
        server.detach_if_incomplete(DETACH_AFTER_S)
        if server.plan is None and not server.detached and elapsed_s > spec.start_timeout:
            if not view.connect:
                raise TimeoutError(_not_started(spec, server))
            if not self._warned:
                self._warned = True
                log.warning(
                    "No Spark task reached this client's control channel (%s) within %g s: "
                    "if the executors cannot reach this machine, the ranks run without live "
                    "logs and their output, errors and results arrive when the job ends "
                    "(timeout= bounds the wait).", spec.driver_host, spec.start_timeout)

    def _results(self, value: Any) -> list[Any]:
        spec, server, sink = self.spec, self._control(), self.sink
        tasks = gather_rows(value)
        if any(t.get("status", {}).get("mode") == "late" for t in tasks.values()):
            raise TimeoutError(_not_started(spec))
        server.wait_ended(10.0)
        replay_rows(server, sink, tasks)
        self._check(0.0)  # a rank that failed as the stage ended
        modes = {t["status"].get("mode") for t in tasks.values()}
        sink.reported_by("rows" if "rows" in modes else "live")
        return _results(server, tasks, spec.size)

    def _stop(self) -> None:
        """Tell the ranks (abort over their connections), cancel the Spark job, kill what is
        left of them on this machine."""
        self._control().abort()
        self._job.cancel()
        kill_local_ranks(self.sink)

    def _behind(self, exc: Exception) -> Optional[BaseException]:
        return _behind_spark_error(exc, self._control(), self.spec)

    def _release(self) -> None:
        # Both servers poll for shutdown: stop them off the return path.
        threading.Thread(target=_stop_servers, args=(self._server, self._backend), daemon=True,
                         name="sparkhvd-stop-servers").start()

    def _control(self) -> ControlServer:
        assert self._server is not None, "the group was not started"
        return self._server


def _behind_spark_error(exc: Exception, server: ControlServer, spec: LaunchSpec
                        ) -> Optional[LaunchFailure]:
    """The rank failure behind the Spark job's own error, when there is one: Spark may abort
    the barrier stage (a lost worker, a task that failed) before the poll loop has seen why.
    The lost executor's rank when Spark names it, else what the control server sees within a
    heartbeat timeout. None for sparkhvd's own errors and before the ranks started."""
    from sparkhvd.common.errors import SparkhvdError

    if isinstance(exc, (SparkhvdError, TimeoutError)) or server.plan is None:
        return None
    lost = server.lost_in(str(exc))
    if lost is not None:
        return lost
    deadline = time.monotonic() + spec.heartbeat_timeout + 2.0
    while time.monotonic() < deadline:
        failure = server.failure(spec.heartbeat_timeout)
        if failure is not None:
            return failure
        time.sleep(0.2)
    return None


def _not_started(spec: LaunchSpec, server: Optional[ControlServer] = None) -> str:
    """Why a launch gave up starting: its job is cancelled and no task of it will run."""
    started = f" ({len(server.tasks)} of {spec.tasks} started)" if server is not None else ""
    return (f"The {spec.tasks} Spark task(s) did not all start within start_timeout="
            f"{spec.start_timeout:g} s{started}, or could not reach this driver's control "
            f"channel ({spec.driver_host}); the run's Spark job was cancelled and none of its "
            "tasks will run. Other jobs may hold the task slots: check the Spark UI and "
            "`sparkhvd doctor --np N`; or raise start_timeout.")


def _results(server: ControlServer, tasks: dict[int, dict[str, Any]], np: int) -> list[Any]:
    """The ranks' return values in rank order, from the collected rows."""
    from sparkhvd.executor.barrier import result_kind

    results: list[Any] = [None] * np
    for partition, task in server.tasks.items():
        for i, rank in enumerate(task.ranks):
            data = tasks.get(partition, {}).get(result_kind(i))
            if data is not None:
                results[rank] = load_result(rank, data)
    return results


def control_address(spec: LaunchSpec, server: ControlServer) -> tuple[str, int]:
    """Where the tasks reach the control server (a seam the tests use to make it unreachable)."""
    return spec.driver_host, server.server_address[1]


def gather_rows(rows: list) -> dict[int, dict[str, Any]]:
    """The collected rows per partition: ``status`` (dict), ``result`` and ``events`` (bytes)."""
    import json

    chunks: dict[tuple[int, str], list[tuple[int, bytes]]] = {}
    for row in rows:
        chunks.setdefault((int(row["partition"]), row["kind"]), []).append(
            (int(row["seq"]), bytes(row["data"])))
    tasks: dict[int, dict[str, Any]] = {}
    for (partition, kind), parts in chunks.items():
        data = b"".join(chunk for _, chunk in sorted(parts))
        tasks.setdefault(partition, {})[kind] = json.loads(data) if kind == "status" else data
    return tasks


def replay_rows(server: ControlServer, sink: Sink, tasks: dict[int, dict[str, Any]]) -> None:
    """Rows mode: deliver what each rank said, in rank order, as if it had come live, and
    record each task's exit -- so failures and errors are decided as in live mode."""
    replayed = []
    for partition, task in tasks.items():
        if task.get("status", {}).get("mode") != "rows":
            continue
        messages = []
        for raw in (task.get("events") or b"").splitlines():
            with contextlib.suppress(ValueError):
                messages.append(protocol.decode(raw))
        raised = min((m.time for m in messages if isinstance(m, protocol.Error)),
                     default=float("inf"))
        replayed.append((raised, task["status"].get("rank") or 0, partition, messages))
    if replayed:
        log.warning("The executors could not reach this machine's control channel: the ranks' "
                    "output below was kept by the Spark tasks and shown when the job ended.")
    # The rank that raised first ends first, so it is the one the error names (as when live).
    for _, _, partition, messages in sorted(replayed, key=lambda r: (r[0], r[1])):
        status = tasks[partition]["status"]
        entry = TaskState(TaskInfo(partition, status.get("host", "?")),
                      ranks=list(status.get("ranks") or []))
        server.tasks[partition] = entry
        for msg in messages:
            server.deliver(entry, msg)
        if status.get("dropped_lines"):
            log.warning("rank %s: %d older output line(s) were not kept (rows mode keeps the "
                        "newest 8 MB)", status.get("rank"), status["dropped_lines"])
        for rank, code in zip(entry.ranks, status.get("codes") or []):
            if code is not None:
                server.rank_exited(entry, rank, code)
        server.ended(entry)


def _stop_servers(server: Optional[ControlServer], backend: Any) -> None:
    if server is not None:
        server.end_all()  # no task connection outlives the launch
        server.shutdown()
        server.server_close()
    if backend is not None:
        backend.stop()


LAUNCHER = BarrierGroup
