"""horovod's Spark launcher, taken over for one run (``launcher="horovod"``).

What each hook replaces is listed in :data:`sparkhvd.common.patches.PATCHED` (checked against the
installed horovod by tests/unit/test_patches.py); :func:`~sparkhvd.common.patches.
check_horovod_version` refuses a horovod these were not written for.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

from sparkhvd.common.patches import check_horovod_version

__side__ = "driver"

log = logging.getLogger(__name__)


class OutputStreams:
    """The ranks' output streams horovod is still copying to the driver.

    horovod's ``rsh`` starts a thread per rank and stream and never joins it: its run returns
    once the ranks' exit codes are known, while the last of their output may still be on its
    way (a 20 MB line, a traceback, under load). The run's end waits here until every stream
    ended -- or went quiet (a stream from a host that is gone never ends by itself).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._open = 0
        self._last_data = time.monotonic()

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        with self._changed:
            self._open += 1
            self._last_data = time.monotonic()
        try:
            yield
        finally:
            with self._changed:
                self._open -= 1
                self._changed.notify_all()

    def received(self) -> None:
        self._last_data = time.monotonic()

    def wait_until_done(self, quiet_s: float = 2.0) -> bool:
        """Until no stream is open (True), or none brought data for ``quiet_s`` since this
        wait began (False): a rank quiet before its exit may still have its last lines on the
        way."""
        began = time.monotonic()
        with self._changed:
            while self._open:
                if time.monotonic() - max(self._last_data, began) > quiet_s:
                    log.debug("%d output stream(s) of horovod still open and quiet", self._open)
                    return False
                self._changed.wait(0.1)
        return True


def _send_one_live(self: Any, streams: OutputStreams, addr: Any, req: Any,
                   stream: Any = None) -> Any:
    """horovod's ``BasicClient._send_one``, but streamed output is passed on as it arrives, and
    each stream is known to ``streams`` while it lasts.

    horovod copies a rank's output with ``shutil.copyfileobj``, whose 64 KiB blocking reads hold
    every line back until 64 KiB piled up or the rank exited. ``read1`` returns what is there.
    """
    import codecs
    import socket

    from horovod.runner.common.util.network import AckStreamResponse

    with streams.streaming() if stream else contextlib.nullcontext():
        for attempt in range(self._attempts):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.connect(addr)
                rfile = sock.makefile("rb")
                wfile = sock.makefile("wb")
                try:
                    self._wire.write(req, wfile)
                    resp = self._wire.read(rfile)
                    if stream and isinstance(resp, AckStreamResponse):
                        decoder = codecs.getincrementaldecoder("utf-8")("replace")
                        while True:
                            chunk = rfile.read1(65536)
                            streams.received()
                            text = decoder.decode(chunk, final=not chunk)
                            if text:
                                stream.write(text)
                            if not chunk:
                                break
                    return resp
                finally:
                    rfile.close()
                    wfile.close()
            except Exception:  # noqa: BLE001 - same retry policy as horovod's
                if attempt == self._attempts - 1:
                    raise
            finally:
                sock.close()


@contextlib.contextmanager
def horovod_driver_hooks(stop: threading.Event, *, elastic: bool, mapper: Callable[..., Any],
                         driver_host: Optional[str] = None) -> Iterator[dict]:
    """Take over what horovod's Spark launcher does by itself, for one run.

    - ``launch_gloo`` gets *our* ``stop`` event instead of installing signal handlers; setting it
      makes horovod abort every rank's command through the task services.
    - The Spark job group name is recorded (``hooks["job_group"]``) to cancel exactly it.
    - Rank output is streamed to the driver as it is printed (:func:`_send_one_live`), and
      ``hooks["streams"]`` (:class:`OutputStreams`) says when the last of it arrived.
    - Spark runs ``mapper`` (``sparkhvd.executor.horovod_spark.spark_task_mapper``) as the task
      function.
    - When a rank exits non-zero the others are stopped at once -- except in ``elastic`` mode,
      where horovod's elastic driver decides whether the remaining ranks carry on.
    - ``driver_host``: the Gloo rendezvous is served at that address. horovod picks the address
      of the first interface *name* the driver and the tasks have in common -- on separate
      machines ``eth0`` is a different network on each, and the ranks cannot reach it.
    """
    check_horovod_version()
    hooks: dict = {"job_group": None, "streams": OutputStreams()}
    replaced = _replacements(stop, hooks, elastic=elastic, mapper=mapper,
                             driver_host=driver_host)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    for owner, name, new in replaced:
        setattr(owner, name, new(getattr(owner, name)))
    try:
        yield hooks
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _replacements(stop: threading.Event, hooks: dict, *, elastic: bool,
                  mapper: Callable[..., Any], driver_host: Optional[str]) -> list:
    """``(owner, attribute, original -> replacement)`` for each of horovod's functions."""
    from horovod.runner import gloo_run
    from horovod.runner.common.util import network
    from horovod.runner.util import network as runner_network
    from horovod.spark import gloo_run as spark_gloo_run
    from horovod.spark import runner as spark_runner
    from horovod.spark.driver import job_id

    def launch_gloo(original: Any) -> Any:
        def launch(command: Any, exec_command: Any, settings: Any, nics: Any, env: Any,
                   server_ip: str) -> Any:
            return original(command, exec_command, settings, nics, env, driver_host or server_ip)
        return launch

    def next_job_id(original: Any) -> Any:
        def next_id() -> int:
            value = original()
            hooks["job_group"] = f"horovod.spark.run.{value}"
            return value
        return next_id

    def exec_command_fn(original: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            run_one = original(*args, **kwargs)

            def run_and_watch(command: Any, slot_info: Any, events: Any) -> Any:
                exit_code, when = run_one(command, slot_info, events)
                if exit_code != 0 and not elastic:
                    stop.set()  # one rank failed: stop the others now, not when they finish
                return exit_code, when
            return run_and_watch
        return make

    def make_mapper(_original: Any) -> Any:
        def make(driver_addresses: Any, settings: Any, use_gloo: bool, is_elastic: bool) -> Any:
            return functools.partial(mapper, driver_addresses, settings.key, settings, use_gloo,
                                     is_elastic)
        return make

    return [
        (gloo_run, "register_shutdown_event", lambda _original: lambda: stop),
        (job_id, "next_job_id", next_job_id),
        (spark_gloo_run, "_exec_command_fn", exec_command_fn),
        (spark_runner, "_make_mapper", make_mapper),
        (network.BasicClient, "_send_one",
         lambda _original: functools.partialmethod(_send_one_live, hooks["streams"])),
        (spark_gloo_run, "launch_gloo", launch_gloo),
        (runner_network, "get_driver_ip",
         lambda original: lambda nics: driver_host or original(nics)),
    ]
