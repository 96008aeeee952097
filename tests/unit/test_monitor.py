"""The one sentence a hang report starts with (sparkhvd.driver.monitor.summarise): who waits in a
collective, who is elsewhere and where, who did not answer."""
from __future__ import annotations

from sparkhvd.common import protocol
from sparkhvd.driver.monitor import parse, summarise

_LIB = "/usr/lib/python3.11/site-packages/horovod/tensorflow/mpi_ops.py"


def _dump(rank, *frames):
    """A faulthandler dump of a rank whose main thread has ``frames`` (innermost first)."""
    lines = ['Current thread 0x00007f82ae84ab80 "MainThread" (most recent call first):']
    lines += [f'  File "{file}", line {line} in {func}' for file, line, func in frames]
    return parse(protocol.Stacks(rank=rank, pid=100 + rank, host="h", text="\n".join(lines)))


def test_ranks_in_one_loop_on_different_lines_are_one_place():
    found = {0: _dump(0, ("/home/u/train.py", 92, "wait_for_data"), ("/home/u/train.py", 7, "main")),
             1: _dump(1, ("/home/u/train.py", 93, "wait_for_data"), ("/home/u/train.py", 7, "main"))}
    assert summarise(found, []) == "ranks 0, 1 are in train.py:92/93 wait_for_data()"


def test_the_rank_elsewhere_is_named_before_those_in_a_collective():
    found = {0: _dump(0, (_LIB, 50, "_allreduce"), ("/home/u/train.py", 30, "step")),
             1: _dump(1, ("/home/u/train.py", 42, "load_batch"), ("/home/u/train.py", 30, "step")),
             2: _dump(2, (_LIB, 50, "_allreduce"), ("/home/u/train.py", 30, "step"))}
    assert summarise(found, [3]) == (
        "rank 1 is in train.py:42 load_batch(); ranks 0, 2 wait in _allreduce; rank 3 did not "
        "answer (lost, or stuck holding Python's lock; install py-spy on the hosts to read them "
        "from outside)")


def test_same_function_name_in_two_files_is_two_places():
    found = {0: _dump(0, ("/home/u/a.py", 1, "step")), 1: _dump(1, ("/home/u/b.py", 1, "step"))}
    assert summarise(found, []) == "rank 0 is in a.py:1 step(); rank 1 is in b.py:1 step()"


def test_a_rank_without_python_frames_and_no_answer_at_all():
    assert summarise({0: _dump(0)}, []) == "rank 0 is in an unknown place (no Python frames)"
    assert summarise({}, []) == "no rank answered"
