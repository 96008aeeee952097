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
from sparkhvd.common.errors import NotEnoughSlotsError, TrainingError
from sparkhvd.driver.launchers import GroupStatus, LaunchFacts, LaunchSpec, Placement, RankFact
from sparkhvd.driver.placing import Short
from sparkhvd.driver.run import Run
from sparkhvd.driver.settings import LaunchConfig, RunConfig, ScalingConfig
from sparkhvd.driver.spec import run_spec

pytestmark = pytest.mark.timeout(60)


def lost(rank: int = 1) -> Callable[[LaunchSpec, Any], GroupStatus]:
    """An attempt whose rank's process vanished (its executor or host went)."""
    def end(spec: LaunchSpec, sink: Any) -> GroupStatus:
        return GroupStatus((RankFact(rank, "vanished", time.monotonic(), host="h1",
                                     executor="10.0.0.1", detail=f"rank {rank} vanished"),),
                           running=False)
    return end


def noticed(rank: int = 0) -> Callable[[LaunchSpec, Any], GroupStatus]:
    """An attempt whose ranks stopped on a notice, after their checkpoint."""
    def end(spec: LaunchSpec, sink: Any) -> GroupStatus:
        return GroupStatus(tuple(RankFact(r, "exited", time.monotonic(), exit_code=75,
                                          host="h1") for r in range(spec.size)),
                           running=False)
    return end


def until_notified(spec: LaunchSpec, sink: Any) -> GroupStatus:
    """An attempt that runs until the driver gives its ranks a notice, then stops on it."""
    return noticed()(spec, sink)


def succeeds(result: Any = b"weights") -> Callable[[LaunchSpec, Any], GroupStatus]:
    def end(spec: LaunchSpec, sink: Any) -> GroupStatus:
        return GroupStatus(tuple(RankFact(r, "exited", time.monotonic(), exit_code=0)
                                 for r in range(spec.size)),
                           running=False, done=True, results=(result,) * spec.size)
    return end


class ScriptedGroup:
    """One attempt's ranks: running for ``polls`` polls, then ended as ``end`` says; it reaches
    its ranks itself (notices are kept)."""

    timeout_message = "scripted ranks ran out of time"
    recovers = False

    def __init__(self, end: Callable[[LaunchSpec, Any], GroupStatus], spec: LaunchSpec,
                 sink: Any, polls: int) -> None:
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
                return GroupStatus()
        else:
            self.polls -= 1
            if self.polls >= 0:
                return GroupStatus()
        return self.end(self.spec, self.sink)

    def shutdown(self, stop: bool = False) -> None:
        self.stopped = self.stopped or stop
        self.closed = True


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

    def place(self, size: int, first: bool, time_left: Optional[float],
              waited_s: float = 0.0, ended: Optional[str] = None) -> Any:
        if self.fail_placing is not None:
            raise self.fail_placing
        self.placed.append(size)
        if self.session is not None:  # a Spark session: the barrier launcher, watched
            return Placement("barrier", nics=frozenset({"lo"}), session=self.session)
        return Placement("local", nics=frozenset({"lo"}))

    def free_slots(self, ended: Optional[str] = None) -> int:
        return self.free.pop(0) if len(self.free) > 1 else self.free[0]

    def note_losses(self, lost: Any, executors: Callable[[], set]) -> None:
        self.losses.append(list(lost))

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


def _count_steps(run: Run) -> list[tuple[str, str, bool]]:
    """Each step the run takes, as (state before, state after, whether it kept its state)."""
    steps: list[tuple[str, str, bool]] = []
    step = run._step

    def counted(state: Any, env: dict) -> Any:
        after = step(state, env)
        steps.append((state.label, after.label, after is state))
        return after

    run._step = counted  # type: ignore[method-assign]
    return steps


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
    assert len(placer.losses) == 1 and [f.kind for f in placer.losses[0]] == ["vanished"]
    assert placer.losses[0][0].executor == "10.0.0.1"  # the lost rank's executor, from its fact


def test_an_elastic_run_starts_smaller_when_fewer_slots_are_free(tmp_path):
    placer = ScriptedPlacer(free=(2,))
    run = _run(tmp_path, ScriptedLauncher(succeeds()), placer, np=3, min_np=2)
    run.execute()
    assert placer.placed == [2]


def test_below_min_np_after_the_wait_the_run_fails_naming_what_was_lost(tmp_path):
    """The policy said relaunch; its placing finds 1 slot free, below min_np, after the
    wait: the run fails there, naming what it lost."""
    placer = ScriptedPlacer(free=(3, 1))
    run = _run(tmp_path, ScriptedLauncher(lost()), placer, np=3, min_np=2, slot_wait_s=0)
    with pytest.raises(NotEnoughSlotsError, match=r"min_np=2 .* but 1 are free .*executor 7"):
        run.execute()
    states = _record(run)["states"]
    assert [s["state"] for s in states] == ["placing", "running", "restarting", "placing",
                                            "failed"]
    assert states[-1]["why"].startswith("NotEnoughSlotsError")


