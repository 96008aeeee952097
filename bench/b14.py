"""B14: what each rank reads of a DataFrameDataset per epoch, for np = 1, 2, 3, 4, 6, 8, and
each rank's plan for np = 1 to 64 and a resize chain.

Goal (issues 48, 75): bytes read per rank per epoch <= 1.1 x its share (N / np) at every np,
and all ranks together <= 1.1 x N (footers counted).

- **Local** (one local[8] session, the cache on this machine's disk): each rank's
  ``/proc/self/io`` ``rchar`` (every ``read()`` the rank made) across one shuffled epoch of each
  reader (``batches``,
  ``torch_batches``, ``torch_dataset`` through a DataLoader, ``tf_dataset``), streamed and with
  the share kept in memory; the same ranks' peak RSS over their kept share; and what a rank
  reads beyond the row groups: the module files its first batch imports, once per rank
  process (measured apart). A rank reads nothing else: on a 200k x 1 KiB table at np=5 and 6,
  every epoch after the first read exactly ``bytes_read``; the first read 0.9 MB more (pyarrow
  and numpy modules) -- 9.4 MB before numeric columns were read without pyarrow's
  ``to_numpy``, which imports pandas: 1.16x the share in that epoch at np=5.
- **abfss:// on the test cluster** (4 hosts as network namespaces, 2 cores each, the cache on
  Azurite): the bytes each host's network interface received during the epoch
  (``/proc/self/net/dev`` inside the host's namespace, divided by the ranks on it) and the bytes
  adlfs fetched in the rank (``AzureBlobFile._fetch_range``).
- **Label diversity on sorted data** (in-process): distinct labels per global batch and per
  rank's batch against a full permutation of the same rows.
- **Every rank's plan, np = 1, 2, 3, 4, 5, 7, 8, 16, 32, 64 and 8 -> 7 -> 8 mid-epoch**
  (in-process: each rank's epoch read by the real reader, one rank after another, from
  Parquet files written as the materialiser writes them -- 512 KB row groups -- with labels
  sorted): the stored bytes and footers each rank read (``bytes_read``) over its share and
  over the files, and distinct labels per rank's batch against a full permutation. The chain
  also with the row groups kept on the ranks' hosts (:data:`HOSTS`: all on one, or a rank
  each), each simulated rank told its attempt, rank and hosts as a run tells it.
- **The same on a 5 GB and a 10 GB table's layout** (:func:`scale_models`): as many row groups
  as the materialiser writes for them (512 KB each), of narrow rows, the default window: the
  plans at np = 8 to 64 and the chain; and the chain on 8 hosts on a 1.1 GB and a 2.2 GB
  table's layout, about the bound of the tables whose row groups are copied to the driver
  (:func:`bound_models`).

N is the materialised files' size (the used columns as stored).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Iterator, Optional
from unittest import mock

#: Where a resize chain's first two attempts stop: (steps of the 8 ranks, then of the 7), in
#: 781ths of the epoch
CHAIN_STOPS = ((100, 120), (230, 60), (45, 300))

#: Where a chain's ranks run when their row groups are kept on their hosts
#: (:mod:`sparkhvd.data.row_group_cache`): every rank on one host (a local master, one
#: machine), or each on its own host -- the 7 of the shrink on the hosts of ranks 0 to 6, the
#: grow's eighth on a new one -- with a small table's row groups also copied to the driver
#: (the default: a run-folder service in this process), or without (the lost host's rows are
#: nowhere but in the files).
HOSTS = ("one host", "8 hosts, a rank each", "8 hosts, a rank each, no copies on the driver")

#: One rank's epochs: (reader, kept in memory?)
READS = [("torch_batches", True), ("torch_batches", False), ("batches", False),
         ("torch_dataset", False), ("tf_dataset", False)]


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _received(interface: str = "eth0") -> Optional[int]:
    """Bytes this network namespace's ``interface`` received (None where it has none)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == interface:
                return int(rest.split()[0])
    return None


def _fetch_counter() -> list[int]:
    """Counts the bytes adlfs fetches in this process (a one-element list)."""
    fetched = [0]
    try:
        from adlfs.spec import AzureBlobFile
    except ImportError:
        return fetched
    original = AzureBlobFile._fetch_range
    if getattr(original, "_b14", False):
        return original._b14  # type: ignore[no-any-return]

    def counted(self: Any, start: int, end: int, **kw: Any) -> Any:
        data = original(self, start, end, **kw)
        fetched[0] += len(data)
        return data

    counted._b14 = fetched  # type: ignore[attr-defined]
    AzureBlobFile._fetch_range = counted
    return fetched


