"""The run as a controller (sparkhvd.driver.run), stepped with a scripted placer and launcher.

No Spark and no rank process: :class:`ScriptedPlacer` says how many slots are free and places
each attempt; :class:`ScriptedLauncher` makes a :class:`ScriptedGroup` the controller starts and polls,
which ends as its script says (a result, a lost rank, a notice). The run's own parts are real -- its states, policies, run folder and
``run.json``, its polls, monitor and elastic watch -- so each lifecycle case (retries and
preemptions within and over budget, a shrink, a grow into free slots, slots below ``min_np``,
a failure while placing, the run's timeout) runs in milliseconds, as Ray Train v2's controller
tests run against a dummy worker group.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

import pytest

from sparkhvd.common import protocol
from sparkhvd.common.errors import LaunchFailure, NotEnoughSlotsError, TrainingError
from sparkhvd.driver.launchers import GroupStatus, LaunchFacts, LaunchSpec, Placement
from sparkhvd.driver.run import Run
from sparkhvd.driver.settings import LaunchConfig, RunConfig, ScalingConfig
from sparkhvd.driver.spec import run_spec

pytestmark = pytest.mark.timeout(60)


def lost(rank: int = 1) -> Callable[[LaunchSpec, Any], Any]:
    """An attempt whose rank's process vanished (its executor or host went)."""
    def end(spec: LaunchSpec, sink: Any) -> Any:
        raise LaunchFailure(rank, None, f"rank {rank} vanished", host="h1", vanished=True)
    return end


def noticed(rank: int = 0) -> Callable[[LaunchSpec, Any], Any]:
    """An attempt whose ranks stopped on a notice, after their checkpoint."""
    def end(spec: LaunchSpec, sink: Any) -> Any:
        raise LaunchFailure(rank, 75, "stopped on a notice after its checkpoint", host="h1",
                            preempted=True)
    return end


def until_notified(spec: LaunchSpec, sink: Any) -> Any:
    """An attempt that runs until the driver gives its ranks a notice, then stops on it."""
    raise LaunchFailure(0, 75, "stopped on a notice after its checkpoint", host="h1",
                        preempted=True)


def succeeds(result: Any = b"weights") -> Callable[[LaunchSpec, Any], Any]:
    def end(spec: LaunchSpec, sink: Any) -> Any:
        return [result] * spec.size
    return end


class ScriptedGroup:
    """One attempt's ranks: running for ``polls`` polls, then ended as ``end`` says; it reaches
    its ranks itself (notices are kept)."""

    timeout_message = "scripted ranks ran out of time"

    def __init__(self, end: Callable[[LaunchSpec, Any], Any], spec: LaunchSpec, sink: Any,
                 polls: int) -> None:
        self.end, self.spec, self.sink, self.polls = end, spec, sink, polls
        self.reach = self
        self.notices: list[str] = []
        self.started, self.stopped, self.closed = False, False, False

    def start(self) -> None:
        self.started = True
        for rank in range(self.spec.size):  # every rank's checkpoint helper listens for notices
            self.sink.receive(protocol.Listening(rank=rank))

    def ask_stacks(self) -> None:
        pass

    def notify(self, reason: str) -> None:
        self.notices.append(reason)

    def poll(self, wait_s: float, elapsed_s: float) -> GroupStatus:
        if self.end is until_notified:
            time.sleep(0.001)
            if not self.notices:
                return GroupStatus("running")
        else:
            self.polls -= 1
            if self.polls >= 0:
                return GroupStatus("running")
        try:
            return GroupStatus("ended", results=tuple(self.end(self.spec, self.sink)))
        except LaunchFailure as failure:
            return GroupStatus("failed", error=failure)

    def shutdown(self, cause: Optional[BaseException] = None) -> Optional[BaseException]:
        self.stopped = self.stopped or cause is not None
        self.closed = True
        return cause