def test_waiting_for_slots_is_the_placing_state_looked_at_each_step(tmp_path):
    """Below min_np at first, the placing state is kept (no transition, no sleep inside the
    step) and looks again each step until a slot comes back."""
    placer = ScriptedPlacer(free=(1, 1, 1, 2))
    run = _run(tmp_path, ScriptedLauncher(succeeds()), placer, np=3, min_np=2, slot_wait_s=60)
    steps = _count_steps(run)
    assert run.execute()[0] == b"weights"
    assert steps[:4] == [("placing", "placing", True)] * 3 + [("placing", "running", False)]
    assert placer.placed == [2] and _states(run) == ["placing", "running", "finished"]


def test_the_runs_timeout_ends_a_wait_for_slots(tmp_path):
    """Waiting below min_np is bounded by run(timeout=...), checked at each look (slot_wait_s
    is 600 s: the module's 60 s timeout is the hang guard)."""
    config = RunConfig(output_dir=str(tmp_path / "runs"), time_split=False)
    spec = run_spec("torch", ScalingConfig(np=3, min_np=2), LaunchConfig(slot_wait_s=600),
                    config, LaunchFacts("torch"))
    run = Run(spec, _train, b"", None, kwargs={}, return_all=False, timeout=0.5,
              placer=ScriptedPlacer(free=(1,)), launchers=ScriptedLauncher(succeeds()))
    with pytest.raises(NotEnoughSlotsError, match="min_np=2"):
        run.execute()
    assert _states(run) == ["placing", "failed"]


class SlotsGoneOnce(ScriptedPlacer):
    """Counts 3 free slots after the loss, but one has gone when the relaunch is placed (a
    lost host's executor Spark had not dropped yet): that placement finds 2."""

    def __init__(self) -> None:
        super().__init__(free=(3, 3, 3, 2))  # the start, the relaunch's size, its placing
        self.tries: list[int] = []

    def place(self, size: int, first: bool, time_left: Optional[float],
              waited_s: float = 0.0, ended: Optional[str] = None) -> Any:
        self.tries.append(size)
        if len(self.tries) == 2:
            return Short(1, 2, 0.0, NotEnoughSlotsError(
                f"np={size} needs {size} Spark task slots, but the session has 2"))
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

    def on_run_start(self, run: Any) -> None:
        self.seen.append("run_start")

    def on_state(self, run: Any, transition: Any) -> None:
        self.seen.append(transition.after)
        self.transitions.append((transition.before, transition.after))

    def on_attempt_start(self, run: Any, attempt: Any) -> None:
        self.seen.append(f"attempt_start {attempt.number}")

    def on_attempt_launch(self, run: Any, attempt: Any) -> None:
        self.seen.append(f"attempt_launch {attempt.number}")

    def on_attempt_end(self, run: Any, attempt: Any) -> None:
        self.seen.append(f"attempt_end {attempt.number} {attempt.status}")

    def on_ranks_done(self, run: Any) -> None:
        self.seen.append("ranks_done")

    def on_run_end(self, run: Any, status: str, error: Any, model: Any) -> None:
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
    steps = _count_steps(run)
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


