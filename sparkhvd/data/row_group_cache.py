"""Row groups a rank read, kept on its host's disk for the rest of the run: what a resize or a
relaunch would read from the files again is read from the host instead.

Why: a rank mixes its batches from many row groups at once (about 32 or more on label-sorted
data, :mod:`sparkhvd.data.sharding`; on a small table its whole share), and a resize or a
relaunch stops it part way through them. The next attempt trains the rest of those windows, and
read them again from the files: on B14's 73 MB table, 8 -> 7 -> 8 mid-epoch read the files
3.6 times. The ranks of the next attempt on the same host read them here instead (Mosaic
Streaming keeps the shards it downloaded on the node's disk, for its ranks and their restarts,
for the same reason).

Rules:

- **what**: each row group as read -- the columns the dataset uses, decoded (Arrow IPC, not a
  pickle: nothing here runs code) -- named by its file's path, the columns and its number,
  written whole or not at all (a temporary file renamed into place).
- **bounded**: each rank keeps the newest :data:`BUDGET_BYTES` it read (what it may keep in
  memory, :data:`~sparkhvd.data.sharding.MEMORY_CACHE_BYTES`; and at most a quarter of the
  folder's free space shared by the ranks on the host), deleting its oldest files first: the
  rows a rank still holds in flight are those it read last. ``$SPARKHVD_ROW_CACHE_BYTES``
  sets the budget; ``0`` turns the cache off.
- **shared on a host**: a rank looks in every rank folder of the run on its host -- those of
  earlier attempts too, whose processes are gone -- before it reads a row group from the files.
- **private**: the folder is the user's own (``sparkhvd-row-groups-<uid>``, made ``0700``) and
  checked before use (owned by this user, not a link, no one else may write in it); else no
  row group is kept or read there (said once) and the ranks read the files.
- **where**: ``$SPARKHVD_ROW_CACHE_DIR``, else the system's temporary folder, in
  ``sparkhvd-row-groups-<uid>/<run id>/rank-<N>-a<attempt>-<pid>/``; only inside a run (a run
  id): a function called outside one reads the files.
- **copied to the driver** (a small table, on a cluster): a rank on another host than the
  driver's also sends each row group it read from the files of a table of up to
  :data:`~sparkhvd.common.protocol.ROW_COPIES_BYTES` of rows to the driver's run-folder
  service, in the background (:mod:`sparkhvd.runfolder.service`: the driver keeps one copy of
  each for the run, at most that many bytes); and a rank of a later attempt reads there what no
  rank on its host kept before it reads the files. Why: on a small table a rank holds its whole
  share in flight (its window is the table), so a lost host took every row it had not trained
  yet with it, and a new host takes rows only other hosts hold -- B14's 8 -> 7 -> 8 on 8 hosts
  read 1.31x the files with the hosts' own copies alone. On a large table a rank holds a small
  part of its share, and what a resize reads again is small without them.
  ``$SPARKHVD_ROW_COPIES_BYTES`` sets the bound, ``0`` turns them off.
- **cleaned**: when the training function returns (the run is done), each rank deletes its own
  folder and those of processes that are gone, then the run's folder once empty; the driver's
  sweep of the hosts an earlier attempt used does the same there
  (:mod:`sparkhvd.executor.host_sweep`). A run's folder untouched for :data:`STALE_S` (a run
  that failed) is deleted by the next rank that uses the cache on that host: every row of it is
  in the files.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
from typing import Any, Callable, Optional, Protocol, Sequence

from sparkhvd.common import protocol
from sparkhvd.common.function_end import at_function_return
from sparkhvd.common.identity import current_rank
from sparkhvd.common.patches import forbid_pickled_arrow_types
from sparkhvd.data.sharding import MEMORY_CACHE_BYTES
from sparkhvd.storage.host_store import HostStore

__side__ = "rank"

log = logging.getLogger(__name__)

#: Where the run folders go (a folder on the host's own disk).
DIR_ENV = "SPARKHVD_ROW_CACHE_DIR"
#: A rank's budget in bytes (0: no cache).
BYTES_ENV = "SPARKHVD_ROW_CACHE_BYTES"
#: A rank's default budget: what it may keep in memory.
BUDGET_BYTES = MEMORY_CACHE_BYTES
#: The share of the folder's free space the ranks on a host may take together.
FREE_SHARE = 0.25
#: A run's folder untouched this long is left over (a failed run, a lost process).
STALE_S = 3600.0

_said: set[str] = set()
_caches: dict[tuple[str, int, str, str], "RowGroupCache"] = {}
_lock = threading.Lock()


class DriverCopies(Protocol):
    """The driver's row-group copies as a rank reaches them (the run-folder service's client,
    :class:`sparkhvd.runfolder.rank_files.DriverRowCopies`)."""

    def put(self, name: str, local_path: str) -> None:
        """Send a kept file. ``PermissionError``: refused (full); ``OSError``: out of reach."""

    def get(self, name: str) -> bytes:
        """A copy's bytes. ``FileNotFoundError``: the driver has none."""


