"""Which rank holds the others back, and why -- or whether the whole run waits on its input or
its communication: the driver compares the ranks' time splits as the run goes.

Over the last :data:`WINDOW_S` of reports, once every rank of the attempt has at least
:data:`MIN_SAMPLED_S` sampled:

- a *straggler* is **the rank the others wait for**: the others measurably wait in collectives
  (their median share :data:`WAITED` or more -- sampled in Python frames, or measured inside
  DDP's ``backward()``, :mod:`sparkhvd.timing.collectives`), it waits less than they do, and
  its own share of data loading, computing or checkpoint I/O exceeds the others' median by
  :data:`GAP` or more: that bucket is its cause. A rank whose extra time is waiting is never
  named, nor is anyone in a run whose ranks do not wait for each other. Where a rank's wait
  cannot be measured (a DDP model with its own comm hook; ``tf.distribute``, whose collectives
  run inside the graph) it hides in computing, so computing alone never names a rank then;
- the run is *input-bound* when every rank spends :data:`BOUND` or more of its time loading
  data, *communication-bound* when every rank waits that much in collectives and none is a
  straggler.

An attempt too short for the window (each rank under :data:`MIN_SAMPLED_S` sampled in its last
:data:`WINDOW_S`, e.g. 150 quick steps) is judged once more when it ends, over the whole attempt
(each rank at least :data:`END_MIN_SAMPLED_S`), by the same rules: a straggler the window never
got to see is still named (:class:`~sparkhvd.timing.splits.TimeSplits`).

A straggler that is no longer one over the window is said once too (``straggler-gone``). The
``other`` bucket (a rank's start, its imports) never makes a straggler: ranks start at
different speeds, and nothing in the training loop changes that.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

from sparkhvd.timing.buckets import LABELS, dominant, share

__side__ = "driver"

#: The ranks are compared over their reports of this last stretch of time.
WINDOW_S = 60.0
#: Each rank needs this much sampled time in the window before any comparison.
MIN_SAMPLED_S = 15.0
#: ... and over a whole attempt, judged when it ends (an attempt too short for the window).
END_MIN_SAMPLED_S = 3.0
#: A straggler's share of a bucket exceeds the others' median by at least this much.
GAP = 0.20
#: Every rank this much in data loading (collectives): the run is input- (communication-) bound.
BOUND = 0.5
#: The buckets a straggler is named for.
STRAGGLER_BUCKETS = ("data", "compute", "checkpoint")
#: The others' median share of waiting in collectives for them to be said to wait for a rank.
WAITED = 0.10


@dataclass
class RankWindow:
    """One rank's time in the window: seconds per bucket, and where (bucket -> place ->
    seconds)."""

    rank: int
    host: str
    seconds: dict[str, float]
    where: dict[str, dict[str, float]]
    #: how its waits were measured beyond the samples (``ddp``), and what it could not measure
    waits: set = field(default_factory=set)
    unmeasured: set = field(default_factory=set)
    #: steps the measured waits span
    steps: int = 0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def add(self, seconds: dict[str, float], where: dict[str, str], waits: Iterable[str] = (),
            unmeasured: Iterable[str] = (), steps: int = 0) -> None:
        """One report's seconds per bucket, and where each bucket's time went."""
        self.waits |= set(waits)
        self.unmeasured |= set(unmeasured)
        self.steps += steps
        for bucket, s in seconds.items():
            self.seconds[bucket] = self.seconds.get(bucket, 0.0) + s
            place = where.get(bucket)
            if place:
                places = self.where.setdefault(bucket, {})
                places[place] = places.get(place, 0.0) + s


@dataclass
class Finding:
    """Something the comparison found, said once: ``kind`` is ``straggler``,
    ``straggler-gone``, ``input-bound`` or ``communication-bound``."""

    kind: str
    text: str
    rank: Optional[int] = None
    host: Optional[str] = None
    bucket: Optional[str] = None
    share: float = 0.0
    others: float = 0.0

    @property
    def key(self) -> tuple:
        """Said once per run: per rank and bucket for a straggler, once for the others."""
        return (self.kind, self.rank, self.bucket)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def rank_list(ranks: Iterable[int]) -> str:
    """``ranks 0–2``, ``ranks 0, 2``, ``rank 1``."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}\u2013{rs[-1]}"
    return "ranks " + ", ".join(str(r) for r in rs)


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def find(ranks: list[RankWindow], size: int, min_sampled: float = MIN_SAMPLED_S
         ) -> list[Finding]:
    """What the window shows (see the module docstring); nothing until every one of ``size``
    ranks has ``min_sampled`` seconds sampled."""
    if len(ranks) < size or not ranks or any(r.total < min_sampled for r in ranks):
        return []
    shares = {r.rank: share(r.seconds) for r in ranks}
    found: list[Finding] = []
    straggler = _straggler(ranks, shares) if len(ranks) > 1 else None
    if straggler is not None:
        found.append(straggler)
    for bucket, kind, advice in (
            ("data", "input-bound", "loading data: a faster input pipeline (more reader "
             "threads, a cached or pre-shuffled dataset) speeds it up, not more ranks"),
            ("collective", "communication-bound", "waiting in collectives: more compute per "
             "all-reduce (a larger batch per rank, gradient accumulation) or fewer ranks per "
             "host helps")):
        if bucket == "collective" and (straggler is not None or len(ranks) < 2):
            continue  # one rank has no peers to wait for
        least = min(shares[r.rank][bucket] for r in ranks)
        if least >= BOUND:
            places = {dominant(r.where, bucket) for r in ranks} - {""}
            where = f" (mostly in {sorted(places)[0]})" if len(places) == 1 else ""
            found.append(Finding(kind=kind, share=round(least, 3), bucket=bucket, text=(
                f"the run is {kind}: every rank spends {_pct(least)} or more of its time "
                f"{advice}{where}")))
    return found


