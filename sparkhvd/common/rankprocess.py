"""One supervised rank process: :class:`RankProcess`.

How the barrier launcher's Spark task (on an executor) and the local launcher (on the driver,
``np < 0``, playing the executor's part) start a rank; horovod's launcher starts its ranks
itself. It writes the payload to a private folder, starts
``python -m sparkhvd.rank.supervisor`` (a supervisor and the rank, see that module) -- forked
by a warm server that already imported the framework where there is one
(:mod:`sparkhvd.common.warmstart`), and leaves one for the next rank after it -- reads the
rank's stdout/stderr as bounded line pieces and its event pipe as typed messages, and at the end
makes sure nothing of the rank's process tree is left.
"""
from __future__ import annotations

import codecs
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Mapping, Optional

from sparkhvd.common import owned_temp, protocol, warmstart
from sparkhvd.common.proctree import kill_group

__side__ = "common"

#: The rank process gets this long to stop after SIGTERM before its group is SIGKILLed.
TERM_GRACE_S = 3.0
#: How long the end of a rank's output may take to arrive after it exited.
DRAIN_S = 5.0
#: Longest event line (an exception with a long traceback).
MAX_EVENT_BYTES = 8 << 20
#: A rank that has not sent its stacks this long after the signal is read with py-spy.
STACKS_ANSWER_S = 2.0