#: Makes this rank's :class:`DriverCopies` (None: it has none) -- set where the rank starts
#: (:mod:`sparkhvd.rank.bootstrap`), which knows how the rank reaches the driver.
_driver_copies: Optional[Callable[[], Optional[DriverCopies]]] = None


def use_driver_copies(make: Optional[Callable[[], Optional[DriverCopies]]]) -> None:
    """Where this process' ranks reach the driver's row-group copies (None: nowhere)."""
    global _driver_copies
    _driver_copies = make


def copies_for(data_bytes: int) -> bool:
    """Whether a table of ``data_bytes`` of rows has its row groups copied to the driver."""
    return _driver_copies is not None and \
        0 < data_bytes <= protocol.row_copies_bytes(os.environ)


def _after_fork() -> None:
    """A forked child (a DataLoader worker) starts with free locks, whatever the parent held,
    and reaches the driver on a connection and a sender thread of its own (its parent's
    connection is the parent's; its sender thread is not in the child)."""
    global _lock
    _lock = threading.Lock()
    for cache in _caches.values():
        cache._lock = threading.Lock()
        cache._copies, cache._sender, cache._sends = None, None, queue.Queue()


os.register_at_fork(after_in_child=_after_fork)


#: This user's row groups on this host (``sparkhvd-row-groups-<uid>``, in
#: ``$SPARKHVD_ROW_CACHE_DIR`` or the temporary folder): the rules every host store keeps.
STORE = HostStore("row-groups", DIR_ENV, stale_s=STALE_S,
                  refused=("row groups are not kept", "change the rows a rank trains on"),
                  say=lambda message: log.warning("data: %s", message))


def base_folder() -> str:
    """The folder that holds every run's row groups on this host (this user's)."""
    return STORE.base()


