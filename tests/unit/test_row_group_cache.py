"""The row groups a rank read, kept on its host for the run (sparkhvd.data.row_group_cache): a
resize's next attempt reads from the host what the one before had read, and trains the same
rows; the cache stays in its budget, passes over what it cannot read, is private, and goes when
the run is done."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkhvd.common import protocol
from sparkhvd.common.function_end import function_ended
from sparkhvd.data import row_group_cache
from sparkhvd.data.shard import DatasetShard
from sparkhvd.data.sharding import ShardSource

# every profile: the cache writes and reads Arrow IPC with pyarrow 10 and 25
pytestmark = pytest.mark.every_profile

RUN = "run-20261206-cache"
SHUFFLED = {"shuffle": True, "seed": 3, "shuffle_buffer": 400}


def _table(tmp_path, n, group_rows=10, files=3):
    """Ids ``0..n-1`` (``x``: the id and twice it; ``y``: the id) in ``files`` Parquet files of
    ``group_rows``-row groups, streamed (never kept), the footers shipped with the source (as
    the materialiser does): a rank reads only row groups."""
    from sparkhvd.data.footers import footer_bytes

    ids = np.arange(n, dtype=np.int64)
    paths, counts, groups = [], [], []
    for f, idx in enumerate(np.array_split(ids, files)):
        path = str(tmp_path / f"part-{f:05d}.parquet")
        values = pa.array(np.stack([idx, 2 * idx], 1).ravel().astype(np.float32))
        offsets = pa.array(np.arange(len(idx) + 1, dtype=np.int32) * 2)
        pq.write_table(pa.table({"x": pa.ListArray.from_arrays(offsets, values), "y": idx}),
                       path, row_group_size=group_rows)
        meta = pq.read_metadata(path)
        paths.append(path)
        counts.append(len(idx))
        groups.append(tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
    return ShardSource(files=tuple(paths), row_counts=tuple(counts), row_groups=tuple(groups),
                       stored={"x": "x", "y": "y"}, row_bytes=16, features=("x",), label="y",
                       memory_cache=0, widths={"x": 2},
                       footers=tuple(footer_bytes(pq.read_metadata(p)) for p in paths))


@pytest.fixture()
def host(tmp_path, monkeypatch):
    """A run's ranks on one host: its id set, the cache in a folder of the test's."""
    monkeypatch.setenv(protocol.RUN_ID_ENV, RUN)
    monkeypatch.setenv(row_group_cache.DIR_ENV, str(tmp_path / "host"))
    monkeypatch.delenv(row_group_cache.BYTES_ENV, raising=False)
    row_group_cache._caches.clear()
    yield tmp_path / "host" / f"sparkhvd-row-groups-{os.getuid()}"
    row_group_cache._caches.clear()
    function_ended(returned=False)  # forget the clean-ups the test registered


def _attempt(source, monkeypatch, attempt, size, state, steps):
    """Attempt ``attempt`` of ``size`` ranks (each its own shard, as its own rank) from
    ``state``: the ids it trained, the position after, the bytes from the files and the
    host."""
    monkeypatch.setenv(protocol.ATTEMPT_ENV, str(attempt))
    ids, after, files, host = [], None, 0, 0
    for rank in range(size):
        monkeypatch.setenv("SPARKHVD_RANK", str(rank))
        shard = DatasetShard(source)
        if state is not None:
            shard.load_state_dict(state)
        for step, (_, y) in enumerate(shard.batches(8, 1, rank=rank, size=size, **SHUFFLED), 1):
            ids += [int(i) for i in y]
            if step == steps:
                break
        after = shard.state_dict()
        files += shard.bytes_read
        host += shard.host_bytes_read
    return ids, after, files, host


def _chain(source, monkeypatch):
    """8 -> 7 -> 8 ranks in epoch 1, each stopped mid-way: the ids, the bytes from the files
    and from the host of each attempt."""
    state, ids, files, host = None, [], [], []
    for attempt, (size, steps) in enumerate(((8, 4), (7, 5), (8, None)), 1):
        got, state, read, found = _attempt(source, monkeypatch, attempt, size, state, steps)
        ids += got
        files.append(read)
        host.append(found)
    return ids, files, host


def _stored_bytes(source):
    """Every row group's stored bytes, once."""
    total = 0
    for path in source.files:
        meta = pq.ParquetFile(path).metadata
        total += sum(
            meta.row_group(g).column(c).total_compressed_size
            for g in range(meta.num_row_groups) for c in range(meta.num_columns))
    return total


