"""Every sample once, across resizes, epoch ends, kills and runs: proven over random chains.

Hypothesis draws chains of attempts -- each a number of ranks from 1 to 16 (numbers that
divide the partition count and numbers that do not), grown and shrunk mid-epoch and at an
epoch's end, ended by a SIGKILL at any point (between steps, or inside a save: before, while
and after its file, its record, ``latest.json`` and the pruning), by a notice (a checkpoint
after the step, then a resize), or run to the end -- and runs of them resumed by later runs
(``resume_from``), resumes of resumes. Each chain runs in this process, with nothing mocked
on the path a sample's position takes:

- **the data room**: each rank its own ``DatasetShard`` over real Parquet files (written here
  with pyarrow, as the materialiser writes them), read shuffled or not, kept or streamed;
- **the checkpoint lineage**: rank 0's ``sparkhvd.torch.Checkpoints`` of a one-layer model
  (``every_steps``, ``keep`` 1-3, ``async_save``, epoch-end saves, as drawn) writing its run
  folder's ``checkpoints/`` -- straight into it, or, rank 0 on another host, through the
  driver's real run-folder service on loopback -- and a relaunch or a resumed run reading
  through that service the folder the driver hands it
  (:func:`sparkhvd.checkpoint.lineage.resumable`: the run's own when it holds a checkpoint,
  else the run it resumes).

The kill is an exception (:class:`Killed`) raised where the process would die: from the
store, between the steps of a save, or from a background save's thread of work (a stand-in
for the writer thread that runs the save's real work when the chain says it ends). What a
kill loses is what the process held: the training since the checkpoint the next attempt
resumes from.

Asserted of every chain: every id of every epoch is trained exactly once -- less the tail
of rows a run that never resized leaves out at the epoch's last size, and the rows a resize
left short of a step boundary (said in the log, counted here) -- the resume point is always
the newest complete checkpoint in the folder resumed (so pruning never removed it), ``keep``
is kept, and a synchronous checkpoint is never further behind than its cadence promises.

``SPARKHVD_PROPERTY_EXAMPLES`` sets how many chains are drawn (default 100, beside the three
found from outside: about 25 s on 2 idle cores), ``SPARKHVD_PROPERTY_RANDOM=1`` draws new ones at
each run (CI draws the same ones).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import sparkhvd.runfolder.rank_files as rank_files  # noqa: E402
from sparkhvd.checkpoint.lineage import progress_of, resumable  # noqa: E402
from sparkhvd.checkpoint.stores import RunFolderStore  # noqa: E402
from sparkhvd.common import function_end, protocol  # noqa: E402
from sparkhvd.data.shard import DatasetShard  # noqa: E402
from sparkhvd.data.sharding import ShardSource  # noqa: E402
from sparkhvd.elastic import notices  # noqa: E402
from sparkhvd.elastic.notices import Preempted  # noqa: E402
from sparkhvd.runfolder.service import RunFileService  # noqa: E402
from sparkhvd.torch.checkpoints import Checkpoints  # noqa: E402

EXAMPLES = int(os.environ.get("SPARKHVD_PROPERTY_EXAMPLES", "100"))
#: Set: chains drawn anew at each run (else the same ones every run: CI's).
RANDOM_ENV = "SPARKHVD_PROPERTY_RANDOM"
#: A failing chain is shown as drawn (each try of a smaller one costs a chain's run); set
#: ``SPARKHVD_PROPERTY_SHRINK=1`` to have hypothesis look for a smaller one.
PHASES = [Phase.explicit, Phase.generate] + \
    ([Phase.shrink] if os.environ.get("SPARKHVD_PROPERTY_SHRINK") else [])


class Killed(BaseException):
    """The attempt's ranks were killed here (SIGKILL: nothing of the process runs after)."""


# -- the tables ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Table:
    source: ShardSource
    rows: int


