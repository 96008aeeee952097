"""What ranks keep on their own host for the rest of a run, in one shape for every kind.

Two kinds use it: the newest checkpoint kept on the writing rank's host
(:mod:`sparkhvd.checkpoint.host_copy`) and the row groups a rank read
(:mod:`sparkhvd.data.row_group_cache`). Both keep files a later attempt's rank on that host
trusts -- a pickle-free checkpoint, the rows it trains on -- so both follow the same rules,
decided here once:

- **where**: ``$<dir_env>`` (the kind's variable), else the system's temporary folder, in
  ``sparkhvd-<kind>-<uid>/<run id>/rank-.../``: a folder per run, a folder per writing rank (or
  process) in it;
- **private**: the base folder is the user's own, made ``0700``, and checked before anything is
  kept or read there -- owned by this user, not a link, no one else may write in it
  (:func:`~sparkhvd.common.owned_temp.private_folder`); else nothing is kept or read (said
  once) and the ranks go to the source (the run folder, the files);
- **bounded**: a kind keeps at most a share of the folder's free space (:meth:`HostStore.free`);
- **cleaned**: a rank folder goes when its rank is done or its owner process is gone
  (:meth:`HostStore.sweep`: claimed by a rename first, so of two sweeps on one host one removes
  and counts it), the run's folder once empty; a run's folder untouched for the kind's
  ``stale_s`` (a run that failed) is removed by the next process that uses the kind on that
  host (:meth:`HostStore.remove_stale`, once per process).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Collection, Optional

from sparkhvd.common import owned_temp

__side__ = "shared"


class HostStore:
    """One kind of host state (see the module docstring).

    Args:
        kind: its name in the base folder's (``sparkhvd-<kind>-<uid>``).
        dir_env: the variable that moves it (``/dev/shm`` for memory speed, a larger disk).
        stale_s: a run's folder untouched this long is a failed run's, removed.
        refused: what is not done when the base is not private, and what anyone could do
            there, for the message (``"no host copy kept or read", "plant a checkpoint"``).
        say: how the kind says something once (its log or its rank's console).
    """

    def __init__(self, kind: str, dir_env: str, *, stale_s: float,
                 refused: tuple[str, str], say: Callable[[str], None]) -> None:
        self.kind, self.dir_env, self.stale_s = kind, dir_env, stale_s
        self.refused, self._say = refused, say
        self._private: set[str] = set()  # base folders this process made or found private
        self._swept: set[str] = set()  # base folders this process looked for stale runs in
        self._said: set[str] = set()

    @property
    def name(self) -> str:
        """The base folder's name: ``sparkhvd-<kind>-<uid>``."""
        return f"sparkhvd-{self.kind}-{os.getuid()}"

    def base(self) -> str:
        """The folder of this user's runs of this kind on this host."""
        return os.path.join(os.environ.get(self.dir_env) or tempfile.gettempdir(), self.name)

    def private(self) -> bool:
        """Make :meth:`base` (``0700``) if it is not there, and check only this user can write
        in it. False (said once) where it is not, or cannot be made: then nothing of this
        kind is kept or read."""
        base = self.base()
        if base in self._private:
            return True
        not_done, risk = self.refused
        try:
            why = owned_temp.private_folder(base)
        except OSError as exc:
            self.say_once(f"make:{base}", f"{not_done} in {base} ({exc})")
            return False
        if why is not None:
            self.say_once(f"private:{base}", f"{not_done} in {base}: {why}, so anyone could "
                          f"{risk}. Fix: remove it, or point {self.dir_env} to a private "
                          "folder")
            return False
        self._private.add(base)
        return True

    def run_folder(self, run_id: Optional[str]) -> Optional[str]:
        """Run ``run_id``'s folder; None without a run id or a private base."""
        if not run_id or not self.private():
            return None
        return os.path.join(self.base(), run_id)

    @staticmethod
    def free(path: str) -> int:
        """What the file system of ``path`` has free (0 when it cannot say)."""
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return 0

    def remove_stale(self, keep: str) -> None:
        """Delete the run folders untouched for ``stale_s`` -- a run's folder and its rank
        folders: a rank that still writes there keeps it fresh -- but ``keep``'s; once per
        process and base folder."""
        base = self.base()
        if base in self._swept:
            return
        self._swept.add(base)
        now = time.time()
        with contextlib.suppress(OSError):
            for entry in os.scandir(base):
                if entry.name == keep or not entry.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    touched = max([entry.stat(follow_symlinks=False).st_mtime] + [
                        e.stat(follow_symlinks=False).st_mtime for e in os.scandir(entry.path)])
                    if now - touched > self.stale_s:
                        shutil.rmtree(entry.path, ignore_errors=True)

    def sweep(self, run_id: str, owner: Callable[[str], Optional[int]],
              mine: Collection[str] = ()) -> int:
        """Remove run ``run_id``'s rank folders (``rank-*``) on this host that ``mine`` names or
        whose owner process (``owner(path)``) is unknown, this process, or gone -- never one a
        live process owns; then the run's folder, once empty. How many this call removed."""
        where = os.path.join(self.base(), run_id)
        if not os.path.isdir(where) or not self.private():
            return 0
        removed = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(where):
                if not entry.name.startswith("rank-"):
                    continue
                pid = owner(entry.path)
                if not (entry.path in mine or pid is None or pid == os.getpid() or
                        not owned_temp.alive(pid)):
                    continue
                claimed = os.path.join(where, f"removing-{entry.name}-{os.getpid()}-"
                                              f"{threading.get_ident()}")
                try:
                    os.rename(entry.path, claimed)  # of two sweeps on a host, one removes it
                except OSError:
                    continue
                shutil.rmtree(claimed, ignore_errors=True)
                removed += 1
        with contextlib.suppress(OSError):
            os.rmdir(where)
        return removed

    def say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self._say(message)
