"""A rank's end is decided once, from facts (sparkhvd.driver.rank_end.judge and verdict_of), and the
retry policy alone decides what follows: every fact kind, every cause, and every decision."""
from __future__ import annotations

import pytest

from sparkhvd.common.errors import RankFailure, TrainingError
from sparkhvd.driver.facts import GroupStatus, RankFact
from sparkhvd.driver.rank_end import Graces, judge, signal_of, verdict_of
from sparkhvd.driver.retry import RetryPolicy, Spent


def _raised(rank, exc_type="ValueError", message="bad batch", at=1.0, host=None):
    return RankFailure(rank=rank, exc_type=exc_type, message=message, traceback="Traceback...",
                       time=at, host=host)


def _fact(rank, code, detail, *, vanished=False, lost=False, host=None, at=1.0):
    """A launcher's fact in the words the tests were written in."""
    kind = "silent" if lost else "vanished" if vanished else "exited"
    return RankFact(rank, kind, at, exit_code=code, host=host, detail=detail)


def _classify(failure, reported=(), hosts=None):
    return verdict_of(failure, list(reported), hosts or {}, lambda rank: f"last lines of {rank}")


@pytest.mark.parametrize("code, signum", [(None, None), (0, None), (1, None), (128, None),
                                          (-9, 9), (-15, 15), (-11, 11), (137, 9), (143, 15)])
def test_exit_codes_decode_to_signals_once(code, signum):
    assert signal_of(code) == signum


def test_a_rank_that_raised_is_named_with_its_exception_and_not_retried():
    verdict = _classify(_fact(1, 1, "rank 1 exited with status 1"),
                        [_raised(1)], hosts={1: "h1"})
    error = verdict.error("/runs/r1")
    assert isinstance(error, TrainingError)
    assert (error.rank, error.exc_type, error.host, error.exit_code) == (1, "ValueError", "h1", 1)
    assert str(error).startswith("Training failed on rank 1 (host h1): ValueError: bad batch")
    assert "Rank logs: /runs/r1/logs/" in str(error)
    assert verdict.retryable is None
    assert verdict.summary == "Training failed on rank 1 (host h1): ValueError: bad batch"


def test_the_first_exception_explains_a_rank_that_exited_without_one():
    verdict = _classify(_fact(0, 1, "rank 0 exited"), [_raised(1, at=2.0)])
    assert verdict.first.rank == 1 and verdict.retryable is None


@pytest.mark.parametrize("message", [
    "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16587",
    "Connection reset by peer", "Horovod has been shut down. This was caused by an exception on "
    "one of the ranks", "NCCL error: remote process exited or there was a network error",
    "Graph execution error: Collective ops is aborted by: failed to connect to all addresses; "
    "last error: UNKNOWN: ipv4:127.0.0.1:41065: Failed to connect to remote host"])
@pytest.mark.parametrize("seen_first", [2, 3])
def test_a_peers_consequence_yields_to_the_rank_that_raised_its_own_error(message, seen_first):
    """Two ranks per task: which of the task's ranks is seen exiting first is a race; the rank
    whose own error started it is named either way."""
    consequence = _raised(2, "RuntimeError", message, at=1.0)
    cause = _raised(3, "ValueError", "bad batch on rank 3", at=1.1)
    verdict = _classify(_fact(seen_first, 1, "exited"), [consequence, cause])
    assert verdict.first.rank == 3 and "bad batch on rank 3" in str(verdict.error())
    assert [f.rank for f in verdict.failures] == [3, 2] and verdict.retryable is None


def test_when_every_rank_only_saw_a_peer_go_the_first_seen_is_named():
    reported = [_raised(r, "RuntimeError", "Connection closed by peer", at=r) for r in (1, 0)]
    assert _classify(_fact(0, 1, "exited"), reported).first.rank == 0


