"""The gloo process group beside the run's default one, for the helpers' own small messages.

The checkpoint helpers agree on flags and send a host copy's bytes between ranks on the CPU; on
an nccl run that would need the GPU, so they use a gloo group made beside the default one (on a
gloo run, the default group itself).
"""
from __future__ import annotations

from typing import Any

__side__ = "rank"

_GROUPS: dict = {}


def side_group() -> Any:
    """The default group on gloo, else a gloo group beside it (made once, by every rank at the
    first call -- a collective)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]
