"""Work a rank must finish before its training function counts as ended.

A helper that goes on working in the background after a call returns -- a checkpoint still
being written -- registers here; the rank's bootstrap runs the callbacks right after the user's
function returns (an error in one is the rank's error, as if the function had raised it) and
again, quietly, however the function ended. Outside a sparkhvd rank (a torchrun script) the
helper also registers with :mod:`atexit`. Work for a function that *returned* -- the run is
done, so a rank's host copy of its checkpoints can go -- registers with :func:`at_function_return`
and runs only then, after the rest.

A helper registers its methods :func:`held_weakly`: these lists, and :mod:`atexit`, would
otherwise keep every helper -- and the host buffers it holds, gigabytes for a large model --
for as long as the process lives, in a process that makes several (a notebook's kernel, a
script, a benchmark).
"""
from __future__ import annotations

import weakref
from typing import Callable

__side__ = "common"

_CALLBACKS: list[Callable[[], None]] = []
_ON_RETURN: list[Callable[[], None]] = []


def held_weakly(method: Callable[[], None]) -> Callable[[], None]:
    """A call of the bound ``method`` that does not keep its object alive: nothing once the
    object is gone. Safe for a helper's "wait for the save in flight": the thread or queue that
    runs a save holds the helper until the save ends, so a gone helper has nothing left to
    wait for."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def at_function_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the rank's training function ends (once per registration)."""
    if callback not in _CALLBACKS:
        _CALLBACKS.append(callback)


def at_function_return(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the rank's training function *returns* (not when it raised)."""
    if callback not in _ON_RETURN:
        _ON_RETURN.append(callback)


def function_ended(returned: bool = True) -> None:
    """Run the callbacks registered so far, in order -- those for a return only when the
    function ``returned`` and the others raised nothing -- and forget them; the first error is
    raised after all of them ran."""
    callbacks, _CALLBACKS[:] = list(_CALLBACKS), []
    on_return, _ON_RETURN[:] = list(_ON_RETURN), []
    first: BaseException | None = None
    for callback in callbacks:
        try:
            callback()
        except BaseException as exc:  # noqa: BLE001 - every callback runs; the first is raised
            first = first or exc
    for callback in on_return if returned and first is None else ():
        try:
            callback()
        except BaseException as exc:  # noqa: BLE001 - as above
            first = first or exc
    if first is not None:
        raise first