@pytest.mark.parametrize("failure, retryable", [
    (_fact(1, None, "gone", vanished=True), "rank 1 vanished (its executor or host"),
    (_fact(1, None, "no heartbeat for 15 s", lost=True, host="h2"),
     "the Spark task of rank 1 on host h2 stopped answering (host lost)"),
    (_fact(1, -9, "killed"), "the process of rank 1 was killed by signal 9"),
    (_fact(1, 137, "killed"), "the process of rank 1 was killed by signal 9"),
    (_fact(1, -15, "terminated"), "the process of rank 1 was killed by signal 15"),
])
@pytest.mark.parametrize("peer", [
    _raised(0, "HorovodInternalError", "Horovod has been shut down", at=0.5),
    _raised(0, "UnavailableError", "Graph execution error: ... Collective ops is aborted by: "
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:41065: "
            "Failed to connect to remote host: Connection refused", at=0.5)],
    ids=["horovod", "tf-grpc"])
def test_a_lost_rank_is_named_first_over_its_peers_consequences_and_retryable(failure,
                                                                               retryable, peer):
    verdict = _classify(failure, [peer])
    assert verdict.first.rank == 1 and verdict.first.exc_type is None
    assert verdict.retryable.startswith(retryable)
    assert [f.rank for f in verdict.failures] == [1, 0]
    assert "(ranks 0 failed after it)" in str(verdict.error())


@pytest.mark.parametrize("code, how", [
    (-11, "was killed by signal 11 without raising"),
    (139, "was killed by signal 11 (exit status 139) without raising"),
    (3, "exited with status 3 without raising"),
    (None, "vanished without an exit status")])
def test_a_rank_that_died_without_raising_says_how_with_its_last_lines(code, how):
    verdict = _classify(_fact(2, code, "d", vanished=code is None))
    assert how in verdict.first.message
    assert verdict.first.traceback == "last lines of 2"
    crashed_itself = code is not None and signal_of(code) not in (None, 9, 15, 1, 2)
    assert (verdict.retryable is None) == (crashed_itself or code == 3)


def test_a_checkpoint_error_is_the_cause_wherever_it_was_raised():
    verdict = _classify(_fact(0, 1, "rank 0 exited"),
                        [_raised(0, "RuntimeError", "peer gone", at=1.0),
                         _raised(1, "CheckpointError", "no usable checkpoint", at=2.0)],
                        hosts={1: "h1"})
    assert verdict.first.exc_type == "CheckpointError" and verdict.first.host == "h1"


def test_secrets_in_a_rank_message_are_redacted_in_the_error():
    from sparkhvd.common.redaction import remember_secret

    remember_secret("s3cr3t-value-123")
    verdict = _classify(_fact(0, 1, "x"), [_raised(0, message="key=s3cr3t-value-123")])
    assert "s3cr3t-value-123" not in str(verdict.error())


@pytest.mark.parametrize("max_retries, attempt, failed, retryable, decision", [
    (0, 1, False, None, "done"),
    (0, 1, True, "lost", "raise"),
    (1, 1, True, "lost", "retry"),
    (1, 2, True, "lost", "raise"),
    (3, 1, True, None, "raise"),  # what the function raised happens again
    (2, 2, False, None, "done"),
])
def test_the_retry_policy_alone_decides(max_retries, attempt, failed, retryable, decision):
    verdict = None
    if failed:
        failure = (_fact(0, None, "gone", vanished=True) if retryable else
                   _fact(0, 1, "exited"))
        verdict = _classify(failure, [] if retryable else [_raised(0)])
    assert RetryPolicy(max_retries).decide(failed, verdict,
                                           spent=Spent(retries=attempt - 1)) == decision


def test_a_stall_or_any_failure_without_a_verdict_is_raised():
    assert RetryPolicy(5).decide(True, None) == "raise"


