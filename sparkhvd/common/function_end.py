"""Work a rank must finish before its training function counts as ended.

A helper that goes on working in the background after a call returns -- a checkpoint still
being written -- registers here; the rank's bootstrap runs the callbacks right after the user's
function returns (an error in one is the rank's error, as if the function had raised it) and
again, quietly, however the function ended. Outside a sparkhvd rank (a torchrun script) the
helper also registers with :mod:`atexit`.
"""
from __future__ import annotations

from typing import Callable

__side__ = "common"

_CALLBACKS: list[Callable[[], None]] = []


def at_function_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the rank's training function ends (once per registration)."""
    if callback not in _CALLBACKS:
        _CALLBACKS.append(callback)


def function_ended() -> None:
    """Run the callbacks registered so far, in order, and forget them; the first error is
    raised after all of them ran."""
    callbacks, _CALLBACKS[:] = list(_CALLBACKS), []
    first: BaseException | None = None
    for callback in callbacks:
        try:
            callback()
        except BaseException as exc:  # noqa: BLE001 - every callback runs; the first is raised
            first = first or exc
    if first is not None:
        raise first
