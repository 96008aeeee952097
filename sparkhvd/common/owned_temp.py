"""Temporary files and folders named by the process that owns them, and the sweep of those whose
process is gone.

A rank or a Spark task killed with SIGKILL runs no cleanup: what it had in ``/tmp`` stays there --
a checkpoint's upload spool (as big as the checkpoint), DCP's local files, a rank's payload -- once
per kill, for good. So these are named ``sparkhvd-<kind>-<pid>-<tail>``, and the first one each
process makes in a folder deletes the ones whose process is gone (:func:`remove_orphans`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from typing import Optional

__side__ = "common"

#: What an owned temporary holds (its name's second part).
KINDS = ("spool", "dcp", "rank")
#: An orphan is deleted once it is this old: a file being written, or between its write and the
#: open that reads it, is never left this long.
ORPHAN_AFTER_S = 60.0
_swept: set[str] = set()


def prefix(kind: str) -> str:
    """The ``prefix=`` for ``tempfile.mkstemp``/``mkdtemp`` of a ``kind`` owned by this process;
    the first call per folder sweeps it."""
    assert kind in KINDS, kind
    folder = tempfile.gettempdir()
    if folder not in _swept:
        _swept.add(folder)
        remove_orphans(folder)
    return f"sparkhvd-{kind}-{os.getpid()}-"


def remove_orphans(folder: str) -> list[str]:
    """Delete the owned temporaries in ``folder`` whose process is gone and that were last
    written :data:`ORPHAN_AFTER_S` ago or more; the names deleted, sorted."""
    removed = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(folder)):
            parts = name.split("-", 3)
            if len(parts) < 4 or parts[0] != "sparkhvd" or parts[1] not in KINDS or \
                    not parts[2].isdigit() or alive(int(parts[2])):
                continue
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(path) < ORPHAN_AFTER_S:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed.append(name)
    return removed


def private_folder(path: str) -> Optional[str]:
    """Make folder ``path`` (``0700``) if it is not there and check that only this user can
    write in it -- its owner, not a link, no write or entry for group or others -- as a folder
    whose files a rank trusts must be. None where it is; else why not, in words.

    Raises:
        OSError: it could not be made or looked at."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or \
            st.st_uid != os.getuid() or st.st_mode & 0o077:
        return (f"it is not a folder only this user can write (owner uid {st.st_uid}, mode "
                f"{st.st_mode & 0o7777:o})")
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running on this host (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