def test_a_resize_reads_from_the_host_what_the_attempt_before_read(tmp_path, monkeypatch,
                                                                   host):
    """8 -> 7 -> 8 mid-epoch, streamed (the windows in flight when each attempt stops are what
    the next one trains first): with the cache no row group is read from the files twice --
    the attempts after the first read it from the host -- and the ranks train the same ids as
    without it, every id once."""
    source = _table(tmp_path, 1200)
    cached_ids, files, found = _chain(source, monkeypatch)
    assert sum(files) <= _stored_bytes(source), "a row group read from the files twice"
    assert found[0] == 0 and found[1] > 0 and found[2] > 0, found
    assert len(cached_ids) == len(set(cached_ids)), "an id trained twice"

    monkeypatch.delenv(protocol.RUN_ID_ENV)  # the same chain outside a run: no cache
    plain_ids, plain_files, plain_found = _chain(source, monkeypatch)
    assert plain_ids == cached_ids, "the cache changed the rows or their order"
    assert plain_found == [0, 0, 0]
    assert sum(plain_files) > _stored_bytes(source), "the chain re-reads without the cache"


def test_a_rank_keeps_at_most_its_budget_and_its_newest_row_groups(tmp_path, monkeypatch,
                                                                   host):
    """A budget of a few row groups: the rank's folder holds at most that (its oldest files
    deleted), and what it holds are the last row groups it read."""
    source = _table(tmp_path, 1200)
    monkeypatch.setenv(row_group_cache.BYTES_ENV, "3000")
    _attempt(source, monkeypatch, 1, 1, None, None)
    [cache] = row_group_cache._caches.values()
    sizes = [os.path.getsize(os.path.join(cache.own, name)) for name in os.listdir(cache.own)]
    assert 1 < len(sizes) and sum(sizes) <= 3000, sizes
    assert sorted(os.listdir(cache.own)) == sorted(cache._kept), "the newest, as counted"


