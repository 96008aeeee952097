"""Why is it stuck? Every rank's stacks on timeout, on a stall, and on demand.

:class:`RunMonitor` watches one attempt at each of the run's polls
(:meth:`sparkhvd.driver.attempt.Attempt.poll`):

- **timeout** (``run_timeout``): before the ranks are stopped, their stacks are collected and the
  ``TimeoutError`` says which rank is where;
- **stall** (``stall_timeout``): no rank has shown progress -- an output line, metrics, any report
  -- for that long: stacks are collected and a warning says which rank is where; with
  ``on_stall="stop"`` the poll says the attempt stalled, and the run ends it with a
  :class:`StallError`;
- **on demand**: ``sparkhvd stacks <run folder>`` (another process; :func:`request_stacks`) drops
  a request file into the run folder, the monitor answers it; :meth:`HorovodRunner.dump_stacks`
  does the same from Python.

Collecting: a request file in the run folder (ranks that poll for it, see
:mod:`sparkhvd.rank.stack_dump`), the launcher's own way to its ranks (its rank group's
``ask_stacks``: the barrier launcher's control channel, the local launcher's processes) or a
signal to the ranks on this machine; what has not answered after :data:`ANSWER_S` and runs
here is read with py-spy where installed. The report goes to ``logs/stacks-<time>.txt``; :func:`summarise` says which
ranks wait in a collective and which is elsewhere ("rank 1 is in train.py:42 load_batch(); ranks
0, 2 wait in allreduce").
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from sparkhvd.common import protocol
from sparkhvd.common.errors import StallError
from sparkhvd.driver.inbox import AttemptInbox
from sparkhvd.timing.buckets import is_collective, is_user_code

__side__ = "driver"

log = logging.getLogger(__name__)

#: How long the ranks get to answer a stack request.
ANSWER_S = 5.0
#: How often the monitor looks for a request from ``sparkhvd stacks``.
REQUEST_POLL_S = 0.5
#: The file ``sparkhvd stacks`` drops into a run folder (the driver answers and removes it).
REQUEST_NAME = ".stacks-request"

_FAULTHANDLER = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_PYSPY = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:()]+):(?P<line>\d+)\)")
_THREAD = re.compile(r'^(Current thread|Thread) (0x[0-9a-f]+|\d+)(?: \(\w+\))?:?\s*(?:"(?P<name>[^"]*)")?')


@dataclass
class Frame:
    file: str
    line: int
    func: str


@dataclass
class RankStacks:
    rank: int
    host: str
    pid: int
    source: str
    text: str
    #: the main thread's frames, innermost first
    main: list[Frame] = field(default_factory=list)


def parse(msg: protocol.Stacks) -> RankStacks:
    """A rank's dump (faulthandler's or py-spy's format) with its main thread's frames."""
    threads: list[tuple[str, list[Frame]]] = []
    for line in msg.text.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append((head.group("name") or "", []))
            continue
        m = _FAULTHANDLER.match(line) or _PYSPY.match(line)
        if m and threads:
            threads[-1][1].append(Frame(m.group("file"), int(m.group("line")), m.group("func")))
    # unnamed threads: faulthandler lists the main thread last
    main = next((frames for name, frames in threads if name == "MainThread"),
                threads[-1][1] if threads else [])
    return RankStacks(msg.rank, msg.host, msg.pid, msg.source, msg.text, main)


def _is_user_code(frame: Frame) -> bool:
    return is_user_code(frame.file)


def where(stacks: RankStacks) -> tuple[str, Optional[Frame]]:
    """``("collective", frame)`` when the main thread waits in a library's collective, else
    ``("elsewhere", frame)``: its innermost frame in user code (or innermost at all)."""
    for frame in stacks.main:  # a library's collective (the user's own names do not count)
        if is_collective(frame.file, frame.func):
            return "collective", frame
    user = next((f for f in stacks.main if _is_user_code(f)), None)
    return "elsewhere", user or (stacks.main[0] if stacks.main else None)


def summarise(found: dict[int, RankStacks], missing: list[int]) -> str:
    """One sentence: which ranks are elsewhere, which wait in a collective, which did not answer.

    Ranks in the same function of the same file are one group even when their lines differ
    (``ranks 0, 1 are in train.py:92/93 wait_for_data()``): two ranks polling in one loop are
    caught on either line of it, and for a hang they are in the same place."""
    groups: dict[tuple[str, str, str], tuple[list[int], set[int]]] = {}
    for rank in sorted(found):
        kind, frame = where(found[rank])
        if frame is None:
            key = (kind, "", "an unknown place (no Python frames)")
        elif kind == "collective":
            key = (kind, "", frame.func)
        else:
            key = (kind, frame.file, frame.func)
        ranks_here, lines = groups.setdefault(key, ([], set()))
        ranks_here.append(rank)
        if frame is not None:
            lines.add(frame.line)

    def ranks(rs: list[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"

    def place(key: tuple[str, str, str], lines: set[int]) -> str:
        kind, file, func = key
        if kind == "collective" or not file:
            return func
        return f"{os.path.basename(file)}:{'/'.join(map(str, sorted(lines)))} {func}()"

    parts = [f"{ranks(rs)} {'is' if len(rs) == 1 else 'are'} in {place(key, lines)}"
             for key, (rs, lines) in groups.items() if key[0] == "elsewhere"]
    parts += [f"{ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} in {place(key, lines)}"
              for key, (rs, lines) in groups.items() if key[0] == "collective"]
    if missing:
        parts.append(f"{ranks(missing)} did not answer (lost, or stuck holding Python's lock; "
                     "install py-spy on the hosts to read them from outside)")
    return "; ".join(parts) if parts else "no rank answered"


@dataclass
class StackReport:
    reason: str
    summary: str
    path: Optional[str]
    found: dict[int, RankStacks]
    missing: list[int]

    def text(self) -> str:
        lines = [f"sparkhvd: every rank's stacks ({self.reason}), "
                 f"{_dt.datetime.now().isoformat(timespec='seconds')}",
                 f"Summary: {self.summary}", ""]
        for rank in sorted(self.found):
            s = self.found[rank]
            lines += [f"=== rank {rank} (pid {s.pid} on host {s.host}; {s.source}) ===",
                      s.text.rstrip(), ""]
        for rank in self.missing:
            lines += [f"=== rank {rank}: no answer ===", ""]
        return "\n".join(lines)


class RunMonitor:
    """Watches one run for stalls and stack requests (module docstring).

    Args:
        inbox: the attempt's :class:`~sparkhvd.driver.inbox.AttemptInbox` (progress, pids, stacks).
        run_path: the run folder's local path (logs, the request file).
        stall_timeout, on_stall: see :class:`~sparkhvd.driver.settings.LaunchConfig`.
    """

    def __init__(self, inbox: AttemptInbox, run_path: Optional[str], *,
                 stall_timeout: Optional[float] = None, on_stall: str = "warn") -> None:
        self.inbox = inbox
        self.run_path = run_path
        self.stall_timeout = stall_timeout
        self.on_stall = on_stall
        #: the launcher's own way to ask its ranks (:meth:`reach_ranks`), else signals here
        self._ask_stacks: Optional[Callable[[], None]] = None
        self.reports: list[StackReport] = []
        self._stall_reported_at: Optional[float] = None
        self._next_request_check = 0.0

    def reach_ranks(self, ask_stacks: Optional[Callable[[], None]]) -> None:
        """How the launcher asks its ranks for their stacks (its control channel, its
        processes); None: the ranks on this machine are signalled."""
        self._ask_stacks = ask_stacks

    # -- at each of the run's polls -------------------------------------------------------------
    def tick(self) -> Optional[StallError]:
        """Answer a pending request; detect a stall: the error that ends the attempt when
        ``on_stall="stop"`` (None: no stall, or one only warned of)."""
        now = time.monotonic()
        if self.run_path and now >= self._next_request_check:
            self._next_request_check = now + REQUEST_POLL_S
            request = os.path.join(self.run_path, REQUEST_NAME)
            if os.path.exists(request):
                self.collect("requested with `sparkhvd stacks`")
                with contextlib.suppress(OSError):
                    os.remove(request)
        if self.stall_timeout is None or not self.inbox.pids:
            return None
        last = self.inbox.last_progress
        if now - last < self.stall_timeout or self._stall_reported_at == last:
            return None
        self._stall_reported_at = last
        report = self.collect(f"no progress for {now - last:.0f} s")
        message = (f"No rank has made progress for {now - last:.0f} s (stall_timeout="
                   f"{self.stall_timeout:g}): {report.summary}. Every rank's stacks: "
                   f"{report.path or 'not saved'}")
        if self.on_stall == "stop":
            return StallError(message + ". The run was stopped (on_stall='stop').")
        log.warning("%s. The run goes on (on_stall='warn'; 'stop' ends it).", message)
        return None

    def explain_timeout(self) -> str:
        """For the TimeoutError: where each rank was, and where its stacks are."""
        try:
            report = self.collect("run_timeout reached")
        except Exception as exc:  # noqa: BLE001 - the timeout must still be raised
            return f" (could not collect the ranks' stacks: {exc})"
        return f"\nWhere the ranks were: {report.summary}.\nEvery rank's stacks: {report.path}"

    # -- collecting -----------------------------------------------------------------------------
    def collect(self, reason: str, answer_s: float = ANSWER_S) -> StackReport:
        """Ask every started rank for its stacks, wait for them, save and return the report."""
        inbox = self.inbox
        since = time.monotonic()
        started = sorted(inbox.pids)
        self._write_request()
        if self._ask_stacks is not None:
            self._ask_stacks()
        else:
            self._signal_local_ranks()
        deadline = since + answer_s
        while time.monotonic() < deadline and not inbox.stacks_since(since, started):
            time.sleep(0.05)
        found = {r: parse(m) for r, m in inbox.stacks_after(since).items()}
        missing = [r for r in started if r not in found]
        for rank in list(missing):  # ours to read from outside: py-spy
            msg = self._py_spy(rank)
            if msg is not None:
                found[rank] = parse(msg)
                missing.remove(rank)
        report = StackReport(reason, summarise(found, missing), None, found, missing)
        report.path = self._save(report)
        self.reports.append(report)
        log.info("Stacks of every rank (%s): %s -- %s", reason, report.summary, report.path)
        return report

    def _write_request(self) -> None:
        if not self.run_path:
            return
        from sparkhvd.common.fileio import atomic_write

        path = os.path.join(self.run_path, protocol.STACKS_REQUEST_FILE)
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, json.dumps({"id": uuid.uuid4().hex, "at": time.time()}).encode())

    def _local_pids(self) -> dict[int, int]:
        me = socket.gethostname()
        return {rank: pid for rank, pid in self.inbox.pids.items()
                if self.inbox.pid_hosts.get(pid) in ("", me)}

    def _signal_local_ranks(self) -> None:
        for pid in self._local_pids().values():
            with contextlib.suppress(OSError):
                os.kill(pid, protocol.STACKS_SIGNAL)

    def _py_spy(self, rank: int) -> Optional[protocol.Stacks]:
        from sparkhvd.common import pyspy

        pid = self._local_pids().get(rank)
        return pyspy.stacks_event(rank, pid) if pid is not None else None

    def _save(self, report: StackReport) -> Optional[str]:
        if not self.run_path:
            return None
        from sparkhvd.common.fileio import atomic_write

        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = os.path.join(self.run_path, "logs", f"stacks-{stamp}.txt")
        n = 1
        while os.path.exists(path):
            n += 1
            path = os.path.join(self.run_path, "logs", f"stacks-{stamp}-{n}.txt")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, report.text().encode())
        except OSError as exc:
            log.warning("could not save the stacks: %s", exc)
            return None
        return path


def request_stacks(run_folder: str, timeout: float = 30.0) -> str:
    """From any process on the driver's machine: ask the run in ``run_folder`` (its local path,
    as the driver logged it) for every rank's stacks; the report's text.

    Raises:
        FileNotFoundError: not a run folder.
        TimeoutError: no answer (the run is not running, or not on this machine).
    """
    if not os.path.isfile(os.path.join(run_folder, "run.json")):
        raise FileNotFoundError(f"{run_folder} is not a sparkhvd run folder (no run.json). Give "
                                "the run folder the driver logged: '... logs in <run>/logs'.")
    logs = os.path.join(run_folder, "logs")
    before = set(os.listdir(logs)) if os.path.isdir(logs) else set()
    with open(os.path.join(run_folder, REQUEST_NAME), "w") as f:
        f.write(str(time.time()))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = sorted(n for n in (os.listdir(logs) if os.path.isdir(logs) else [])
                     if n.startswith("stacks-") and n.endswith(".txt") and n not in before)
        if new:
            with open(os.path.join(logs, new[-1]), encoding="utf-8") as f:
                return f.read()
        time.sleep(0.2)
    with contextlib.suppress(OSError):
        os.remove(os.path.join(run_folder, REQUEST_NAME))
    raise TimeoutError(f"No answer from the run in {run_folder} within {timeout:g} s: it is not "
                       "running, or its driver runs on another machine.")
