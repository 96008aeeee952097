"""``run.json``: what one run was and how it ended -- its schema, and its only writer.

Every field ``run.json`` can hold is written by one method of :class:`RunRecord`, named after
the moment in the run that writes it; nothing else in sparkhvd writes the file. Each write
rewrites it atomically and redacted, so the file is always whole and never holds a secret.

====================  =============================================================  ===========
field                 what                                                           written by
====================  =============================================================  ===========
run_id, output        the run's id and (public) URL                                  ``__init__``
versions              sparkhvd, Python, pyspark, TF/Keras/torch/horovod              ``__init__``
status                created, starting, succeeded, failed, timed out, stalled,      events
                      interrupted
np, mode, backend,    what was asked (``local_ranks``: "host" or "task"; ``min_np``,  started
ranks_per_task, ...   ``max_np`` of an elastic run)
launcher, session,    where it ran: launcher, Spark master/app, classic or connect,  placed
spark_master, slots   the task slots seen
resume                requested / restored / epoch / skipped, or a warning           resume_*,
                                                                                     attempt_ended
mlflow                tracking URI (redacted), experiment, run id, model id          tracked
timeline, control     the Horovod timeline's file; how reports came (live / rows)    launched
stacks                the stack reports saved under logs/                            stacks_saved
time_split            where the ranks' time went: file (timing.jsonl), ranks (host,  timed
                      seconds, share and where per bucket), findings (stragglers,
                      input- or communication-bound)
report                the run's report (report.html)                                 reported
attempts              one entry per attempt: status, size, error, retryable,          attempt_ended
                      preempted, resumed_from, restored, skipped, rank_pids, hosts,
                      ended_at
state, states         the run's state now, and every transition: state, at, why      transition
                      (and the attempt, sizes, checkpoint)
resizes               every change of the world size: from, to, why, checkpoint,     transition
                      attempt
rank_pids, pids,      the last attempt's rank -> pid, every pid, rank -> host        finished
hosts
error                 the error's type and first line                                finished
model                 the file rank 0's return value was saved as                    finished
timings               seconds since the start: launch, finished, total;               mark,
                      ``starts``: each attempt's launch, step by step (placing,      start_timed
                      Spark job, process start, import, rendezvous, first step,
                      function, result back; warm ranks), see timing/start_times
finished_at, ...      ISO times                                                      events
(anything)            the caller's own notes (``demo``: the demo's test accuracy)    annotate
====================  =============================================================  ===========
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from sparkhvd.common.fileio import atomic_write
from sparkhvd.common.protocol import Resumed
from sparkhvd.common.redaction import redact

__side__ = "driver"

log = logging.getLogger(__name__)


def now() -> str:
    """The time as ``run.json`` writes it (ISO, whole seconds, local)."""
    return _dt.datetime.now().isoformat(timespec="seconds")


class RunRecord(Mapping[str, Any]):
    """``run.json`` of one run folder: read like a dict, written only by its event methods."""

    def __init__(self, path: str, *, run_id: str, output: str,
                 versions: Mapping[str, Optional[str]]) -> None:
        self.path = path
        self._fields: dict[str, Any] = {"run_id": run_id, "status": "created", "output": output,
                                        "versions": dict(versions), "timings": {}}
        self._t0 = time.monotonic()
        #: writes come from the run's thread and from launcher threads (findings as they come)
        self._lock = threading.RLock()

    # -- reading ----------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def params(self) -> dict:
        """The run's parameters worth tracking elsewhere (np, mode, function, versions)."""
        params = {k: self._fields.get(k) for k in ("np", "mode", "function", "spark_master")}
        params.update({f"version.{k}": v for k, v in self._fields["versions"].items()})
        return params

    # -- the run's moments, in order ----------------------------------------------------------
    def started(self, *, np: int, mode: str, ranks_per_task: int, node_per_task: bool,
                backend: str, function: str, **elastic: int) -> None:
        """What was asked (``min_np=``, ``max_np=`` for an elastic run)."""
        self._write(status="starting", np=np, mode=mode, ranks_per_task=ranks_per_task,
                    local_ranks="task" if node_per_task else "host", backend=backend,
                    function=function, started_at=now(), **elastic)

    def placed(self, launcher: str, **spark: Any) -> None:
        """Where the ranks go: the launcher, and the Spark session's master, app id, kind and
        slots (``spark_master=``, ``spark_app_id=``, ``session=``, ``slots=``)."""
        self._write(launcher=launcher, **spark)

    def resume_requested(self, source: str) -> None:
        self._write(resume={"requested": source, "restored": None})

    def tracked(self, **mlflow: Any) -> None:
        """Where the run is tracked (MLflow's URI, already public, experiment, run and model
        ids); merged into what was recorded before."""
        self._write(mlflow={**(self._fields.get("mlflow") or {}), **mlflow})

    def submitting(self, name: str, kind: str, attempt: int) -> None:
        """The Spark job an attempt is about to submit: its tag (or group) -- what cancels it."""
        self._write(spark_job={"name": name, "kind": kind, "attempt": attempt})

    def launched(self, *, timeline: Optional[str] = None, control: Optional[str] = None) -> None:
        """What an attempt's launch set up: the timeline file, how reports came."""
        self._write(**{k: v for k, v in (("timeline", timeline), ("control", control)) if v})

    def stacks_saved(self, names: list[str]) -> None:
        if names:
            self._write(stacks=[*(self._fields.get("stacks") or []), *names])

    def transition(self, entry: Mapping[str, Any]) -> None:
        """The run entered a state (``entry``: state, at, why, ...); a resize is kept apart in
        ``resizes`` too."""
        fields: dict[str, Any] = {"state": entry["state"],
                                  "states": [*(self._fields.get("states") or []), dict(entry)]}
        if entry["state"] == "resizing":
            fields["resizes"] = [*(self._fields.get("resizes") or []),
                                 {k: entry.get(k) for k in
                                  ("from", "to", "why", "checkpoint", "attempt", "at")}]
        self._write(**fields)

    def attempt_ended(self, entry: Mapping[str, Any], resumed: Optional[Resumed]) -> None:
        """One more entry of ``attempts``, and what its ranks restored."""
        self._write(attempts=[*(self._fields.get("attempts") or []), dict(entry)],
                    **self._restored(resumed))

    def finished(self, status: str, *, error: Optional[BaseException], pids: Mapping[str, Any],
                 resumed: Optional[Resumed], model: Optional[str] = None) -> None:
        """The run's end: status, error, PIDs and hosts, what a resume restored (or a warning
        that nothing was), the model file."""
        self.mark("total")
        fields: dict[str, Any] = {"status": status, "finished_at": now(), **pids}
        if error is not None:
            fields["error"] = {"type": type(error).__name__,
                               "message": str(error).split("\n", 1)[0]}
        if status == "succeeded":
            fields.update(self._restored(resumed, warn=True))
            fields["model"] = model
        self._write(**fields)

    def timed(self, **time_split: Any) -> None:
        """Where the ranks' time went (:mod:`sparkhvd.timing.splits`): merged into
        ``time_split`` (findings as they come, the totals at the end)."""
        with self._lock:
            self._write(time_split={**(self._fields.get("time_split") or {}), **time_split})

    def reported(self, name: str) -> None:
        """The run's report file (``report.html``)."""
        self._write(report=name)

    def annotate(self, **fields: Any) -> None:
        """The caller's own notes in ``run.json`` (e.g. the demo's test accuracy)."""
        self._write(**fields)

    def start_timed(self, attempt: int, steps: Mapping[str, Any]) -> None:
        """Where an attempt's launch went (:func:`sparkhvd.timing.start_times.breakdown`), one
        entry of ``timings["starts"]``."""
        with self._lock:
            starts = [*self._fields["timings"].get("starts", []), {"attempt": attempt, **steps}]
            self._fields["timings"]["starts"] = starts
            self._write()

    def mark(self, timing: str) -> None:
        """Seconds since the run started, as ``timings[timing]`` (written with the next event;
        under the lock: a hub thread may be writing the record meanwhile)."""
        with self._lock:
            self._fields["timings"][timing] = round(time.monotonic() - self._t0, 3)

    # -- the one writer ------------------------------------------------------------------------
    def _write(self, **fields: Any) -> None:
        with self._lock:
            self._fields.update(fields)
            text = redact(json.dumps(self._fields, indent=2, default=str))
            atomic_write(self.path, text.encode())

    def _restored(self, resumed: Optional[Resumed], warn: bool = False) -> dict:
        """``resume``: what was asked, and what the (latest) attempt restored -- with the
        checkpoints it skipped, and why; with ``warn``, say so when nothing was restored."""
        requested = (self._fields.get("resume") or {}).get("requested")
        if not requested and resumed is not None and resumed.source:
            # a retry resumed from the run's own checkpoints
            requested = os.path.join(os.path.dirname(self.path), "checkpoints")
        if not requested:
            return {}
        if resumed is not None and resumed.source:
            restored = {"requested": requested, "restored": resumed.source,
                        "epoch": resumed.epoch}
            if resumed.step:
                restored["step"] = resumed.step
            restored["copy"] = resumed.copy
            if not resumed.uploaded:
                restored["uploaded"] = False  # restored from the hosts; not in the folder
            if resumed.skipped:
                restored["skipped"] = list(resumed.skipped)
            return {"resume": restored, "resumed_from": requested}
        if not warn:
            return {}
        warning = (f"resume_from asked to resume from {requested}, but no checkpoint was "
                   "restored: the ranks trained from scratch. Use "
                   "sparkhvd.keras.KerasDistributed in the training function (it restores "
                   "unless resume=False), or restore the checkpoint yourself.")
        log.warning(warning)
        return {"resume": {"requested": requested, "restored": None, "warning": warning}}
