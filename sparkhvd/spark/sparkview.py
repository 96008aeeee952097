"""One view of a SparkSession, classic or Spark Connect: everything sparkhvd asks of Spark.

A classic session has a SparkContext (the JVM behind py4j, in this process). A Spark Connect
session -- Databricks standard-access and serverless compute, Dataproc serverless, Spark 4's
``spark.api.mode=connect``, ``SparkSession.builder.remote(...)`` -- has none: no
``sparkContext``, RDDs, broadcast, job groups or JVM gateway, and this process is a *client*,
not Spark's driver. What sparkhvd needs works on both, and this module is the one place that
knows the difference:

- the master, the application id and settings, read through ``spark.conf``;
- DataFrame barrier stages (``spark.range(n).mapInArrow(fn, schema, barrier=True)``, Spark
  >= 3.5), the one launch path of :mod:`sparkhvd.driver.launchers.barrier` -- as Spark's own
  ``TorchDistributor`` does;
- cancellation by job tags (``addTag``/``interruptTag``: Connect, and classic from Spark 4.0),
  else job groups (classic Spark 3.5);
- whether the session was stopped;
- task slots: a live SparkContext's executors, or -- without one -- the session's settings or
  what the user declared (``spark.sparkhvd.slots``);
- where the executors reach this process (the driver's address, or the client's).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from typing import Any, Callable, Optional

from sparkhvd.common.errors import SessionError
from sparkhvd.common.netif import is_loopback, route_address

__side__ = "driver"

log = logging.getLogger(__name__)

#: A setting that declares the task slots where sparkhvd cannot count them (Spark Connect).


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def is_loopback_master(master: str) -> bool:
    """Whether every executor of this master runs on this machine (local or 127.0.0.1)."""
    from urllib.parse import urlparse

    if master.startswith("local"):
        return True
    host = urlparse(master).hostname or ""
    return is_loopback(host)


#: How often a failed question to the JVM is asked again before the session counts as stopped.
STOPPED_ASKS = 3
#: How long to wait between those questions (seconds).
STOPPED_ASK_GAP_S = 0.2


def session_stopped(sc: Any, *, asks: int = STOPPED_ASKS) -> bool:
    """Whether a SparkContext was stopped, or is stopping (Java marks that first, before it
    kills the tasks; Python clears ``_jsc`` last).

    A py4j error alone does not mean stopped: a gateway busy with another thread's call can
    fail one question (a run was once failed as "stopped" 0.7 s in). The question is asked
    again, ``asks`` times in all; only a context Python cleared, or a JVM that keeps failing,
    counts as stopped.
    """
    for ask in range(asks):
        jsc = getattr(sc, "_jsc", None) if sc is not None else None
        if jsc is None:
            return True
        try:
            return bool(jsc.sc().isStopped())
        except Exception as exc:  # noqa: BLE001 - py4j errors: going away, or one busy call
            log.debug("asking whether the SparkContext is stopped failed (%d of %d): %s",
                      ask + 1, asks, exc)
            if ask + 1 < asks:
                time.sleep(STOPPED_ASK_GAP_S)
    return True


def stopped_session_error(during: bool) -> SessionError:
    when = "while the ranks ran" if during else "before the run"
    return SessionError(
        f"The SparkSession was stopped {when}. Fix: create a new one "
        "(SparkSession.builder.getOrCreate()) and pass it as spark=, or pass spark=None to let "
        "HorovodRunner use the active session or start a local one.")


def lost_server_error(endpoint: str, why: str) -> SessionError:
    return SessionError(
        f"The Spark Connect server at {endpoint} was lost while the ranks ran ({why}): the run "
        "was stopped, and its ranks with it. Fix: reconnect when the server is back "
        "(SparkSession.builder.remote(...).getOrCreate()) and run again -- with resume_from=True "
        "to continue from the run's last checkpoint.")


#: How long a cleanup call to a session that may be gone (cancel a job) may take.
CLEANUP_S = 5.0
#: A cancelled job whose launch has not returned is cancelled again this often (a cancel that
#: came before Spark had the job cancels nothing) ...
RECANCEL_S = 0.5
#: ... for at most this long.
RECANCEL_FOR_S = 120.0
#: How long a check that a Spark Connect server still answers may take.
PROBE_S = 2.0


class SparkView:
    """What sparkhvd reads from and does with one session (see the module docstring)."""

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self.connect = is_connect(spark)

    @property
    def sc(self) -> Any:
        """The SparkContext (classic only)."""
        if self.connect:
            raise AttributeError("a Spark Connect session has no SparkContext")
        return self.spark.sparkContext

    @property
    def kind(self) -> str:
        return "connect" if self.connect else "classic"

    def conf(self, key: str, default: Optional[str] = None) -> Optional[str]:
        """A Spark setting of the session (``default`` when unset or unreadable)."""
        try:
            if self.connect:
                return self.spark.conf.get(key, default)
            return self.sc.getConf().get(key, default)
        except Exception:  # noqa: BLE001 - a setting the server will not show
            return default

    @functools.cached_property
    def master(self) -> str:
        return (self.conf("spark.master") or "") if self.connect else self.sc.master

    @functools.cached_property
    def app_id(self) -> Optional[str]:
        return self.conf("spark.app.id") if self.connect else self.sc.applicationId

    @functools.cached_property
    def version(self) -> str:
        return str(self.spark.version)

    @property
    def has_tags(self) -> bool:
        """Job tags: the session's on Spark Connect, the SparkContext's on classic (3.5+).

        Classic sessions' own ``spark.addTag``/``interruptTag`` (Spark 4) keep tags per thread:
        ``interruptTag`` from another thread -- the one that gives up on a launch -- finds no
        job and cancels nothing. ``SparkContext.addJobTag``/``cancelJobsWithTag`` work from
        any thread."""
        return self.connect or hasattr(self.sc, "addJobTag")

    @property
    def job_kind(self) -> str:
        """How this session's runs mark their jobs: ``tag`` or ``group``."""
        return "tag" if self.has_tags else "group"

    def stopped(self) -> bool:
        if self.connect:
            return bool(getattr(self.spark, "is_stopped", False))
        return session_stopped(self.sc)

    def endpoint(self) -> Optional[tuple[str, int]]:
        """``(host, port)`` of the Spark Connect server (``None`` on classic sessions)."""
        if not self.connect:
            return None
        builder = getattr(getattr(self.spark, "client", None), "_builder", None)
        host, _, port = str(getattr(builder, "endpoint", "") or "").rpartition(":")
        return (host.strip("[]"), int(port)) if host and port.isdigit() else None

    def lost(self) -> Optional[SessionError]:
        """A :class:`SessionError` when the session is gone -- a Spark Connect server that no
        longer accepts connections, a stopped SparkContext -- else None. Bounded: a TCP connect
        of at most :data:`PROBE_S`, never a Spark call (pyspark's Connect client retries a dead
        server for minutes)."""
        if not self.connect:
            return stopped_session_error(during=True) if self.stopped() else None
        endpoint = self.endpoint()
        if endpoint is None:
            return None
        try:
            socket.create_connection(endpoint, timeout=PROBE_S).close()
        except OSError as exc:
            return lost_server_error(f"sc://{endpoint[0]}:{endpoint[1]}",
                                     exc.strerror or type(exc).__name__)
        return None

    def abandon(self) -> None:
        """Give up a Spark Connect session whose server is gone: close its client locally,
        without the goodbye calls (release the session, clean its ML cache) that pyspark would
        otherwise retry against the dead server for minutes -- at interpreter exit too. The
        session is unusable either way; the error says to reconnect."""
        client = getattr(self.spark, "client", None) if self.connect else None
        if client is None:
            return
        with contextlib.suppress(Exception):
            client._closed = True  # pyspark's own flag: calls fail at once, exit skips cleanup
        channel = getattr(client, "_channel", None)
        if channel is not None:
            threading.Thread(target=lambda: channel.close(), daemon=True,
                             name="sparkhvd-close-channel").start()

    def describe(self) -> str:
        """For the console: ``local[2]`` or ``spark://h:7077 via Spark Connect (sc://h:15002)``."""
        if not self.connect:
            return self.master
        client = getattr(self.spark, "client", None)
        where = getattr(getattr(client, "_builder", None), "endpoint", None) or \
            getattr(client, "host", "?")
        return f"{self.master or '?'} via Spark Connect (sc://{where})"

    @functools.cached_property
    def server_host(self) -> Optional[str]:
        """The Spark Connect server's host (``None`` on classic sessions)."""
        if not self.connect:
            return None
        return getattr(getattr(self.spark, "client", None), "host", None) or "127.0.0.1"

    def executors_here(self) -> bool:
        """Whether every executor runs on this machine: a local or 127.0.0.1 master -- of this
        process (classic), or of a Connect server that itself runs here."""
        local_server = self.server_host is None or is_loopback(self.server_host)
        return local_server and is_loopback_master(self.master)

    def driver_host(self) -> str:
        """The address executors reach this process at: 127.0.0.1 when every executor is on this
        machine, else Spark's ``spark.driver.host`` (classic) or, for a Spark Connect client,
        this machine's address on the route to the Connect server."""
        if self.executors_here():
            return "127.0.0.1"
        if not self.connect or is_loopback(self.server_host):
            return self.conf("spark.driver.host") or socket.gethostname()
        return route_address(self.server_host or "127.0.0.1")

    def python_exec(self) -> Optional[str]:
        """The Python Spark's workers run (when this process can know it)."""
        if self.connect:
            return self.conf("spark.pyspark.python")
        return self.sc.pythonExec or "python3"

    def job(self, name: str, description: str) -> "SparkJob":
        return SparkJob(self, name, description)

    def barrier_collect(self, np: int, mapper: Callable[[Any], Any], schema: str) -> list:
        """Run ``mapper`` (an Arrow batch iterator -> iterator) in one barrier stage of ``np``
        tasks and collect the rows it yields -- the same call on classic and Connect."""
        return self.spark.range(0, np, 1, np).mapInArrow(mapper, schema, barrier=True).collect()


