"""Where a launch's time goes: each rank's start, marked as it happens, and the breakdown the
driver writes into ``run.json`` (``timings.starts``), so a slow start is found from the record.

In the rank (:func:`begin` before the function, :func:`mark` at each moment, :func:`report`
after it), wall-clock seconds on the rank's host:

- ``process``: the rank's process was created (its supervisor: forked by a warm server, or a
  fresh interpreter);
- ``ready``: sparkhvd's rank code is loaded and the rank starts preparing;
- ``function``: the user's function is called;
- ``framework_start``, ``framework``: torch or TensorFlow began and finished importing --
  wherever that happens (unpickling the function, the function's first line); a warm rank's
  process already held it: ``framework`` at ``ready``, no start;
- ``rendezvous``: ``torch.distributed.init_process_group`` returned;
- ``first_step``: the first forward of a ``DistributedDataParallel`` model (the DDP timing
  hook, :mod:`sparkhvd.timing.collectives`);
- ``returned``: the function returned.

On the driver, :func:`breakdown` turns every rank's marks and the driver's own moments (the
attempt placed, its Spark job submitted, the result back) into seconds per step -- the slowest
rank's for each -- with how many ranks started warm. Hosts' clocks are assumed to agree to
well under a second (NTP); a step a rank did not pass through is left out.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any, Mapping, Optional

from sparkhvd.common import protocol, warmstart

__side__ = "common"

#: The module whose import is the backend's framework.
FRAMEWORK = {"torch": "torch", "tf": "tensorflow", "horovod": "tensorflow"}
_marks: dict[str, float] = {}


def mark(name: str, at: Optional[float] = None) -> None:
    """Note the first time this rank passes ``name`` (later passes change nothing)."""
    _marks.setdefault(name, time.time() if at is None else at)


def begin(backend: Optional[str], supervised: bool) -> None:
    """Before the user's function: the process's own start, and hooks for the moments that
    happen inside the function (the framework's import, the rendezvous)."""
    from sparkhvd.common.after_import import when_imported

    with contextlib.suppress(OSError, ValueError, IndexError):
        mark("process", created_at(os.getppid() if supervised else os.getpid()))
    mark("ready")
    framework = FRAMEWORK.get(backend or "")
    if framework:
        when_imported(framework, lambda _module: mark("framework"),
                      starting=lambda: mark("framework_start"))
    when_imported("torch.distributed", _time_rendezvous)


def created_at(pid: int) -> float:
    """When process ``pid`` was created, on this clock (``time.time()``), to 10 ms: its age
    from the kernel's ticks since boot (psutil's ``create_time`` adds the boot time, which the
    kernel keeps in whole seconds)."""
    with open(f"/proc/{pid}/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def _time_rendezvous(module: Any) -> None:
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_sparkhvd_timed", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        mark("rendezvous")
        return result

    init_process_group._sparkhvd_timed = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group
    c10d = getattr(module, "distributed_c10d", None)  # `from ... import init_process_group`
    if c10d is not None and getattr(c10d, "init_process_group", None) is original:
        c10d.init_process_group = init_process_group


def report(rank: int) -> protocol.StartTimes:
    """This rank's marks as the event the driver keeps."""
    return protocol.StartTimes(rank=rank, marks=dict(_marks), warm=warmstart.FORKED_WARM)


#: The steps of a launch, in order, each ``(name, from, to)``: ``launch`` and ``result`` are the
#: driver's moments, the rest the ranks' marks (the slowest rank's span for each).
STEPS = (("spark_job", "launch", "process"), ("process_start", "process", "ready"),
         ("prepare", "ready", "function"), ("import", "framework_start", "framework"),
         ("rendezvous", "framework", "rendezvous"), ("to_first_step", "launch", "first_step"),
         ("function", "function", "returned"))


def breakdown(ranks: Mapping[int, protocol.StartTimes], launched_at: Optional[float],
              placing_s: Optional[float] = None,
              result_at: Optional[float] = None) -> dict[str, Any]:
    """Seconds per step of one attempt's launch (module docstring): the slowest rank's, each
    step's span clipped at zero; ``import`` is 0 for a rank whose framework was there (warm);
    ``prepare`` does not count an import inside it."""
    out: dict[str, Any] = {}
    if placing_s is not None:
        out["placing"] = round(placing_s, 3)
    for step, start, end in STEPS:
        spans = []
        for times in ranks.values():
            marks = dict(times.marks)
            if launched_at is not None:
                marks["launch"] = launched_at
            if step == "rendezvous" and "framework" in marks and "function" in marks:
                marks["framework"] = max(marks["framework"], marks["function"])
            if step == "import" and "framework" in marks:
                marks.setdefault("framework_start", marks["framework"])  # held already
            if start in marks and end in marks:
                span = marks[end] - marks[start]
                if step == "prepare" and "framework_start" in marks and "framework" in marks \
                        and marks["ready"] <= marks["framework_start"] < marks["function"]:
                    span -= marks["framework"] - marks["framework_start"]  # counted as import
                spans.append(max(0.0, span))
        if spans:
            out[step] = round(max(spans), 3)
    first = ranks.get(0)
    if first is not None and result_at is not None and "returned" in first.marks:
        out["result_back"] = round(max(0.0, result_at - first.marks["returned"]), 3)
    out["ranks"] = len(ranks)
    out["warm_ranks"] = sum(1 for times in ranks.values() if times.warm)
    return out
