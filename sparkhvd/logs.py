"""Rank output on the driver: parse, tag with ``[rank N]``, filter noise, keep per-rank files.

Horovod hands the driver each rank's output as text chunks of lines shaped
``[index]<stdout>:text``. :class:`RankLogRouter` is the stream given to horovod: it splits the
chunks into lines, maps the launcher index to the Horovod rank (from the marker each rank prints
first), writes every line to ``logs/rank-N.log`` and shows the interesting ones on the driver.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
from typing import IO, Optional

from .errors import RankFailure
from .rank import ERROR_MARKER, METRICS_MARKER, RANK_MARKER
from .storage import redact

VERBOSITIES = ("rank0", "all")

_PREFIX = re.compile(r"^(?:[^\[]*?)\[(?P<idx>\d+)\]<(?P<tag>stdout|stderr)>:(?P<text>.*)$", re.S)

#: Start-up chatter of TensorFlow, Gloo, Horovod and friends, hidden unless verbose.
NOISE = [re.compile(p) for p in (
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] ",            # TF C++ info/warning lines
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] ",          # horovod C++ info/warning lines
    r"^To enable the following instructions: ",
    r"rebuild TensorFlow with the appropriate compiler flags",
    r"^WARNING:tensorflow:.*(deprecated|is deprecated|will be removed)",
    r"^\s*warnings\.warn\(",
    r"(FutureWarning|DeprecationWarning|PendingDeprecationWarning): ",
    r"^WARNING: Logging before flag parsing goes to stderr",
    r"^I\d{4} \d\d:\d\d:\d\d\.\d+ ",                           # glog info lines
    r"Gloo.*(rendezvous|connected)",
)]
_ERRORISH = re.compile(r"(?i)\b(error|exception|fatal|traceback|killed|segmentation fault)\b")


class _StdoutHandler(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stdout`` is *now* (notebooks swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stdout

    @stream.setter
    def stream(self, value: IO[str]) -> None:  # StreamHandler.__init__ assigns it
        pass


#: Logger that carries rank lines to the driver's console; reconfigure it like any logger.
rank_logger = logging.getLogger("sparkhvd.ranks")
if not rank_logger.handlers:
    _handler = _StdoutHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    rank_logger.addHandler(_handler)
    rank_logger.setLevel(logging.INFO)
    rank_logger.propagate = False


def is_noise(text: str) -> bool:
    """Whether a rank's output line is start-up noise hidden unless verbose."""
    return any(p.search(text) for p in NOISE)


class _Channel:
    """A write()-able text stream for one tag (stdout or stderr)."""

    def __init__(self, router: "RankLogRouter", tag: str) -> None:
        self._router = router
        self._tag = tag
        self._buffer = ""

    def write(self, text: str) -> int:
        with self._router._lock:
            self._buffer += text
            *lines, self._buffer = self._buffer.split("\n")
            for line in lines:
                self._router._route(line, self._tag)
        return len(text)

    def flush(self) -> None:
        pass

    def drain(self) -> None:
        with self._router._lock:
            if self._buffer:
                line, self._buffer = self._buffer, ""
                self._router._route(line, self._tag)