class ScriptedLauncher:
    """Ends attempt N as ``script[N - 1]`` says (after ``polls`` polls); keeps each attempt's
    launch spec and worker group."""

    def __init__(self, *script: Callable[[LaunchSpec, Any], Any], polls: int = 0) -> None:
        self.script, self.polls = list(script), polls
        self.specs: list[LaunchSpec] = []
        self.groups: list[ScriptedGroup] = []

    def __call__(self, name: str) -> Callable[[LaunchSpec, Any], ScriptedGroup]:
        return self.group  # the run's launcher by name: this one's group, whatever the name

    def group(self, spec: LaunchSpec, sink: Any) -> ScriptedGroup:
        self.specs.append(spec)
        self.groups.append(ScriptedGroup(self.script[len(self.specs) - 1], spec, sink,
                                         self.polls))
        return self.groups[-1]


class ScriptedPlacer:
    """Slots free as ``free`` says at each count (the last repeats); places every attempt as
    local processes; may fail a placement."""

    counts_slots = True

    def __init__(self, free: tuple = (64,), fail_placing: Optional[Exception] = None,
                 session: Any = None) -> None:
        self.free, self.fail_placing, self.session = list(free), fail_placing, session
        self.placed: list[int] = []
        self.losses: list[Any] = []
        self.swept: list[tuple[str, set[str], dict]] = []

    def place(self, size: int, first: bool, time_left: Optional[float]) -> Placement:
        if self.fail_placing is not None:
            raise self.fail_placing
        self.placed.append(size)
        if self.session is not None:  # a Spark session: the barrier launcher, watched
            return Placement("barrier", nics=frozenset({"lo"}), session=self.session)
        return Placement("local", nics=frozenset({"lo"}))

    def free_slots(self, ended: Optional[str] = None) -> int:
        return self.free.pop(0) if len(self.free) > 1 else self.free[0]

    def note_losses(self, failure: Any, executors: Callable[[], set]) -> None:
        self.losses.append(failure)

    def describe_lost(self) -> str:
        return "executor 7 on h1 lost"

    def sweep_host_copies(self, run_id: str, hosts: set[str], env: Any) -> None:
        self.swept.append((run_id, hosts, dict(env)))


def _run(tmp_path, launcher: ScriptedLauncher, placer: Optional[ScriptedPlacer] = None,
         **settings: Any) -> Run:
    scaling = ScalingConfig(**{k: settings.pop(k) for k in ("np", "min_np", "max_np",
                                                            "resize_check_s") if k in settings})
    launch = LaunchConfig(**{k: settings.pop(k) for k in ("slot_wait_s", "env")
                             if k in settings})
    config = RunConfig(output_dir=str(tmp_path / "runs"), time_split=False, **settings)
    spec = run_spec("torch", scaling, launch, config, LaunchFacts("torch"))
    return Run(spec, _train, b"", None, kwargs={}, return_all=False, timeout=None,
               placer=placer or ScriptedPlacer(), launchers=launcher)


def _train() -> None:
    """The user's function (never called: the launcher is scripted)."""


def _record(run: Run) -> dict:
    return json.loads(open(run.run_dir.file("run.json")).read())


def _states(run: Run) -> list[str]:
    return [entry["state"] for entry in _record(run)["states"]]


def test_a_run_that_succeeds_places_runs_and_finishes(tmp_path):
    run = _run(tmp_path, ScriptedLauncher(succeeds()), np=2)
    assert run.execute() == [b"weights", b"weights"]
    assert _states(run) == ["placing", "running", "finished"]
    assert _record(run)["status"] == "succeeded"


def test_a_lost_rank_is_retried_within_max_retries_from_the_same_size(tmp_path):
    launcher = ScriptedLauncher(lost(), succeeds())
    run = _run(tmp_path, launcher, np=2, max_retries=1)
    assert run.execute()[0] == b"weights"
    assert _states(run) == ["placing", "running", "restarting", "placing", "running",
                            "finished"]
    restarting = _record(run)["states"][2]
    assert (restarting["attempt"], restarting["from"], restarting["to"]) == (1, 2, 2)
    assert [spec.size for spec in launcher.specs] == [2, 2]
    assert [a["status"] for a in _record(run)["attempts"]] == ["failed", "succeeded"]