class RankProcess:
    """One rank: a supervised process whose output and events are pumped to callbacks.

    Args:
        payload: the pickled function and arguments.
        options: rank options (see :func:`sparkhvd.rank.bootstrap.rank_main`).
        env: the rank's whole environment (see :mod:`sparkhvd.common.environment`).
        rank: the rank number, for the output lines.
        on_line: called with each :class:`~sparkhvd.common.protocol.Line` (from pump threads).
        on_event: called with each event message the rank emits (from a pump thread).
    """

    def __init__(self, payload: bytes, options: Mapping[str, Any], env: Mapping[str, str], *,
                 rank: int, on_line: Callable[[protocol.Line], None],
                 on_event: Callable[[Any], None]) -> None:
        self.payload = payload
        self.options = dict(options)
        self.env = dict(env)
        self.rank = rank
        self.on_line = on_line
        self.on_event = on_event
        self.proc: Optional[subprocess.Popen[bytes] | warmstart.WarmChild] = None
        #: the warm server's socket this rank may start from and leaves warm (None: off)
        self.warm: Optional[str] = None
        #: whether the rank was forked by a warm server (its framework already imported)
        self.started_warm = False
        self.work: Optional[str] = None
        self._pumps: list[threading.Thread] = []
        #: the rank process itself (the supervisor's child), once it announced itself
        self.rank_pid: Optional[int] = None
        self._stacks_seen = threading.Event()

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def start(self) -> "RankProcess":
        # named by this process: swept by the next one on the host if this one is killed
        self.work = tempfile.mkdtemp(prefix=owned_temp.prefix("rank"))
        payload_path = os.path.join(self.work, protocol.PAYLOAD_FILE)
        with open(payload_path, "wb") as f:
            f.write(self.payload)
        argv = [payload_path, self.work, json.dumps(self.options)]
        read_fd, write_fd = os.pipe()
        try:
            self.proc = self._start_warm(argv, write_fd)
        finally:
            os.close(write_fd)
        if self.proc is None:  # a new event pipe: a warm child whose answer was lost ends
            os.close(read_fd)   # with its connection, but may still hold the first one
            read_fd, write_fd = os.pipe()
            try:
                self.proc = self._start_fresh(argv, write_fd)
            finally:
                os.close(write_fd)
        events = os.fdopen(read_fd, "rb")
        for target, args in ((self._pump_lines, (self.proc.stdout, "stdout")),
                             (self._pump_lines, (self.proc.stderr, "stderr")),
                             (self._pump_events, (events,))):
            thread = threading.Thread(target=target, args=args, daemon=True,
                                      name=f"sparkhvd-rank{self.rank}-pump")
            thread.start()
            self._pumps.append(thread)
        return self

    def _start_warm(self, argv: list[str], write_fd: int) -> Optional[warmstart.WarmChild]:
        """The supervisor forked by this executor's warm server for the backend, if there is
        one (see :mod:`sparkhvd.common.warmstart`); a server that refused is said once. Where
        there is none, one is started beside this fresh rank: a retry or an elastic relaunch
        of this run finds it ready."""
        backend = self.env.get(protocol.BACKEND_ENV, "")
        if not warmstart.enabled(bool(self.options.get("warm_start", True)), self.env):
            return None
        self.warm = warmstart.socket_path(backend, self.env)
        if self.warm is None:
            return None
        why = warmstart.refused(self.warm)
        said = warmstart.say_once(why, backend) if why else None
        if said:
            with contextlib.suppress(Exception):
                self.on_line(protocol.Line(self.rank, "stderr", said))
        child = warmstart.spawn(self.warm, argv, self.env, write_fd, protocol.EVENTS_FD_ENV)
        self.started_warm = child is not None
        if child is None:  # none yet: one starts beside this rank, for a retry or the next run
            threading.Thread(target=warmstart.keep_warm, args=(self.warm, backend, self.env),
                             daemon=True, name="sparkhvd-keep-warm").start()
        return child

    def _start_fresh(self, argv: list[str], write_fd: int) -> subprocess.Popen[bytes]:
        # The supervisor asks for SIGTERM when this process dies (PR_SET_PDEATHSIG) itself, at
        # once: no preexec_fn, whose Python code between fork and exec aborts a child of a
        # process that has gRPC loaded (a Spark Connect client, TorchDistributor's imports).
        env = {**self.env, protocol.EVENTS_FD_ENV: str(write_fd),
               protocol.PARENT_PID_ENV: str(os.getpid())}
        return subprocess.Popen(
            [sys.executable, "-m", "sparkhvd.rank.supervisor", *argv],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(write_fd,))

    # -- pumps --------------------------------------------------------------------------------
    def _pump_lines(self, pipe: Any, tag: str) -> None:
        from sparkhvd.common.outputlines import PARTIAL, UPDATE, OutputSplitter

        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        splitter = OutputSplitter()
        try:
            while True:
                chunk = pipe.read1(protocol.MAX_CHUNK_BYTES)
                pieces = splitter.feed(decoder.decode(chunk, final=not chunk)) if chunk else \
                    splitter.feed(decoder.decode(b"", final=True)) + splitter.close()
                for kind, text in pieces:
                    with contextlib.suppress(Exception):
                        self.on_line(protocol.Line(self.rank, tag, text,
                                                   partial=kind == PARTIAL,
                                                   update=kind == UPDATE))
                if not chunk:
                    break
        finally:
            pipe.close()

    def _pump_events(self, pipe: Any) -> None:
        try:
            while True:
                line = pipe.readline(MAX_EVENT_BYTES)
                if not line:
                    break
                try:
                    msg = protocol.decode(line)
                except ValueError:
                    continue
                if isinstance(msg, protocol.Started):
                    self.rank_pid = msg.pid
                elif isinstance(msg, protocol.Stacks):
                    self._stacks_seen.set()
                with contextlib.suppress(Exception):
                    self.on_event(msg)
        finally:
            pipe.close()

    # -- stacks -------------------------------------------------------------------------------
    def request_stacks(self, answer_s: float = STACKS_ANSWER_S) -> None:
        """Ask the rank for every thread's stack (it answers with a Stacks event); if it has not
        answered within ``answer_s``, take them with py-spy where installed (in a thread)."""
        pid = self.rank_pid
        if pid is None or self.poll() is not None:
            return
        self._stacks_seen.clear()
        with contextlib.suppress(OSError):
            os.kill(pid, protocol.STACKS_SIGNAL)

        def fallback() -> None:
            from sparkhvd.common import pyspy

            if self._stacks_seen.wait(answer_s) or not pyspy.available():
                return
            event = pyspy.stacks_event(self.rank, pid)
            if event is not None:
                with contextlib.suppress(Exception):
                    self.on_event(event)

        threading.Thread(target=fallback, daemon=True, name=f"sparkhvd-rank{self.rank}-stacks"
                         ).start()

    def notice(self) -> None:
        """Give the rank a notice (:data:`~sparkhvd.common.protocol.NOTICE_SIGNAL` to the rank
        itself, not its supervisor): a listening checkpoint helper checkpoints after the step
        and the rank exits as preempted."""
        pid = self.rank_pid
        if pid is not None and self.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(pid, protocol.NOTICE_SIGNAL)

    # -- lifecycle ----------------------------------------------------------------------------
    def poll(self) -> Optional[int]:
        return self.proc.poll() if self.proc else None

    def wait(self, timeout: Optional[float] = None) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def terminate(self) -> None:
        """Stop the rank now: SIGTERM to its supervisor (which ends the whole tree), then
        SIGKILL to the process group if it is still there after a grace period."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group()
        self.proc.wait()

    def _kill_group(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)

    def finish(self) -> None:
        """After the rank exited: nothing of its group may remain; let its output drain."""
        self._kill_group()
        for thread in self._pumps:
            thread.join(DRAIN_S)

    def result(self) -> Optional[bytes]:
        """The pickled return value the rank stored, if any."""
        if not self.work:
            return None
        for name in os.listdir(self.work):
            if protocol.is_result_file(name):
                with open(os.path.join(self.work, name), "rb") as f:
                    return f.read()
        return None

    def close(self) -> None:
        """Remove the private folder (payload, result); leave a warm server for the next rank
        of this backend on this executor, if none is there."""
        if self.work:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        if self.warm is not None:
            warm, self.warm = self.warm, None
            warmstart.keep_warm(warm, self.env.get(protocol.BACKEND_ENV, ""), self.env)
