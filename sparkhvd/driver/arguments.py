"""Arguments that need driver-side work before they can travel to the ranks.

An argument of ``run()`` -- also one inside a list, tuple or dict argument -- whose type has
``prepare_for_ranks()`` is *prepared* before the payload is pickled: the method does the driver's
work (``DataFrameDataset`` materialises its Parquet) and returns what the ranks get in its place
(a :class:`~sparkhvd.data.sharding.ShardSource`, read there as a shard). After the run,
``after_run(succeeded)`` lets it clean up (a failed run removes the materialised files).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Protocol, runtime_checkable

__side__ = "driver"

log = logging.getLogger(__name__)


@runtime_checkable
class PreparedArgument(Protocol):
    """An argument that needs the driver before it can travel (see the module docstring)."""

    def prepare_for_ranks(self) -> Any:
        """Driver-side work; returns the value the ranks receive instead of this object."""

    def after_run(self, succeeded: bool) -> None:
        """Called once the run ended, however it ended."""


class Prepared:
    """The arguments of one run with every :class:`PreparedArgument` replaced."""

    def __init__(self, kwargs: Mapping[str, Any]) -> None:
        self.originals: list[PreparedArgument] = []
        try:
            self.kwargs = {name: self._walk(value) for name, value in kwargs.items()}
        except BaseException:
            self.finish(succeeded=False)
            raise

    def _walk(self, value: Any) -> Any:
        if isinstance(value, PreparedArgument) and not isinstance(value, type):
            prepared = value.prepare_for_ranks()
            self.originals.append(value)
            return prepared
        if type(value) in (list, tuple):
            return type(value)(self._walk(v) for v in value)
        if type(value) is dict:
            return {k: self._walk(v) for k, v in value.items()}
        return value

    def finish(self, *, succeeded: bool) -> None:
        for value in self.originals:
            try:
                value.after_run(succeeded)
            except Exception as exc:  # noqa: BLE001 - clean-up must not hide the run's outcome
                log.warning("could not clean up %r: %s", value, exc)
