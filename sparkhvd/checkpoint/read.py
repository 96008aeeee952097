"""Reading checkpoints back: the newest one whose files match its record (an older one when
they do not, :func:`restore_newest`), a file or only its pieces checked as they are read, what
rank 0 says it resumed from, and the one rule of where a rank resumes from
(:func:`resume_store`). The store is :mod:`sparkhvd.checkpoint.stores`; writing,
:mod:`sparkhvd.checkpoint.write`.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import zlib
from typing import (
    Any,
    Callable,
    Iterator,
    Optional,
    Sequence,
    TypeVar,
    Union,
)

from sparkhvd.checkpoint.file_pieces import FilePieces, Needs, Span, index_files, load_plan, merged
from sparkhvd.checkpoint.host_copy import content_of
from sparkhvd.checkpoint.lineage import LATEST, RECORD_PATTERN, expected_files, progress
from sparkhvd.checkpoint.stores import (
    CheckpointStore,
    RunFolderStore,
    UrlStore,
    holds_checkpoint,
    url_store,
)

__side__ = "rank"

T = TypeVar("T")


def newest_checked(store: CheckpointStore) -> Optional[dict]:
    """The newest checkpoint's record when it names a SHA-256 for each of its files -- what
    a host copy must equal to be read instead -- else None."""
    newest = next(_candidates(store, []), None)
    files = expected_files(newest) if newest is not None else {}
    if not files or not all(expected and expected.get("sha256") for expected in files.values()):
        return None
    return newest


def _candidates(store: CheckpointStore, problems: list[str]) -> Iterator[dict]:
    """Every checkpoint record the folder has, newest first (by epoch, then step):
    ``latest.json`` and each ``epoch-000N[-step-K].json`` (a corrupt ``latest.json`` is a
    problem, not the end). Read one at a time, as they are tried: a folder of a run that saved
    every step keeps thousands of records, and a resume needs the newest (reading them all
    through the run folder's service took 5 s for 110)."""
    names = store.list()
    newest = _record(store, LATEST, problems) if not names or LATEST in names else None
    order: list[tuple[tuple[int, int], int, str]] = []
    if newest is not None:
        order.append((progress(newest), 1, LATEST))  # ties: latest.json's own record
    for name in names:
        match = RECORD_PATTERN.match(name)
        if match:
            order.append(((int(match.group(1)), int(match.group(2) or 0)), 0, name))
    tried: set[tuple[int, int]] = set()
    for made, _, name in sorted(order, reverse=True):
        if made in tried:
            continue
        record = newest if name == LATEST else _record(store, name, problems)
        if record is None:
            continue
        tried.add(progress(record))
        yield record


def _record(store: CheckpointStore, name: str, problems: list[str]) -> Optional[dict]:
    """The record ``name`` (None: gone, or unreadable -- then a problem)."""
    try:
        record = json.loads(store.read(name))
        progress(record)
        return dict(record)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - any unreadable record is one problem
        problems.append(f"{store.describe(name)}: unreadable ({_why(exc)})")
        return None


def _read_checked(store: CheckpointStore, record: dict, problems: list[str],
                  needs: Optional[Needs] = None) -> Optional[dict[str, Any]]:
    """The checkpoint's files, each checked against its record (None: one is missing or
    changed, a problem said) -- with ``needs``, its index files, then only what this rank's
    load reads of the others (:class:`FilePieces` where that is less than the file)."""
    expected_of = expected_files(record)
    files: dict[str, Any] = {}
    for name in index_files(needs, record, expected_of):
        files[name] = read_file_checked(store, name, expected_of[name], problems)
        if files[name] is None:
            return None
    if needs is None:
        return files
    spans = load_plan(needs, record, files)
    for name, expected in expected_of.items():
        if name in files or (spans is not None and name not in spans):
            continue
        files[name] = read_file_checked(store, name, expected, problems,
                                        None if spans is None else spans[name])
        if files[name] is None:
            return None
    return files


def read_copy(store: CheckpointStore, name: str, expected: Optional[dict], copy: Any,
              problems: list[str], mapped: bool = False) -> Union[bytes, memoryview, None]:
    """The host copy ``copy`` of the checkpoint file ``name`` when it is the one the record
    names and reads back whole (``mapped``: as a view of the file mapped into memory, see
    :meth:`~sparkhvd.checkpoint.host_copy.HostCopy.read`); None otherwise (a copy that does
    not read back is a problem)."""
    if copy is None or expected is None or not copy.content \
            or copy.content != content_of(expected):
        return None
    try:
        return copy.read(mapped)  # checked against the same size and SHA-256 (or CRC-32)
    except ValueError as exc:
        problems.append(f"{exc}; read {store.describe(name)} instead")
        return None


def read_file_checked(store: CheckpointStore, name: str, expected: Optional[dict],
                      problems: list[str], spans: Optional[list[Span]] = None
                      ) -> Union[bytes, FilePieces, None]:
    """The checkpoint file ``name`` from the folder, checked against its record's size and
    SHA-256 (``expected``; None for records from before digests); None when it is missing or
    changed (a problem said). With ``spans`` and a record of its pieces' CRC-32s
    (:func:`digest_file`), only the pieces that hold those byte ranges, each checked: the
    :class:`FilePieces` a rank's load reads of another rank's shard file."""
    if spans is not None and expected is not None and expected.get("pieces"):
        return _read_pieces_checked(store, name, expected, spans, problems)
    try:
        data = store.read(name)
    except FileNotFoundError:
        problems.append(f"{store.describe(name)}: missing")
        return None
    if expected is not None and len(data) != expected.get("size"):
        problems.append(f"{store.describe(name)}: truncated or changed ({len(data):,} of "
                        f"{expected.get('size'):,} bytes)")
        return None
    if expected is not None and hashlib.sha256(data).hexdigest() != expected.get("sha256"):
        problems.append(f"{store.describe(name)}: checksum mismatch (corrupt)")
        return None
    return data


def _read_pieces_checked(store: CheckpointStore, name: str, expected: dict,
                         spans: list[Span], problems: list[str]) -> Optional[FilePieces]:
    """The pieces of ``name`` (:func:`digest_file`'s) that hold ``spans``, one range read per
    run of them, each piece checked against its CRC-32 in ``expected``; None when one is short
    or changed (a problem said)."""
    size = int(expected["size"])
    starts = [int(offset) for offset, _ in expected["pieces"]]
    crcs = [int(crc) for _, crc in expected["pieces"]]
    ends = starts[1:] + [size]
    first = [bisect.bisect_right(starts, offset) - 1 for offset, length in spans if length > 0]
    last = [bisect.bisect_right(starts, offset + length - 1) - 1
            for offset, length in spans if length > 0]
    runs = merged((starts[a], ends[b] - starts[a]) for a, b in zip(first, last))
    pieces: dict[int, bytes] = {}
    for start, length in runs:
        try:
            data = store.read_range(name, start, length)
        except FileNotFoundError:
            problems.append(f"{store.describe(name)}: missing")
            return None
        if len(data) != length:
            problems.append(f"{store.describe(name)}: truncated or changed (bytes {start:,}-"
                            f"{start + length:,} of {size:,} read as {len(data):,})")
            return None
        for i in range(bisect.bisect_left(starts, start), len(starts)):
            if starts[i] >= start + length:
                break
            if zlib.crc32(data[starts[i] - start:ends[i] - start]) != crcs[i]:
                problems.append(f"{store.describe(name)}: checksum mismatch in bytes "
                                f"{starts[i]:,}-{ends[i]:,} (corrupt)")
                return None
        pieces[start] = data
    return FilePieces(size, pieces)


def restore_newest(store: CheckpointStore, load: Callable[[dict, dict[str, Any]], T],
                   needs: Optional[Needs] = None
                   ) -> tuple[Optional[dict], Optional[T], list[str]]:
    """Resume from the newest checkpoint in ``store`` that is complete and readable.

    Each candidate's files are checked against its record (size, SHA-256) and then given to
    ``load(record, files)`` -- with ``needs``, only what this rank's load reads of them
    (:func:`_read_checked`); a candidate that fails either is skipped with a problem naming the
    file and why, and the next older one is tried. Returns ``(record, load's value, problems)``,
    or ``(None, None, [])`` when the folder has no checkpoint at all (train from scratch).

    Raises:
        CheckpointError: the folder has checkpoints but none is usable -- never a silent start
            from scratch, never a raw h5py/zip/pickle error.
    """
    problems: list[str] = []
    for record in _candidates(store, problems):
        files = _read_checked(store, record, problems, needs)
        if files is None:
            continue
        try:
            value = load(record, files)
        except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint is skipped
            name = record.get("file") or next(iter(files), "?")
            problems.append(f"{store.describe(name)}: unreadable ({_why(exc)})")
            continue
        return record, value, problems
    if not problems:
        return None, None, []
    from sparkhvd.common.errors import CheckpointError

    raise CheckpointError(
        f"No usable checkpoint to resume from in {store.describe()}: "
        + "; ".join(problems) + ". Fix: resume from an earlier run folder "
        "(HorovodRunner(resume_from='<run folder>')), or train from scratch with "
        "resume_from=False (or the helper's resume=False); the files above are kept as they "
        "are.")


def _why(exc: BaseException) -> str:
    from sparkhvd.common.errors import SparkhvdError

    if isinstance(exc, SparkhvdError):  # ours: names the file and the fix, said whole
        return f"{type(exc).__name__}: {exc}"
    text = str(exc).split("\n", 1)[0]
    return f"{type(exc).__name__}: {text[:200]}"


#: How the resume line names each copy a checkpoint can be read from (``Resumed.copy``).
COPIES = {"folder": "", "host": " (its copy on this host)",
          "peer": " (another rank's host copy, sent over the process group)"}


def announce_resume(store: CheckpointStore, file: Optional[str] = None, epoch: int = 0,
                    problems: Sequence[str] = (), step: int = 0, copy: str = "folder",
                    uploaded: bool = True) -> None:
    """Rank 0 says what it resumed from (``file`` None: nothing found) and which copy of it it
    read -- and, ``uploaded`` False, that the folder does not have it (kept on the hosts
    before an upload that never ended) -- on its console line and to the driver
    (``run.json``'s ``resume``), for every framework's helpers."""
    from sparkhvd.common import protocol
    from sparkhvd.common.events import emit

    if file is None:
        print(f"resume: no checkpoint under {store.describe()}; training from scratch",
              flush=True)
        emit(protocol.Resumed(rank=0, source=None, epoch=0))
        return
    where = store.describe(file)
    for problem in problems:
        print(f"resume: WARNING: {problem}", flush=True)
    # one numbering: the training loop's epoch index, as the checkpoint files name it
    # (epoch-0001-step-0000040 is step 40 of the loop's epoch 1; epoch-0002 continues at 2)
    at = f"epoch {epoch}" + (f" after its step {step}" if step else "")
    unsent = "" if uploaded else (
        "; a memory snapshot of that step: the folder does not have it"
        if file.endswith(".snapshot") else
        "; its upload had not ended: the folder does not have it")
    print(f"resume: restored {where}{COPIES[copy]}{unsent}; continuing at {at}", flush=True)
    emit(protocol.Resumed(rank=0, source=where, epoch=epoch, skipped=list(problems), step=step,
                          copy=copy, uploaded=uploaded))


def resume_store(resume: object, own: Optional[CheckpointStore],
                 storage_options: Optional[dict] = None) -> Optional[CheckpointStore]:
    """Where a rank resumes from (the one rule, for every framework's helpers).

    ``resume``: ``None`` resumes when the driver asked for it (``HorovodRunner(resume_from=...)``
    resolved it into ``SPARKHVD_RESUME_URL``, read through the run-folder service); ``True``
    resumes from there, or from ``own`` (this run's store) when the driver asked nothing; a
    URL resumes from that folder (a run folder's ``checkpoints/`` when it has one); ``False``
    never resumes. A relaunch of the run (a retry or a resize: attempt 2 on) whose checkpoints
    go to a URL of the user's (``own``, not the run folder, so the driver cannot see them)
    resumes from there when it holds one -- with ``None`` as with ``True``. A relaunch the
    driver asked nothing of (the run folder had no checkpoint) resumes from ``own`` too: the
    ranks' hosts may keep a checkpoint the folder does not have yet (kept before its upload,
    a memory snapshot), and only the ranks see those. The rule reads nothing a rank's host
    has, so every rank takes the same path into the restore's collectives.
    """
    from sparkhvd.common import protocol

    requested = os.environ.get(protocol.RESUME_URL_ENV)
    relaunched = int(os.environ.get(protocol.ATTEMPT_ENV) or 1) > 1
    if resume is None and relaunched and (
            not requested or isinstance(own, UrlStore) and holds_checkpoint(own)):
        return own
    if resume is None:
        resume = bool(requested)
    if resume is True:
        return RunFolderStore("resume", label=requested) if requested else own
    if resume:
        return url_store(str(resume), storage_options)
    return None