def test_a_torn_file_is_passed_over_and_read_from_the_files(tmp_path, monkeypatch, host):
    """Every kept file cut short (a host that crashed as it wrote -- a file is renamed into
    place whole, but a disk may lose what was not flushed): the next attempt reads those row
    groups from the files and trains the same rows."""
    source = _table(tmp_path, 300)
    first, state, _, _ = _attempt(source, monkeypatch, 1, 2, None, 3)
    for folder, _, names in os.walk(host):
        for name in names:
            with open(os.path.join(folder, name), "r+b") as f:
                f.truncate(os.path.getsize(f.name) // 2)
    rest, _, files, _ = _attempt(source, monkeypatch, 2, 2, state, None)
    assert files > 0, "the torn row groups were read from the files"
    monkeypatch.delenv(protocol.RUN_ID_ENV)  # the same attempt outside a run: no cache
    assert rest == _attempt(source, monkeypatch, 2, 2, state, None)[0]
    assert len(first + rest) == len(set(first + rest)) == 288


def test_a_folder_others_can_write_is_not_used(monkeypatch, host, caplog):
    """The base folder writable by others: no cache (anyone could change the rows a rank
    trains on), said with the fix."""
    os.makedirs(host, exist_ok=True)
    os.chmod(host, 0o777)
    with caplog.at_level(logging.WARNING, logger="sparkhvd.data.row_group_cache"):
        assert row_group_cache.for_this_rank() is None
    assert "only this user can write" in caplog.text and row_group_cache.DIR_ENV in caplog.text


def test_no_cache_outside_a_run_or_when_turned_off(monkeypatch, host):
    monkeypatch.setenv(row_group_cache.BYTES_ENV, "0")
    assert row_group_cache.for_this_rank() is None
    monkeypatch.delenv(row_group_cache.BYTES_ENV)
    monkeypatch.delenv(protocol.RUN_ID_ENV)
    assert row_group_cache.for_this_rank() is None
    assert not os.path.exists(host)


def test_the_run_s_folder_goes_when_the_function_returns(tmp_path, monkeypatch, host):
    """When the training function returns, the rank deletes its own folder and those of
    processes that are gone (earlier attempts), not one a live process owns; a run's folder
    untouched for an hour (a failed run's) goes when the cache is first used; the driver's
    sweep (no folder of its own) deletes what no live process owns."""
    source = _table(tmp_path, 300)
    host.mkdir(mode=0o700, parents=True)
    stale = host / "run-that-failed" / "rank-0-a1-1"
    stale.mkdir(parents=True)
    old = time.time() - 2 * row_group_cache.STALE_S
    for path in (stale, stale.parent):
        os.utime(path, (old, old))
    _attempt(source, monkeypatch, 1, 1, None, 3)
    assert not stale.parent.exists()
    run = host / RUN
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (run / f"rank-1-a1-{gone}").mkdir()
    (run / f"rank-2-a1-{os.getppid()}").mkdir()  # a live process's
    [mine] = [p for p in run.iterdir() if p.name.endswith(f"-{os.getpid()}")]
    assert any(mine.iterdir())
    function_ended(returned=True)
    assert sorted(p.name for p in run.iterdir()) == [f"rank-2-a1-{os.getppid()}"]
    assert row_group_cache.sweep(RUN) == 0 and run.exists()  # still owned
    os.rename(run / f"rank-2-a1-{os.getppid()}", run / f"rank-2-a1-{gone}")
    assert row_group_cache.sweep(RUN) == 1 and not run.exists()


def test_the_rows_found_on_the_host_are_the_rows_in_the_files(tmp_path, monkeypatch, host):
    """A rank that finds every row group on the host reads no file, and its batches hold the
    same values as from the files (lists of floats and the label)."""
    source = _table(tmp_path, 400, group_rows=16, files=2)

    def epoch(attempt):
        monkeypatch.setenv(protocol.ATTEMPT_ENV, str(attempt))
        shard = DatasetShard(source)
        got = [(x.copy(), y.copy()) for x, y in shard.batches(32, 0, **SHUFFLED)]
        return got, shard.bytes_read, shard.host_bytes_read

    first, read, found = epoch(1)
    again, read_again, found_again = epoch(2)
    assert read > 0 and found == 0 and read_again == 0 and found_again > 0
    for (x1, y1), (x2, y2) in zip(first, again):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
        np.testing.assert_array_equal(x1[:, 0] * 2, x1[:, 1])
        np.testing.assert_array_equal(x1[:, 0], y1)


def _on_hosts(source, monkeypatch, root, attempt, hosts, state, steps=None, read=None):
    """Attempt ``attempt`` with rank ``r`` on host ``hosts[r]`` (its row groups kept in
    ``root/hosts[r]``), from ``state``: each rank's ids and the position after ``steps``
    (``read``: adds each rank's bytes from the files and from the driver, once the rank's row
    groups went to the driver)."""
    monkeypatch.setenv(protocol.ATTEMPT_ENV, str(attempt))
    monkeypatch.setenv(protocol.RANK_HOSTS_ENV, ",".join(hosts))
    ids, after = [], None
    for rank, name in enumerate(hosts):
        monkeypatch.setenv("SPARKHVD_RANK", str(rank))
        monkeypatch.setenv(row_group_cache.DIR_ENV, str(root / name))
        shard = DatasetShard(source)
        shard.load_state_dict(state)
        ids.append([])
        size = len(hosts)
        for step, (_, y) in enumerate(shard.batches(8, 1, rank=rank, size=size, **SHUFFLED), 1):
            ids[-1] += [int(i) for i in y]
            if step == steps:
                break
        after = shard.state_dict()
        if read is not None:
            assert row_group_cache.for_this_rank().sent(30)
            read["files"] += shard.bytes_read
            read["driver"] += shard.driver_bytes_read
    return ids, after


def test_a_resize_deals_each_host_the_rows_its_ranks_were_reading(tmp_path, monkeypatch,
                                                                  host):
    """8 ranks on 8 hosts -> 7 (host 7 lost) -> 8 (a new host), mid-epoch: after the shrink
    each surviving host's rank trains every row its rank was still to train (the rows it was
    reading, kept there), and after the grow each only gives rows away, to the new host; every
    id once, as many as without hosts."""
    source = _table(tmp_path, 1200)
    eight, seven = [f"h{r}" for r in range(8)], [f"h{r}" for r in range(7)]
    grown = seven + ["h8"]
    full, _ = _on_hosts(source, monkeypatch, tmp_path, 1, eight, None)
    first, state = _on_hosts(source, monkeypatch, tmp_path, 1, eight, None, 4)
    was = [ids[len(done):] for ids, done in zip(full, first)]  # each rank's rows still to train
    full, _ = _on_hosts(source, monkeypatch, tmp_path, 2, seven, state)
    second, state = _on_hosts(source, monkeypatch, tmp_path, 2, seven, state, 5)
    for rank in range(7):
        assert set(was[rank]) <= set(full[rank]), f"host h{rank} lost rows it was reading"
    was = [ids[len(done):] for ids, done in zip(full, second)]
    third, _ = _on_hosts(source, monkeypatch, tmp_path, 3, grown, state)
    for rank in range(7):
        assert set(third[rank]) <= set(was[rank]), f"host h{rank} was given rows of another"
    trained = [i for attempt in (first, second, third) for ids in attempt for i in ids]
    assert len(trained) == len(set(trained)), "an id trained twice"

    monkeypatch.delenv(protocol.RUN_ID_ENV)  # no hosts said: the deal as before
    monkeypatch.setenv(protocol.RANK_HOSTS_ENV, "")
    plain = _chain(source, monkeypatch)[0]
    assert len(plain) == len(trained) and plain != trained


def test_part_of_a_window_given_to_another_host_is_cut_by_where_its_rows_lie():
    """A window 50 rows into its 300, 100 of the 250 left given away (as a resize gives a new
    host rows of a window a surviving host was reading): the two parts hold exactly the rows
    left, the head those before some row of the window and the tail those at or after it (so
    the rank given the tail reads only the row groups from there), each drawn in the window's
    order; a part cut again is cut within it; a part survives a checkpoint."""
    from sparkhvd.data.deal import Unit, own_order, split_by_rows

    window = Unit(3, 100, 400, key=(1, 0, 3, 4, 100), first=50)
    order = own_order(window)
    at = {int(row): i for i, row in enumerate(order)}

    def drawn(unit):
        rows = own_order(unit)[unit.first:unit.last]
        assert [at[int(r)] for r in rows] == sorted(at[int(r)] for r in rows), "the order"
        return rows

    head, tail = split_by_rows(window, 100)
    assert (head.rows, tail.rows) == (100, 150) and head.part[1] == tail.part[0]
    assert sorted(np.concatenate([drawn(head), drawn(tail)])) == sorted(order[50:])
    assert drawn(head).max() < tail.part[0] <= drawn(tail).min()
    first, second = split_by_rows(tail, 60)
    assert sorted(np.concatenate([drawn(first), drawn(second)])) == sorted(drawn(tail))
    assert tail.part[0] == first.part[0] < first.part[1] == second.part[0] < second.part[1] \
        == tail.part[1]
    assert Unit.of(second.as_list()) == second and Unit.of(window.as_list()) == window


@pytest.fixture()
def driver(tmp_path, monkeypatch):
    """The driver's run-folder service keeping the run's row-group copies, and the ranks
    pointed at it as ranks on other hosts are."""
    from sparkhvd.runfolder.rank_files import driver_row_copies
    from sparkhvd.runfolder.service import RunFileService

    (tmp_path / "run").mkdir()
    server = RunFileService("127.0.0.1", str(tmp_path / "run"),
                            row_copies=str(tmp_path / "driver" / "copies")).start()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(protocol.RUN_URL_ENV, raising=False)
    row_group_cache.use_driver_copies(driver_row_copies)
    yield server
    row_group_cache.use_driver_copies(None)
    server.stop()


def _hosts_chain(source, monkeypatch, root):
    """8 ranks on 8 hosts -> 7 (host 7 lost, its folder gone) -> 8 (a new host), mid-epoch:
    every id trained, in order, and the bytes read from the files and from the driver."""
    import shutil

    eight, seven = [f"h{r}" for r in range(8)], [f"h{r}" for r in range(7)]
    read = {"files": 0, "driver": 0}
    first, state = _on_hosts(source, monkeypatch, root, 1, eight, None, 4, read)
    shutil.rmtree(root / "h7")
    second, state = _on_hosts(source, monkeypatch, root, 2, seven, state, 5, read)
    third, _ = _on_hosts(source, monkeypatch, root, 3, seven + ["h8"], state, None, read)
    row_group_cache._caches.clear()
    return [i for attempt in (first, second, third) for ids in attempt for i in ids], read


def test_on_a_cluster_a_small_table_s_lost_rows_are_read_from_the_driver(tmp_path,
                                                                         monkeypatch, host,
                                                                         driver):
    """A small table's row groups also go to the driver: 8 -> 7 -> 8 on 8 hosts, the lost
    host's rows and the new host's read from the driver's copies, not the files -- each row
    group read from the files about once in the whole chain -- and the same ids in the same
    order as without the copies."""
    source = _table(tmp_path, 1200, group_rows=10, files=3)
    stored = _stored_bytes(source)
    trained, read = _hosts_chain(source, monkeypatch, tmp_path / "with")
    assert len(set(trained)) == len(trained), "an id trained twice"
    assert read["driver"] > 0, "no row group came from the driver"
    row_group_cache.use_driver_copies(None)
    without, read_without = _hosts_chain(source, monkeypatch, tmp_path / "without")
    assert trained == without
    assert read_without["driver"] == 0
    assert read["files"] <= 1.1 * stored < read_without["files"], (read, read_without, stored)


def test_only_a_table_within_the_bound_is_copied_and_0_turns_the_copies_off(monkeypatch):
    """``SPARKHVD_ROW_COPIES_BYTES`` (default 1 GB of rows) bounds the tables whose row groups
    go to the driver; ``0`` sends none; a rank that cannot reach the driver sends none."""
    row_group_cache.use_driver_copies(None)
    assert not row_group_cache.copies_for(1 << 20)  # no way to the driver
    row_group_cache.use_driver_copies(lambda: None)
    try:
        monkeypatch.delenv(protocol.ROW_COPIES_BYTES_ENV, raising=False)
        assert row_group_cache.copies_for(protocol.ROW_COPIES_BYTES)
        assert not row_group_cache.copies_for(protocol.ROW_COPIES_BYTES + 1)
        monkeypatch.setenv(protocol.ROW_COPIES_BYTES_ENV, "0")
        assert not row_group_cache.copies_for(1)
    finally:
        row_group_cache.use_driver_copies(None)