def _straggler(ranks: list[RankWindow], shares: dict[int, dict[str, float]]) -> \
        Optional[Finding]:
    best: Optional[tuple[float, RankWindow, str, float]] = None
    for r in ranks:
        rest = [o for o in ranks if o is not r]
        waited = statistics.median(shares[o.rank]["collective"] for o in rest)
        if waited < WAITED or shares[r.rank]["collective"] >= waited:
            continue  # nobody measurably waits for r, or r waits as much itself
        hidden = any(o.unmeasured for o in ranks)  # some wait may hide in computing
        for bucket in STRAGGLER_BUCKETS:
            if bucket == "compute" and hidden:
                continue
            others = statistics.median(shares[o.rank][bucket] for o in rest)
            gap = shares[r.rank][bucket] - others
            if gap >= GAP and (best is None or gap > best[0]):
                best = (gap, r, bucket, others)
    if best is None:
        return None
    _, slow, bucket, others = best
    mine = shares[slow.rank][bucket]
    place = dominant(slow.where, bucket)
    host = f" (host {slow.host})" if slow.host else ""
    text = (f"rank {slow.rank}{host} is the straggler: {_pct(mine)} of its time in "
            f"{LABELS[bucket]}{f' ({place})' if place else ''} vs {_pct(others)} on the others")
    rest = [o for o in ranks if o is not slow]
    waiting = statistics.median(shares[o.rank]["collective"] for o in rest)
    if waiting >= 0.05:
        names = {dominant(o.where, "collective") for o in rest} - {""}
        what = sorted(names)[0] if len(names) == 1 else "collectives"
        verb = "waits" if len(rest) == 1 else "wait"
        text += f"; {rank_list(o.rank for o in rest)} {verb} in {what} {_pct(waiting)} of the time"
    return Finding(kind="straggler", text=text, rank=slow.rank, host=slow.host or None,
                   bucket=bucket, share=round(mine, 3), others=round(others, 3))


def gone(was: Finding, ranks: list[RankWindow]) -> Finding:
    """A straggler the window no longer shows: said once, with where its bucket stands now."""
    me = next((r for r in ranks if r.rank == was.rank), None)
    rest = [r for r in ranks if r.rank != was.rank]
    bucket = was.bucket or "compute"
    mine = share(me.seconds)[bucket] if me is not None else 0.0
    others = statistics.median(share(r.seconds)[bucket] for r in rest) if rest else 0.0
    host = f" (host {was.host})" if was.host else ""
    return Finding(kind="straggler-gone", rank=was.rank, host=was.host, bucket=bucket,
                   share=round(mine, 3), others=round(others, 3), text=(
                       f"rank {was.rank}{host} is no longer the straggler: {_pct(mine)} of its "
                       f"time in {LABELS[bucket]} vs {_pct(others)} on the others"))
