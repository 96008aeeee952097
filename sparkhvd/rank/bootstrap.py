"""Inside each rank: prepare the process, run the user's function, report what happened.

Every launcher ends in :func:`rank_main`: in a supervised rank process (:mod:`sparkhvd.rank.
supervisor`, started by the barrier and local launchers) or in horovod's own task process
(``launcher="horovod"``). It imports nothing of the driver or the Spark task, and stays cheap to
import: TensorFlow is imported only to pin a GPU.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any

from sparkhvd.common import protocol
from sparkhvd.common.environment import allowed, run_variable
from sparkhvd.common.errors import PayloadError
from sparkhvd.common.events import announce, emit, error_event, events
from sparkhvd.common.function_end import function_ended
from sparkhvd.common.identity import current_rank
from sparkhvd.common.netif import collective_iface_env
from sparkhvd.common.proctree import become_subreaper, end_children, end_tree_on_term
from sparkhvd.elastic.notices import Preempted
from sparkhvd.elastic.notices import install as install_notices
from sparkhvd.rank.arguments import open_argument
from sparkhvd.rank.devices import apply_plan, detect_gpus, plan_rank
from sparkhvd.rank.stack_dump import install as install_stacks

__side__ = "rank"

_NOISY_MODULES = r"(petastorm|pyarrow|tensorflow|keras|horovod|numpy|pandas|google|absl)(\..*)?"


def pick_gloo_iface() -> None:
    """When asked (:data:`~sparkhvd.common.protocol.GLOO_AUTO_ENV`, horovod's launcher), use the
    interface that reaches the rendezvous server."""
    if os.environ.pop(protocol.GLOO_AUTO_ENV, None):
        os.environ.update(collective_iface_env(None, os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")))


def scrub_environment(keep: list[str]) -> None:
    """Drop inherited variables a rank may not see (see :mod:`sparkhvd.common.environment`).

    The barrier and local launchers build the rank's environment that way already; horovod's
    own launcher copies the executor's whole environment, so this is where it is enforced there.
    """
    keep_set = set(keep)
    for name in list(os.environ):
        if not (name in keep_set or run_variable(name) or allowed(name)):
            del os.environ[name]


def pickled_result(rank: int, result: Any) -> bytes:
    """``result`` pickled for the driver, or a PayloadError that names the type and the fix."""
    import cloudpickle

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


def rank_main(payload: bytes, wire_options: dict, *, pickle_result: bool = False) -> Any:
    """Run the user's function in this rank (every launcher ends up here).

    Args:
        payload: :func:`sparkhvd.driver.payload.dumps` of the user's function and kwargs.
        wire_options: :meth:`RankOptions.as_dict <sparkhvd.common.protocol.RankOptions.as_dict>`,
            read back typed here.
        pickle_result: return the kept value already pickled (bytes), for a launcher that
            stores it (:mod:`sparkhvd.rank.supervisor`).
    Returns:
        The function's return value on rank 0 (every rank with ``return_all``), else ``None``;
        elastic ranks tag it with their final rank (:data:`~sparkhvd.common.protocol.
        ELASTIC_RESULT`). Whether a value is kept, and its pickling, are decided here only.
    """
    from sparkhvd.timing import start_times

    options = protocol.RankOptions.from_dict(wire_options)
    start_times.begin(os.environ.get(protocol.BACKEND_ENV), supervised=pickle_result)
    _prepare_process(options, supervised=pickle_result)
    try:
        _place_rank()
        import cloudpickle

        fn, kwargs = cloudpickle.loads(payload)  # made by sparkhvd.driver.payload.dumps
        arguments = {name: open_argument(value) for name, value in kwargs.items()}
        start_times.mark("function")
        result = fn(**arguments)
        start_times.mark("returned")
        emit(start_times.report(events.rank))
        function_ended()  # a checkpoint still being written is part of the function
        rank = events.rank
        keep = rank == 0 or options.return_all
        pickled = pickled_result(rank, result) if keep and (
            pickle_result or options.check_result) else None
    except Preempted:  # reported by the helper that stopped; every rank exits the same way
        emit(start_times.report(events.rank))
        raise SystemExit(protocol.PREEMPTED_EXIT) from None
    except BaseException as exc:
        emit(start_times.report(events.rank))  # how far it got: a failed start is timed too
        emit(error_event(events.rank, exc))
        raise
    finally:
        _hand_over_files()
    if pickle_result:
        return pickled
    if options.elastic:
        return (protocol.ELASTIC_RESULT, rank, result if keep else None)
    return result if keep else None


def _prepare_process(options: protocol.RankOptions, *, supervised: bool) -> None:
    """Before the user's code: the environment it may see, the process tree it owns, notices,
    the rank announced, the driver's row-group copies in reach, stacks on request, its time
    sampled, elastic resets followed, library noise quieted."""
    events.take_from_env()
    scrub_environment(list(options.env_keep))
    pick_gloo_iface()
    become_subreaper()
    if not supervised:  # no supervisor of ours (horovod's launcher): end our tree ourselves
        end_tree_on_term()
    else:  # SIGTERM is a notice: a listening checkpoint helper turns it into a checkpoint
        install_notices()
    announce(current_rank().rank)
    if os.environ.get(protocol.FILES_ADDR_ENV):  # a small table's row groups go to the driver
        from sparkhvd.data.row_group_cache import use_driver_copies
        from sparkhvd.runfolder.rank_files import driver_row_copies

        use_driver_copies(driver_row_copies)
    install_stacks()  # every thread's stack on request, however stuck the rank is
    if options.time_split:  # where the rank's time goes, sampled (sparkhvd.timing)
        from sparkhvd.timing.sampler import start

        start(os.environ.get(protocol.BACKEND_ENV))
    if os.environ.get(protocol.BACKEND_ENV) == "torch":  # join as soon as rank 0's store is up
        from sparkhvd.rank.rendezvous import install as join_promptly

        join_promptly()
    if options.elastic:
        from sparkhvd.common.patches import follow_elastic_resets

        follow_elastic_resets(announce)
    if not options.verbose:
        _quiet_warnings()


def _place_rank() -> None:
    """Threads and the GPU for this rank; plain TF code made to run on ``backend="tf"``."""
    _, _, local_rank, local_size = current_rank()
    cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    backend = os.environ.get(protocol.BACKEND_ENV)
    # threads are shared by the ranks on this host (a node may be one Spark task)
    sharing = int(os.environ.get(protocol.HOST_RANKS_ENV) or local_size)
    apply_plan(plan_rank(local_rank, local_size, cpu_count, detect_gpus(),
                         threads_shared_by=sharing), backend)
    if backend == "tf":  # plain TF code runs unchanged (imports nothing now)
        from sparkhvd.keras.plain import install

        install()


def _hand_over_files() -> None:
    """After the user's code, whatever happened: work it left in the background finished, the
    timeline and ``output_dir()`` files into the run folder, the rank's children ended, its
    output flushed."""
    try:
        function_ended(returned=False)  # after an error: the checkpoint being written lands
    except Exception as exc:  # noqa: BLE001 - said, never hiding the function's outcome
        print(f"sparkhvd: {exc}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        from sparkhvd.timing.sampler import finish

        finish()
    with contextlib.suppress(Exception):
        from sparkhvd.runfolder.rank_files import publish_timeline

        publish_timeline(events.rank)
    try:
        from sparkhvd.runfolder.rank_files import publish_outputs

        publish_outputs()
    except Exception as exc:  # noqa: BLE001 - said, never hiding the function's outcome
        print(f"sparkhvd: could not copy output_dir() files into the run folder: {exc}",
              file=sys.stderr, flush=True)
    end_children()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
