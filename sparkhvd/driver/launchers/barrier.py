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

Each poll says what the control server saw of each rank -- an exit status, a vanished one (its
connection dropped without an exit status: executor lost), a silent one (no heartbeat for
``heartbeat_timeout``: host off the network) -- as facts; once the run decided the attempt
ended, stopping aborts the others over their connections and cancels the job group. A failing
rank does not fail its Spark task, so Spark never retries a training run by itself. Barrier stages cannot run with
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
from sparkhvd.common.errors import SparkhvdError
from sparkhvd.common.netif import bind_address, collective_iface_env
from sparkhvd.common.protocol import TaskSpec
from sparkhvd.driver.launchers.base import SPARK_TIMEOUT, BlockingCall, kill_local_ranks
from sparkhvd.driver.launchers.control import ControlServer, TaskState
from sparkhvd.driver.launchers.seam import GroupStatus, LaunchSpec, Sink
from sparkhvd.driver.payload import load_result
from sparkhvd.spark.sparkview import stopped_session_error

__side__ = "driver"

log = logging.getLogger(__name__)

#: How often a running launch checks that its session is still there (a Spark Connect server).
LIVENESS_S = 3.0
#: A run whose tasks did not all register this long after the first did goes on without the
#: channel (a task gives up connecting after ``task.barrier.CONNECT_TIMEOUT_S``).
DETACH_AFTER_S = 15.0