def rank_reads(ds: Any, batch: int, reads: Optional[list] = None) -> list[dict]:
    """In a rank: one shuffled epoch per ``(reader, kept)``, each from a fresh shard, with the
    bytes it took from the disk (``rchar``), the network (this host's interface) and adlfs."""
    import importlib.util
    import resource
    import time

    import psutil

    from sparkhvd.common.identity import current_rank
    from sparkhvd.data.shard import DatasetShard

    if importlib.util.find_spec("torch"):
        import torch  # noqa: F401 - imported before anything is measured
    has_tf = importlib.util.find_spec("tensorflow") is not None
    if has_tf:
        import tensorflow  # noqa: F401
    # what a rank's first batch imports (pyarrow's Parquet and IPC readers, fsspec, sparkhvd's
    # reader and storage): read from the module files once per rank process, not the data --
    # measured apart, so the epochs below count the reads of the rows alone
    imported = _rchar()
    import pyarrow.ipc  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from sparkhvd import storage  # noqa: F401
    from sparkhvd.data import reader as _reader  # noqa: F401
    from sparkhvd.data import row_group_cache as _cache  # noqa: F401
    imports = _rchar() - imported
    fetched = _fetch_counter()
    me = current_rank()
    out = []
    for reader, kept in reads or READS:
        if reader == "tf_dataset" and not has_tf or \
                reader.startswith("torch") and not importlib.util.find_spec("torch"):
            continue
        shard = DatasetShard(ds.source)
        shard.memory_cache = 1 << 40 if kept else 0
        rss0 = psutil.Process().memory_info().rss
        disk, net, adl, t0 = _rchar(), _received(), fetched[0], time.perf_counter()
        rows = 0
        if reader == "batches":
            for _, y in shard.batches(batch, 0, shuffle=True, seed=1):
                rows += len(y)
        elif reader == "torch_batches":
            for _, y in shard.torch_batches(batch, 0, shuffle=True, seed=1):
                rows += len(y)
        elif reader == "torch_dataset":
            import torch

            data = shard.torch_dataset(batch, shuffle=True, seed=1)
            for _, y in torch.utils.data.DataLoader(data, batch_size=None):
                rows += len(y)
        else:
            with shard.tf_dataset(batch, epochs=1, shuffle=True, seed=1) as tfds:
                for _, y in tfds:
                    rows += int(y.shape[0])
        net_after = _received()
        out.append({"reader": reader, "kept": kept, "rank": me.rank, "size": me.size,
                    "host": os.uname().nodename, "rows": rows,
                    "seconds": time.perf_counter() - t0, "disk": _rchar() - disk,
                    "net": None if net is None or net_after is None else net_after - net,
                    "adlfs": fetched[0] - adl, "stored": shard.bytes_read, "imports": imports,
                    "peak_rss_over_start": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                            * 1024 - rss0) if kept else None})
    return out


def _files_bytes(ds: Any) -> int:
    from sparkhvd import storage

    total = 0
    for url in ds.files:
        loc = storage.resolve(url, ds.storage_options)
        total += loc.fs.size(loc.path)
    return total


def _rows(where: str, nps: list[int], per_np: dict[int, list[list[dict]]], total: int,
          measure: str) -> list[dict]:
    """B14 rows: per np and reader, the largest rank's bytes over its share, and all ranks'
    bytes over the files."""
    import statistics

    rows = []
    for np_ in nps:
        runs = per_np[np_]
        by_read: dict[tuple, list[tuple[float, float]]] = {}
        for run in runs:
            flat = [r for rank in run for r in rank]
            for reader, kept in {(r["reader"], r["kept"]) for r in flat}:
                mine = [r for r in flat if r["reader"] == reader and r["kept"] == kept]
                values = []
                for r in mine:
                    value = r[measure]
                    if measure == "net" and value is not None:  # each rank saw its host's
                        host = [o["net"] for o in mine if o["host"] == r["host"]]
                        value = max(host) / len(host)
                    values.append(value)
                if any(v is None for v in values):
                    continue
                by_read.setdefault((reader, kept), []).append(
                    (max(values) / (total / np_), sum(values) / total))
        for (reader, kept), pairs in sorted(by_read.items()):
            how = "kept in memory" if kept else "streamed"
            for label, index in (("per rank / share", 0), ("all ranks / N", 1)):
                values = [p[index] for p in pairs]
                rows.append({"case": "B14", "variant": f"{where}, np={np_}, {reader} ({how}): "
                             f"{label}", "unit": "ratio", "np": np_, "reader": reader,
                             "kept": kept, "measure": measure, "median": statistics.median(values),
                             "min": min(values), "max": max(values), "runs": values})
    return rows