class RowGroupCache:
    """This rank's row groups in the run's folder on its host (see the module docstring).
    Safe to use from the read-ahead thread and the training thread at once."""

    def __init__(self, run_folder: str, budget: int) -> None:
        rank, attempt = current_rank().rank, os.environ.get(protocol.ATTEMPT_ENV, "1")
        self.run_folder = run_folder
        self.own = os.path.join(run_folder, f"rank-{rank}-a{attempt}-{os.getpid()}")
        self.budget = budget
        #: this rank's files, oldest first, and their sizes
        self._kept: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._off = False
        try:
            self.attempt = int(attempt)
        except ValueError:
            self.attempt = 1
        #: the driver's copies (made at first use), and the row groups waiting to go there
        self._copies: Optional[DriverCopies] = None
        self._copies_off = _driver_copies is None
        self._sends: "queue.Queue[tuple[str, str]]" = queue.Queue()
        self._sender: Optional[threading.Thread] = None
        self._sent: set[str] = set()  # sent once: a row group read again is not sent again

    @staticmethod
    def name(path: str, columns: Sequence[str], group: int) -> str:
        """The file a row group is kept in: its file's path and the columns hashed (a path
        names no secret, but it need not show either)."""
        digest = hashlib.sha256(json.dumps([path, list(columns)]).encode()).hexdigest()[:24]
        return f"{digest}-{group}.arrow"

    def find(self, path: str, columns: Sequence[str], groups: Sequence[int],
             copies: bool = False) -> tuple[dict[int, Any], set[int]]:
        """The row groups of ``groups`` a rank on this host kept, as Arrow tables -- and, for a
        table whose row groups are ``copies`` (:func:`copies_for`) in an attempt after the
        first, those the driver has of the rest (kept here too); with the groups that came
        from the driver."""
        if self._off:
            return {}, set()
        found = self._on_host(path, columns, groups)
        from_driver: set[int] = set()
        if copies and self.attempt > 1 and len(found) < len(groups):
            for group in groups:
                if group not in found and not self._copies_off:
                    table = self._from_driver(path, columns, group)
                    if table is not None:
                        found[group] = table
                        from_driver.add(group)
        return found, from_driver

    def _on_host(self, path: str, columns: Sequence[str], groups: Sequence[int]
                 ) -> dict[int, Any]:
        import pyarrow as pa
        import pyarrow.ipc

        names = {self.name(path, columns, group): group for group in groups}
        where: dict[str, str] = {}  # a name -> its file, this rank's own first
        try:
            folders = [e.path for e in os.scandir(self.run_folder)
                       if e.is_dir(follow_symlinks=False) and e.name.startswith("rank-")]
        except OSError:
            return {}
        for folder in sorted(folders, key=lambda f: f != self.own):
            with contextlib.suppress(OSError):
                for name in set(os.listdir(folder)) & names.keys():
                    where.setdefault(name, os.path.join(folder, name))
        found: dict[int, Any] = {}
        forbid_pickled_arrow_types()  # a planted copy's schema unpickles nothing
        for name, file in where.items():
            try:
                with pa.OSFile(file) as f:
                    found[names[name]] = pyarrow.ipc.open_file(f).read_all()
            except (OSError, pa.ArrowInvalid):
                continue  # deleted as it was opened, or torn: read from the files
        return found

    def _from_driver(self, path: str, columns: Sequence[str], group: int) -> Optional[Any]:
        """Row group ``group`` from the driver's copies (kept here too), or None."""
        import pyarrow as pa
        import pyarrow.ipc

        copies = self._driver()
        if copies is None:
            return None
        forbid_pickled_arrow_types()
        try:
            data = copies.get(self.name(path, columns, group))
            table = pyarrow.ipc.open_file(pa.py_buffer(data)).read_all()
        except FileNotFoundError:
            return None
        except (OSError, pa.ArrowInvalid) as exc:  # out of reach, or torn: the files
            self._copies_off = True
            _say_once("copies-get", "the driver's row-group copies are out of reach (%s); "
                      "the files are read instead", exc, level=logging.INFO)
            return None
        self.keep(path, columns, group, table)
        return table

    def _driver(self) -> Optional[DriverCopies]:
        if self._copies is None and not self._copies_off:
            made = _driver_copies() if _driver_copies is not None else None
            if made is None:
                self._copies_off = True
            self._copies = made
        return self._copies

    def sent(self, timeout: float) -> bool:
        """Wait until every row group queued for the driver went (or was given up on);
        whether they did within ``timeout`` seconds."""
        done = self._sends.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._sends.unfinished_tasks, timeout)

    def _send(self, name: str, file: str) -> None:
        """Queue a kept file for the driver (a name: the file stays on the host's disk, and
        one deleted past the budget before it went is not sent)."""
        if self._copies_off or self._driver() is None:
            return
        with self._lock:
            if name in self._sent:
                return
            self._sent.add(name)
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_all, daemon=True,
                                                name="sparkhvd-row-copies")
                self._sender.start()
        self._sends.put((name, file))

    def _send_all(self) -> None:
        while True:
            name, file = self._sends.get()
            try:
                self._send_one(name, file)
            finally:
                self._sends.task_done()

    def _send_one(self, name: str, file: str) -> None:
        copies = self._copies
        if self._copies_off or copies is None:
            return
        try:
            copies.put(name, file)
        except FileNotFoundError:
            return  # past the budget and deleted before it went: not needed
        except OSError as exc:  # full, or out of reach
            self._copies_off = True
            _say_once("copies-put", "row groups are no longer copied to the driver (%s); "
                      "a resize reads a lost host's rows from the files", exc,
                      level=logging.INFO)

    def keep(self, path: str, columns: Sequence[str], group: int, table: Any,
             copies: bool = False) -> None:
        """Keep a row group just read from the files (and send it to the driver, when its
        table's row groups are ``copies``); the oldest kept go past the budget."""
        import pyarrow.ipc

        if self._off or table.nbytes > self.budget:
            return
        name = self.name(path, columns, group)
        target = os.path.join(self.own, name)
        temporary = f"{target}.tmp-{threading.get_ident()}"
        try:
            if not self._kept:
                os.makedirs(self.own, mode=0o700, exist_ok=True)
            with pyarrow.OSFile(temporary, "wb") as sink, \
                    pyarrow.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
            size = os.path.getsize(temporary)
            os.replace(temporary, target)
        except OSError as exc:  # a full disk: the ranks read the files, as without a cache
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            self._off = True
            _say_once(f"write:{self.run_folder}", "row groups are no longer kept on this host "
                      "(%s: %s); a resize reads them from the files again", target, exc)
            return
        drop: list[str] = []
        with self._lock:
            self._held += size - self._kept.pop(name, 0)
            self._kept[name] = size
            while self._held > self.budget and len(self._kept) > 1:
                old, old_size = self._kept.popitem(last=False)
                self._held -= old_size
                drop.append(old)
        for old in drop:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.own, old))
        if copies:
            self._send(name, target)


