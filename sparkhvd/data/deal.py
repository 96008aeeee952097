"""The order of an epoch whose number of ranks does not divide ``P`` or is over 8 (or that
such a run resized): the rest of the epoch *dealt* to the ranks in contiguous spans. Pure
functions of plain numbers, the same on every rank; the why is in
:mod:`sparkhvd.data.sharding`.

The round robin of :mod:`sparkhvd.data.order` gives rank ``r`` of ``size`` the positions
``i % size == r``: they fall in the partitions ``c % g == r % g`` (``g = gcd(size, P)``), the
rank's share when ``size`` divides ``P`` -- but every partition, the whole table, for a
``size`` prime to ``P``. Such a run instead deals what is left of the epoch:

1. **Units** (:class:`Unit`): the rows of the epoch still to train, each a range of one
   partition's epoch sequence of pieces (:func:`~sparkhvd.data.order.epoch_pieces`) -- a *run*
   of rows not drawn yet, or one *window* of rows permuted, of which a range is left (or of
   its rows that lie in some of its row groups: a *part*, :func:`split_by_rows`). An epoch's
   start is one run per partition (:func:`units_at`, which also turns a round-robin position
   into units).
2. **A deal** (:class:`Deal`, :func:`deal`): the units laid end to end in partition order and
   cut into ``size`` consecutive spans -- rank ``r`` the ``r``-th -- of equal rows (a lead-in
   step first where the rows left call for one, so the epoch trains as many rows as a run that
   never resized; the rows after are left out). A rank reads only the row groups of its span:
   its share, plus a row group it splits with a neighbour.
3. **A rank's sequence**: its units in turn, one row of each (a round robin, as the partitions
   are interleaved), each unit's rows a window at a time -- a window is whole pieces of at
   least ``window_rows`` rows, permuted when shuffled (its seed from the rows it holds, so the
   same window is drawn the same way on every rank and in every run). A span of few units
   (more than 8 ranks) widens its runs' windows so that the rank draws from at least
   ``1 / MIXING_RANKS`` of the shuffle window at once, its batches mixed at any ``size``; a
   run keeps its windows' size once drawn from, so a resumed deal draws it the same way.

A run resumed at another size, or on other hosts, lays the units out by host first
(:func:`by_host`): each rank's span begins with what a rank on its host was reading.

What is left after ``steps`` steps of a deal (:func:`left_after`) follows from the deal alone,
on any rank: a checkpoint keeps the deal and its steps, and a run resumed with any number of
ranks deals what is left -- with the same number, the same spans, windows and sequence, so the
epoch goes on as if it had not stopped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from sparkhvd.data.order import (
    MIXING_RANKS,
    Piece,
    epoch_pieces,
    partition_window_rows,
    plan_partition,
)

if TYPE_CHECKING:
    import numpy as np

__side__ = "common"  # numpy inside the functions: nothing third-party at import time

#: Seed tag of a window a rank draws from a run (those of the round robin's windows are
#: :data:`sparkhvd.data.order._ROWS`).
_RUN_WINDOW = 4


@dataclass(frozen=True)
class Unit:
    """Rows ``[lo, hi)`` of partition ``partition``'s epoch sequence of pieces, drawn in their
    own sequence -- one window permuted by ``key``'s generator, or (``key`` None) a run: its
    windows in turn (:meth:`Sequences.windows`) -- of which the rows ``[first, last)`` are
    left to train."""

    partition: int
    lo: int
    hi: int
    key: Optional[tuple[int, ...]] = None
    first: int = 0
    last: int = -1  # -1: to the end (``hi - lo``)
    #: rows of the partition's pieces in the layout's order, the same every epoch (a run a
    #: rank keeps in memory: the same row groups every epoch), not the epoch's
    layout: bool = False
    #: a run's windows are at least this many rows (0: a partition's share of the shuffle
    #: window, :attr:`Sequences.window_rows`), set by the deal that gave it to a rank
    #: (:meth:`Deal.spans`) and kept once it is drawn from
    window: int = 0
    #: a window's rows ``[lo + a, lo + b)`` only (None: all of them): its sequence is the
    #: window's permuted rows that lie there, in the window's order, and ``first``/``last``
    #: count in it -- part of a window a rank was drawn from, given to another by the row
    #: groups it lies in (:func:`split_by_rows`), so that rank reads only those
    part: Optional[tuple[int, int]] = None

    def __post_init__(self) -> None:
        if self.last < 0:
            object.__setattr__(self, "last", self.hi - self.lo)

    @property
    def rows(self) -> int:
        return self.last - self.first

    def as_list(self) -> list:
        return [self.partition, self.lo, self.hi, list(self.key) if self.key else None,
                self.first, self.last, int(self.layout), self.window,
                list(self.part) if self.part else None]

    @classmethod
    def of(cls, value: Sequence) -> "Unit":
        c, lo, hi, key, first, last, layout, *more = value  # saved before window, part: none
        part = more[1] if len(more) > 1 and more[1] else None
        return cls(int(c), int(lo), int(hi), tuple(int(k) for k in key) if key else None,
                   int(first), int(last), bool(layout), int(more[0]) if more else 0,
                   (int(part[0]), int(part[1])) if part else None)

    @property
    def fresh(self) -> bool:
        """A run nothing was drawn from yet."""
        return self.key is None and self.first == 0 and self.last == self.hi - self.lo

    def with_rows(self, lo: int, hi: int, first: int = 0, last: int = -1) -> "Unit":
        """This unit's kind (window key, order, windows' size, part) over other rows."""
        return Unit(self.partition, lo, hi, self.key, first, last, self.layout, self.window,
                    self.part)

    def with_window(self, rows: int) -> "Unit":
        """This unit, its windows at least ``rows`` rows."""
        return Unit(self.partition, self.lo, self.hi, self.key, self.first, self.last,
                    self.layout, rows, self.part)


@dataclass(frozen=True)
class Deal:
    """What was left of the epoch (``units``), dealt to ``size`` ranks: each runs the lead-in
    step (its part of ``lead`` rows, if any), then ``steps`` full steps of ``batch`` rows,
    drawing from at least ``window`` rows at once (0, a deal saved before it: from a window
    of each of its units)."""

    units: tuple[Unit, ...]
    size: int
    batch: int
    lead: int
    steps: int
    window: int = 0

    def lead_of(self, rank: int) -> int:
        """Rank ``rank``'s rows of the lead-in step (0: none)."""
        return self.lead // self.size + (1 if rank < self.lead % self.size else 0) \
            if self.lead else 0

    @property
    def total_steps(self) -> int:
        return self.steps + (1 if self.lead else 0)

    def rank_rows(self, rank: int, steps: Optional[int] = None) -> int:
        """Rows rank ``rank`` trains in the first ``steps`` steps (default: all of them)."""
        n = self.total_steps if steps is None else min(steps, self.total_steps)
        if n <= 0:
            return 0
        if self.lead:
            return self.lead_of(rank) + (n - 1) * self.batch
        return n * self.batch

    def consumed(self, steps: int) -> int:
        """Rows all ranks together trained in the first ``steps`` steps."""
        return sum(self.rank_rows(r, steps) for r in range(self.size))

    def spans(self) -> list[list[Unit]]:
        """Each rank's units, in rank order (the rows after the last rank's are left out). A
        rank draws from a window of each of its units at once, so where a span holds few units
        (fewer than ``P / 8``: a share of about a partition or less, past 8 ranks) its runs
        nothing was drawn from get windows of ``window / units`` rows (where that is more than
        a partition's share of the shuffle window): a rank's batches always draw from about
        ``window`` rows or more -- enough row groups to mix -- at the cost of reading further
        ahead."""
        spans: list[list[Unit]] = []
        queue = list(self.units)
        for rank in range(self.size):
            need, span = self.rank_rows(rank), []
            while need > 0:
                unit = queue.pop(0)
                if unit.rows <= need:
                    span.append(unit)
                    need -= unit.rows
                else:
                    head, tail = split(unit, need)
                    span.append(head)
                    queue.insert(0, tail)
                    need = 0
            if self.window and span:
                rows = -(-self.window // len(span))
                span = [u.with_window(rows) if u.fresh and not u.window else u for u in span]
            spans.append(span)
        return spans

    def undealt(self) -> list[Unit]:
        """The units after the last rank's span (left out if the epoch ends with this deal)."""
        skip = sum(self.rank_rows(r) for r in range(self.size))
        rest: list[Unit] = []
        for unit in self.units:
            if skip >= unit.rows:
                skip -= unit.rows
                continue
            rest.append(split(unit, skip)[1] if skip else unit)
            skip = 0
        return rest

    def as_dict(self) -> dict[str, Any]:
        return {"units": [u.as_list() for u in self.units], "size": self.size,
                "batch": self.batch, "lead": self.lead, "steps": self.steps,
                "window": self.window}

    @classmethod
    def of(cls, value: Mapping[str, Any]) -> "Deal":
        return cls(tuple(Unit.of(u) for u in value["units"]), int(value["size"]),
                   int(value["batch"]), int(value["lead"]), int(value["steps"]),
                   int(value.get("window", 0)))


def split(unit: Unit, rows: int) -> tuple[Unit, Unit]:
    """``unit``'s next ``rows`` rows and the rest. A run nothing was drawn from yet is cut
    between its pieces' rows (the two halves share at most one row group); anything else
    between rows of its own sequence (the two share the window the cut falls in)."""
    if unit.fresh:
        cut = unit.lo + rows
        return unit.with_rows(unit.lo, cut), unit.with_rows(cut, unit.hi)
    cut = unit.first + rows
    return (unit.with_rows(unit.lo, unit.hi, unit.first, cut),
            unit.with_rows(unit.lo, unit.hi, cut, unit.last))


def split_by_rows(unit: Unit, rows: int) -> tuple[Unit, Unit]:
    """``rows`` of a window's rows left (``unit.key`` set) and the rest, cut by where they lie:
    the head those in the window's rows before some row, the tail those at or after it -- each
    drawn in the window's order still. Unlike :func:`split`, the two share at most a row group:
    the rank given the tail reads only the row groups it lies in, not the window's."""
    import numpy as np

    assert unit.key is not None and 0 < rows < unit.rows
    a, b = unit.part or (0, unit.hi - unit.lo)
    order = own_order(unit)
    cut = int(np.sort(order[unit.first:unit.last])[rows])
    halves = []
    for lo, hi in ((a, cut), (cut, b)):
        inside = (order >= lo) & (order < hi)
        halves.append(Unit(unit.partition, unit.lo, unit.hi, unit.key,
                           int(inside[:unit.first].sum()), int(inside[:unit.last].sum()),
                           unit.layout, unit.window, (lo, hi)))
    return halves[0], halves[1]


def own_order(window: Unit) -> np.ndarray:
    """A window's rows (from its ``lo``) in the order its sequence draws them: its permutation,
    or (``part`` set) the permutation's rows that lie in the part."""
    import numpy as np

    assert window.key is not None
    order = np.random.default_rng(list(window.key)).permutation(window.hi - window.lo)
    if window.part is not None:
        order = order[(order >= window.part[0]) & (order < window.part[1])]
    return order


def deal(units: Sequence[Unit], *, size: int, batch: int, num_rows: int,
         window_rows: int = 0) -> Deal:
    """Deal what is left of the epoch to ``size`` ranks of ``batch`` rows per step: the epoch
    ends where a run of ``size`` ranks that never resized ends it (``num_rows`` less
    ``num_rows % (size * batch)``); the steps up to there are full but a lead-in step first
    where the rows left call for one (fewer rows than ranks: left out instead). Each rank
    draws from at least ``1 / MIXING_RANKS`` of the shuffle window of ``window_rows`` rows
    (:meth:`Deal.spans`)."""
    left = sum(u.rows for u in units)
    train = max(0, left - num_rows % (size * batch))
    steps, lead = divmod(train, size * batch)
    if lead < size:
        lead = 0
    return Deal(tuple(u for u in units if u.rows), size, batch, lead, steps,
                -(-window_rows // MIXING_RANKS))


class Sequences:
    """Each partition's epoch sequence of pieces (:func:`~sparkhvd.data.order.epoch_pieces`),
    sliced by rows, and the windows a unit's rows are drawn in -- what every rank computes
    the same way, from the layout alone (no file is read)."""

    def __init__(self, parts: Sequence[Sequence[Piece]], *, shuffle: bool, seed: int,
                 epoch: int, window_rows: int) -> None:
        self.parts, self.shuffle, self.seed, self.epoch = parts, shuffle, seed, epoch
        #: rows of a window a unit is drawn in (a partition's share of the shuffle window)
        self.window_rows = partition_window_rows(window_rows, len(parts))
        self._ordered: dict[tuple[int, bool], tuple[list[Piece], np.ndarray]] = {}

    def ordered(self, partition: int, layout: bool = False) -> tuple[list[Piece], np.ndarray]:
        """Partition ``partition``'s pieces in the epoch's order (``layout``: the layout's), and
        where each starts."""
        import numpy as np

        found = self._ordered.get((partition, layout))
        if found is None:
            pieces = list(self.parts[partition]) if layout else epoch_pieces(
                self.parts[partition], partition=partition, shuffle=self.shuffle,
                seed=self.seed, epoch=self.epoch)
            starts = np.cumsum([0] + [p.rows for p in pieces])
            found = self._ordered[(partition, layout)] = (pieces, starts)
        return found

    def pieces(self, unit: Unit) -> list[Piece]:
        """The pieces holding ``unit``'s rows ``[lo, hi)`` (cut at the ends)."""
        import numpy as np

        lo, hi = (unit.lo + unit.part[0], unit.lo + unit.part[1]) if unit.part \
            else (unit.lo, unit.hi)
        pieces, starts = self.ordered(unit.partition, unit.layout)
        out = []
        k = int(np.searchsorted(starts, lo, side="right")) - 1
        while k < len(pieces) and starts[k] < hi:
            p, at = pieces[k], int(starts[k])
            a, b = max(lo, at) - at, min(hi, at + p.rows) - at
            if b > a:
                out.append(Piece(p.file, p.group, p.lo + a, p.lo + b))
            k += 1
        return out

    def windows(self, unit: Unit) -> list[Unit]:
        """The windows ``unit``'s rows are drawn in, in order: itself when it is one; a run's
        rows in whole pieces of at least :attr:`window_rows` rows (from its first row), each
        permuted when shuffled."""
        import numpy as np

        if unit.key is not None:
            whole = len(own_order(unit)) if unit.part else -1
            return [unit.with_rows(unit.lo, unit.hi, 0, whole)]
        _, starts = self.ordered(unit.partition, unit.layout)
        out, lo, size = [], unit.lo, max(self.window_rows, unit.window)
        while lo < unit.hi:
            # the first piece end at or after lo + size, or the run's end
            k = int(np.searchsorted(starts, lo + size, side="left"))
            hi = min(unit.hi, int(starts[k]) if k < len(starts) else unit.hi)
            rows = hi - lo
            key = (self.seed, self.epoch, unit.partition, _RUN_WINDOW, int(unit.layout), lo) \
                if self.shuffle else None
            out.append(Unit(unit.partition, lo, hi, key, 0, rows, unit.layout))
            lo = hi
        return out


def permutation(window: Unit) -> Optional[np.ndarray]:
    """A window's order of rows (None: in the pieces' order)."""
    import numpy as np

    if window.key is None:
        return None
    if window.part is not None:  # the part's rows, from its first (what is read of it)
        return own_order(window) - window.part[0]
    return np.random.default_rng(list(window.key)).permutation(window.hi - window.lo)


def taken(span: Sequence[Unit], n: int) -> list[int]:
    """Rows each unit of a rank's ``span`` gave after ``n`` rows of the rank's sequence: a
    round robin over the units by their rows' places in their own sequences (row ``j`` of
    every unit that has it, in unit order, then row ``j + 1``), so a span that resumes part
    way goes on exactly as it would have."""
    if not span:
        return []

    def upto(j: int) -> int:  # rows at places below j
        return sum(min(max(j - u.first, 0), u.rows) for u in span)

    lo, hi = min(u.first for u in span), max(u.last for u in span)
    while lo < hi:  # the largest j with upto(j) <= n
        mid = (lo + hi + 1) // 2
        if upto(mid) <= n:
            lo = mid
        else:
            hi = mid - 1
    counts = [min(max(lo - u.first, 0), u.rows) for u in span]
    extra = n - sum(counts)
    for k, u in enumerate(span):
        if extra <= 0:
            break
        if u.first <= lo < u.last:
            counts[k] += 1
            extra -= 1
    return counts


def rest(unit: Unit, used: int) -> list[Unit]:
    """What is left of ``unit`` once ``used`` more of its rows were trained (a run nothing was
    drawn from sheds its windows' size: the next deal sets its own)."""
    if used >= unit.rows:
        return []
    if used == 0 and unit.fresh:
        return [unit.with_window(0)]
    return [unit.with_rows(unit.lo, unit.hi, unit.first + used, unit.last)]


def left_after(done: Deal, steps: int) -> list[Unit]:
    """The units left of the epoch after ``steps`` steps of ``done``: each rank's span less what
    it trained, in rank order, then what the deal left undealt."""
    return [unit for unit, _ in left_by_rank(done, steps)]


def left_by_rank(done: Deal, steps: int) -> list[tuple[Unit, Optional[int]]]:
    """:func:`left_after`'s units, each with the rank whose span it was (None: undealt)."""
    left: list[tuple[Unit, Optional[int]]] = []
    for rank, span in enumerate(done.spans()):
        for unit, used in zip(span, taken(span, done.rank_rows(rank, steps))):
            left += [(u, rank) for u in rest(unit, used)]
    return left + [(u, None) for u in done.undealt()]


def by_host(dealt: Deal, homes: Sequence[Optional[int]], was: Sequence[str],
            now: Sequence[str]) -> Deal:
    """``dealt`` with its units laid out so that each rank's span begins with the units a rank
    of the attempt before held on the same host -- their rows were read there, and are kept
    there (:mod:`sparkhvd.data.row_group_cache`) -- and is filled up from what no rank on its
    host held: the units of a host that is gone, and the rows a host held beyond its ranks'
    spans now (those at the end of each of its ranks' units: a run's rows not drawn yet). A
    window cut between two ranks is cut by where its rows lie (:func:`split_by_rows`): the
    rank on another host reads only the row groups of its part, not the whole window.

    ``homes``: the rank of the attempt before that held each of ``dealt.units`` (None: none);
    ``was`` and ``now``: the hosts of that attempt's ranks and of these. A host's earlier
    ranks are matched to its ranks now in rank order (the ``j``-th earlier rank on a host to
    its ``j % n``-th of ``n`` now). The same rows, the same steps: only which rank trains which
    of them changes (with the same hosts in the same order, nothing does)."""
    size = dealt.size
    ranks_now: dict[str, list[int]] = {}
    for rank, host in enumerate(now):
        ranks_now.setdefault(host, []).append(rank)
    seen: dict[str, int] = {}
    mapped: dict[int, int] = {}
    for old, host in enumerate(was):
        j = seen[host] = seen.get(host, -1) + 1
        if host in ranks_now:
            mapped[old] = ranks_now[host][j % len(ranks_now[host])]
    own: list[list[Unit]] = [[] for _ in range(size)]
    orphans: list[Unit] = []
    for unit, home in zip(dealt.units, homes):
        if home is not None and home in mapped:
            own[mapped[home]].append(unit)
        else:
            orphans.append(unit)
    spans: list[list[Unit]] = [[] for _ in range(size)]
    extra: list[Unit] = []
    need = [dealt.rank_rows(rank) for rank in range(size)]
    for rank in range(size):
        extra += _fill(spans[rank], own[rank], need, rank)
    pool = extra + orphans
    for rank in range(size):
        pool = _fill(spans[rank], pool, need, rank)
    return Deal(tuple(u for span in spans for u in span) + tuple(pool), size, dealt.batch,
                dealt.lead, dealt.steps, dealt.window)


def _fill(span: list[Unit], units: list[Unit], need: list[int], rank: int) -> list[Unit]:
    """Add ``units`` to ``span`` in turn while rank ``rank`` needs rows (the last one split);
    what is left of them."""
    for k, unit in enumerate(units):
        if need[rank] <= 0:
            return units[k:]
        if unit.rows <= need[rank]:
            span.append(unit)
            need[rank] -= unit.rows
            continue
        head, tail = (split_by_rows if unit.key is not None else split)(unit, need[rank])
        span.append(head)
        need[rank] = 0
        return [tail] + units[k + 1:]
    return []


def units_at(samples: int, *, sequences: Sequences, window_rows: int,
             layout: bool = False) -> list[Unit]:
    """The units left of the round robin's epoch (:mod:`sparkhvd.data.order`) after
    ``samples`` positions: of each partition, the rest of the window it stopped in (drawn as
    the round robin draws it) and a run of the rest. ``layout``: a partition nothing was drawn
    from is a run in the layout's order (ranks that keep their share: the same row groups
    every epoch)."""
    from sparkhvd.data.order import _ROWS

    parts = sequences.parts
    count = len(parts)
    units: list[Unit] = []
    per_partition = partition_window_rows(window_rows, count)
    for c, pieces in enumerate(parts):
        rows = sum(p.rows for p in pieces)
        used = max(0, -(-(samples - c) // count)) if samples > c else 0
        if used >= rows:
            continue
        if used == 0:
            units.append(Unit(c, 0, rows, layout=layout))
            continue
        if not sequences.shuffle:
            units.append(Unit(c, used, rows))
            continue
        for w in plan_partition(pieces, per_partition, partition=c, shuffle=True,
                                seed=sequences.seed, epoch=sequences.epoch):
            if w.start <= used < w.end:
                if used > w.start:
                    key = (sequences.seed, sequences.epoch, c, _ROWS, w.number)
                    units.append(Unit(c, w.start, w.end, key, used - w.start))
                    if w.end < rows:
                        units.append(Unit(c, w.end, rows))
                else:
                    units.append(Unit(c, w.start, rows))
                break
    return units


def rank_rows_between(span: Sequence[Unit], n0: int, n1: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[n0, n1)`` of a rank's sequence over ``span``: which unit each comes from and its
    place in that unit's own sequence, in the order of :func:`taken`."""
    import numpy as np

    a, b = taken(span, n0), taken(span, n1)
    unit = np.concatenate([np.full(hi - lo, k, dtype=np.int64)
                           for k, (lo, hi) in enumerate(zip(a, b))] or [np.zeros(0, np.int64)])
    place = np.concatenate([np.arange(u.first + lo, u.first + hi, dtype=np.int64)
                            for u, lo, hi in zip(span, a, b)] or [np.zeros(0, np.int64)])
    order = np.lexsort((unit, place))  # by place, then unit
    return unit[order], place[order]
