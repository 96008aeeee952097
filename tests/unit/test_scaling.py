"""How many ranks an elastic run's next attempt gets (sparkhvd.elastic.scaling), alone."""
import re

import pytest

from sparkhvd.common.errors import NotEnoughSlotsError
from sparkhvd.driver.settings import ScalingConfig
from sparkhvd.elastic.scaling import SizeDecision, not_enough_slots, scaling_policy


def _policy(config: ScalingConfig):
    """The policy a runner with these settings decides (as ``driver.spec.run_spec`` does)."""
    return scaling_policy(config.size, config.elastic, config.resize_check_s)


def test_a_relaunch_takes_the_free_slots_up_to_max_np():
    policy = _policy(ScalingConfig(np=3, min_np=2, max_np=4, resize_check_s=5))
    assert policy.elastic and (policy.min_np, policy.max_np, policy.resize_check_s) == (2, 4, 5)
    assert policy.size_now(2, 0, 0) == SizeDecision("place", 2)
    assert policy.size_now(9, 0, 0) == SizeDecision("place", 4)


def test_below_min_np_it_waits_for_slots_then_says_it_is_short():
    """The policy only decides: the run sleeps between looks and raises the error it names."""
    policy = _policy(ScalingConfig(np=3, min_np=2))
    assert policy.size_now(1, 0.0, 5) == SizeDecision("wait")
    assert policy.size_now(1, 4.9, 5) == SizeDecision("wait")
    assert policy.size_now(3, 4.9, 5) == SizeDecision("place", 3)  # slots came back in time
    assert policy.size_now(1, 5.0, 5) == SizeDecision("short")
    error = not_enough_slots(2, 1, 0, "executor 7 on h3 lost")
    assert isinstance(error, NotEnoughSlotsError)
    assert re.search(r"min_np=2 .* but 1 are free after waiting 0 s \(executor 7 on h3 lost\)",
                     str(error))


def test_it_grows_only_below_max_np_and_only_into_free_slots():
    policy = _policy(ScalingConfig(np=4, min_np=2, max_np=4))
    assert policy.grow_to(2, 0) is None and policy.grow_to(4, 3) is None
    assert policy.grow_to(2, 1) == 3 and policy.grow_to(2, 5) == 4
    assert not _policy(ScalingConfig(np=-2)).elastic


def test_resize_check_s_is_a_positive_time():
    with pytest.raises(ValueError, match="resize_check_s must be a positive number"):
        ScalingConfig(np=2, resize_check_s=0)


def test_a_grow_waits_a_moment_for_its_slots_then_takes_what_is_free():
    policy = _policy(ScalingConfig(np=3, min_np=2))
    assert policy.size_now(2, 0, 0, want=3, settle_s=5) == SizeDecision("wait")
    assert policy.size_now(3, 1, 0, want=3, settle_s=5) == SizeDecision("place", 3)
    assert policy.size_now(2, 5, 0, want=3, settle_s=5) == SizeDecision("place", 2)


def test_a_grow_is_asked_for_only_when_a_second_look_agrees(monkeypatch):
    """While executors come and go Spark may list a lost one beside its replacement: one look
    that finds room is checked by another; the watch says what it saw, the policy decides."""
    from types import SimpleNamespace

    from sparkhvd.elastic import watch

    looks = iter([1, 0, 1, 2])
    now = [0.0]
    view = SimpleNamespace(connect=False, master="spark://x:7077")
    w = watch.AttemptWatch(view, "job", slots=True, resize_check_s=30.0,
                           free=lambda: next(looks), clock=lambda: now[0])
    monkeypatch.setattr(watch.AttemptWatch, "_decommissioning", lambda self: {})
    seen = []
    for t in (30.0, 31.0, 61.0, 62.0):  # room, gone; room, room again -> seen
        now[0] = t
        seen.append(w.look())
    assert seen[:3] == [None] * 3 and seen[3] == watch.Sighting(free=1)
    policy = _policy(ScalingConfig(np=4, min_np=2))
    request = policy.stop_for(2, seen[3])
    assert request is not None and request.grow_to == 3
    assert "1 Spark task slot(s) free: growing from 2 to 3" in request.reason
    assert policy.stop_for(4, seen[3]) is None, "at max_np: nothing to grow into"
    going = policy.stop_for(2, watch.Sighting(decommissioning={"7": "h2"}))
    assert going is not None and going.kind == "decommission"
    assert going.reason == "executor 7 on h2 is being decommissioned"