class SparkJob:
    """One cancellable unit of Spark work for one run: a job tag where the session has them,
    else a job group. Started from the launch thread, cancellable from any.

    A cancel can come before Spark has the job (``collect()`` still planning on a busy driver):
    Spark would then cancel nothing and the job would wait for slots and run later. So a
    cancelled job is never started, and the cancel is repeated every :data:`RECANCEL_S` until
    the launch thread's call returns (at most :data:`RECANCEL_FOR_S`)."""

    def __init__(self, view: SparkView, name: str, description: str) -> None:
        self.view, self.name, self.description = view, name, description
        self.cancelled = threading.Event()
        self.returned = threading.Event()

    def run(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` (which starts Spark jobs) under the tag or group."""
        view, tagged = self.view, self.view.has_tags
        try:
            if self.cancelled.is_set():
                raise RuntimeError(f"Spark job {self.name} was cancelled before it started")
            if tagged and view.connect:
                view.spark.addTag(self.name)
            elif tagged:
                view.sc.addJobTag(self.name)
            else:
                view.sc.setJobGroup(self.name, self.description, interruptOnCancel=True)
            return action()
        except Exception as exc:
            if view.stopped() or "SparkContext was shut down" in str(exc) or \
                    "stopped SparkContext" in str(exc):
                raise stopped_session_error(during=True) from None
            raise
        finally:
            self.returned.set()
            if tagged:
                with contextlib.suppress(Exception):
                    if view.connect:
                        view.spark.removeTag(self.name)
                    else:
                        view.sc.removeJobTag(self.name)

    def cancel(self) -> None:
        """Cancel the run's jobs -- running or still waiting for slots; a stopped session has
        none left to cancel. Bounded by :data:`CLEANUP_S`: a Connect server that went away
        would keep the call in pyspark's retry loop for minutes, so it runs in a thread that is
        left behind."""
        view = self.view
        self.cancelled.set()
        if view.stopped():
            return

        def cancel() -> None:
            try:
                if view.connect:
                    view.spark.interruptTag(self.name)
                elif view.has_tags:
                    view.sc.cancelJobsWithTag(self.name)
                else:
                    view.sc.cancelJobGroup(self.name)
            except Exception as exc:  # noqa: BLE001 - stopped meanwhile
                log.debug("could not cancel Spark job %s: %s", self.name, exc)

        first = threading.Event()

        def cancel_until_returned() -> None:
            cancel()
            first.set()
            deadline = time.monotonic() + RECANCEL_FOR_S
            while not self.returned.wait(RECANCEL_S) and time.monotonic() < deadline \
                    and not view.stopped():
                cancel()

        threading.Thread(target=cancel_until_returned, daemon=True,
                         name="sparkhvd-cancel").start()
        if not first.wait(CLEANUP_S):
            log.debug("cancelling Spark job %s did not return within %g s; left behind",
                      self.name, CLEANUP_S)


def cancel_job_group(sc: Any, group: str) -> None:
    """Cancel a classic job group someone else set (horovod.spark.run's)."""
    if session_stopped(sc):
        return
    try:
        sc.cancelJobGroup(group)
    except Exception as exc:  # noqa: BLE001 - stopped meanwhile (Py4J errors)
        log.debug("could not cancel job group %s: %s", group, exc)