class BarrierGroup:
    """``np`` ranks in one DataFrame barrier stage of the run's session, classic or Spark
    Connect (module docstring); reached through the control server."""

    recovers = False

    def __init__(self, spec: LaunchSpec, sink: Sink) -> None:
        self.spec, self.sink = spec, sink
        self.timeout_message = SPARK_TIMEOUT.format(timeout=spec.timeout or 0)
        self.reach: Optional[ControlServer] = None
        self._view = spec.session
        self._backend: Any = None
        self._server: Optional[ControlServer] = None
        self._job: Any = None
        self._call: Optional[BlockingCall] = None
        #: what the stage returned, read once: the ranks' results, or why there are none
        self._ended: Optional[tuple[tuple, Optional[Exception]]] = None
        #: the session's liveness: when last probed, and whether the no-channel warning was said
        self._probed, self._warned = 0.0, False
        self._session_lost = False
        self._failed = 0  # ranks seen failed when the session was last probed
        self._released = False

    def start(self) -> None:
        try:
            mapper = self._launch()
        except BaseException:
            self.shutdown()
            raise
        from sparkhvd.executor.barrier import ROW_SCHEMA

        tasks = self.spec.tasks
        self._call = BlockingCall(lambda: self._job.run(
            lambda: self._view.barrier_collect(tasks, mapper, ROW_SCHEMA)), "sparkhvd-barrier")

    def _launch(self) -> Any:
        """The backend's rendezvous, the control server and the Spark job; the task mapper."""
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
        return functools.partial(arrow_barrier_task, TaskSpec(
            payload=spec.payload, options=spec.options.as_dict(), env=dict(spec.env),
            driver=control_address(spec, server), token=token,
            start_timeout=float(spec.start_timeout), backend=spec.backend,
            run_env=dict(run_env), ranks_per_task=spec.ranks_per_task,
            node_per_task=spec.node_per_task, start_by=time.time() + spec.start_timeout))

    def poll(self, wait_s: float, elapsed_s: float) -> GroupStatus:
        """Wait up to ``wait_s`` for the stage; what the control server saw of the ranks. A
        stopped or lost session is the error (the ranks' ends are its consequences); the
        stage's own error is given a heartbeat timeout for the rank behind it to show."""
        call, server = self._started(), self._control()
        call.wait(wait_s)
        session = self._session_error(elapsed_s, server)
        if session is not None:
            return GroupStatus(running=False, error=session)
        if call.done and self._ended is None:
            self._ended = self._read_end(call)
        facts = tuple(server.facts(self.spec.heartbeat_timeout))
        # a lost host shows as a silent rank a heartbeat timeout after it went
        silent_after = 0.0 if server.plan is None else self.spec.heartbeat_timeout + 2.0
        if self._ended is None:
            return GroupStatus(facts, running=server.running(), silent_after_s=silent_after)
        results, error = self._ended
        if error is None:
            return GroupStatus(facts, running=False, done=True, results=results)
        lost = server.lost_in(str(error))
        explained = 0.0 if isinstance(error, (SparkhvdError, TimeoutError)) else silent_after
        return GroupStatus(facts + ((lost,) if lost is not None else ()),
                           running=server.running(), error=error,
                           explained_within_s=explained, silent_after_s=silent_after)

    def _session_error(self, elapsed_s: float, server: ControlServer) -> Optional[Exception]:
        """A stopped or lost session (looked at every :data:`LIVENESS_S`, and whenever a rank
        ended otherwise than with status 0: a lost Connect server takes its executors' ranks
        with it, and says nothing); tasks that never reached the control channel."""
        spec, view = self.spec, self._view
        if view.stopped():
            self._session_lost = True
            return stopped_session_error(during=True)
        failed = sum(fact.failed for fact in server.facts(spec.heartbeat_timeout))
        if failed > self._failed or elapsed_s - self._probed >= LIVENESS_S:
            self._failed = failed
            self._probed = elapsed_s
            lost = view.lost()
            if lost is not None:
                self._session_lost = True
                view.abandon()
                return lost
        server.detach_if_incomplete(DETACH_AFTER_S)
        if server.plan is None and not server.detached and elapsed_s > spec.start_timeout:
            if not view.connect:
                return TimeoutError(_not_started(spec, server))
            if not self._warned:
                self._warned = True
                log.warning(
                    "No Spark task reached this client's control channel (%s) within %g s: "
                    "if the executors cannot reach this machine, the ranks run without live "
                    "logs and their output, errors and results arrive when the job ends "
                    "(timeout= bounds the wait).", spec.driver_host, spec.start_timeout)
        return None

    def _read_end(self, call: BlockingCall) -> tuple[tuple, Optional[Exception]]:
        """The stage returned: the ranks' results from its rows (rows mode: their output and
        exits replayed first), or the stage's error."""
        if call.error is not None:
            if not isinstance(call.error, Exception):
                raise call.error
            return (), call.error
        spec, server, sink = self.spec, self._control(), self.sink
        tasks = gather_rows(call.value)
        if any(t.get("status", {}).get("mode") == "late" for t in tasks.values()):
            return (), TimeoutError(_not_started(spec))
        server.wait_ended(10.0)
        replay_rows(server, sink, tasks)
        modes = {t["status"].get("mode") for t in tasks.values()}
        sink.reported_by("rows" if "rows" in modes else "live")
        return tuple(_results(server, tasks, spec.size)), None

    def shutdown(self, stop: bool = False) -> None:
        """``stop``: tell the ranks (abort over their connections), cancel the Spark job, wait
        for the stage to end (briefly after a lost session: Spark's call is in its client's
        retries), kill what is left of the ranks on this machine. Then the servers stop, off
        the return path (both poll for shutdown)."""
        try:
            if stop and self._server is not None:
                self._stop()
                call = self._call
                if call is not None and not call.done:
                    call.wait(2.0 if self._session_lost else 60.0)
                    self._stop()  # (again: whatever started meanwhile)
        finally:
            if not self._released:
                self._released = True
                threading.Thread(target=_stop_servers, args=(self._server, self._backend),
                                 daemon=True, name="sparkhvd-stop-servers").start()

    def _stop(self) -> None:
        with contextlib.suppress(Exception):
            self._control().abort()
            if self._job is not None:
                self._job.cancel()
        with contextlib.suppress(Exception):
            kill_local_ranks(self.sink)

    def _started(self) -> BlockingCall:
        assert self._call is not None, "the group was not started"
        return self._call

    def _control(self) -> ControlServer:
        assert self._server is not None, "the group was not started"
        return self._server


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
