"""The upload queue of checkpoints kept on this host (sparkhvd.checkpoint.background)."""
from __future__ import annotations

import threading

from sparkhvd.checkpoint.background import UploadQueue


def test_uploads_run_oldest_first_a_superseded_step_is_dropped_and_no_thread_stays():
    """Uploads run one at a time, oldest first; a step checkpoint queued behind a running
    upload and superseded before its turn is dropped; once the queue is empty its thread
    ends (a finished rank keeps none), and the next upload starts another."""
    queue, ran, dropped = UploadQueue(), [], []
    first_began, first_may_end = threading.Event(), threading.Event()

    def upload(name, hold=None):
        def run():
            if hold is not None:
                first_began.set()
                assert hold.wait(10)
            ran.append(name)
        return run

    queue.put("epoch-0001-step-0000001", upload("s1", first_may_end), lambda: None, True)
    assert first_began.wait(10)
    queue.put("epoch-0001-step-0000002", upload("s2"), lambda: dropped.append("s2"), True)
    queue.put("epoch-0001-step-0000003", upload("s3"), lambda: dropped.append("s3"), True)
    thread = queue._thread
    first_may_end.set()
    queue.wait()
    assert ran == ["s1", "s3"] and dropped == ["s2"] and queue.dropped == 1
    thread.join(5)
    assert not thread.is_alive(), "no upload thread once the queue is empty"
    queue.put("epoch-0002", upload("e2"), lambda: None, False)
    queue.wait()
    assert ran == ["s1", "s3", "e2"]
