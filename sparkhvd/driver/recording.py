"""What a run leaves behind, as callbacks on its lifecycle: the run decides and acts, its
recorders write down what it did.

:class:`~sparkhvd.driver.run.Run` calls every callback at the same moments, in the order they
were registered (:func:`recorders` gives sparkhvd's, in the order that matters: ``run.json``
before ``report.html`` reads it, both before MLflow uploads the folder), with frozen
snapshots of the run and of the attempt (:class:`~sparkhvd.driver.view.RunSnapshot`,
:class:`~sparkhvd.driver.view.AttemptSnapshot`) -- what the ranks send while they run is
subscribed to through the run's hub (``run.hub``):

- ``on_run_start(run)``: the run folder is checked; nothing is placed yet;
- ``on_state(run, transition)``: every transition (:class:`~sparkhvd.driver.view.Transition`:
  the state left, the state entered, and its entry as ``run.json``'s ``states`` keeps it);
- ``on_attempt_start(run, attempt)``: an attempt is placed (``attempt.placement``);
- ``on_attempt_launch(run, attempt)``: its launch is prepared and about to be submitted;
- ``on_attempt_end(run, attempt)``: its ranks have ended, before the policy decides;
- ``on_ranks_done(run)``: no rank runs any more (the run may still be recorded as failed);
- ``on_run_end(run, status, error, model)``: the outcome is known; ``model`` is the saved
  model's file name, if any.

Like Ray Train v2's controller callbacks and Lightning's: a recorder never decides what the
run does next, and every ``run.json`` write is a recorder's (:class:`RunJson`). A recorder's
error goes on as the run's own, except where one would hide the outcome: the curves and
``report.html`` say so in a warning instead.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from sparkhvd.driver.inbox import merge_epochs
from sparkhvd.driver.view import AttemptSnapshot, RunSnapshot, Transition
from sparkhvd.timing.splits import TimeSplits
from sparkhvd.timing.start_times import breakdown

if TYPE_CHECKING:
    from sparkhvd.driver.settings import RunConfig

__side__ = "driver"

log = logging.getLogger(__name__)


class RunCallback:
    """A recorder: every hook does nothing unless overridden (module docstring)."""

    def on_run_start(self, run: RunSnapshot) -> None:
        pass

    def on_state(self, run: RunSnapshot, transition: Transition) -> None:
        pass

    def on_attempt_start(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        pass

    def on_attempt_launch(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        pass

    def on_attempt_end(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        pass

    def on_ranks_done(self, run: RunSnapshot) -> None:
        pass

    def on_run_end(self, run: RunSnapshot, status: str, error: Optional[BaseException],
                   model: Optional[str]) -> None:
        pass


class RunJson(RunCallback):
    """``run.json`` (:class:`~sparkhvd.runfolder.record.RunRecord`): what was asked, each
    transition, where each attempt went and what it launched, its end (and the stacks the
    driver saved meanwhile), the outcome."""

    def __init__(self) -> None:
        #: the attempts whose stack dumps are in ``run.json`` (an aborted one's: at the end)
        self.stacks_of: set[int] = set()
        #: wall-clock moments of the attempt being started, for its ``timings.starts`` entry
        self._placing_since: Optional[float] = None
        self._placing_s: Optional[float] = None
        self._launched_at: Optional[float] = None

    def on_run_start(self, run: RunSnapshot) -> None:
        spec, scaling = run.spec, run.scaling
        elastic = {"min_np": scaling.min_np, "max_np": scaling.max_np} if scaling.elastic else {}
        run.record.started(np=spec.scaling.np, mode=spec.scaling.mode,
                           ranks_per_task=spec.scaling.ranks_per_task,
                           node_per_task=spec.scaling.node_per_task, backend=spec.backend,
                           function=run.function, **elastic)

    def on_state(self, run: RunSnapshot, transition: Transition) -> None:
        if transition.after == "placing" and self._placing_since is None:
            self._placing_since = time.time()  # kept through a resize back to placing
        run.record.transition(transition.entry)

    def on_attempt_start(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        if self._placing_since is not None:
            self._placing_s, self._placing_since = time.time() - self._placing_since, None
        placement = attempt.placement
        run.record.placed(placement.launcher, **placement.recorded)
        if attempt.number == 1 and attempt.resume:
            run.record.resume_requested(attempt.resume)

    def on_attempt_launch(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        """Before the job is submitted: its tag, so it can always be found and cancelled."""
        record = run.record
        if attempt.placement.launcher == "barrier":
            record.submitting(attempt.spark_job, attempt.job_kind or "tag", attempt.number)
        record.mark("launch")
        self._launched_at = time.time()
        if run.spec.config.timeline:
            record.launched(timeline="timeline.json")

    def on_attempt_end(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        if attempt.status == "succeeded":
            run.record.launched(control=attempt.channel)
        run.record.start_timed(attempt.number, breakdown(
            attempt.start_times, self._launched_at, self._placing_s, time.time()))
        self._placing_s = self._launched_at = None
        self._stacks(run, attempt)
        run.record.attempt_ended(dict(attempt.entry), attempt.resumed)

    def on_ranks_done(self, run: RunSnapshot) -> None:
        for attempt in run.attempts:  # an attempt the run aborted had no end of its own
            self._stacks(run, attempt)
        if run.state == "finished":
            run.record.mark("finished")

    def _stacks(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        if attempt.number not in self.stacks_of:
            self.stacks_of.add(attempt.number)
            run.record.stacks_saved(list(attempt.stack_files))

    def on_run_end(self, run: RunSnapshot, status: str, error: Optional[BaseException],
                   model: Optional[str]) -> None:
        last = run.attempt
        run.record.finished(status, error=error,
                            pids=dict(last.pids) if last is not None else {},
                            resumed=last.resumed if last is not None else None,
                            model=model)


class Curves(RunCallback):
    """``metrics.csv`` always; ``curves.png`` where matplotlib is installed (the ``plots``
    extra): nobody asked for a picture, so its absence is no warning. Epochs redone by a
    relaunch replace the ones they repeat."""

    def __init__(self) -> None:
        self.metrics: list[dict] = []

    def on_attempt_end(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        self.metrics = merge_epochs(self.metrics, [dict(m) for m in attempt.metrics])

    def on_ranks_done(self, run: RunSnapshot) -> None:
        if not self.metrics:
            return
        from sparkhvd.runfolder.curves import can_plot, plot_curves, write_metrics_csv

        try:
            write_metrics_csv(run.run_dir.file("metrics.csv"), self.metrics)
            if can_plot():
                plot_curves(run.run_dir.file("curves.png"), self.metrics)
            else:
                log.debug("curves.png not drawn: matplotlib is not installed")
        except Exception as exc:  # noqa: BLE001 - curves must never hide the run's outcome
            log.warning("could not write the training curves: %s", exc)


class TimeSplitRecorder(RunCallback):
    """Where the ranks' time goes (:class:`~sparkhvd.timing.splits.TimeSplits`):
    ``timing.jsonl``, stragglers on the console, findings in ``run.json``."""

    def __init__(self) -> None:
        self.splits: Optional[TimeSplits] = None

    def on_run_start(self, run: RunSnapshot) -> None:
        record = run.record
        self.splits = TimeSplits(run.run_dir.path, say=run.say,
                                 findings=lambda found: record.timed(findings=found))
        run.hub.on_time_split(self.splits.add)

    def on_attempt_start(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        if self.splits is not None:
            self.splits.begin(attempt.number, attempt.size)

    def also_to(self, tracker: Any) -> None:
        """Send what the splits find, and the ranks' system metrics, to ``tracker`` too."""
        if self.splits is not None:
            self.splits.tracker = tracker

    def on_ranks_done(self, run: RunSnapshot) -> None:
        if self.splits is not None:
            self.splits.close()
            run.record.timed(**self.splits.summary())


