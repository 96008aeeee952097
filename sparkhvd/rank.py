"""Inside each rank: prepare the process, run the user's function, report what happened.

This module runs on the Spark executors (or in the driver's local rank processes) and imports
nothing from the driver side: only :mod:`sparkhvd.protocol`, :mod:`sparkhvd.environment` and the
exception types. It must stay cheap to import: TensorFlow is imported only to pin a GPU.

What a rank reports travels as typed events (:func:`emit`), separate from its printed output.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from . import protocol
from .protocol import TASK_GPUS_ENV

_NOISY_MODULES = r"(petastorm|pyarrow|tensorflow|keras|horovod|numpy|pandas|google|absl)(\..*)?"


@dataclass
class RankPlan:
    """How one rank process should use the machine it shares with its local peers."""

    env: dict[str, str] = field(default_factory=dict)
    gpu_index: Optional[int] = None
    memory_growth: bool = False


def plan_rank(local_rank: int, local_size: int, cpu_count: int, gpus: list[str],
              environ: Optional[dict] = None) -> RankPlan:
    """Decide GPU pinning and thread counts for one rank (pure; unit-tested).

    - GPUs present: the rank is pinned to the GPU Spark assigned to its task (``spark.task.
      resource.gpu.amount``, passed as :data:`~sparkhvd.protocol.TASK_GPUS_ENV`), else to GPU
      ``local_rank % len(gpus)``; TF memory growth is turned on, so local ranks do not grab
      each other's memory.
    - CPU only: the cores are shared among the local ranks through TF's intra/inter-op thread
      pools and OpenMP, so two ranks on a 2-core executor do not each spawn 2+ threads.
    Settings the user already exported are never overridden.
    """
    environ = os.environ if environ is None else environ
    local_size = max(1, local_size)
    plan = RankPlan()

    def setdefault(key: str, value: str) -> None:
        if key not in environ:
            plan.env[key] = value

    threads = max(1, cpu_count // local_size)
    if gpus:
        assigned = [a.strip() for a in environ.get(TASK_GPUS_ENV, "").split(",") if a.strip()]
        plan.gpu_index = (gpus.index(assigned[0]) if assigned and assigned[0] in gpus
                          else local_rank % len(gpus))
        plan.memory_growth = True
        setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        setdefault("OMP_NUM_THREADS", str(threads))
    else:
        setdefault("TF_NUM_INTRAOP_THREADS", str(threads))
        setdefault("TF_NUM_INTEROP_THREADS", str(min(2, threads)))
        setdefault("OMP_NUM_THREADS", str(threads))
    return plan


def detect_gpus(environ: Optional[dict] = None) -> list[str]:
    """GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() not in ("", "-1")]
    if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/proc/driver/nvidia"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def configure_tensorflow(tf: Any, plan: RankPlan) -> Optional[str]:
    """Apply a plan's GPU pinning to an imported ``tensorflow`` module; return the pinned GPU name.

    Uses ``tf.config`` rather than ``CUDA_VISIBLE_DEVICES`` so that user code written for plain
    Horovod (``set_visible_devices(gpus[hvd.local_rank()], 'GPU')``) keeps working unchanged.
    """
    if plan.gpu_index is None:
        return None
    gpus = tf.config.experimental.list_physical_devices("GPU")
    if not gpus:
        return None
    for gpu in gpus:
        if plan.memory_growth:
            tf.config.experimental.set_memory_growth(gpu, True)
    chosen = gpus[plan.gpu_index % len(gpus)]
    tf.config.experimental.set_visible_devices(chosen, "GPU")
    return chosen.name


