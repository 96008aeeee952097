"""Restore the newest checkpoint from its nearest copy, for every framework.

The rank that writes a checkpoint file keeps its newest on its host
(:mod:`sparkhvd.checkpoint.host_copy`). After a relaunch the ranks that load the state need
those files: read from the run folder, they cross the network once per rank (minutes for a
large model on ``abfss://``). Here, with the framework's collectives (:class:`Collectives`:
``torch.distributed``, Horovod or a ``tf.distribute`` strategy):

1. every rank says which copies its host has, and the records of those kept before their
   upload (one small all-gather);
2. rank 0 reads the newest complete checkpoint's record from the checkpoint folder -- or takes
   a newer one kept on the hosts first, when the ranks' hosts hold every file of it (its upload
   had not ended: :mod:`sparkhvd.checkpoint.host_copy`) -- and tells every rank its files and
   checksums (one small broadcast): the one decision, so every rank takes the same path
   through the collectives below;
3. for each file, a loading rank whose host has it reads it from disk (checked against the
   checksum); when some loading rank's host has none, the lowest rank that has it sends its
   bytes to every rank over the framework's collectives; a file no rank has (or whose only
   copy is bad, said with a warning) is read from the checkpoint folder;
4. when a loading rank has not every file that way, or the state does not load, the loading
   ranks read the checkpoint folder as before
   (:func:`sparkhvd.checkpoint.read.restore_newest`).

A checkpoint of shards (DCP's: a ``.metadata`` index and a file per rank) need not reach every
rank whole: with :class:`Needs`, the index comes first, each loading rank says which byte
ranges of which files its own load reads (its DCP load plan; one small all-gather), and a rank
that lacks a file gets only those ranges (:mod:`sparkhvd.checkpoint.file_pieces`) -- so under
FSDP a restore moves each rank's shards once, not every rank's file to every rank.

Which ranks load is the framework's: every rank with torch and ``tf.distribute``, rank 0 on
Horovod (it broadcasts the weights itself). Returns which copy was used, for the resume line
and ``run.json`` (``resume.copy``): the farthest any file came from.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Optional, Protocol, Union

from sparkhvd.checkpoint import host_copy
from sparkhvd.checkpoint.file_pieces import (
    FilePieces,
    Needs,
    Span,
    cut,
    index_files,
    load_plan,
    wanted_spans,
)
from sparkhvd.checkpoint.lineage import files_of, progress
from sparkhvd.checkpoint.read import newest_checked, read_copy, read_file_checked, restore_newest
from sparkhvd.checkpoint.stores import CheckpointStore

__side__ = "rank"

#: The copies a file can come from, nearest first (``resume.copy`` is the farthest used).
FARTHEST = ("host", "peer", "folder")


class Collectives(Protocol):
    """What the restore needs of a framework's process group (every rank calls each method in
    the same order)."""

    size: int

    def gather(self, held: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``held`` (a JSON-able dict), by rank."""

    def broadcast_record(self, record: Optional[dict], source: int) -> Optional[dict]:
        """``source``'s record (a JSON-able dict, or None) on every rank."""

    def broadcast_bytes(self, data: Optional[bytes], source: int, rank: int
                        ) -> Optional[bytes]:
        """``source``'s bytes on every rank (None everywhere when the source has none)."""

    def everyone(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""


#: What one rank reads of each file: file -> rank -> its ranges (None: the whole file).
Wants = dict[str, dict[int, Optional[list[Span]]]]


class Alone:
    """The collectives of a run of one rank."""

    size = 1

    def gather(self, held: dict[str, Any]) -> list[dict[str, Any]]:
        return [held]

    def broadcast_record(self, record: Optional[dict], source: int) -> Optional[dict]:
        return record

    def broadcast_bytes(self, data: Optional[bytes], source: int, rank: int
                        ) -> Optional[bytes]:
        return data

    def everyone(self, ok: bool) -> bool:
        return ok


def load_nearest(store: CheckpointStore, load: Callable[[dict, dict[str, Any]], Any],
                 rank: int, world: Collectives, loaders: Optional[Collection[int]] = None,
                 needs: Optional[Needs] = None, mapped: bool = False
                 ) -> tuple[Optional[dict], Any, list[str], str]:
    """``(record, load's value, problems, copy)``: the newest checkpoint in ``store``, read from
    the nearest copy -- ``copy`` is ``"host"``, ``"peer"`` or ``"folder"``. Call on every rank
    (a collective when there are several); ``load`` runs on the ranks in ``loaders`` (default:
    every rank), each with the same record, or on none of them (it may be a collective among
    them). It gets every file's bytes -- or, with ``needs``, the files its load reads, each as
    bytes or as the :class:`FilePieces` it reads. ``mapped``: ``load`` also takes a file
    read from this host's disk as a read-only ``memoryview`` of it mapped into memory, not a
    copy (:func:`~sparkhvd.checkpoint.file_pieces.as_stream` reads either). A rank outside
    ``loaders`` returns ``(None, None, [], "folder")``."""
    readers = set(range(world.size)) if loaders is None else set(loaders)
    loading = rank in readers
    mine = host_copy.find_all()
    gathered = world.gather({"files": {file: copy.content for file, copy in mine.items()},
                             "records": host_copy.records(store.key)})
    everyone: list[dict[str, str]] = [held["files"] for held in gathered]
    kept_first = [record for held in gathered for record in held["records"]
                  if _held_whole(record, everyone)]
    record = _decide(store, rank, any(everyone), kept_first, world)
    problems: list[str] = []
    if record is not None:
        files, copy = _fetch_needed(store, record, mine, everyone, rank, readers, problems,
                                    world, needs, mapped)
        if files is not None and loading:
            try:
                return record, load(record, files), problems, copy
            except Exception as exc:  # noqa: BLE001 - a copy that does not load: the folder
                problems.append(f"{copy} copy of {record.get('file')}: unreadable "
                                f"({type(exc).__name__}: {str(exc)[:200]})")
    if not loading:
        return None, None, [], "folder"
    newest, state, skipped = restore_newest(store, load, needs)
    return newest, state, problems + skipped, "folder"


def _decide(store: CheckpointStore, rank: int, any_copy: bool, kept_first: list[dict],
            world: Collectives) -> Optional[dict]:
    """Rank 0's choice, the same on every rank: the newest checkpoint's record in the folder,
    or a newer one of ``kept_first`` (records of checkpoints the ranks' hosts hold whole,
    kept before their upload); None when no rank has a host copy or the record has no
    checksums to check a copy against."""
    if not any_copy:
        return None
    wanted = None
    if rank == 0:
        try:
            wanted = newest_checked(store)
        except Exception:  # noqa: BLE001 - the folder path below says what is wrong
            wanted = None
        newer = [r for r in kept_first if wanted is None or progress(r) > progress(wanted)]
        if newer:
            # a checkpoint file before a memory snapshot of the same step: its SHA-256 is checked
            first = max(newer, key=lambda r: (progress(r), not r.get("snapshot")))
            kept = ("is a snapshot of that step's state kept in memory on the ranks' hosts "
                    "(it was never written to the folder)" if first.get("snapshot") else
                    f"was kept on the ranks' hosts before its upload to {store.describe()} "
                    "ended")
            print(f"resume: {first.get('file') or 'the newest checkpoint'} {kept}; it is "
                  f"newer than the folder's newest ({(wanted or {}).get('file') or 'none'}): "
                  "reading it from the hosts", flush=True)
            wanted = {**first, "uploaded": False}  # for the resume line and run.json
    return world.broadcast_record(wanted, 0)


def _held_whole(record: dict, everyone: list[dict[str, str]]) -> bool:
    """Whether some rank's host holds each file of ``record`` with its checksum (or, a memory
    snapshot, its identity: :func:`~sparkhvd.checkpoint.host_copy.content_of`)."""
    contents = {name: host_copy.content_of(expected) for name, expected in files_of(record).items()}
    return bool(contents) and all(content and any(held.get(name) == content for held in everyone)
                                  for name, content in contents.items())


def _fetch_needed(store: CheckpointStore, record: dict, mine: dict[str, host_copy.HostCopy],
                  everyone: list[dict[str, str]], rank: int, readers: set[int],
                  problems: list[str], world: Collectives, needs: Optional[Needs],
                  mapped: bool) -> tuple[Optional[dict[str, Any]], str]:
    """:func:`_fetch` of every file whole for every loading rank -- or, with ``needs``, of the
    index files first, then of what each loading rank's load reads of the others."""
    expected = sorted(files_of(record))
    whole: Wants = {name: dict.fromkeys(readers) for name in expected}
    if needs is None:
        files, farthest = _fetch(store, record, expected, mine, everyone, rank, whole,
                                 problems, world, mapped)
        return files, FARTHEST[farthest]
    first = index_files(needs, record, expected)
    files, farthest = _fetch(store, record, first, mine, everyone, rank, whole, problems,
                             world, mapped)
    if files is None:
        return None, FARTHEST[2]
    spans = load_plan(needs, record, files) if rank in readers else None
    said = [held["spans"] for held in world.gather({"spans": spans})]
    wants: Wants = {name: {r: None if said[r] is None else said[r][name] for r in sorted(readers)
                           if said[r] is None or name in said[r]}
                    for name in expected if name not in first}
    rest, farther = _fetch(store, record, sorted(wants), mine, everyone, rank, wants,
                           problems, world, mapped)
    if rest is None:
        return None, FARTHEST[2]
    return {**files, **rest}, FARTHEST[max(farthest, farther)]


def _fetch(store: CheckpointStore, record: dict, names: list[str],
           mine: dict[str, host_copy.HostCopy], everyone: list[dict[str, str]], rank: int,
           wants: Wants, problems: list[str], world: Collectives, mapped: bool
           ) -> tuple[Optional[dict[str, Any]], int]:
    """For each of ``names`` (the checkpoint's files), for the ranks that read it (``wants``,
    the same on every rank): this host's copy, else what they read of the lowest rank's that
    holds it (a collective whenever some reader does not), else the folder's; and the farthest
    copy read (an index of :data:`FARTHEST`). None (on every rank) when some reader could not
    get a file. ``mapped``: this host's copies as views of the files mapped into memory."""
    files: dict[str, Union[bytes, memoryview, FilePieces]] = {}
    farthest = 0
    complete = True
    said = len(problems)
    expected_of = files_of(record)
    for name in names:
        expected = expected_of[name]
        readers = set(wants[name])
        reading = rank in readers
        content = host_copy.content_of(expected)
        holders = [r for r, held in enumerate(everyone) if content and held.get(name) == content]
        lacking = sorted(readers.difference(holders))  # the same on every rank
        sends = bool(holders) and bool(lacking)
        held = read_copy(store, name, expected, mine.get(name), problems, mapped) \
            if rank in holders and (reading or (sends and rank == holders[0])) else None
        data: Union[bytes, memoryview, FilePieces, None] = held
        where = 0
        if sends:
            spans = wanted_spans([wants[name][r] for r in lacking])
            payload = None if held is None or rank != holders[0] else \
                bytes(held) if spans is None else cut(held, spans)  # a mapped view: copied
            sent = world.broadcast_bytes(payload, holders[0], rank)
            if data is None and sent is not None and reading:
                data = sent if spans is None else FilePieces.of(int(expected["size"]), spans,
                                                                sent)
                where = 1
        if not reading:
            continue
        if data is None and complete:
            data, where = read_file_checked(store, name, expected, problems,
                                            wants[name][rank]), 2
        if data is None:
            complete = False  # every broadcast still taken part in
            continue
        files[name] = data
        farthest = max(farthest, where)
    if rank != 0:  # rank 0 says its own with the resume line
        for problem in problems[said:]:
            print(f"resume: WARNING: {problem}", flush=True)
    if not world.everyone(complete):
        return None, 2
    return files, farthest