def local_reads(repeat: int, tiny: bool, spark_session: Any, frame: Any) -> list[dict]:
    from sparkhvd import DataFrameDataset, HorovodRunner

    rows_n, width = (4_000, 32) if tiny else (200_000, 256)
    nps = [2] if tiny else [1, 2, 3, 4, 6, 8]
    spark = spark_session(max(nps))
    ds = DataFrameDataset(frame(spark, rows_n, width), "x", "y").materialize()
    out = tempfile.mkdtemp(prefix="bench-b14-")
    try:
        total = _files_bytes(ds)
        reads = [("batches", False)] if tiny else None  # tiny: the code runs, nothing more
        per_np = {np_: [HorovodRunner(np=np_, spark=spark, output_dir=out, backend="torch"
                                      if _has("torch") else "tf").run_all(
            rank_reads, ds=ds, batch=64, reads=reads) for _ in range(max(1, min(repeat, 2)))]
            for np_ in nps}
    finally:
        ds.close()
    rows = _rows("local disk", nps, per_np, total, "disk")
    for np_ in nps:  # beyond the row groups: the reader's modules, read once per rank process
        imports = [r["imports"] / 2**20 for run in per_np[np_] for rank in run for r in rank[:1]]
        rows.append({"case": "B14", "variant": f"local disk, np={np_}: MB a rank reads beyond "
                     "its row groups, once per rank process: the module files its first batch "
                     "imports (not in the epochs above)", "unit": "MB", "np": np_,
                     **_stats(imports)})
    share = rows_n * (width * 4 + 8)  # the rows in memory
    for np_ in nps:
        peaks = [r["peak_rss_over_start"] / (share / np_) for run in per_np[np_]
                 for rank in run for r in rank if r["kept"]]
        if peaks:
            rows.append({"case": "B14", "variant": f"local disk, np={np_}: peak RSS growth "
                         f"while reading / the rank's share in memory ({share / np_ / 2**20:.0f} "
                         "MB), kept in memory", "unit": "ratio", "np": np_, **_stats(peaks)})
    return rows


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def cluster_reads(repeat: int, tiny: bool, frame: Any) -> list[dict]:
    """B14 on the test cluster: 4 hosts (network namespaces) x 2 cores, cache on Azurite."""
    variant = "abfss:// (Azurite) on 4 hosts"
    if tiny:
        return [{"case": "B14", "variant": variant, "unit": "ratio", "skipped": "not in --tiny"}]
    from pyspark.sql import SparkSession

    from conftest import Azurite
    from netns_cluster import NetnsCluster
    from sparkhvd import DataFrameDataset, HorovodRunner

    cluster = NetnsCluster(tempfile.mkdtemp(prefix="bench-b14-hosts-"), hosts=4, cores=2)
    try:
        cluster.up()
    except RuntimeError as exc:
        cluster.down()
        return [{"case": "B14", "variant": variant, "unit": "ratio", "skipped": str(exc)[:200]}]
    azurite = None
    try:
        azurite = Azurite.start(tempfile.mkdtemp(prefix="bench-b14-azurite-"),
                                host=cluster.driver_ip)
        azurite.make_container("cache")
        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
        spark = (SparkSession.builder.master(cluster.master_url).appName("bench-b14")
                 .config("spark.driver.host", cluster.driver_ip)
                 .config("spark.driver.bindAddress", cluster.driver_ip)
                 .config("spark.executor.cores", "2").config("spark.cores.max", "8")
                 .config("spark.executor.memory", "1g")
                 .config("spark.pyspark.python", sys.executable).getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        from sparkhvd.spark.slots import check_slots

        check_slots(spark.sparkContext, 8, wait_s=120)
        ds = DataFrameDataset(frame(spark, 200_000, 256), "x", "y",
                              cache_url=azurite.url("cache", "b14"),
                              storage_options=azurite.options()).materialize()
        out = tempfile.mkdtemp(prefix="bench-b14-")
        nps = [1, 2, 3, 4, 6, 8]
        try:
            total = _files_bytes(ds)
            per_np = {np_: [HorovodRunner(np=np_, spark=spark, output_dir=out,
                                          backend="torch" if _has("torch") else "tf")
                            .run_all(rank_reads, ds=ds, batch=64,
                                     reads=[("torch_batches", False)])
                            for _ in range(max(1, min(repeat, 2)))] for np_ in nps}
        finally:
            ds.close()
        spark.stop()
        return _rows(variant + ", host's network", nps, per_np, total, "net") + \
            _rows(variant + ", adlfs fetches", nps, per_np, total, "adlfs")
    finally:
        if azurite is not None:
            azurite.stop()
        cluster.down()


def label_diversity(tiny: bool) -> list[dict]:
    """Sorted labels (the digits, each label's rows together): distinct labels per global
    batch and per rank's batch of 32, streamed in windows of ~1/10 of the data, at np 1, 2,
    4, 8 -- against the same rows fully permuted."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    from sparkhvd.data.shard import DatasetShard
    from sparkhvd.data.sharding import ShardSource

    _, y = load_digits(return_X_y=True)
    y = np.sort(np.tile(y, 1 if tiny else 8))
    folder = tempfile.mkdtemp(prefix="bench-b14-labels-")
    path = os.path.join(folder, "part-00000.parquet")
    pq.write_table(pa.table({"c0": pa.array(np.arange(len(y))), "c1": pa.array(y)}), path,
                   row_group_size=16)
    meta = pq.ParquetFile(path).metadata
    source = ShardSource(files=(path,), row_counts=(len(y),),
                         row_groups=(tuple(meta.row_group(g).num_rows
                                           for g in range(meta.num_row_groups)),),
                         stored={"id": "c0", "y": "c1"}, row_bytes=16, features=("id",),
                         label="y", memory_cache=0)
    batch, window = 32, len(y) // 10
    rng = np.random.default_rng(0)
    rows = []
    for size in (1, 2, 4, 8):
        per_step, per_rank = [], []
        streams = [DatasetShard(source).batches(batch, 0, rank=r, size=size, shuffle=True,
                                                seed=1, shuffle_buffer=window)
                   for r in range(size)]
        for step in zip(*streams):
            per_step.append(len({int(v) for _, labels in step for v in labels}))
            per_rank += [len(set(labels.tolist())) for _, labels in step]
        full = rng.permutation(y)[:len(per_step) * size * batch]
        steps = full.reshape(len(per_step), size, batch)
        rows.append({"case": "B14", "variant": f"sorted labels, np={size}: distinct labels per "
                     f"global batch of {size}x{batch} (full permutation: "
                     f"{np.mean([len(set(s.ravel())) for s in steps]):.2f})", "unit": "labels",
                     "np": size, **_stats([float(np.mean(per_step))])})
        rows.append({"case": "B14", "variant": f"sorted labels, np={size}: distinct labels per "
                     f"rank's batch of {batch} (full permutation: "
                     f"{np.mean([len(set(b)) for s in steps for b in s]):.2f})",
                     "unit": "labels", "np": size, **_stats([float(np.mean(per_rank))])})
    return rows


def planned_reads(tiny: bool) -> list[dict]:
    """Every rank's epoch at many np, one rank after another in this process (see the module
    docstring): bytes over share and over N, labels per rank's batch on sorted labels -- from
    local files, and (not in --tiny) the same files on Azurite through ``abfss://``."""
    from sparkhvd.data.materialize import group_bytes_for

    rows_n, width, files = (8_000, 8, 2) if tiny else (200_000, 64, 8)
    # row groups as the materialiser sizes them for this table (on a cluster of 64 slots)
    group_rows = max(1, group_bytes_for(rows_n * (width * 4 + 12), 1) // (width * 4 + 12))
    source, paths, total, uniform = _sorted_table(rows_n, width, group_rows, files)
    nps = [1, 2, 5] if tiny else [1, 2, 3, 4, 5, 7, 8, 16, 32, 64]
    chains = [] if tiny else [
        (None, "the default window: the whole table"),
        *((None, f"the default window, the row groups kept on {placing}", placing)
          for placing in HOSTS),
        *((source.num_rows // k, f"a window of N / {k}") for k in (20, 40, 80))]
    rows = _plans("plans", source, total, uniform, nps, chains)
    if not tiny:
        rows += _plans_on_azurite(source, paths, total, uniform, nps)
        rows += scale_models() + bound_models()
    for r in rows:
        r.pop("_read", None)
    return rows


def scale_models() -> list[dict]:
    """The plans and the 8 -> 7 -> 8 chain at the default window on tables of 5 GB and 10 GB
    as the materialiser writes them -- 512 KB row groups, 10,240 and 20,480 of them, the
    default window (128 MB) 256 of them -- modelled by tables of as many row groups of 122
    narrow rows: what a rank reads and mixes depends on the row groups, not their width. N is
    the row groups' stored bytes: the model's footers (2 columns of 122 rows a group) weigh
    far more beside its narrow rows than a real table's do beside 512 KB groups. No row group
    is copied to the driver: such tables are past the copies' bound (2 GB of rows)."""
    import dataclasses

    import pyarrow.parquet as pq

    from sparkhvd.data.materialize import ROW_GROUP_BYTES

    group_rows, rows = 122, []
    window_groups = (128 << 20) // ROW_GROUP_BYTES
    for gigabytes in (5, 10):
        groups = (gigabytes << 30) // ROW_GROUP_BYTES
        source, paths, _, uniform = _sorted_table(groups * group_rows, 8, group_rows, 8)
        stored = 0
        for path in paths:
            meta = pq.read_metadata(path)
            stored += sum(meta.row_group(g).column(c).total_compressed_size
                          for g in range(meta.num_row_groups) for c in range(meta.num_columns))
        window = window_groups * group_rows
        rows += _plans(f"plans, a {gigabytes} GB table's layout ({groups:,} row groups, the "
                       f"default window {window_groups} of them)",
                       dataclasses.replace(source, footer_bytes=0), stored, uniform,
                       [1, 2, 4, 8, 12, 16, 24, 32, 64], [
                           (window, "the default window"),
                           *((window, f"the default window, the row groups kept on {placing}",
                              placing) for placing in HOSTS[:2])], window=window, copies=False)
    return rows


def bound_models() -> list[dict]:
    """The 8 -> 7 -> 8 chain on 8 hosts at the default window on the layouts of tables about
    the driver's copies' bound (:data:`~sparkhvd.common.protocol.ROW_COPIES_BYTES`, 2 GB):
    1.1 GB (under it: with the copies, and without) and 2.2 GB (past it: no copies). Modelled
    as :func:`scale_models` models its tables."""
    import dataclasses

    import pyarrow.parquet as pq

    from sparkhvd.data.materialize import ROW_GROUP_BYTES

    group_rows, rows = 122, []
    window_groups = (128 << 20) // ROW_GROUP_BYTES
    for megabytes, copies in ((1100, True), (2200, False)):
        groups = (megabytes << 20) // ROW_GROUP_BYTES
        source, paths, _, uniform = _sorted_table(groups * group_rows, 8, group_rows, 8)
        stored = sum(pq.read_metadata(p).row_group(g).column(c).total_compressed_size
                     for p in paths for g in range(pq.read_metadata(p).num_row_groups)
                     for c in range(2))
        window = window_groups * group_rows
        rows += _plans(f"plans, a {megabytes:,} MB table's layout ({groups:,} row groups, the "
                       f"default window {window_groups} of them)",
                       dataclasses.replace(source, footer_bytes=0), stored, uniform, [], [
                           (window, f"the default window, the row groups kept on {placing}",
                            placing) for placing in (HOSTS[1:] if copies else HOSTS[1:2])],
                       window=window, copies=copies)
    return rows


def _sorted_table(rows_n: int, width: int, group_rows: int, files: int
                  ) -> tuple[Any, list[str], int, float]:
    """A table of ``rows_n`` rows of ``width`` floats and a label sorted (each label's rows
    together) in ``files`` Parquet files of ``group_rows``-row groups: its ShardSource (the
    footers go with it, as the materialiser's writers return them), files, bytes and the
    distinct labels per 32 rows of a full permutation."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparkhvd.data.footers import footer_bytes
    from sparkhvd.data.sharding import ShardSource, footer_size

    folder = tempfile.mkdtemp(prefix="bench-b14-plans-")
    labels = np.arange(rows_n) * 10 // rows_n  # sorted: each label's rows together
    x = np.random.default_rng(0).random((rows_n, width), dtype=np.float32)
    paths, counts, groups = [], [], []
    for f, index in enumerate(np.array_split(np.arange(rows_n), files)):
        path = os.path.join(folder, f"part-{f:05d}.parquet")
        offsets = pa.array(np.arange(len(index) + 1, dtype=np.int32) * width)
        pq.write_table(pa.table({"x": pa.ListArray.from_arrays(offsets, x[index].ravel()),
                                 "y": labels[index]}), path, row_group_size=group_rows)
        meta = pq.ParquetFile(path).metadata
        paths.append(path)
        counts.append(len(index))
        groups.append(tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
    total = sum(os.path.getsize(p) for p in paths)
    metas = [pq.read_metadata(p) for p in paths]
    source = ShardSource(files=tuple(paths), row_counts=tuple(counts), row_groups=tuple(groups),
                         stored={"x": "x", "y": "y"}, row_bytes=width * 4 + 8,
                         features=("x",), label="y", memory_cache=0, widths={"x": width},
                         footers=tuple(footer_bytes(m) for m in metas),
                         footer_bytes=sum(footer_size(m) for m in metas))
    full = np.random.default_rng(0).permutation(labels)
    uniform = float(np.mean([len(set(full[i:i + 32])) for i in range(0, rows_n - 32, 32)]))
    return source, paths, total, uniform


def _plans_on_azurite(source: Any, paths: list[str], total: int, uniform: float,
                      nps: list[int]) -> list[dict]:
    """:func:`_plans` on the same files uploaded to Azurite, and what adlfs fetched."""
    import dataclasses

    from conftest import Azurite
    from sparkhvd import storage

    azurite = Azurite.start(tempfile.mkdtemp(prefix="bench-b14-azurite-"))
    try:
        azurite.make_container("plans")
        options = azurite.options()
        urls = []
        for path in paths:
            url = azurite.url("plans", os.path.basename(path))
            with open(path, "rb") as local, storage.open_atomic(url, options) as remote:
                remote.write(local.read())
            urls.append(url)
        remote_source = dataclasses.replace(source, files=tuple(urls), storage_options=options)
        fetched = _fetch_counter()
        before = fetched[0]
        rows = _plans("plans on abfss:// (Azurite)", remote_source, total, uniform, nps, [])
        rows.append({"case": "B14", "variant": "plans on abfss:// (Azurite): bytes adlfs "
                     f"fetched over all np ({', '.join(map(str, nps))}) / the reader's count",
                     "unit": "ratio", **_stats([(fetched[0] - before) / max(1, sum(
                         r.get("_read", 0) for r in rows))])})
        return rows
    finally:
        azurite.stop()


@contextlib.contextmanager
def _on_host(root: Optional[str], hosts: list[str], attempt: int, rank: int,
             driver: Optional[dict] = None) -> Iterator[None]:
    """This process as rank ``rank`` of attempt ``attempt`` of a run whose ranks are on
    ``hosts`` (its row groups kept in ``root/<its host>``, and sent to the run-folder service
    ``driver`` points at); nothing changes without a ``root``. It ends once the rank's row
    groups went to the driver: a host is lost long after it read them."""
    from sparkhvd.common import protocol
    from sparkhvd.data import row_group_cache

    if root is None:
        yield
        return
    env = {protocol.RUN_ID_ENV: "bench-b14-chain", protocol.ATTEMPT_ENV: str(attempt),
           "SPARKHVD_RANK": str(rank), protocol.RANK_HOSTS_ENV: ",".join(hosts),
           row_group_cache.DIR_ENV: os.path.join(root, hosts[rank]), **(driver or {})}
    with mock.patch.dict(os.environ, env):
        yield
        cache = row_group_cache.for_this_rank()
        if cache is not None and not cache.sent(120):
            raise RuntimeError("the row groups did not reach the driver in 2 minutes")


@contextlib.contextmanager
def _driver_copies(placing: Optional[str]) -> Iterator[Optional[dict]]:
    """A run-folder service keeping row-group copies, as the driver runs it, for ``placing``
    :data:`HOSTS`'s second: the variables that point a rank at it (None: no copies)."""
    import shutil

    from sparkhvd.data import row_group_cache
    from sparkhvd.runfolder.rank_files import driver_row_copies
    from sparkhvd.runfolder.service import RunFileService

    if placing != HOSTS[1]:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="bench-b14-driver-")
    service = RunFileService("127.0.0.1", folder,
                             row_copies=os.path.join(folder, "copies", "run")).start()
    row_group_cache.use_driver_copies(driver_row_copies)
    try:
        yield service.env()
    finally:
        row_group_cache.use_driver_copies(None)
        service.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _host_of(placing: str, attempt: int, rank: int) -> str:
    """The host of rank ``rank`` of the chain's ``attempt`` (1, 2, 3) under ``placing``."""
    if placing == HOSTS[0]:
        return "host-0"
    return "host-8" if attempt == 3 and rank == 7 else f"host-{rank}"


def _plans(where: str, source: Any, total: int, uniform: float, nps: list[int],
           chains: list[tuple], window: Optional[int] = None, copies: bool = True
           ) -> list[dict]:
    """B14's plan rows for ``source`` (see :func:`planned_reads`): an epoch at each of ``nps``
    with ``window`` (default: the dataset's), and each of ``chains`` (a window, what it is,
    and where the ranks keep their row groups: none of :data:`HOSTS`, no cache) -- with the
    driver's row-group copies where :data:`HOSTS` says so and ``copies``."""
    import shutil

    import numpy as np

    from sparkhvd.data import row_group_cache
    from sparkhvd.data.shard import DatasetShard

    batch, seed = 32, 1

    def epoch(size: int, state: Optional[dict] = None, stop: Optional[int] = None,
              window: Optional[int] = None, hosts: Optional[tuple[str, str, int]] = None,
              driver: Optional[dict] = None, from_driver: Optional[list[int]] = None
              ) -> tuple[list[int], list[float], Optional[dict]]:
        read, mixed, after = [], [], None
        for rank in range(size):
            root, placing, attempt = hosts or (None, "", 0)
            with _on_host(root, [_host_of(placing, attempt, r) for r in range(size)], attempt,
                          rank, driver):
                shard = DatasetShard(source)
                read_epoch(shard, rank, size, state, stop, window, mixed)
            read.append(shard.bytes_read)
            if from_driver is not None:
                from_driver.append(shard.driver_bytes_read)
            after = shard.state_dict()
        return read, mixed, after

    def read_epoch(shard: Any, rank: int, size: int, state: Optional[dict],
                   stop: Optional[int], window: Optional[int], mixed: list[float]) -> None:
        if state is not None:
            shard.load_state_dict(state)
        for step, (_, y) in enumerate(shard.batches(batch, 1, rank=rank, size=size,
                                                    shuffle=True, seed=seed,
                                                    shuffle_buffer=window), 1):
            mixed.append(len(set(y.tolist())))
            if stop is not None and step == stop:
                break

    # (name, np, the busiest rank / its share, all ranks / N, labels, bytes read): a list of
    # values each (one per chain's stops), the busiest rank for single epochs only
    out: list[tuple[str, int, list[float], list[float], list[float], int]] = []
    for size in nps:
        read, mixed, _ = epoch(size, window=window)
        out.append((f"np={size}", size, [max(read) / (total / size)],
                    [(sum(read) + source.footer_bytes) / total], [float(np.mean(mixed))],
                    sum(read)))
    # 8 -> 7 -> 8 within epoch 1, each attempt stopped after some steps: three pairs of stops,
    # in 781ths of the epoch (its steps at 200k rows), as what a stop costs depends on where in
    # its windows it falls. An attempt that stops has read the windows it was in, and half a
    # group of windows ahead on average: with a window of the whole table its whole share; with
    # a window of a k-th of it, about twice that per resize -- and a rank's batch draws on
    # fewer row groups at once (the labels per batch say the cost)
    steps = source.num_rows // (8 * batch)
    copied: list[tuple[str, list[float]]] = []
    for chain_window, said, *placing in chains:
        ratios, labels, driver_ratios = [], [], []
        for first, second in CHAIN_STOPS:
            chain_read: list[int] = []
            chain_mixed: list[float] = []
            from_driver: list[int] = []
            state = None
            root = tempfile.mkdtemp(prefix="bench-b14-hosts-") if placing else None
            with _driver_copies(placing[0] if placing and copies else None) as driver:
                for attempt, (size, stop) in enumerate(((8, steps * first // 781),
                                                        (7, steps * second // 781),
                                                        (8, None)), 1):
                    hosts = (root, placing[0], attempt) if root else None
                    read, mixed, state = epoch(size, state, stop, chain_window, hosts, driver,
                                               from_driver)
                    chain_read += read
                    chain_mixed += mixed
                if root:
                    row_group_cache._caches.clear()
                    shutil.rmtree(root, ignore_errors=True)
            ratios.append((sum(chain_read) + source.footer_bytes) / total)
            labels.append(float(np.mean(chain_mixed)))
            driver_ratios.append(sum(from_driver) / total)
        name = f"8 -> 7 -> 8 mid-epoch, {said} (all attempts)"
        out.append((name, 8, [], ratios, labels, 0))
        if driver is not None:
            copied.append((name, driver_ratios))
    rows = []
    for name, size, busiest, ratio, mixed, read_sum in out:
        if busiest:
            rows.append({"case": "B14", "variant": f"{where}, {name}: bytes the busiest rank "
                         "read / its share (the footers came with the source)", "unit": "ratio",
                         "np": size, **_stats(busiest)})
        rows.append({"case": "B14", "variant": f"{where}, {name}: bytes all ranks read / N "
                     "(and the driver's one read of the footers)", "unit": "ratio", "np": size,
                     "_read": read_sum, **_stats(ratio)})
        rows.append({"case": "B14", "variant": f"{where}, {name}: distinct labels per rank's "
                     f"batch of {batch}, sorted labels (full permutation: {uniform:.2f})",
                     "unit": "labels", "np": size, **_stats(mixed)})
    for name, driver_ratios in copied:
        rows.append({"case": "B14", "variant": f"{where}, {name}: decoded bytes the ranks "
                     "read from the driver's row-group copies / N", "unit": "ratio", "np": 8,
                     **_stats(driver_ratios)})
    return rows


def _stats(values: list[float]) -> dict:
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": [round(v, 4) for v in values]}


def ready_times(repeat: int, tiny: bool, spark_session: Any, frame: Any) -> list[dict]:
    """Seconds until a DataFrameDataset is ready on a ~1 GB Parquet table written with 4 MB
    row groups: read in place vs materialised (``in_place=False``) vs petastorm's
    ``make_spark_converter``, taking turns."""
    import shutil
    import time

    from sparkhvd import DataFrameDataset

    rows_n = 4_000 if tiny else 330_000  # x 784 float32: about 1 GB
    spark = spark_session(2)
    folder = tempfile.mkdtemp(prefix="bench-b14-table-")
    frame(spark, rows_n, 784).write.mode("overwrite").option("parquet.block.size", 4 << 20) \
        .parquet(folder)
    table = spark.read.parquet(folder)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    petastorm_cache = tempfile.mkdtemp(prefix="bench-b14-petastorm-")
    spark.conf.set("petastorm.spark.converter.parentCacheDirUrl", "file://" + petastorm_cache)
    times: dict[str, list[float]] = {}

    def timed(name: str, make: Any, close: Any) -> None:
        t0 = time.perf_counter()
        made = make()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        close(made)

    variants = [("read in place", lambda: DataFrameDataset(table, "x", "y").materialize(),
                 lambda ds: (ds.read_in_place or _fail("not read in place"), ds.close())),
                ("materialised (in_place=False)",
                 lambda: DataFrameDataset(table, "x", "y", in_place=False).materialize(),
                 lambda ds: ds.close())]
    if _has("petastorm"):
        from petastorm.spark import make_spark_converter

        variants.append(("petastorm make_spark_converter", lambda: make_spark_converter(table),
                         lambda converter: converter.delete()))
    try:
        for _ in range(max(1, min(repeat, 2))):
            for name, make, close in variants:
                timed(name, make, close)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(petastorm_cache, ignore_errors=True)
    return [{"case": "B14", "variant": f"ready on a {size / 2**30:.2f} GB Parquet table "
             f"({rows_n:,} rows x 784 float32, 4 MB row groups): {name}", "unit": "s",
             **_stats(values)} for name, values in times.items()]


def _fail(why: str) -> None:
    raise AssertionError(why)


def case_b14(repeat: int, tiny: bool, spark_session: Any, frame: Any) -> list[dict]:
    return (local_reads(repeat, tiny, spark_session, frame) + label_diversity(tiny) +
            planned_reads(tiny) +
            ready_times(repeat, tiny, spark_session, frame) + cluster_reads(repeat, tiny, frame))