def apply_plan(plan: RankPlan) -> None:
    """Export the plan's environment and pin the GPU (imports TensorFlow only on GPU hosts)."""
    os.environ.update(plan.env)
    if plan.gpu_index is not None:
        try:
            import tensorflow as tf
        except ImportError:
            return
        configure_tensorflow(tf, plan)


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def current_rank() -> tuple[int, int, int, int]:
    """(rank, size, local_rank, local_size) from the launcher's environment."""
    return (_env_int("SPARKHVD_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"),
            _env_int("SPARKHVD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1),
            _env_int("SPARKHVD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
            _env_int("SPARKHVD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                     default=1))


def route_address(address: str) -> str:
    """This host's address on the route to ``address`` (no packet is sent; the hostname when
    there is no route)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]
    return socket.gethostname()


def iface_towards(address: str) -> Optional[str]:
    """The name of this host's network interface that routes to ``address``."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        local_ip = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local_ip for a in addrs):
            return name
    return None


def pick_gloo_iface() -> None:
    """When asked (:data:`~sparkhvd.protocol.GLOO_AUTO_ENV`), use the interface that reaches
    the rendezvous server -- interface *names* mean nothing across machines."""
    if not os.environ.pop(protocol.GLOO_AUTO_ENV, None):
        return
    address = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if address:
        with contextlib.suppress(OSError):
            iface = iface_towards(address)
            if iface:
                os.environ["HOROVOD_GLOO_IFACE"] = os.environ["NCCL_SOCKET_IFNAME"] = iface


# -- events ---------------------------------------------------------------------------------
class _Events:
    """Where :func:`emit` writes: the launcher's event pipe, else marker lines on stderr."""

    def __init__(self) -> None:
        self.fd: Optional[int] = None
        self.lock = threading.Lock()
        self.rank = 0

    def take_from_env(self) -> None:
        # Taken out of the environment at once: a child process the user starts must not
        # inherit the number and write into whatever file it names there.
        raw = os.environ.pop(protocol.EVENTS_FD_ENV, None)
        if raw and self.fd is None:
            with contextlib.suppress(ValueError):
                self.fd = int(raw)

    def send(self, msg: Any) -> None:
        if self.fd is not None:
            data = protocol.encode(msg)
            try:
                with self.lock:
                    while data:
                        data = data[os.write(self.fd, data):]
                return
            except OSError:
                self.fd = None
        with contextlib.suppress(OSError, ValueError):
            print(protocol.as_text(msg), file=sys.__stderr__, flush=True)


_events = _Events()


def emit(msg: Any) -> None:
    """Send an event (a :mod:`sparkhvd.protocol` message) to the driver."""
    _events.send(msg)


def error_event(rank: int, exc: BaseException) -> protocol.Error:
    """The :class:`~sparkhvd.protocol.Error` event for an exception that ended a rank."""
    return protocol.Error(
        rank=rank, exc_type=type(exc).__name__, message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        time=time.time())


def announce(rank: int) -> None:
    """Tell the driver which rank this process is (again, after an elastic reset)."""
    _events.rank = rank
    emit(protocol.Started(rank=rank, pid=os.getpid(), host=socket.gethostname()))


# -- the rank's own process tree -------------------------------------------------------------
def become_subreaper() -> None:
    """Linux: orphaned descendants (daemonised helpers) are re-parented to this process, so
    :func:`end_children` finds them too."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def end_children(grace_s: float = 1.0) -> None:
    """Stop every process this rank started (data loaders, tools, multiprocessing workers).

    A leftover child would keep the rank's output pipes open (so nothing downstream sees the
    end of its output) and multiprocessing's exit handler would wait for it forever.
    """
    import psutil

    with contextlib.suppress(psutil.Error):
        stop_processes(psutil.Process().children(recursive=True), grace_s)


def stop_processes(procs: list, grace_s: float = 5.0) -> None:
    """SIGTERM the given ``psutil.Process`` objects, then SIGKILL those still alive after
    ``grace_s`` (the one way sparkhvd stops processes it owns)."""
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def scrub_environment(keep: list[str]) -> None:
    """Drop inherited variables a rank may not see (see :mod:`sparkhvd.environment`).

    The barrier and local launchers build the rank's environment that way already; horovod's
    own launcher copies the executor's whole environment, so this is where it is enforced there.
    """
    from .environment import allowed

    keep_set = set(keep)
    for name in list(os.environ):
        if not (name in keep_set or name.startswith("SPARKHVD_") or allowed(name)):
            del os.environ[name]


def pickled_result(rank: int, result: Any) -> bytes:
    """``result`` pickled for the driver, or a PayloadError that names the type and the fix."""
    import cloudpickle

    from .errors import PayloadError

    try:
        return cloudpickle.dumps(result)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the same problem
        kind = f"{type(result).__module__}.{type(result).__qualname__}"
        raise PayloadError(
            f"rank {rank} returned a {kind}, which cannot be sent to the driver "
            f"({type(exc).__name__}: {exc}). Return bytes or plain data (numbers, strings, "
            "lists, dicts, numpy arrays); for a Keras model, return its saved bytes "
            "(model.save(path), then open(path, 'rb').read()).") from None


def _quiet_warnings() -> None:
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)


#: What an elastic rank returns: (ELASTIC_RESULT, final rank, value-or-None).
ELASTIC_RESULT = "@@sparkhvd-elastic-result@@"


def elastic_result(results: list[Any]) -> list[Any]:
    """The driver's view of elastic ranks' returns: values in final-rank order.

    Spark tasks return in launch order, and a task of a lost executor may have been retried
    as an empty task; each elastic rank tags its return with the rank it ended as.
    """
    tagged = [r for r in results if isinstance(r, tuple) and len(r) == 3
              and r[0] == ELASTIC_RESULT]
    return [value for _, _, value in sorted(tagged, key=lambda r: r[1])]


def rank_main(payload: bytes, options: dict) -> Any:
    """Run the user's function in this rank (every launcher ends up here).

    Args:
        payload: :func:`sparkhvd.payload.dumps` of the user's function and kwargs.
        options: ``verbose``, ``return_all``, ``elastic`` (bools), ``env_keep`` (names of the
            variables the driver sent on purpose), ``check_result`` (validate the return value
            here: on launchers that pickle it themselves).
    Returns:
        The function's return value on rank 0 (every rank with ``return_all``), else ``None``;
        elastic ranks tag it with their final rank (see :func:`elastic_result`).
    """
    rank, _, local_rank, local_size = current_rank()
    _events.take_from_env()
    scrub_environment(list(options.get("env_keep", ())))
    pick_gloo_iface()
    become_subreaper()
    announce(rank)
    if options.get("elastic"):
        from ._compat import follow_elastic_resets

        follow_elastic_resets(announce)
    if not options.get("verbose"):
        _quiet_warnings()
    try:
        cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        apply_plan(plan_rank(local_rank, local_size, cpu_count, detect_gpus()))
        import cloudpickle

        fn, kwargs = cloudpickle.loads(payload)  # made by sparkhvd.payload.dumps on the driver
        result = fn(**kwargs)
        rank = _events.rank
        keep = rank == 0 or options.get("return_all")
        if keep and options.get("check_result"):
            pickled_result(rank, result)
    except BaseException as exc:
        emit(error_event(_events.rank, exc))
        raise
    finally:
        with contextlib.suppress(Exception):
            from .runfiles import publish_timeline

            publish_timeline(_events.rank)
        end_children()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    if options.get("elastic"):
        return (ELASTIC_RESULT, rank, result if keep else None)
    return result if keep else None
