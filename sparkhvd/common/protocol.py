"""What ranks and tasks tell the driver, as typed messages, and the names both sides agree on.

The contract between the driver, the Spark task and the rank: the environment variables a launcher
sets for a rank, the options a rank runs with (:class:`RankOptions`), and the messages that travel
back.

Outcomes travel separately from output, as in Spark's ``log_communication``: a rank's printed
lines are best-effort :class:`Line` messages for the console and the rank logs, while what
decides the run -- :class:`Started`, :class:`Error`, :class:`Metrics`, :class:`Resumed`,
:class:`Exit` -- are their own messages, never parsed out of the text.

Wire format: one JSON object per line, ``{"t": <kind>, ...fields}``. Channels:

- barrier launcher: the rank process writes events to a pipe (``SPARKHVD_EVENTS_FD``), its Spark
  task forwards them with the output lines over the task's control connection, as they are;
- local launcher: the same pipe, read by the driver directly;
- horovod launcher (no channel of ours): the rank prints ``@@sparkhvd@@ <json>`` on stderr and
  :mod:`sparkhvd.driver.launchers.horovod_spark` maps horovod's text output back onto these types.
"""
from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

__side__ = "common"

@dataclass(frozen=True)
class RankOptions:
    """How a rank runs the user's function (see :func:`sparkhvd.rank.bootstrap.rank_main`);
    travels as a plain dict (JSON on a command line, pickled by horovod)."""

    verbose: bool = False
    #: Keep every rank's return value, not only rank 0's.
    return_all: bool = False
    elastic: bool = False
    #: Names of the variables the driver sent on purpose (kept by the rank's scrub).
    env_keep: tuple[str, ...] = ()
    #: Pickle the kept value in the rank to name what cannot travel (launchers that pickle it
    #: themselves, e.g. horovod's).
    check_result: bool = False
    #: Sample where the rank's time goes (:mod:`sparkhvd.timing`); ``time_split=False`` on the
    #: runner turns it off.
    time_split: bool = True
    #: Start the rank from a warm server that already imported its framework, where there is
    #: one (:mod:`sparkhvd.common.warmstart`); ``warm_start=False`` on the runner turns it off.
    warm_start: bool = True

    def as_dict(self) -> dict[str, Any]:
        """The wire form (JSON on a command line, pickled by horovod)."""
        return {**dataclasses.asdict(self), "env_keep": list(self.env_keep)}

    @classmethod
    def from_dict(cls, wire: "dict[str, Any] | RankOptions") -> "RankOptions":
        """Read back what :meth:`as_dict` sent (unknown keys refused: both sides are one
        sparkhvd)."""
        if isinstance(wire, RankOptions):
            return wire
        return cls(**{**wire, "env_keep": tuple(wire.get("env_keep", ()))})


@dataclass(frozen=True)
class TaskSpec:
    """What the driver gives every Spark task of a barrier launch (pickled with the task)."""

    payload: bytes
    #: :meth:`RankOptions.as_dict`
    options: dict[str, Any]
    #: variables every rank gets from the driver
    env: dict[str, str]
    #: ``(host, port)`` of the driver's control server
    driver: tuple[str, int]
    token: str
    start_timeout: float
    backend: str
    #: the backend's variables for every rank (what its ``start()`` returned)
    run_env: dict[str, str]
    ranks_per_task: int = 1
    #: every task its own node (``LOCAL_RANK`` within the task; the task's GPUs made visible)
    node_per_task: bool = False
    #: the driver's clock (``time.time()``) past which the run has given up starting: a task
    #: that cannot reach the driver and starts later never runs the function (0: no limit)
    start_by: float = 0.0