def on_hosts(*hosts: str, then: Callable[[LaunchSpec, Any], Any]) -> Callable[[LaunchSpec, Any],
                                                                             Any]:
    """An attempt whose rank N started on ``hosts[N]``, then ended as ``then`` says."""
    def end(spec: LaunchSpec, sink: Any) -> Any:
        for rank, host in enumerate(hosts):
            sink.receive(protocol.Started(rank=rank, pid=1000 + rank, host=host))
        return then(spec, sink)
    return end


def test_a_run_that_succeeds_sweeps_the_hosts_only_earlier_attempts_used(tmp_path):
    """Attempt 1 on h1 and h2 loses a rank; attempt 2 runs on h2 and h3 and succeeds: h1's
    host copies are swept (h2's and h3's ranks cleaned their own), with where the run said
    copies go."""
    placer = ScriptedPlacer()
    launcher = ScriptedLauncher(on_hosts("h1", "h2", then=lost()),
                                on_hosts("h2", "h3", then=succeeds()))
    run = _run(tmp_path, launcher, placer, np=2, max_retries=1,
               env={"SPARKHVD_HOST_COPY_DIR": "/dev/shm"})
    run.execute()
    assert placer.swept == [(run.run_dir.run_id, {"h1"},
                             {"SPARKHVD_HOST_COPY_DIR": "/dev/shm"})]


def test_no_sweep_where_the_last_attempt_used_every_host_or_the_run_failed(tmp_path):
    """The same hosts again (its ranks cleaned them), or a run that failed (its newest
    checkpoint may be in a host copy alone): nothing is swept."""
    same = ScriptedPlacer()
    _run(tmp_path / "same", ScriptedLauncher(on_hosts("h1", "h2", then=lost()),
                                             on_hosts("h2", "h1", then=succeeds())),
         same, np=2, max_retries=1).execute()
    failed = ScriptedPlacer()
    with pytest.raises(TrainingError):
        _run(tmp_path / "failed", ScriptedLauncher(on_hosts("h1", "h2", then=lost()),
                                                   on_hosts("h3", "h2", then=lost())),
             failed, np=2, max_retries=1).execute()
    assert same.swept == [] and failed.swept == []


def test_a_lost_rank_over_max_retries_fails_the_run_naming_the_rank(tmp_path):
    run = _run(tmp_path, ScriptedLauncher(lost(), lost()), np=2, max_retries=1)
    with pytest.raises(TrainingError, match="rank 1"):
        run.execute()
    assert _states(run)[-1] == "failed" and len(run.attempts) == 2
    assert _record(run)["status"] == "failed"


def test_notices_have_their_own_budget(tmp_path):
    """Two notices within max_preemptions=2 are relaunched; no lost-rank retry is used."""
    run = _run(tmp_path, ScriptedLauncher(noticed(), noticed(), succeeds()), np=2,
               max_retries=0, max_preemptions=2)
    assert run.execute()[0] == b"weights"
    assert _states(run).count("restarting") == 2
    assert (run.spent.retries, run.spent.preemptions) == (0, 2)


def test_a_notice_over_max_preemptions_fails_the_run(tmp_path):
    run = _run(tmp_path, ScriptedLauncher(noticed(), noticed()), np=2, max_preemptions=1)
    with pytest.raises(TrainingError):
        run.execute()
    assert _states(run) == ["placing", "running", "restarting", "placing", "running", "failed"]
    assert [a["status"] for a in _record(run)["attempts"]] == ["preempted", "preempted"]


def test_an_elastic_run_shrinks_to_the_free_slots_after_a_loss(tmp_path):
    """np=3, min_np=2: 3 slots at the start, 2 after the loss -> resizing 3 -> 2."""
    placer = ScriptedPlacer(free=(3, 2))
    launcher = ScriptedLauncher(lost(), succeeds())
    run = _run(tmp_path, launcher, placer, np=3, min_np=2)
    assert run.execute()[0] == b"weights"
    assert _states(run) == ["placing", "running", "resizing", "placing", "running", "finished"]
    resizing = _record(run)["states"][2]
    assert (resizing["from"], resizing["to"]) == (3, 2)
    assert placer.placed == [3, 2] and [spec.size for spec in launcher.specs] == [3, 2]
    assert len(placer.losses) == 1 and placer.losses[0].vanished


