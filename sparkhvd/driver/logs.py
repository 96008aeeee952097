"""Rank output on the driver: ``[rank N]`` lines on the console, everything in per-rank files.

:class:`RankLogRouter` only shows and files lines (:class:`sparkhvd.common.protocol.Line`); what a rank
*reports* (exceptions, metrics, its PID) is kept by :class:`sparkhvd.driver.inbox.AttemptInbox`.

- Every line goes, redacted, to ``logs/rank-N.log``, whole, however long.
- The console shows rank 0's lines and every rank's errors (``driver_log_verbosity="rank0"``),
  or every line (``"all"``); TensorFlow/Gloo start-up noise only with ``verbose=True``; a line
  longer than :data:`~sparkhvd.common.protocol.MAX_SHOWN_CHARS` is cut there, with a note saying so.
- A progress bar's updates (``\r``, :mod:`sparkhvd.common.outputlines`) are redrawn in place where
  the console can (a terminal, a notebook) and filed nowhere; each bar's final state is a normal
  line, on the console and in the rank log.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from typing import IO, Optional

from sparkhvd.common.protocol import MAX_SHOWN_CHARS, Line
from sparkhvd.common.redaction import redact
from sparkhvd.driver.rank_end import PEER_LOST

__side__ = "driver"

VERBOSITIES = ("rank0", "all")

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
    r"^[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ ",                     # absl lines (TF >= 2.19)
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called",
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


#: Progress updates are redrawn at most this often.
LIVE_INTERVAL_S = 0.1
#: A live progress line is cut to this width (the final state is never cut).
LIVE_WIDTH = 160


def console_can_redraw() -> bool:
    """Whether the driver's console redraws a line on ``\r``: a terminal or a Jupyter kernel."""
    if "ipykernel" in sys.modules:
        return True
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def is_noise(text: str) -> bool:
    """Whether a rank's output line is start-up noise hidden unless verbose."""
    return any(p.search(text) for p in NOISE)


def check_verbosity(verbosity: str) -> str:
    """``verbosity`` if it is one of :data:`VERBOSITIES`, else a ValueError naming them."""
    if verbosity not in VERBOSITIES:
        raise ValueError(f"driver_log_verbosity must be one of {VERBOSITIES}; got {verbosity!r}")
    return verbosity