# -- environment a launcher sets for each rank ----------------------------------------------
#: The run's id (its run folder's name): the same for every attempt of the run.
RUN_ID_ENV = "SPARKHVD_RUN_ID"
#: Local path of the run folder when the rank shares the driver's disk.
RUN_URL_ENV = "SPARKHVD_RUN_URL"
#: ``host:port`` of the driver's run-folder service (ranks on other hosts).
FILES_ADDR_ENV = "SPARKHVD_FILES_ADDR"
#: The run's one-off token for that service (redacted like any secret).
FILES_TOKEN_ENV = "SPARKHVD_FILES_TOKEN"
#: Set when HorovodRunner(resume_from=...) asked to resume: the source it resolved.
RESUME_URL_ENV = "SPARKHVD_RESUME_URL"
#: File descriptor of the rank's event pipe.
EVENTS_FD_ENV = "SPARKHVD_EVENTS_FD"
#: PID of the process that started a rank's supervisor (it ends with that process).
PARENT_PID_ENV = "SPARKHVD_PARENT_PID"
#: GPU addresses Spark assigned to the rank's task.
TASK_GPUS_ENV = "SPARKHVD_TASK_GPUS"
#: How many of the run's ranks share this rank's host (its cores), whatever a node is.
HOST_RANKS_ENV = "SPARKHVD_HOST_RANKS"
#: The hosts of the attempt's ranks, in rank order, comma-separated: where each rank's rows
#: were when the next attempt deals the rest of an epoch (:func:`sparkhvd.data.deal.by_host`).
RANK_HOSTS_ENV = "SPARKHVD_RANK_HOSTS"
#: A table whose rows take up to this many bytes has each row group ranks on other hosts read
#: copied to the driver for the run (:mod:`sparkhvd.data.row_group_cache`); the driver keeps
#: at most this many bytes of copies a run. ``$SPARKHVD_ROW_COPIES_BYTES`` (the ranks' variable)
#: sets it, ``0`` turns the copies off. Why 2 GB: past it the default shuffle window is at most
#: a 16th of the table, and a resize chain reads the files again little without copies (B14's
#: layouts: 8 -> 7 -> 8 on 8 hosts 1.12x at 1.1 GB, 1.07x at 1.5 and 2 GB, 1.03x at 5 GB).
ROW_COPIES_BYTES = 2 << 30
ROW_COPIES_BYTES_ENV = "SPARKHVD_ROW_COPIES_BYTES"


def row_copies_bytes(environ: Mapping[str, str]) -> int:
    """The bound on the row-group copies ``environ`` sets (the ranks' variables, on a rank or
    on the driver): :data:`ROW_COPIES_BYTES` unless it names a number of bytes."""
    try:
        return int(environ.get(ROW_COPIES_BYTES_ENV, ROW_COPIES_BYTES))
    except ValueError:
        return ROW_COPIES_BYTES
#: Where rank 0 writes the Horovod timeline on its own host before it goes to the run folder.
TIMELINE_ENV = "HOROVOD_TIMELINE"
#: Set when the rank itself must pick the network interface that reaches the rendezvous.
GLOO_AUTO_ENV = "SPARKHVD_GLOO_AUTO"
#: The backend the ranks run on, when it is not horovod ("tf": see sparkhvd.common.backends.tf).
BACKEND_ENV = "SPARKHVD_BACKEND"

#: The signal that makes a rank write every thread's stack (``faulthandler``, set up in the
#: rank by :mod:`sparkhvd.rank.stack_dump`).
STACKS_SIGNAL = signal.SIGUSR1
#: The signal that is a *notice* to a rank: its node is about to be reclaimed (Kubernetes, YARN
#: and systemd send it before they kill), or the driver asks it to stop at its next step
#: (a decommissioned executor, a resize). A rank whose checkpoint helper listens finishes its
#: step, checkpoints and exits as preempted (:mod:`sparkhvd.elastic.notices`).
NOTICE_SIGNAL = signal.SIGTERM
#: The reason a rank gives when the notice came to another rank (spread by the helpers).
NOTICE_SPREAD = "a notice on another rank"
#: The exit status of a rank that stopped on a notice after its checkpoint (``EX_TEMPFAIL``).
PREEMPTED_EXIT = 75
#: Set for the ranks of an elastic run (``min_np``/``max_np``): helpers look for notices after
#: every step, since the driver may ask them to stop for a resize.
ELASTIC_ENV = "SPARKHVD_ELASTIC"
#: The run's attempt a rank belongs to (1, 2, ... after each relaunch), on every backend.
ATTEMPT_ENV = "SPARKHVD_ATTEMPT"
#: The world size of the attempt before this one, when it differed (a resize); unset else.
PREVIOUS_SIZE_ENV = "SPARKHVD_PREVIOUS_WORLD_SIZE"
#: Set when the rank must also look for stack requests in the run folder itself (launchers
#: without a channel to remote ranks: horovod's).
STACKS_POLL_ENV = "SPARKHVD_STACKS_POLL"
#: The run-folder file a stack request is written to (by the driver, for ranks that poll).
STACKS_REQUEST_FILE = "control/stacks-request.json"

# -- files both sides name ----------------------------------------------------------------
#: The payload a rank's supervisor reads, in the rank's private work folder.
PAYLOAD_FILE = "payload.pkl"


def result_file(rank: int) -> str:
    """The file (in the rank's work folder) that holds rank ``rank``'s pickled return value."""
    return f"rank-{rank}.pkl"


def is_result_file(name: str) -> bool:
    return name.startswith("rank-") and name.endswith(".pkl")


#: Prefix of an event printed as text (launchers without a channel of ours).
#: What an elastic rank returns: (ELASTIC_RESULT, final rank, value-or-None) -- Spark tasks
#: return in launch order, and a lost executor's task may have been retried as an empty one.
ELASTIC_RESULT = "@@sparkhvd-elastic-result@@"