def test_preemptions_and_losses_have_their_own_budgets():
    """A notice's preempted exit uses max_preemptions, a lost rank max_retries; a grow the
    driver asked for uses neither. Elastic runs get 3 retries unless they say otherwise."""
    preempted = _judged(GroupStatus((_fact(1, 75, "x"),), running=False)).verdict
    lost = _classify(_fact(0, None, "gone", vanished=True), [])
    assert preempted.preempted and preempted.retryable and not lost.preempted
    policy = RetryPolicy(max_retries=1, max_preemptions=2)
    spent, decisions = Spent(), []
    for verdict in (preempted, preempted, preempted, lost, lost):
        decisions.append(policy.decide(True, verdict, spent=spent))
        if decisions[-1] == "retry":
            spent = spent.charged(verdict)
    assert decisions == ["retry", "retry", "raise", "retry", "raise"]
    assert spent == Spent(retries=1, preemptions=2)
    assert policy.budget(lost, spent) == "retry 1 of max_retries=1"
    assert policy.budget(preempted, spent) == "preemption 2 of max_preemptions=2"
    assert RetryPolicy(0, 0).decide(True, preempted, planned=True) == "retry"
    assert RetryPolicy.of(None, None, elastic=True).max_retries == 3
    assert RetryPolicy.of(None, None, elastic=False).max_retries == 0
    assert RetryPolicy.of(0, 4, elastic=True) == RetryPolicy(0, 4)


def test_a_stage_spark_aborted_for_a_lost_worker_names_the_rank_on_it():
    """Spark may abort the barrier stage ("ExecutorLostFailure ... worker lost: <ip>:<port>")
    before the heartbeat timeout: the loss is named as the silent heartbeat would have."""
    import threading
    from types import SimpleNamespace

    from sparkhvd.common.protocol import TaskInfo
    from sparkhvd.driver.launchers.control import ControlServer

    tasks = {p: SimpleNamespace(rank=p, info=TaskInfo(p, f"h{p + 1}", f"10.0.0.{p + 1}"))
             for p in range(3)}
    server = SimpleNamespace(cond=threading.Condition(), tasks=tasks)
    said = ("Job aborted due to stage failure: Could not recover from a failed barrier "
            "ResultStage.\nExecutorLostFailure (executor 5 exited unrelated to the running "
            "tasks) Reason: worker lost: 10.0.0.3:37911 got disassociated\n\tat org.apache...")
    failure = ControlServer.lost_in(server, said)
    assert failure is not None and (failure.rank, failure.host) == (2, "h3")
    assert failure.kind == "silent" and failure.executor == "10.0.0.3"
    assert "worker lost: 10.0.0.3:37911" in failure.detail
    assert ControlServer.lost_in(server, "ExecutorLostFailure ... worker lost: 10.0.0.33:1") \
        is None, "another address is nobody's"
    assert ControlServer.lost_in(server, "Python worker raised ValueError") is None


# -- judge: every fact kind, as one poll of a launcher says it ---------------------------------
NOW = 100.0


def _judged(status, raised=None, reported=(), now=NOW, error_since=None, **kwargs):
    return judge(status, raised or {}, list(reported), {1: "h1"}, lambda r: f"tail {r}",
                 now=now, error_since=error_since, **kwargs)


def test_nothing_failed_is_running_and_every_rank_returned_is_done():
    ok = RankFact(0, "exited", 1.0, exit_code=0)
    assert _judged(GroupStatus((ok,))).kind == "running"
    assert _judged(GroupStatus((ok,), running=False, done=True, results=(1,))).kind == "done"


@pytest.mark.parametrize("kind, code, retryable", [
    ("exited", 1, None), ("exited", -9, "killed by signal 9"), ("vanished", None, "vanished"),
    ("silent", None, "stopped answering")])