class RankLogRouter:
    """Shows and files rank output lines (see the module docstring).

    Args:
        verbosity: ``"rank0"`` or ``"all"``.
        log_dir: folder for ``rank-N.log`` files (all lines, unfiltered); ``None`` for none.
        verbose: show start-up noise too.
        logger: where shown lines go (default :data:`rank_logger`).
    """

    def __init__(self, verbosity: str = "rank0", log_dir: Optional[str] = None,
                 verbose: bool = False, logger: Optional[logging.Logger] = None,
                 live: Optional[bool] = None) -> None:
        self.verbosity = check_verbosity(verbosity)
        self.verbose = verbose
        self.log_dir = log_dir
        self.logger = logger or rank_logger
        #: rank -> the traceback block it is printing (shown when its exception line closes it)
        self._tracebacks: dict[int, list[str]] = {}
        self._tail: dict[int, list[str]] = {}
        self._files: dict[int, IO[str]] = {}
        self._pending: dict[tuple[int, str], list] = {}  # (rank, tag) -> [shown, total chars]
        self._lock = threading.RLock()
        self._closed = False
        #: progress updates are drawn in place (a terminal or a notebook can redraw a line)
        self.live = console_can_redraw() if live is None else live
        self._live_at = 0.0
        self._live_len = 0
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def line(self, msg: Line) -> None:
        """Record one line (or one piece of a long line, or a progress update) of a rank's
        output."""
        text = redact(msg.text.rstrip("\r"))
        rank, key = msg.rank, (msg.rank, msg.tag)
        if msg.update:
            self._update(rank, msg.tag, text)
            return
        with self._lock:
            if self._closed:
                return
            f = self.open(rank)
            if f is not None:
                f.write(text if msg.partial else text + "\n")
                f.flush()
            shown, total = self._pending.pop(key, ["", 0])
            shown = (shown + text)[:MAX_SHOWN_CHARS + 1]
            total += len(text)
            if msg.partial:
                self._pending[key] = [shown, total]
                return
            if total > MAX_SHOWN_CHARS:
                where = f"logs/rank-{rank}.log" if self.log_dir else "the rank log"
                shown = (f"{shown[:MAX_SHOWN_CHARS]} ... [line cut: {total:,} characters; "
                         f"whole in {where}]")
            self._show(rank, msg.tag, shown)

    def _update(self, rank: int, tag: str, text: str) -> None:
        """A progress bar's intermediate state: redrawn in place where the console can (a
        terminal, a notebook), at most every :data:`LIVE_INTERVAL_S`; never filed -- the bar's
        final state arrives as a normal line."""
        if not self.live or not text or not self.should_show(rank, tag, text):
            return
        now = time.monotonic()
        with self._lock:
            if self._closed or now - self._live_at < LIVE_INTERVAL_S:
                return
            self._live_at = now
            shown = f"[rank {rank}] {text}"[:LIVE_WIDTH]
            pad = " " * max(0, self._live_len - len(shown))
            with contextlib.suppress(Exception):
                sys.stdout.write(f"\r{shown}{pad}")
                sys.stdout.flush()
            self._live_len = len(shown)

    def _clear_live(self) -> None:
        if self._live_len:
            with contextlib.suppress(Exception):
                sys.stdout.write("\r" + " " * self._live_len + "\r")
                sys.stdout.flush()
            self._live_len = 0

    def _show(self, rank: int, tag: str, text: str) -> None:
        tail = self._tail.setdefault(rank, [])
        tail.append(text)
        del tail[:-40]
        block = self._tracebacks.get(rank)
        if tag == "stderr" and (block is not None or
                                text.startswith("Traceback (most recent call last)")):
            # Every rank's tracebacks are shown, whole -- once the exception line closes the
            # block and says what it is.
            if block is None:
                block = self._tracebacks[rank] = []
            block.append(text)
            if text and not text[0].isspace() and len(block) > 1:
                self._show_traceback(rank, self._tracebacks.pop(rank))
            return
        if self.should_show(rank, tag, text):
            self._emit(rank, text)

    def _show_traceback(self, rank: int, block: list[str]) -> None:
        """A rank's traceback; one line for a knock-on error (a peer went away under its
        collective: the rank that went is what matters, and a relaunch may follow)."""
        if PEER_LOST.search(block[-1]):
            where = f"logs/rank-{rank}.log" if self.log_dir else "the rank log"
            self._emit(rank, f"{block[-1]} (a peer went away; traceback in {where})")
            return
        for text in block:
            self._emit(rank, text)

    def _emit(self, rank: int, text: str) -> None:
        label = f"[rank {rank}]" if rank >= 0 else "[horovod]"
        self._clear_live()
        self.logger.info("%s %s", label, text)

    def should_show(self, rank: int, tag: str, text: str) -> bool:
        """Whether a line (not of a traceback: those are always shown) is shown on the driver
        under the current verbosity."""
        if not self.verbose and is_noise(text):
            return False
        if self.verbosity == "all" or rank == 0:
            return True
        # Other ranks: only their errors (tracebacks, or an error-looking line).
        return bool(_ERRORISH.search(text))

    def note(self, text: str) -> None:
        """A line of sparkhvd's own on the console, whatever the verbosity (e.g. where the run
        folder is): it goes where rank lines go, so it is seen without configuring logging."""
        with self._lock:
            self._clear_live()
            self.logger.info("[sparkhvd] %s", text)

    def line_all(self, text: str) -> None:
        """A line of the driver's own in every rank log opened so far (e.g. a retry's start)."""
        with self._lock:
            for f in self._files.values():
                f.write(text + "\n")
                f.flush()

    def open(self, rank: int) -> Optional[IO[str]]:
        """The rank's log file (created on first use; ``launcher.log`` for rank -1)."""
        if not self.log_dir or self._closed:
            return None
        with self._lock:
            f = self._files.get(rank)
            if f is None:
                name = f"rank-{rank}.log" if rank >= 0 else "launcher.log"
                f = self._files[rank] = open(os.path.join(self.log_dir, name), "a",
                                             encoding="utf-8")
            return f

    def tail(self, rank: int, lines: int = 20) -> str:
        """The last lines a rank printed (for errors without a traceback)."""
        return "\n".join(self._tail.get(rank, [])[-lines:])

    def close(self) -> None:
        """Show what is left of unfinished lines and close the per-rank files."""
        with self._lock:
            self._clear_live()
            for (rank, tag) in list(self._pending):
                self.line(Line(rank, tag, "", partial=False))
            for rank, block in list(self._tracebacks.items()):  # cut short: the rank died
                del self._tracebacks[rank]
                for text in block:
                    self._emit(rank, text)
            for f in self._files.values():
                f.close()
            self._files.clear()
            self._closed = True