MARKER = "@@sparkhvd@@"

#: A console line longer than this is cut (the rank log keeps it whole).
MAX_SHOWN_CHARS = 4000
#: Output is read in pieces of at most this many bytes (bounds memory for endless lines).
MAX_CHUNK_BYTES = 64 * 1024


@dataclass
class Line:
    """Part of a rank's output: a whole line, a piece of a long one (``partial``), or a progress
    bar's intermediate state (``update``, see :mod:`sparkhvd.common.outputlines`)."""

    rank: int
    tag: str  # "stdout" or "stderr"
    text: str
    partial: bool = False
    #: a progress update (the line was redrawn with ``\r``): shown live, not kept
    update: bool = False


@dataclass
class Started:
    """A rank process started (and, after an elastic reset, its new rank)."""

    rank: int
    pid: int
    host: str = ""


@dataclass
class Error:
    """The exception that ended a rank's function."""

    rank: int
    exc_type: str
    message: str
    traceback: str = ""
    time: float = 0.0


@dataclass
class Metrics:
    """One epoch's (rank-averaged) metrics from rank 0: they make ``metrics.csv``/``curves.png``."""

    rank: int
    record: dict[str, Any] = field(default_factory=dict)


@dataclass
class Resumed:
    """What rank 0 restored when asked to resume: ``source`` is None when it found nothing."""

    rank: int
    source: Optional[str]
    epoch: int = 0
    #: checkpoints passed over (newest first), each "file: why"
    skipped: list[str] = field(default_factory=list)
    #: steps of epoch ``epoch`` the checkpoint had done (0: it was taken at an epoch's end)
    step: int = 0
    #: which copy rank 0 read: ``"folder"`` (the checkpoint folder), ``"host"`` (the copy kept
    #: on its own host) or ``"peer"`` (another rank's host copy, sent over the process group)
    copy: str = "folder"
    #: False for a checkpoint kept on the hosts whose upload had not ended: ``source`` names
    #: where the folder would have it, but the folder does not
    uploaded: bool = True


@dataclass
class OutputDir:
    """A rank asked for ``<run folder>/<name>/`` (``sparkhvd.torch.output_dir``): a library's
    own files -- its checkpoints, which a relaunch may resume from."""

    rank: int
    name: str


@dataclass
class Listening:
    """A rank's checkpoint helper listens for notices: a notice becomes a checkpoint after the
    step, then a preempted exit (the driver asks only such ranks to stop for a resize)."""

    rank: int


@dataclass
class Preempted:
    """A rank stopped on a notice after ``checkpoint`` (its name; empty when none was written);
    ``seconds`` from its own notice to its stop (None: the notice was another rank's)."""

    rank: int
    checkpoint: str = ""
    reason: str = ""
    seconds: Optional[float] = None


@dataclass
class Exit:
    """A rank process' exit status (``None``: it vanished without one)."""

    rank: int
    code: Optional[int]


def exit_status(exc: SystemExit) -> int:
    """The process status ``sys.exit(code)`` means: ints as they are, ``None`` is 0, anything
    else (a message) is 1 -- what the interpreter itself would exit with."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


@dataclass
class Stacks:
    """Every thread's Python stack in one rank process, when the driver asked
    (:class:`DumpStacks`): ``source`` says who took them (``faulthandler`` in the rank,
    ``py-spy`` from outside when the rank could not answer)."""

    rank: int
    pid: int = 0
    host: str = ""
    text: str = ""
    source: str = "faulthandler"


@dataclass
class TimeSplit:
    """Where one rank's time went over one interval (:mod:`sparkhvd.timing.sampler`): seconds
    per bucket, where in the code each bucket was spent, and the process' system metrics."""

    rank: int
    host: str = ""
    #: the interval, as wall-clock seconds since the epoch
    start: float = 0.0
    end: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)
    #: bucket -> the innermost user frame ("train.py:42 load_batch") or the collective's name
    where: dict[str, str] = field(default_factory=dict)
    #: MLflow's system-metric names (``cpu_utilization_percentage``, ...) -> value
    system: dict[str, float] = field(default_factory=dict)
    #: how the wait in collectives was measured beyond the stack samples (``ddp``: DDP's
    #: timed comm hook, :mod:`sparkhvd.timing.collectives`), and over how many steps
    waits: list[str] = field(default_factory=list)
    steps: int = 0
    #: samples per step on this rank (the first step's batch; 0: not known)
    batch: int = 0
    #: waits this rank knows it cannot measure (a model with its own comm hook, ...)
    unmeasured: list[str] = field(default_factory=list)