def test_each_failed_fact_ends_the_attempt_with_its_verdict(kind, code, retryable):
    fact = RankFact(1, kind, 99.0, exit_code=code, host="h1", detail="seen")
    judged = _judged(GroupStatus((fact,)))
    assert judged.kind == "failed" and judged.verdict.first.rank == 1
    assert (judged.verdict.retryable is None) == (retryable is None)
    if retryable:
        assert retryable in judged.verdict.retryable


def test_a_rank_gone_from_outside_is_the_cause_even_when_a_peer_failed_first():
    peer = RankFact(0, "exited", 90.0, exit_code=1)
    gone = RankFact(1, "silent", 95.0, host="h1")
    verdict = _judged(GroupStatus((peer, gone)),
                      reported=[_raised(0, "RuntimeError", "Horovod has been shut down")]).verdict
    assert verdict.first.rank == 1 and "stopped answering" in verdict.retryable


def test_a_consequence_alone_waits_for_its_cause_then_is_named():
    """A rank whose error only says a peer went away: its cause gets Graces.cause_s."""
    peer = RankFact(0, "exited", 99.0, exit_code=1)
    said = [_raised(0, "RuntimeError", "Connection closed by peer")]
    assert _judged(GroupStatus((peer,)), reported=said).kind == "waiting"
    late = _judged(GroupStatus((peer,)), reported=said, now=99.0 + Graces().cause_s + 0.1)
    assert late.kind == "failed" and late.verdict.first.rank == 0
    assert _judged(GroupStatus((peer,), running=False), reported=said).kind == "failed"


def test_notices_wait_for_the_others_then_the_attempt_is_preempted():
    noticed = RankFact(1, "exited", 99.0, exit_code=75, host="h1")
    assert _judged(GroupStatus((noticed,))).kind == "waiting"
    for judged in (_judged(GroupStatus((noticed,), running=False)),
                   _judged(GroupStatus((noticed,)), now=99.0 + Graces().notice_s + 1),
                   _judged(GroupStatus((noticed,)), stopping=True)):
        assert judged.kind == "failed" and judged.verdict.preempted
        assert judged.verdict.first.message == "rank 1 on host h1 stopped on a notice after " \
            "its checkpoint"
    failed = RankFact(0, "exited", 99.5, exit_code=1)
    assert not _judged(GroupStatus((noticed, failed))).verdict.preempted


def test_a_rank_that_raised_and_never_exited_ends_the_attempt_after_its_grace():
    raised = {1: 99.0}
    said = [_raised(1)]
    assert _judged(GroupStatus(), raised, said).kind == "running"
    late = _judged(GroupStatus(), raised, said, now=99.0 + Graces().raised_s + 0.1)
    assert late.kind == "failed" and late.verdict.first.exc_type == "ValueError"
    assert late.verdict.retryable is None
    assert _judged(GroupStatus(), raised, said, now=200.0, recovers=True).kind == "running"
    exited = RankFact(1, "exited", 99.5, exit_code=0)
    assert _judged(GroupStatus((exited,)), raised, said, now=200.0).kind == "running"


def test_an_error_that_is_no_ranks_waits_for_a_rank_to_explain_it():
    error = RuntimeError("Job aborted due to stage failure")
    status = GroupStatus(running=False, error=error, explained_within_s=17.0)
    assert _judged(status, error_since=NOW - 1).kind == "waiting"
    assert _judged(status, error_since=NOW - 18).error is error
    assert _judged(status, error_since=NOW - 1, stopping=True).kind == "error"
    explained = GroupStatus((RankFact(1, "silent", 99.0),), running=False, error=error)
    assert _judged(explained, error_since=NOW).verdict.first.rank == 1


def test_a_rank_that_crashed_by_itself_is_the_cause_of_its_peers_lost_connections():
    """A SIGSEGV is a word of its own: named at once (not retried), its peer's "connection
    closed" a consequence."""
    crashed = RankFact(1, "exited", 99.0, exit_code=-11, host="h1")
    peer = RankFact(0, "exited", 98.0, exit_code=1)
    judged = _judged(GroupStatus((peer, crashed)),
                     reported=[_raised(0, "RuntimeError", "Connection closed by peer")])
    assert judged.kind == "failed" and judged.verdict.first.rank == 1
    assert "killed by signal 11" in judged.verdict.first.message
    assert judged.verdict.retryable is None and judged.fact is crashed