def _table(folder, rows: int, group_rows: int, partitions: int) -> Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    paths, counts, groups = [], [], []
    for f, idx in enumerate(np.array_split(np.arange(rows, dtype=np.int64), 3)):
        path = os.path.join(folder, f"part-{f:05d}.parquet")
        pq.write_table(pa.table({"id": idx, "label": idx % 10}), path,
                       row_group_size=group_rows)
        meta = pq.ParquetFile(path).metadata
        paths.append(path)
        counts.append(len(idx))
        groups.append(tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
    source = ShardSource(files=tuple(paths), row_counts=tuple(counts),
                         row_groups=tuple(groups), stored={"id": "id", "label": "label"},
                         row_bytes=16, features=("id",), label="label",
                         partitions=partitions)
    return Table(source, rows)


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> list[Table]:
    """Three tables: 24 partitions (the default) with rows that no step size divides, and 10
    partitions -- every number of ranks from 1 to 16 deals some of them."""
    base = tmp_path_factory.mktemp("tables")
    return [_table(str(base / "a"), 403, 17, 24), _table(str(base / "b"), 251, 9, 24),
            _table(str(base / "c"), 317, 13, 10)]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The driver's run-folder service, on loopback (each attempt points it at its folders)."""
    server = RunFileService("127.0.0.1", str(tmp_path_factory.mktemp("service"))).start()
    yield server
    server.shutdown()
    server.server_close()


# -- a chain ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Attempt:
    """One launch of ``size`` ranks: it trains ``steps`` steps (``soon``: ``steps % 3`` steps
    into the second epoch it hands out -- just after an epoch's end), then ends by ``end`` --
    ``"kill"`` (between steps), ``"kill-in-save"`` (at the ``at``-th thing the store does
    after that: a save's file begun, written, its record, ``latest.json``, a prune's
    deletion), ``"notice"`` (a checkpoint after the next step, or at the epoch's end, then the
    resize), or it runs to the end when it gets there first. ``new_run``: the attempt starts a
    new run that resumes the last one (``resume_from``). ``remote``: rank 0 is on another host
    than the run folder (it writes through the driver's service)."""

    size: int
    steps: int
    end: str
    at: int = 1
    soon: bool = False
    new_run: bool = False
    remote: bool = False
    hosts: int = 1


@dataclass(frozen=True)
class Chain:
    table: int
    batch: int
    epochs: int
    shuffle: bool
    seed: int
    streamed: bool
    window: Optional[int]
    every_steps: Optional[int]
    keep: Optional[int]
    async_save: bool
    save_epochs: bool
    write_steps: int  # async: a background write ends this many steps after it began
    attempts: tuple[Attempt, ...]


attempts = st.builds(
    Attempt, size=st.integers(1, 16), steps=st.integers(0, 80),
    end=st.sampled_from(["kill", "kill", "kill-in-save", "notice", "notice", "finish"]),
    at=st.integers(1, 9), soon=st.booleans(), new_run=st.booleans(), remote=st.booleans(),
    hosts=st.integers(1, 3))
chains = st.builds(
    Chain, table=st.integers(0, 2), batch=st.integers(1, 4), epochs=st.integers(1, 3),
    shuffle=st.booleans(), seed=st.integers(0, 3), streamed=st.booleans(),
    window=st.sampled_from([None, 40, 120]),
    every_steps=st.sampled_from([None, None, None, 1, 2, 3, 5, 8]),
    keep=st.sampled_from([None, 1, 2, 3]), async_save=st.booleans(),
    save_epochs=st.sampled_from([True, True, False]), write_steps=st.integers(0, 3),
    attempts=st.lists(attempts, min_size=2, max_size=8).map(tuple))


def _issue_chain(*then: Attempt) -> Chain:
    """403 rows in batches of 4, shuffled, saved at each epoch's end; 4 ranks train 3 steps and
    checkpoint after the 4th on a notice; then ``then``."""
    return Chain(table=0, batch=4, epochs=2, shuffle=True, seed=0, streamed=False, window=None,
                 every_steps=None, keep=None, async_save=False, save_epochs=True,
                 write_steps=0, attempts=(Attempt(4, 3, "notice"), *then))


# -- the kill's seams ------------------------------------------------------------------------
@dataclass
class Switch:
    """Counts what the store does; raises :class:`Killed` at the ``at``-th thing once armed."""

    at: Optional[int] = None
    count: int = 0

    def arm(self, after: int) -> None:
        self.at = self.count + after

    def tick(self, what: str) -> None:
        self.count += 1
        if self.at is not None and self.count >= self.at:
            self.at = None
            raise Killed(what)


class KillableStore(RunFolderStore):
    """The run folder's checkpoints, as rank 0's helper writes them, with a kill switch; and
    what was committed there (a record written: the checkpoint is complete)."""

    def __init__(self, switch: Switch) -> None:
        super().__init__("run")
        self.switch = switch

    @contextlib.contextmanager
    def open_write(self, name):
        self.switch.tick(f"begin {name}")
        with super().open_write(name) as f:
            yield f
            self.switch.tick(f"half of {name}")  # killed mid-file: never renamed in
        self.switch.tick(f"wrote {name}")

    def write(self, name, data):
        self.switch.tick(f"begin {name}")
        super().write(name, data)
        self.switch.tick(f"wrote {name}")

    def write_file(self, name, local_path):
        self.switch.tick(f"send {name}")
        super().write_file(name, local_path)

    def delete(self, name):
        self.switch.tick(f"delete {name}")
        super().delete(name)


class WriterThread:
    """``BackgroundSave`` whose thread of work runs when the chain says the write ends --
    ``write_steps`` steps after it began, or when the next save or the function's end waits
    for it -- or never (the process was killed first): the save's real work at a known
    moment."""

    def __init__(self, write_steps: int, written: Callable[[], None]) -> None:
        self.write_steps, self.written = write_steps, written
        self.work: Optional[Callable[[], None]] = None
        self.due = 0
        self.name, self.skipped, self.last_write_s = "", 0, 0.0
        self._error: Optional[BaseException] = None

    @property
    def busy(self) -> bool:
        return self.work is not None

    def start(self, name: str, work: Callable[[], None]) -> None:
        self.raise_error()
        self.name, self.skipped, self.work, self.due = name, 0, work, self.write_steps

    def run(self) -> None:
        work, self.work = self.work, None
        if work is None:
            return
        try:
            work()
        except Killed:
            raise
        except BaseException as exc:  # noqa: BLE001 - kept, as the real thread keeps it
            self._error = exc
            return
        self.written()

    def wait(self) -> None:
        self.run()
        self.raise_error()

    def raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def skip(self, due: str, snapshot: bool = False) -> None:
        self.skipped += 1

    def tick(self) -> None:
        """A step went by: the write ends when it is due."""
        if self.work is not None:
            self.due -= 1
            if self.due < 0:
                self.run()


# -- running a chain -------------------------------------------------------------------------
#: A step trained: its epoch, the attempt that trained it (counted over the chain), that
#: attempt's size, the ids.
Step = tuple[int, int, int, tuple[int, ...]]


def _records(run: str) -> set[tuple[int, int]]:
    """``(epoch, step)`` of the checkpoints whose records are in run folder ``run``."""
    return {p for p in map(progress_of, os.listdir(os.path.join(run, "checkpoints")))
            if p is not None}


class Left(logging.Handler):
    """Rows a resize left short of a step boundary, as rank 0 says them: epoch -> rows."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.rows: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = re.match(r"Epoch (\d+) resumes .*?(\d+) row\(s\) short of a step boundary",
                         record.getMessage())
        if match:
            epoch, rows = int(match.group(1)), int(match.group(2))
            self.rows[epoch] = self.rows.get(epoch, 0) + rows


@dataclass
class Launched:
    """One attempt of the chain: its size, the checkpoint it resumed (a token, None: none),
    the epochs it handed out, and the rows it said a resize left out of each."""

    size: int
    resumed: Optional[int] = None
    restored: Optional[tuple[int, int]] = None
    handed: list[int] = field(default_factory=list)
    left: dict[int, int] = field(default_factory=dict)


@dataclass
class Chained:
    """What a chain did so far: its run folders and attempts, the steps trained that count
    (the ledger: what the checkpoint resumed held, and the steps since), and what each
    checkpoint saved of it (a token -> the ledger then, and the attempt that saved it)."""

    base: str
    runs: list[str] = field(default_factory=list)
    attempts: list[Launched] = field(default_factory=list)
    ledger: list[Step] = field(default_factory=list)
    saved: dict[int, tuple[tuple[Step, ...], int]] = field(default_factory=dict)

    def new_run(self) -> str:
        run = os.path.join(self.base, f"run-{len(self.runs)}")
        os.makedirs(os.path.join(run, "checkpoints"))
        self.runs.append(run)
        return run

    def source(self) -> Optional[str]:
        """The checkpoints the driver hands the next attempt: the run's own when it holds a
        checkpoint, else the newest earlier run's that does (``resume_from=True``)."""
        for run in reversed(self.runs):
            found = resumable(os.path.join(run, "checkpoints"))
            if found:
                return found
        return None

    def token(self) -> int:
        """What a checkpoint saves of the training: the ledger now, by number."""
        self.saved[len(self.saved)] = (tuple(self.ledger), len(self.attempts) - 1)
        return len(self.saved) - 1

    def last_hand_out(self, epoch: int) -> Launched:
        """The attempt whose hand-out of ``epoch`` ended it: the last of the lineage (the final
        attempt, the one that saved the checkpoint it resumed, and so on back) to hand the
        epoch out before the checkpoint its successor resumed -- even with no step left in it
        (its size decides the tail, and what it leaves short of a step boundary)."""
        lineage, at = [], self.attempts[-1]
        cut: Optional[tuple[int, int]] = None  # (epoch, step) its successor resumed at
        while True:
            lineage.append((at, cut))
            if at.resumed is None:
                break
            ledger, by = self.saved[at.resumed]
            cut = at.restored
            at = self.attempts[by]
        for attempt, cut in lineage:  # newest first
            if epoch in attempt.handed and (cut is None or epoch < cut[0] or
                                            (epoch == cut[0] and cut[1] > 0)):
                return attempt
        raise AssertionError(f"no attempt handed epoch {epoch} out")


def run_chain(chain: Chain, table: Table, base: str, service: RunFileService) -> None:
    """Run ``chain`` on ``table`` in run folders under ``base``, the driver's run-folder
    ``service`` pointed at each attempt's run folder and resume source (what it reads at each
    request); then check every epoch's ids."""
    done = Chained(base)
    done.new_run()
    _run_attempts(chain, table, done, service)
    _every_id_once(chain, table, done)


def _run_attempts(chain: Chain, table: Table, done: Chained, service: RunFileService) -> None:
    run, number = done.runs[-1], 0
    plan = list(chain.attempts) + [Attempt(size=chain.attempts[-1].size, steps=10 ** 6,
                                           end="finish")]
    for attempt in plan:
        if attempt.new_run and _records(run):
            run, number = done.new_run(), 0
        number += 1
        source = done.source()
        service.run_path, service.resume = run, (source, {}) if source else None
        expected = max(_records(os.path.dirname(source)), default=None) if source else None
        left = Left()
        done.attempts.append(Launched(attempt.size, left=left.rows))
        logging.getLogger("sparkhvd.data").addHandler(left)
        try:
            restored, finished = _attempt(chain, table, attempt, run, number, source, done,
                                          service)
        finally:
            logging.getLogger("sparkhvd.data").removeHandler(left)
        assert restored == expected, (
            f"attempt {number} of {run} resumed from {restored}, but the newest complete "
            f"checkpoint in {source} is {expected}")
        if finished:
            break


def _attempt(chain: Chain, table: Table, attempt: Attempt, run: str, number: int,
             source: Optional[str], done: Chained, service: RunFileService
             ) -> tuple[Optional[tuple[int, int]], bool]:
    """One attempt: the ranks restore, train, save, and end as ``attempt`` says. Returns the
    ``(epoch, step)`` it resumed from and whether the run finished."""
    size = attempt.size
    hosts = [f"host-{r * attempt.hosts // size}" for r in range(size)]
    env = {**service.env(), protocol.ATTEMPT_ENV: str(number),
           protocol.RUN_URL_ENV: "" if attempt.remote else run,
           protocol.RANK_HOSTS_ENV: ",".join(hosts), protocol.RESUME_URL_ENV: source or ""}
    switch = Switch()
    shards = [DatasetShard(table.source) for _ in range(size)]
    for shard in shards:
        shard.memory_cache = 0 if chain.streamed else 1 << 30
    restored: Optional[tuple[int, int]] = None
    with _environ(env):
        rank_files._shared = None
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        ckpt = Checkpoints(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           data=shards[0], every_steps=chain.every_steps, keep=chain.keep,
                           async_save=chain.async_save, host_copy=False)
        ckpt.store = KillableStore(switch)
        writer = None
        if chain.async_save:
            writer = ckpt._background = WriterThread(chain.write_steps, lambda: _kept(chain,
                                                                                        run))
        try:
            epoch = ckpt.restore()
            me = done.attempts[-1]
            if "epoch" in ckpt.restored:
                restored = me.restored = (ckpt.restored["epoch"], ckpt.restored["step"])
                me.resumed = ckpt.restored["token"]
                done.ledger = list(done.saved[me.resumed][0])
            else:
                done.ledger = []
            for shard in shards[1:]:  # every rank reads the same checkpoint
                shard.load_state_dict(shards[0].state_dict() if restored else None)
            _train(chain, attempt, number, shards, ckpt, epoch, done, writer, switch, run)
            function_end.function_ended(returned=True)  # waits for the save in flight
            return restored, True
        except (Killed, Preempted):
            return restored, False
        finally:
            function_end._CALLBACKS.clear()
            function_end._ON_RETURN.clear()
            notices._state.noticed = None
            rank_files.run_files().close()


def _train(chain: Chain, attempt: Attempt, number: int, shards: list, ckpt: Checkpoints,
           first: int, done: Chained, writer: Optional[WriterThread], switch: Switch,
           run: str) -> None:
    """The user's loop on every rank, step by step together, ended as ``attempt`` says."""
    size, steps = attempt.size, 0
    end = None if attempt.soon else attempt.steps  # the step the attempt ends after
    for epoch in range(first, chain.epochs):
        if end is None and epoch > first:
            end = steps + attempt.steps % 3
        done.attempts[-1].handed.append(epoch)
        batches = [shard.batches(chain.batch, epoch, rank=r, size=size, shuffle=chain.shuffle,
                                 seed=chain.seed, shuffle_buffer=chain.window)
                   for r, shard in enumerate(shards)]
        for step in zip(*batches):
            if attempt.end == "kill" and end is not None and steps >= end:
                raise Killed(f"after step {steps}")
            done.ledger.append((epoch, len(done.attempts) - 1, size,
                                tuple(int(i) for x, _ in step for i in x)))
            steps += 1
            now = shards[0].position.step
            name = ckpt.step(epoch, token=done.token())
            if chain.every_steps and now % chain.every_steps == 0 and not chain.async_save:
                assert name is not None, f"a checkpoint was due after step {now}: none saved"
            if name is not None and not chain.async_save:
                _kept(chain, run)
            if steps == end and attempt.end == "kill-in-save":
                switch.arm(attempt.at)
            if steps == end and attempt.end == "notice":
                notices._state.noticed = "SIGTERM"
            if writer is not None:
                writer.tick()
        for rest in batches:
            assert next(rest, None) is None, "every rank runs the same steps"
        if attempt.end == "kill" and end is not None and steps >= end:
            raise Killed(f"after step {steps}, before the epoch's save")
        if chain.save_epochs or notices._state.noticed:
            ckpt.save(epoch, token=done.token())
            if not chain.async_save:
                _kept(chain, run)


def _kept(chain: Chain, run: str) -> None:
    """After a save is written: ``keep=`` kept its word."""
    if chain.keep:
        assert len(_records(run)) <= chain.keep, f"more than keep={chain.keep} checkpoints"


def _every_id_once(chain: Chain, table: Table, done: Chained) -> None:
    """Each epoch's ids trained once; all of them but the tail at its last size and what its
    last hand-out said it left out."""
    for epoch in range(chain.epochs):
        steps = [s for s in done.ledger if s[0] == epoch]
        ids = [i for s in steps for i in s[3]]
        assert len(ids) == len(set(ids)), f"an id of epoch {epoch} was trained twice"
        # the epoch's last hand-out leaves out its tail -- or, begun past its size's last
        # step, what was left -- and what a resize left short of its step boundary (rows at
        # the end: a later hand-out of the epoch would deal them again)
        last = done.last_hand_out(epoch)
        before = sum(len(s[3]) for s in steps if done.attempts[s[1]] is not last)
        tail = table.rows % (last.size * chain.batch)
        said = last.left.get(epoch, 0)
        missing = min(table.rows - before, tail + said)
        assert table.rows - len(ids) == missing, (
            f"epoch {epoch} trained {len(ids)} of {table.rows} ids: its last hand-out, "
            f"{last.size} ranks from row {before}, leaves out {missing} (its tail {tail}, and "
            f"{said} said left out)")


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.long("a hundred chains of real saves and restores: 25 s alone, up to 2 minutes "
                  "beside the integration tests on 2 cores")
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get(RANDOM_ENV),
          database=None, phases=PHASES,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(chain=chains)
# the chains found from outside (issue 93): 4 ranks save mid-epoch; 5 resume, end the epoch and
# save it; the next epoch is resumed -- after a kill in it, after a notice during the epoch's
# save (a grow to 7), and by the next run -- and trained whole
@example(chain=_issue_chain(Attempt(5, 1, "kill", soon=True)))
@example(chain=_issue_chain(Attempt(5, 17, "notice"), Attempt(7, 30, "finish")))
@example(chain=_issue_chain(Attempt(5, 17, "notice"), Attempt(4, 30, "finish", new_run=True)))
def test_every_id_of_every_epoch_is_trained_once_over_any_chain(tables, service,
                                                                 tmp_path_factory, chain):
    run_chain(chain, tables[chain.table], str(tmp_path_factory.mktemp("chain")), service)