@dataclass
class StartTimes:
    """How one rank's start went (:mod:`sparkhvd.timing.start_times`): mark -> wall-clock
    seconds on its host; whether a warm server forked it."""

    rank: int
    marks: dict[str, float] = field(default_factory=dict)
    warm: bool = False


@dataclass
class Heartbeat:
    """A Spark task is alive (sent every second; silence means a lost host)."""

    rank: Optional[int] = None


@dataclass
class TaskInfo:
    """One rank's place, as a backend sees it: its *slot* (the task's partition, or
    ``partition * ranks_per_task + i`` for the ``i``-th rank of a task that runs several), the
    host, the address its peers reach, the port reserved for it, and its *node* -- what
    ``LOCAL_RANK`` counts within (the host by default; the Spark task under
    ``local_ranks="task"``, see :func:`node_of`)."""

    partition: int
    host: str
    address: str = ""
    port: Optional[int] = None
    node: str = ""


def node_of(host: str, partition: int, per_task: bool) -> str:
    """The node a task's ranks belong to: its host (torchrun's numbering) or, ``per_task``,
    the task itself (TorchDistributor's: every Spark task its own node)."""
    return f"{host}#task{partition}" if per_task else host


def task_slots(partition: int, ranks_per_task: int) -> range:
    """The slots of one task's ranks, in the order it starts them."""
    return range(partition * ranks_per_task, (partition + 1) * ranks_per_task)


def rank_slots(partition: int, host: str, address: str, ports: list[int], ranks_per_task: int,
               per_task: bool) -> dict[int, TaskInfo]:
    """The :class:`TaskInfo` of each rank one task runs, keyed by slot (the one numbering of
    the driver, the tasks in rows mode and the local launcher)."""
    node = node_of(host, partition, per_task)
    return {slot: TaskInfo(slot, host, address, ports[i] if i < len(ports) else None, node)
            for i, slot in enumerate(task_slots(partition, ranks_per_task))}


@dataclass
class Hello:
    """A Spark task registers with the driver: where it runs, one reserved port per rank it
    will start (when the backend needs them), and the run's token."""

    partition: int
    host: str
    address: str = ""
    ports: list[int] = field(default_factory=list)
    token: str = ""


@dataclass
class Assign:
    """The driver's answer to :class:`Hello`: each of the task's ranks' environment."""

    envs: list[dict[str, str]]


@dataclass
class Abort:
    """The driver tells a task to kill its ranks now."""


@dataclass
class DumpStacks:
    """The driver asks a task for its rank's stacks (the task signals the rank)."""


@dataclass
class Notice:
    """The driver tells a task to give its ranks a notice (:data:`NOTICE_SIGNAL`): checkpoint
    after the step they are in, then stop -- ``reason`` is for the task's log."""

    reason: str = ""


@dataclass
class Detached:
    """The driver's answer to :class:`Hello` when some task could not reach it: run without
    the control channel and return everything in the Spark job's rows."""


Message = Union[Line, Started, Error, Metrics, Resumed, OutputDir, Listening, Preempted, Exit,
                Stacks, TimeSplit, Heartbeat, Hello, Assign, Abort, DumpStacks, Notice,
                Detached]
KINDS: dict[str, type] = {cls.__name__.lower(): cls for cls in
                          (Line, Started, Error, Metrics, Resumed, OutputDir, Listening,
                           Preempted, Exit, Stacks, TimeSplit, StartTimes, Heartbeat, Hello, Assign, Abort, DumpStacks,
                           Notice, Detached)}


def to_dict(msg: Any) -> dict[str, Any]:
    """The message as a JSON-able dict with its kind under ``"t"``."""
    return {"t": type(msg).__name__.lower(), **dataclasses.asdict(msg)}


def from_dict(data: dict[str, Any]) -> Any:
    """Inverse of :func:`to_dict`; ``ValueError`` for an unknown kind or bad fields."""
    try:
        cls = KINDS[data["t"]]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a sparkhvd message: {data!r:.200}") from exc


def encode(msg: Any) -> bytes:
    """One wire line (JSON + newline)."""
    return (json.dumps(to_dict(msg)) + "\n").encode()


def decode(line: Union[bytes, str]) -> Any:
    """One wire line back to its message; ``ValueError`` if it is not one."""
    return from_dict(json.loads(line))


def as_text(msg: Any) -> str:
    """The message as a marker line, for channels that carry only text."""
    return f"{MARKER} {json.dumps(to_dict(msg))}"


def from_text(text: str) -> Optional[Any]:
    """The message in a marker line, or ``None`` if ``text`` is not one."""
    if not text.startswith(MARKER):
        return None
    try:
        return decode(text[len(MARKER):])
    except ValueError:
        return None