def test_an_elastic_run_starts_smaller_when_fewer_slots_are_free(tmp_path):
    placer = ScriptedPlacer(free=(2,))
    run = _run(tmp_path, ScriptedLauncher(succeeds()), placer, np=3, min_np=2)
    run.execute()
    assert placer.placed == [2]


def test_below_min_np_after_the_wait_the_run_fails_naming_what_was_lost(tmp_path):
    placer = ScriptedPlacer(free=(3, 1))
    run = _run(tmp_path, ScriptedLauncher(lost()), placer, np=3, min_np=2, slot_wait_s=0)
    with pytest.raises(NotEnoughSlotsError, match=r"min_np=2 .* but 1 are free .*executor 7"):
        run.execute()
    states = _record(run)["states"]
    assert [s["state"] for s in states] == ["placing", "running", "failed"]
    assert states[-1]["why"].startswith("NotEnoughSlotsError")


class SlotsGoneOnce(ScriptedPlacer):
    """Counts 3 free slots after the loss, but one has gone when the relaunch is placed (a
    lost host's executor Spark had not dropped yet): that placement finds 2."""

    def __init__(self) -> None:
        super().__init__(free=(3, 3, 2))
        self.tries: list[int] = []

    def place(self, size: int, first: bool, time_left: Optional[float]) -> Placement:
        self.tries.append(size)
        if len(self.tries) == 2:
            raise NotEnoughSlotsError(f"np={size} needs {size} Spark task slots, but the "
                                      "session has 2")
        return super().place(size, first, time_left)


def test_an_elastic_relaunch_whose_slots_went_before_its_placement_takes_those_there_are(
        tmp_path):
    """np=3, min_np=2: a rank is lost, 3 slots are still counted free, so the relaunch is
    placed at 3 -- and 2 are there: the run resizes to them (a transition of its own, with
    the loss for its reason), never fails for slots it could do without."""
    placer = SlotsGoneOnce()
    launcher = ScriptedLauncher(lost(), succeeds())
    run = _run(tmp_path, launcher, placer, np=3, min_np=2, max_retries=1)
    assert run.execute()[0] == b"weights"
    assert _states(run) == ["placing", "running", "restarting", "placing", "resizing",
                            "placing", "running", "finished"]
    resizing = _record(run)["states"][4]
    assert (resizing["from"], resizing["to"]) == (3, 2), resizing
    assert "rank 1 on host h1 vanished" in resizing["why"], resizing
    assert "only 2 of the 3 task slots" in resizing["why"], resizing
    assert [(r["from"], r["to"]) for r in _record(run)["resizes"]] == [(3, 2)]
    assert placer.tries == [3, 3, 2] and [spec.size for spec in launcher.specs] == [3, 2]
    assert (run.spent.retries, len(run.attempts)) == (1, 2)


def test_a_relaunch_that_is_not_elastic_still_names_the_slots_it_lacks(tmp_path):
    placer = SlotsGoneOnce()
    run = _run(tmp_path, ScriptedLauncher(lost(), succeeds()), placer, np=3, max_retries=1)
    with pytest.raises(NotEnoughSlotsError, match="np=3 needs 3"):
        run.execute()
    assert _states(run) == ["placing", "running", "restarting", "placing", "failed"]


def test_a_failure_while_placing_fails_the_run_in_one_transition(tmp_path):
    placer = ScriptedPlacer(fail_placing=NotEnoughSlotsError("np=4 needs 4 task slots"))
    run = _run(tmp_path, ScriptedLauncher(), placer, np=4)
    with pytest.raises(NotEnoughSlotsError, match="np=4 needs 4"):
        run.execute()
    assert _states(run) == ["placing", "failed"]
    assert _record(run)["status"] == "failed" and run.attempts == []