def for_this_rank() -> Optional[RowGroupCache]:
    """This rank's cache, or None: outside a run, turned off, or no private folder."""
    run_id = os.environ.get(protocol.RUN_ID_ENV)
    if not run_id:
        return None
    try:
        budget = int(os.environ.get(BYTES_ENV, BUDGET_BYTES))
    except ValueError:
        _say_once("bytes", "%s=%r is not a number of bytes; the default %d is used", BYTES_ENV,
                  os.environ.get(BYTES_ENV), BUDGET_BYTES)
        budget = BUDGET_BYTES
    if budget <= 0 or not STORE.private():
        return None
    base = base_folder()
    key = (base, current_rank().rank, os.environ.get(protocol.ATTEMPT_ENV, "1"), run_id)
    with _lock:
        cache = _caches.get(key)
        if cache is None:
            STORE.remove_stale(keep=run_id)
            free = STORE.free(base) * FREE_SHARE / max(1, _host_ranks())
            cache = _caches[key] = RowGroupCache(os.path.join(base, run_id),
                                                 int(min(budget, free)))
            at_function_return(clean)
    return cache


def clean() -> None:
    """This rank's part of deleting the run's row groups on this host (the run is done): its
    own folder, and those of processes that are gone; then the run's folder, once empty."""
    run_id = os.environ.get(protocol.RUN_ID_ENV)
    with _lock:
        mine = [c.own for c in _caches.values() if c.run_folder.endswith(os.sep + str(run_id))]
        _caches.clear()
    if run_id:
        sweep(run_id, mine)


def sweep(run_id: str, mine: Sequence[str] = ()) -> int:
    """Delete run ``run_id``'s rank folders on this host that ``mine`` names or whose process is
    gone; the run's folder too, once empty. How many rank folders went (the driver's sweep of a
    finished run's hosts calls it with none of its own)."""
    return STORE.sweep(run_id, _owner, mine)


def _owner(path: str) -> Optional[int]:
    """The process a rank folder is named by (``rank-<N>-a<attempt>-<pid>``; None: not so)."""
    pid = path.rsplit("-", 1)[-1]
    return int(pid) if pid.isdigit() else None


def _host_ranks() -> int:
    try:
        return int(os.environ.get(protocol.HOST_RANKS_ENV) or current_rank().local_size)
    except ValueError:
        return 1


def _say_once(key: str, message: str, *args: object, level: int = logging.WARNING) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, "data: " + message, *args)
