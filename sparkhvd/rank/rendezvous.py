"""Inside a torch rank: join the process group as soon as rank 0's store listens.

Under ``env://`` rank 0 hosts the ``TCPStore`` inside its ``init_process_group()``; a rank that
gets there first is refused and retries with a growing back-off, so it joins up to half a
second after the store opened (measured: 0.52 s for a rank 0.3 s early, 0.32 s with this).
When a rank's start is cheap -- forked warm, :mod:`sparkhvd.rank.warm_server` -- which rank
starts first is chance, and that back-off was most of a no-op run's rendezvous.

So, before ``init_process_group()`` runs with the default ``env://`` (no ``init_method``, no
``store``), a rank other than 0 waits until ``MASTER_ADDR:MASTER_PORT`` accepts a connection,
looking every 5 ms (at most the call's ``timeout`` or :data:`MAX_WAIT_S`; then the call goes on
as it would have). The
look is a connection opened and closed, which the store ignores. Nothing else changes: the
call, its arguments, its errors and its timeout are torch's.
"""
from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any

__side__ = "rank"

#: How long a rank looks for rank 0's store before it calls torch anyway.
MAX_WAIT_S = 120.0
LOOK_S = 0.005


def install() -> None:
    """Wrap ``torch.distributed.init_process_group`` once it is imported (or now)."""
    from sparkhvd.common.after_import import when_imported

    when_imported("torch.distributed", _wrap)


def _wrap(module: Any) -> None:
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_sparkhvd_waits_for_store", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if _env_rendezvous(args, kwargs):
            timeout = kwargs.get("timeout", args[2] if len(args) > 2 else None)
            seconds = getattr(timeout, "total_seconds", None)
            limit = min(MAX_WAIT_S, seconds()) if callable(seconds) else MAX_WAIT_S
            wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), limit)
        return original(*args, **kwargs)

    init_process_group._sparkhvd_waits_for_store = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group
    c10d = getattr(module, "distributed_c10d", None)  # `from ... import init_process_group`
    if c10d is not None and getattr(c10d, "init_process_group", None) in (original, getattr(
            original, "__wrapped__", None)):
        c10d.init_process_group = init_process_group


def _env_rendezvous(args: tuple, kwargs: dict) -> bool:
    """Whether this call is a non-zero rank's default ``env://`` rendezvous on rank 0's store
    (``init_process_group(backend, init_method, timeout, world_size, rank, store, ...)``)."""
    def given(name: str, index: int) -> Any:
        return kwargs.get(name, args[index] if len(args) > index else None)

    rank = given("rank", 4)
    rank = os.environ.get("RANK", "0") if rank in (None, -1) else str(rank)
    return (given("init_method", 1) in (None, "env://") and given("store", 5) is None
            and rank != "0" and bool(os.environ.get("MASTER_ADDR"))
            and os.environ.get("MASTER_PORT", "").isdigit()
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")


def wait_for_store(host: str, port: int, limit_s: float = MAX_WAIT_S) -> bool:
    """Whether ``host:port`` accepted a connection within ``limit_s`` (a host that does not
    resolve: False at once -- torch says so itself)."""
    deadline = time.monotonic() + limit_s
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    while True:
        for family, _, _, _, address in found:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.settimeout(min(1.0, left))
                try:
                    probe.connect(address)
                    return True
                except OSError:
                    pass
        time.sleep(LOOK_S)