class Mlflow(RunCallback):
    """The run in MLflow (:class:`~sparkhvd.driver.tracking.MlflowTracker`), started when the
    first attempt is placed (its launcher is a parameter): transitions, the ranks' metrics as
    they come, time-split findings, the run folder at the end."""

    def __init__(self, target: Any, splits: Optional[TimeSplitRecorder]) -> None:
        self.target, self.splits = target, splits
        self.tracker: Any = None

    def on_attempt_start(self, run: RunSnapshot, attempt: AttemptSnapshot) -> None:
        if self.tracker is None:
            from sparkhvd.driver.tracking import MlflowTracker

            self.tracker = MlflowTracker(self.target)
            self.tracker.start(run.run_dir, {**run.record.params(),
                                             "launcher": attempt.placement.launcher},
                               run.kwargs)
            if self.splits is not None:
                self.splits.also_to(self.tracker)
            run.hub.on_metrics(self.tracker.metrics)

    def on_state(self, run: RunSnapshot, transition: Transition) -> None:
        if self.tracker is not None:
            self.tracker.transition(transition.entry)

    def on_run_end(self, run: RunSnapshot, status: str, error: Optional[BaseException],
                   model: Optional[str]) -> None:
        if self.tracker is not None:
            self.tracker.finish(run.run_dir, status)


class Report(RunCallback):
    """``report.html``: the run at a glance, one offline file (:mod:`sparkhvd.timing.report`),
    written from ``run.json`` once the outcome is in it."""

    def on_run_end(self, run: RunSnapshot, status: str, error: Optional[BaseException],
                   model: Optional[str]) -> None:
        from sparkhvd.timing.report import write_report

        try:
            write_report(run.run_dir.path)
            run.record.reported("report.html")
        except Exception as exc:  # noqa: BLE001 - a report must never hide the run's outcome
            log.warning("could not write report.html: %s", exc)


def recorders(config: "RunConfig") -> list[RunCallback]:
    """sparkhvd's recorders for a run of ``config``, in the order they must run."""
    splits = TimeSplitRecorder() if config.time_split else None
    found: list[RunCallback] = [RunJson(), Curves()]
    if splits is not None:
        found.append(splits)
    found.append(Report())
    if config.mlflow:
        found.append(Mlflow(config.mlflow, splits))
    return found