class RankLogRouter:
    """Receives horovod's prefixed rank output and routes it (see module docstring).

    Args:
        verbosity: ``"rank0"`` shows rank 0's lines and every rank's errors on the driver;
            ``"all"`` shows every rank's lines.
        log_dir: folder for ``rank-N.log`` files (all lines, unfiltered); ``None`` for none.
        verbose: show start-up noise too.
        logger: where shown lines go (default :data:`rank_logger`).
    """

    def __init__(self, verbosity: str = "rank0", log_dir: Optional[str] = None,
                 verbose: bool = False, logger: Optional[logging.Logger] = None) -> None:
        if verbosity not in VERBOSITIES:
            raise ValueError(f"driver_log_verbosity must be one of {VERBOSITIES}; "
                             f"got {verbosity!r}")
        self.verbosity = verbosity
        self.verbose = verbose
        self.log_dir = log_dir
        self.logger = logger or rank_logger
        self.failures: dict[int, RankFailure] = {}
        self.metrics: list[dict] = []  # rank 0's per-epoch records (sparkhvd.keras)
        self.pids: dict[int, int] = {}  # rank -> process id, as each rank reported it
        self.all_pids: set[int] = set()  # every rank process seen (elastic ranks renumber)
        self._index_to_rank: dict[int, int] = {}
        self._in_traceback: dict[int, bool] = {}
        self._tail: dict[int, list[str]] = {}
        self._files: dict[int, IO[str]] = {}
        self._lock = threading.RLock()
        self.stdout = _Channel(self, "stdout")
        self.stderr = _Channel(self, "stderr")
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def pid_record(self) -> dict:
        """The rank processes for ``run.json``: ``rank_pids`` (rank -> pid) and all ``pids``."""
        return {"rank_pids": dict(self.pids), "pids": sorted(self.all_pids)}

    # -- parsing -------------------------------------------------------------------------
    def _route(self, raw: str, channel_tag: str) -> None:
        raw = raw.rstrip("\r")
        m = _PREFIX.match(raw)
        if m:
            idx, tag, text = int(m.group("idx")), m.group("tag"), m.group("text")
        else:
            idx, tag, text = -1, channel_tag, raw
        if text.startswith(RANK_MARKER):
            try:
                fields = text[len(RANK_MARKER):].split()
                rank = self._index_to_rank[idx] = int(fields[0])
                if len(fields) > 1:
                    self.pids[rank] = int(fields[1])
                    self.all_pids.add(int(fields[1]))
            except (ValueError, IndexError):
                return
            self._open_file(rank)  # every rank gets its log file, even a silent one
            return
        rank = self._index_to_rank.get(idx, idx)
        if text.startswith(ERROR_MARKER):
            self._record_failure(rank, text[len(ERROR_MARKER):])
            return
        if text.startswith(METRICS_MARKER):
            if rank == 0:
                with contextlib.suppress(ValueError):
                    self.metrics.append(json.loads(text[len(METRICS_MARKER):]))
            return
        self.handle_line(rank, tag, text)

    def _record_failure(self, rank: int, record: str) -> None:
        try:
            data = json.loads(record)
        except ValueError:
            return
        rank = int(data.get("rank", rank))
        self.failures.setdefault(rank, RankFailure(
            rank=rank, exc_type=data.get("type"), message=data.get("message", ""),
            traceback=data.get("traceback", ""), time=float(data.get("time", 0.0))))

    # -- routing -------------------------------------------------------------------------
    def handle_line(self, rank: int, tag: str, text: str) -> None:
        """Record one line of a rank's output and show it if it should be shown."""
        text = redact(text)
        self._write_file(rank, text)
        tail = self._tail.setdefault(rank, [])
        tail.append(text)
        del tail[:-40]
        if self.should_show(rank, tag, text):
            label = f"[rank {rank}]" if rank >= 0 else "[horovod]"
            self.logger.info("%s %s", label, text)

    def should_show(self, rank: int, tag: str, text: str) -> bool:
        """Whether a line is shown on the driver under the current verbosity."""
        if not self.verbose and is_noise(text):
            return False
        if self.verbosity == "all" or rank == 0:
            return True
        # Other ranks: only their errors (a traceback block, or an error-looking line).
        if tag == "stderr":
            if text.startswith("Traceback (most recent call last)"):
                self._in_traceback[rank] = True
                return True
            if self._in_traceback.get(rank):
                if text and not text[0].isspace():
                    self._in_traceback[rank] = False  # the exception line closes the block
                return True
        return bool(_ERRORISH.search(text))

    def _open_file(self, rank: int) -> Optional[IO[str]]:
        if not self.log_dir:
            return None
        f = self._files.get(rank)
        if f is None:
            name = f"rank-{rank}.log" if rank >= 0 else "launcher.log"
            f = self._files[rank] = open(os.path.join(self.log_dir, name), "a", encoding="utf-8")
        return f

    def _write_file(self, rank: int, text: str) -> None:
        f = self._open_file(rank)
        if f is not None:
            f.write(text + "\n")
            f.flush()

    def tail(self, rank: int, lines: int = 20) -> str:
        """The last lines a rank printed (for errors without a traceback)."""
        return "\n".join(self._tail.get(rank, [])[-lines:])

    def close(self) -> None:
        """Flush partial lines and close the per-rank files."""
        self.stdout.drain()
        self.stderr.drain()
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