def test_a_ranks_own_error_beats_a_sibling_stopped_after_it():
    """Two ranks a task: rank 0 raised, its sibling was stopped (SIGTERM) after it -- the
    error is named, not the stop, and nothing is retried."""
    raised = RankFact(0, "exited", 98.0, exit_code=1)
    stopped = RankFact(1, "exited", 99.0, exit_code=-15)
    verdict = _judged(GroupStatus((raised, stopped)), reported=[_raised(0)]).verdict
    assert verdict.first.rank == 0 and verdict.first.exc_type == "ValueError"
    assert verdict.retryable is None


def test_a_host_lost_is_named_over_the_tasks_spark_killed_for_it():
    """Spark aborts the stage for a lost executor: its other tasks vanish first, the lost one
    (what Spark said) is the cause."""
    killed = RankFact(0, "vanished", 90.0)
    lost = RankFact(2, "silent", 95.0, host="h3")
    assert _judged(GroupStatus((killed, lost)), {}).verdict.first.rank == 2


def test_a_consequence_waits_a_heartbeat_timeout_for_a_silent_host_on_spark():
    peer = RankFact(0, "exited", 99.0, exit_code=1)
    said = [_raised(0, "HorovodInternalError", "Horovod has been shut down")]
    status = GroupStatus((peer,), silent_after_s=17.0)
    assert _judged(status, reported=said, now=99.0 + 10).kind == "waiting"
    assert _judged(status, reported=said, now=99.0 + 18).verdict.first.rank == 0


def test_a_crash_under_a_broken_collective_yields_to_a_peers_own_error():
    """Rank 0 raised (not exited yet); rank 1 aborted (SIGABRT) as its collective broke: the
    error of rank 0's own is named, not retried."""
    aborted = RankFact(1, "exited", 99.0, exit_code=-6)
    verdict = _judged(GroupStatus((aborted,)), raised={0: 98.5},
                      reported=[_raised(0, at=98.5)]).verdict
    assert verdict.first.rank == 0 and verdict.first.exc_type == "ValueError"
    assert verdict.retryable is None


def test_a_sibling_stopped_before_the_rank_that_raised_is_still_not_the_cause():
    """Rows mode, two ranks a task: the replay may put the sibling's SIGTERM first."""
    stopped = RankFact(0, "exited", 98.0, exit_code=-15)
    raised = RankFact(1, "exited", 99.0, exit_code=1)
    verdict = _judged(GroupStatus((stopped, raised)), reported=[_raised(1)]).verdict
    assert verdict.first.rank == 1 and verdict.retryable is None


def test_a_verdict_lists_what_the_others_said_while_they_were_stopped_keeping_its_first():
    verdict = _judged(GroupStatus((RankFact(0, "exited", 99.0, exit_code=3),))).verdict
    later = _raised(1, "BrokenPipeError", "Broken pipe", at=100.0)
    listed = verdict.listing([later])
    assert listed.first is verdict.first and listed.failures[-1] is later


def test_a_rank_that_exited_with_a_status_of_its_own_is_named_at_once():
    """Exited 3 without raising, its peers saying their connection closed: its status is its
    own word -- nothing to wait for."""
    exited = RankFact(0, "exited", 99.0, exit_code=3)
    said = [_raised(1, "RuntimeError", "Connection closed by peer", at=99.1)]
    judged = _judged(GroupStatus((exited,), silent_after_s=17.0), reported=said)
    assert judged.kind == "failed" and judged.verdict.first.rank == 0
    assert "exited with status 3 without raising" in judged.verdict.first.message
