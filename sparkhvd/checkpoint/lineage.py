"""A checkpoint lineage as plain names and records: what every store, writer and reader of
checkpoints -- and the driver deciding where a relaunch resumes -- agree on, once.

- a checkpoint is named by its progress (:func:`checkpoint_name`): ``epoch-000N`` after N
  epochs, ``epoch-000N-step-000000K`` after step K of the next; names sort as progress, and the
  step counts on across resizes, so the order only grows;
- its **record** (``<name>.json``, :func:`record_of`) names its files with their sizes and
  checksums; written after the files, it is what makes the checkpoint *complete*;
- ``latest.json`` (:data:`LATEST`) repeats the newest record, written last; a resume reads the
  newest complete record (``latest.json`` first: :mod:`sparkhvd.checkpoint.read`), so a kill
  between a record and ``latest.json`` still resumes from that record's checkpoint -- and the
  driver hands a folder holding one to a relaunch (:func:`resumable`).
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping, Optional

__side__ = "common"

LATEST = "latest.json"


def resumable(folder: str) -> Optional[str]:
    """``folder``, a checkpoints folder on this host, when a run can resume from it: it holds a
    complete checkpoint (:func:`holds_checkpoint`); else None."""
    return folder if holds_checkpoint(folder) else None


def holds_checkpoint(folder: str) -> bool:
    """Whether the checkpoints folder ``folder`` (on this host) holds a complete checkpoint
    (:func:`complete_in`)."""
    try:
        return complete_in(os.listdir(folder))
    except OSError:
        return False


def complete_in(names: Iterable[str]) -> bool:
    """Whether a checkpoints folder of these file names holds a complete checkpoint:
    ``latest.json``, or any checkpoint's record -- a kill between a record and
    ``latest.json`` leaves a complete checkpoint (its files are in, checked by its record),
    and a resume reads the newest record, so every path that looks for one counts it."""
    return any(name == LATEST or RECORD_PATTERN.match(name) for name in names)


def newest_checkpoint(folder: str) -> Optional[str]:
    """The file name of the newest complete checkpoint in the checkpoints folder ``folder`` (on
    this host): what ``latest.json`` names, else the newest record's (None: none)."""
    import json

    try:
        names = os.listdir(folder)
    except OSError:
        return None
    records = sorted(((progress_of(n), n) for n in names if progress_of(n) is not None),
                     reverse=True)
    for name in ([LATEST] if LATEST in names else []) + [n for _, n in records]:
        try:
            with open(os.path.join(folder, name)) as f:
                return str(json.load(f).get("file") or "") or None
        except (OSError, ValueError, AttributeError):
            continue
    return None


def check_cadence(every_steps: Any, every_seconds: Any, keep: Any) -> None:
    """The checkpoint helpers' cadence settings (torch and Keras), checked once: ValueError
    naming the one that is wrong."""
    for name, value in (("every_steps", every_steps), ("keep", keep)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive int or None; got {value!r}")
    if every_seconds is not None and not every_seconds > 0:
        raise ValueError(f"every_seconds must be a positive number or None; got "
                         f"{every_seconds!r}")


def checkpoint_name(epoch: int, step: int = 0) -> str:
    """A checkpoint's name: ``epoch-000N`` after N epochs, ``epoch-000N-step-000000K`` after
    step K of the epoch that follows them (a mid-epoch checkpoint). Names sort as progress."""
    return f"epoch-{epoch:04d}" + (f"-step-{step:07d}" if step else "")


def record_name(epoch: int, step: int = 0) -> str:
    """The record of a checkpoint (its files, sizes, checksums): its name + ``.json``."""
    return checkpoint_name(epoch, step) + ".json"


def progress_of(name: str) -> Optional[tuple[int, int]]:
    """``(epoch, step)`` of a record's name, None for other files."""
    match = RECORD_PATTERN.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def files_of(record: dict) -> dict[str, dict]:
    """A checked record's files: name -> its size and SHA-256 (and, sharded, its rank)."""
    return {name: dict(expected or {}) for name, expected in expected_files(record).items()}


def record_of(epoch: int, files: Mapping[str, dict], info: dict, step: int = 0) -> dict:
    """The record of a checkpoint of ``files`` (name -> :func:`digest`) after ``step`` steps of
    epoch ``epoch`` (0: an epoch-end checkpoint)."""
    return {**info, "epoch": epoch, "step": step, "files": dict(files)}


def progress(record: dict) -> tuple[int, int]:
    """``(epoch, step)`` of a record: which of two checkpoints is newer."""
    return int(record["epoch"]), int(record.get("step") or 0)


def expected_files(record: dict) -> dict[str, Optional[dict]]:
    """name -> expected digest (None for checkpoints written before records had them)."""
    if isinstance(record.get("files"), dict):
        return dict(record["files"])
    legacy = [record.get("file"), record.get("optimizer")]
    return {name: None for name in legacy if isinstance(name, str)}


RECORD_PATTERN = re.compile(r"^epoch-(\d{4,})(?:-step-(\d+))?\.json$")
