"""The wait inside DDP's backward(), measured at the communication layer
(sparkhvd.timing.collectives): a timing comm hook on every DDP model, moved from computing to
waiting in collectives by the sampler. One process here (a world of 1 over a file store, no
server): the hook's bookkeeping and its installation on real DDP; the straggler tests with two
ranks are in tests/integration/test_time_split.py."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from sparkhvd.timing import collectives  # noqa: E402
from sparkhvd.timing.collectives import DDP, StepWaits, WaitClock  # noqa: E402


class Bucket:
    def __init__(self, last: bool) -> None:
        self._last = last

    def is_last(self) -> bool:
        return self._last

    def buffer(self):
        return torch.zeros(2)


def test_a_step_waits_from_its_last_launch_to_its_last_completion():
    """Buckets launched at 1.0 and 2.0 (the last: backward's computing ends), completed at 2.5
    and 5.0: the rank waited 3.0 s for its peers."""
    clock, now = WaitClock(), iter([1.0, 2.0, 2.5, 5.0])
    pending = []

    def inner(state, bucket):
        future = torch.futures.Future()
        pending.append(future)
        return future

    timer = StepWaits(inner, clock=clock, now=lambda: next(now))
    first = timer.hook(None, Bucket(False))
    last = timer.hook(None, Bucket(True))
    pending[0].set_result(torch.ones(2))
    pending[1].set_result(torch.ones(2))
    assert first.wait().tolist() == [1.0, 1.0] and last.wait().tolist() == [1.0, 1.0]
    assert clock.take() == (3.0, 1, {DDP})
    assert clock.take() == (0.0, 0, set()), "taken once"


class FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False) -> None:
        self.done = False
        FakeEvent.log.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        return 250.0


class FakeCuda:
    Event = FakeEvent


def test_on_a_gpu_the_wait_is_read_from_events_once_they_happened():
    """CUDA: two events per step (the last launch, the completion on the all-reduce's
    stream), read at a later step once the device passed them -- never waited for."""
    clock = WaitClock()
    FakeEvent.log = []

    class CudaBucket(Bucket):
        def buffer(self):
            return type("Buffer", (), {"is_cuda": True})()

    def inner(state, bucket):
        future = torch.futures.Future()
        future.set_result(torch.ones(1))
        return future

    timer = StepWaits(inner, clock=clock, cuda=FakeCuda)
    timer.hook(None, CudaBucket(True)).wait()
    assert clock.take() == (0.0, 0, set()), "nothing read before the device got there"
    for event in FakeEvent.log:
        event.done = True
    timer.hook(None, CudaBucket(True)).wait()  # the next step reads the last one
    assert clock.take() == (0.25, 1, {DDP})


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp_steps(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        opt.step()


def test_every_ddp_model_is_timed_unless_it_has_its_own_hook(one_rank_group, monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as DDPModel

    clock = WaitClock()
    monkeypatch.setattr(collectives, "CLOCK", clock)
    collectives.install_ddp_timing()
    timed = DDPModel(torch.nn.Linear(8, 2))
    began = time.perf_counter()
    _ddp_steps(timed)
    took = time.perf_counter() - began
    seconds, steps, how = clock.take()
    # the wait is a part of the steps' time (one rank: nobody to wait for, but it is timed)
    assert steps == 3 and how == {DDP} and 0 <= seconds <= took, (seconds, took)
    assert timed._sparkhvd_timer is not None

    calls = []

    def own(state, bucket):
        calls.append(state)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    theirs = DDPModel(torch.nn.Linear(8, 2))
    theirs.register_comm_hook("mine", own)  # before training: theirs alone, said once
    _ddp_steps(theirs)
    assert calls == ["mine"] * 3 and clock.take()[1] == 0
    assert any("own comm hook" in reason for reason in clock.unmeasured)

    later = DDPModel(torch.nn.Linear(8, 2))
    _ddp_steps(later, 1)
    later.register_comm_hook("late", own)  # after training began: theirs, timed
    _ddp_steps(later, 2)
    assert calls[-2:] == ["late", "late"] and clock.take()[1] == 3
