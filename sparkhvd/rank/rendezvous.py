"""Inside a torch rank: join the process group as soon as rank 0's store listens.

Under ``env://`` rank 0 hosts the ``TCPStore`` inside its ``init_process_group()``; a rank that
gets there first is refused and retries with a growing back-off, so it joins up to half a
second after the store opened (measured: 0.52 s for a rank 0.3 s early, 0.32 s with this).
When a rank's start is cheap -- forked warm, :mod:`sparkhvd.rank.warm_server` -- which rank
starts first is chance, and that back-off was most of a no-op run's rendezvous.

So, before ``init_process_group()`` runs with the default ``env://`` (no ``init_method``, no
``store``), a rank other than 0 waits until ``MASTER_ADDR:MASTER_PORT`` accepts a connection,
looking every 5 ms (at most :data:`MAX_WAIT_S`; then the call goes on as it would have). The
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
            wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        return original(*args, **kwargs)

    init_process_group._sparkhvd_waits_for_store = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group


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
    """Whether ``host:port`` accepted a connection within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return True
        except OSError:
            time.sleep(LOOK_S)
    return False