def test_recorders_are_handed_frozen_snapshots_never_the_run_or_an_attempt(tmp_path):
    """A recorder sees the run and the attempt as they were at the moment, and cannot reach
    the placer, the policies or a live worker group; what the ranks send comes through the
    run's hub."""
    import dataclasses

    from sparkhvd.driver.view import AttemptSnapshot, RunSnapshot

    seen: list[tuple[Any, Any]] = []
    metrics: list[dict] = []

    class Peek(Moments):
        def on_run_start(self, run: Any) -> None:
            run.hub.on_metrics(metrics.append)

        def on_attempt_end(self, run: Any, attempt: Any) -> None:
            seen.append((run, attempt))

    def reports(spec: LaunchSpec, sink: Any) -> GroupStatus:
        sink.receive(protocol.Metrics(rank=0, record={"epoch": 0, "loss": 0.5}))
        sink.receive(protocol.Metrics(rank=1, record={"epoch": 0, "loss": 0.7}))
        return lost()(spec, sink)

    run = _run(tmp_path, ScriptedLauncher(reports, succeeds()), np=2, max_retries=1)
    run.callbacks = [Peek()]  # type: ignore[list-item]
    run.execute()
    (first_run, first), (_, second) = seen
    assert isinstance(first_run, RunSnapshot) and isinstance(first, AttemptSnapshot)
    assert not hasattr(first_run, "placer") and not hasattr(first, "group")
    assert (first.status, second.status) == ("failed", "succeeded")
    assert first_run.state == "running" and len(first_run.attempts) == 1
    assert first.metrics == ({"epoch": 0, "loss": 0.5},) and metrics == [first.metrics[0]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first_run.state = "finished"  # type: ignore[misc]


def test_the_time_up_is_never_relaunched_even_with_a_notice_in_its_grace(tmp_path):
    """A rank stopped on a notice, the others finishing their step -- and the run's timeout
    passes: the attempt ended timed out, and nothing is launched after the deadline."""
    def one_noticed(spec: LaunchSpec, sink: Any) -> GroupStatus:
        return GroupStatus((RankFact(0, "exited", time.monotonic(), exit_code=75),))

    launcher = ScriptedLauncher(one_noticed, succeeds(), polls=0)
    config = RunConfig(output_dir=str(tmp_path / "runs"), time_split=False)
    spec = run_spec("torch", ScalingConfig(np=2), LaunchConfig(), config, LaunchFacts("torch"))
    run = Run(spec, _train, b"", None, kwargs={}, return_all=False, timeout=0.3,
              placer=ScriptedPlacer(), launchers=launcher)
    with pytest.raises(TimeoutError):
        run.execute()
    assert len(launcher.specs) == 1
    assert [a["status"] for a in _record(run)["attempts"]] == ["timed out"]


class BusyOnce(ScriptedPlacer):
    """Other jobs hold a slot at the first look, worth waiting for; the next look finds it."""

    def __init__(self) -> None:
        super().__init__(free=(3,))
        self.looks = 0

    def place(self, size: int, first: bool, time_left: Optional[float],
              waited_s: float = 0.0, ended: Optional[str] = None) -> Any:
        self.looks += 1
        if self.looks == 1:
            return Short(1, 2, 30.0, NotEnoughSlotsError("busy"), ("job 7 (1 task(s))",))
        return super().place(size, first, time_left)


def test_slots_other_jobs_hold_are_waited_for_not_resized_away(tmp_path, caplog):
    placer = BusyOnce()
    run = _run(tmp_path, ScriptedLauncher(succeeds()), placer, np=3, min_np=2, slot_wait_s=30)
    assert run.execute()[0] == b"weights"
    assert placer.placed == [3] and placer.looks == 2
    assert "held by other jobs (job 7 (1 task(s)))" in caplog.text


def test_an_interrupt_while_waiting_for_slots_ends_the_run_in_failed(tmp_path, monkeypatch):
    placer = ScriptedPlacer(free=(1,))
    run = _run(tmp_path, ScriptedLauncher(succeeds()), placer, np=3, min_np=2,
               slot_wait_s=600)

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("sparkhvd.driver.run.time.sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.execute()
    assert _states(run) == ["placing", "failed"]
    assert _record(run)["status"] == "interrupted"


def test_a_lost_ranks_executor_is_the_one_that_ran_its_partition(monkeypatch):
    """Two executors on one host (one address): the one that ran the silent rank's partition
    is lost for the run; a vanished rank's executor is left out of the next count only; a
    rank killed by a signal loses nothing."""
    from types import SimpleNamespace

    from sparkhvd.driver.placing import SparkPlacer
    from sparkhvd.elastic.cluster import Executor

    monkeypatch.setattr("sparkhvd.elastic.cluster.executors", lambda sc: [
        Executor("1", "10.0.0.2", 2), Executor("2", "10.0.0.2", 2), Executor("3", "10.0.0.3", 2)])
    placer = SparkPlacer(None, None)
    placer.view = SimpleNamespace(connect=False, sc=object())  # type: ignore[assignment]
    ran_on = {0: "1", 1: "2", 2: "3"}
    placer.note_losses([RankFact(1, "silent", 1.0, executor="10.0.0.2", partition=1)],
                       lambda: ran_on)
    assert placer.lost_executors == {"2": "10.0.0.2"}
    placer.note_losses([RankFact(2, "vanished", 1.0, executor="10.0.0.3", partition=2)],
                       lambda: {})  # where it ran unknown: the only executor at its address
    assert placer._suspects == {"3": "10.0.0.3"} and "3" not in placer.lost_executors
    placer.note_losses([RankFact(0, "exited", 1.0, exit_code=-9, partition=0)], lambda: ran_on)
    assert set(placer.lost_executors) == {"2"}


def test_a_rank_lost_as_the_runs_time_runs_out_is_not_relaunched(tmp_path):
    """The policy would retry the loss, but run(timeout=...) has passed: nothing is launched
    after the deadline; the loss is the run's error."""
    def late_loss(spec: LaunchSpec, sink: Any) -> GroupStatus:
        time.sleep(0.4)
        return lost()(spec, sink)

    launcher = ScriptedLauncher(late_loss, succeeds())
    config = RunConfig(output_dir=str(tmp_path / "runs"), time_split=False, max_retries=3)
    spec = run_spec("torch", ScalingConfig(np=2), LaunchConfig(), config, LaunchFacts("torch"))
    run = Run(spec, _train, b"", None, kwargs={}, return_all=False, timeout=0.2,
              placer=ScriptedPlacer(), launchers=launcher)
    with pytest.raises(TrainingError, match="rank 1"):
        run.execute()
    assert len(launcher.specs) == 1 and _states(run) == ["placing", "running", "failed"]