class Moments:
    """A recorder that notes every moment the run tells its callbacks."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.transitions: list[tuple[Optional[str], str]] = []

    def on_run_start(self, run: Run) -> None:
        self.seen.append("run_start")

    def on_state(self, run: Any, transition: Any) -> None:
        self.seen.append(transition.after)
        self.transitions.append((transition.before, transition.after))

    def on_attempt_start(self, run: Any, attempt: Any) -> None:
        self.seen.append(f"attempt_start {attempt.number}")

    def on_attempt_launch(self, run: Any, attempt: Any) -> None:
        self.seen.append(f"attempt_launch {attempt.number}")

    def on_attempt_end(self, run: Run, attempt: Any) -> None:
        self.seen.append(f"attempt_end {attempt.number} {attempt.status}")

    def on_ranks_done(self, run: Run) -> None:
        self.seen.append("ranks_done")

    def on_run_end(self, run: Run, status: str, error: Any, model: Any) -> None:
        self.seen.append(f"run_end {status} {model}")


def test_callbacks_record_every_moment_in_order_and_the_defaults_write_the_run_folder(tmp_path):
    from sparkhvd.driver.recording import recorders

    moments = Moments()
    config = RunConfig(output_dir=str(tmp_path / "runs"), time_split=False, max_retries=1)
    run = _run(tmp_path, ScriptedLauncher(lost(), succeeds()), np=2, max_retries=1)
    run.callbacks = [*recorders(config), moments]  # type: ignore[list-item]
    run.execute()
    assert moments.seen == [
        "run_start", "placing", "attempt_start 1", "running", "attempt_launch 1",
        "attempt_end 1 failed", "restarting", "placing", "attempt_start 2", "running",
        "attempt_launch 2", "attempt_end 2 succeeded", "finished", "ranks_done",
        "run_end succeeded result.bin"]
    # each transition comes with the state it left
    assert moments.transitions[:3] == [(None, "placing"), ("placing", "running"),
                                       ("running", "restarting")]
    record = _record(run)
    assert record["status"] == "succeeded" and record["launcher"] == "local"
    assert record["timings"]["launch"] <= record["timings"]["finished"]
    assert (tmp_path / "runs" / run.run_dir.run_id / "report.html").exists()


def test_a_run_without_recorders_still_runs(tmp_path):
    run = _run(tmp_path, ScriptedLauncher(succeeds()), np=2)
    run.callbacks = []
    assert run.execute() == [b"weights", b"weights"]
    assert run.state is not None and run.state.label == "finished"


def test_the_controller_polls_the_group_stops_it_on_a_failure_and_always_closes_it(tmp_path):
    launcher = ScriptedLauncher(lost(), succeeds(), polls=3)
    run = _run(tmp_path, launcher, np=2, max_retries=1)
    assert run.execute()[0] == b"weights"
    first, second = launcher.groups
    assert (first.polls, second.polls) == (-1, -1)  # polled until they said they ended
    assert first.stopped and not second.stopped
    assert first.closed and second.closed


def test_the_runs_timeout_stops_a_group_that_does_not_end(tmp_path):
    launcher = ScriptedLauncher(succeeds(), polls=10**9)
    config = RunConfig(output_dir=str(tmp_path / "runs"), time_split=False)
    spec = run_spec("torch", ScalingConfig(np=2), LaunchConfig(), config, LaunchFacts("torch"))
    run = Run(spec, _train, b"", None, kwargs={}, return_all=False, timeout=0.3,
              placer=ScriptedPlacer(), launchers=launcher)
    with pytest.raises(TimeoutError, match="scripted ranks ran out of time"):
        run.execute()
    assert launcher.groups[0].stopped and launcher.groups[0].closed
    assert _record(run)["status"] == "timed out"
    assert _states(run) == ["placing", "running", "failed"]
    assert [a["status"] for a in _record(run)["attempts"]] == ["timed out"]


def test_each_running_step_polls_the_ranks_once_and_is_no_transition(tmp_path):
    """The run owns the poll loop: while the ranks run, a step polls them once and keeps the
    state (nothing recorded); the step whose poll finds them ended decides what follows."""
    launcher = ScriptedLauncher(succeeds(), polls=2)
    run = _run(tmp_path, launcher, np=2)
    steps, step = [], run._step

    def counted(state: Any, env: dict) -> Any:
        after = step(state, env)
        steps.append((state.label, after.label, after is state))
        return after

    run._step = counted  # type: ignore[method-assign]
    assert run.execute()[0] == b"weights"
    assert steps == [("placing", "running", False), ("running", "running", True),
                     ("running", "running", True), ("running", "finished", False)]
    assert _states(run) == ["placing", "running", "finished"]


def test_a_stall_with_on_stall_stop_is_found_by_a_poll_and_the_step_stops_the_ranks(
        tmp_path, monkeypatch):
    """No rank makes progress: the poll says the attempt stalled (data, not an exception);
    the step stops the ranks, and the run fails with the StallError naming where they were."""
    from sparkhvd.common.errors import StallError
    from sparkhvd.driver.monitor import RunMonitor, StackReport

    monkeypatch.setattr(RunMonitor, "collect", lambda self, reason, answer_s=0: StackReport(
        reason, "rank 0 is in train.py:9 wait()", None, {}, []))
    launcher = ScriptedLauncher(on_hosts("h1", "h1", then=succeeds()), polls=10**9)
    config = RunConfig(output_dir=str(tmp_path / "runs"), time_split=False)
    spec = run_spec("torch", ScalingConfig(np=2),
                      LaunchConfig(stall_timeout=0.05, on_stall="stop"), config,
                      LaunchFacts("torch"))
    run = Run(spec, _train, b"", None, kwargs={}, return_all=False, timeout=None,
              placer=ScriptedPlacer(), launchers=launcher)

    def started(spec: LaunchSpec, sink: Any, start=launcher.group) -> ScriptedGroup:
        group = start(spec, sink)
        for rank in range(spec.size):  # ranks that started, then never said anything again
            sink.receive(protocol.Started(rank=rank, pid=(1 << 22) + 1 + rank, host="h1"))
        return group

    launcher.group = started  # type: ignore[method-assign]
    with pytest.raises(StallError, match="rank 0 is in train.py:9 wait"):
        run.execute()
    group = launcher.groups[0]
    assert group.stopped and group.closed
    assert _states(run) == ["placing", "running", "failed"]
    record = _record(run)
    assert record["status"] == "stalled"
    assert [a["status"] for a in record["attempts"]] == ["stalled"]


class LocalMasterSession:
    """A classic session on a local master, as far as the watch looks: slots to grow into,
    no executors to decommission."""

    connect = False
    master = "local[4]"
    job_kind = "tag"

    def describe(self) -> str:
        return "a scripted local[4] session"


def test_an_elastic_run_grows_into_free_slots_at_its_next_step(tmp_path, monkeypatch):
    monkeypatch.setattr("sparkhvd.elastic.watch.GROW_CONFIRM_S", 0.01)
    # 2 free at the start (np=3 waits for none: min_np=2), then a slot comes back
    placer = ScriptedPlacer(free=(2, 1, 1, 3), session=LocalMasterSession())
    launcher = ScriptedLauncher(until_notified, succeeds())
    run = _run(tmp_path, launcher, placer, np=3, min_np=2, max_np=3, resize_check_s=0.01)
    assert run.execute()[0] == b"weights"
    assert placer.placed == [2, 3]
    assert launcher.groups[0].notices == ["1 Spark task slot(s) free: growing from 2 to 3 ranks"]
    assert _states(run) == ["placing", "running", "resizing", "placing", "running", "finished"]
    resizing = _record(run)["states"][2]
    assert (resizing["from"], resizing["to"]) == (2, 3)
    assert [a["status"] for a in _record(run)["attempts"]] == ["preempted", "succeeded"]
    assert run.spent.preemptions == 0  # a grow the driver asked for spends no budget
    # the recorders wrote what each barrier attempt was about to submit, before it was
    job = _record(run)["spark_job"]
    assert (job["name"], job["kind"], job["attempt"]) == (run.attempts[1].spark_job, "tag", 2)
    assert _record(run)["launcher"] == "barrier"


def test_a_transition_next_does_not_allow_is_refused_as_a_bug(tmp_path):
    """NEXT is checked where the run changes state: placing never leads straight to
    finished; failed may follow any state."""
    from sparkhvd.driver.states import Finished, Placing

    run = _run(tmp_path, ScriptedLauncher(succeeds()), np=2)
    run.callbacks = []
    run._enter(Placing("the run starts", size=2))
    with pytest.raises(RuntimeError, match="from placing to finished, which NEXT does not"):
        run._enter(Finished("skipped the running"))
