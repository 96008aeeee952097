"""B11: launch cost as np grows, and where the time goes (run by bench.py)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from bench_common import stats, timed


def _started_at(pid) -> float:
    """When process ``pid`` started, as a ``time.time()`` value: its age from /proc on the boot
    clock (psutil's create_time adds /proc/stat's whole-second boot time: up to 1 s off)."""
    import os as _os
    import time as _time

    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return _time.time() - (uptime - ticks / _os.sysconf("SC_CLK_TCK"))


def _launch_probe(join_group):
    """A no-op rank that says when its process tree started and when it got to the user's code
    (and, with ``join_group``, how long torch's rendezvous took)."""
    import os as _os
    import time as _time

    entered = _time.time()
    record = {"supervisor_started": _started_at(_os.getppid()), "entered": entered,
              "imports_s": 0.0, "rendezvous_s": 0.0}
    if join_group:
        import torch.distributed as dist

        start = _time.time()
        record["imports_s"] = start - entered
        dist.init_process_group("gloo")
        dist.barrier()
        record["rendezvous_s"] = _time.time() - start
        dist.destroy_process_group()
    record["left"] = _time.time()
    return record


def session_of(cores: int):
    """A local[cores] session (the running one is stopped if it has another master)."""
    from pyspark.sql import SparkSession

    from sparkhvd.spark.session import get_or_create_session

    active = SparkSession.getActiveSession()
    if active is not None and active.sparkContext.master != f"local[{cores}]":
        active.stop()
    return get_or_create_session(cores)


def case_b11(repeat: int, tiny: bool) -> list[dict]:
    """Launch cost as np grows: a no-op at np 2/4/8/16 on one local[16] session, per backend,
    against the floor (an np-task Spark job that starts a Python per task), with where the time
    goes (slowest rank at each point): the Spark stage until a rank's process exists, the
    interpreter and sparkhvd's start-up until the user's function runs, torch's rendezvous,
    and the end (results back, ranks reaped, run folder written)."""
    import importlib.util

    from sparkhvd import HorovodRunner

    nps = (2,) if tiny else (2, 4, 8, 16)
    spark = session_of(max(nps))
    sc, python = spark.sparkContext, sys.executable
    out = tempfile.mkdtemp(prefix="bench-b11-")
    backends = [b for b, module in (("horovod", "horovod"), ("tf", "tensorflow"),
                                    ("torch", "torch"))
                if importlib.util.find_spec(module) is not None]
    rows: list[dict] = []
    try:
        for np_ in nps:
            def floor(n=np_):
                sc.parallelize(range(n), n).map(
                    lambda _: subprocess.run([python, "-c", "pass"]).returncode).collect()

            floor()
            rows.append({"case": "B11", "variant": f"floor: {np_}-task Spark job + python, "
                         f"np={np_}", "unit": "s", "np": np_, **timed(floor, repeat)})
            for backend in backends:
                parts: dict[str, list[float]] = {"total": [], "Spark stage to rank process": [],
                                                 "rank start-up to the user's function": [],
                                                 "import torch": [], "rendezvous (torch)": [],
                                                 "end": []}
                warm_up = 0 if tiny else 1
                for round_ in range(warm_up + repeat):
                    t0 = time.time()
                    got = HorovodRunner(np=np_, spark=spark, output_dir=out, backend=backend)\
                        .run_all(_launch_probe, join_group=backend == "torch")
                    t1 = time.time()
                    if round_ < warm_up:
                        continue
                    parts["total"].append(t1 - t0)
                    parts["Spark stage to rank process"].append(
                        max(r["supervisor_started"] for r in got) - t0)
                    parts["rank start-up to the user's function"].append(
                        max(r["entered"] - r["supervisor_started"] for r in got))
                    parts["import torch"].append(max(r["imports_s"] for r in got))
                    parts["rendezvous (torch)"].append(max(r["rendezvous_s"] for r in got))
                    parts["end"].append(t1 - max(r["left"] for r in got))
                for part, values in parts.items():
                    if part in ("import torch", "rendezvous (torch)") and backend != "torch":
                        continue
                    rows.append({"case": "B11", "variant": f"backend={backend}, np={np_}: "
                                 f"{part}", "unit": "s", "np": np_, "backend": backend,
                                 **stats(values)})
    finally:
        spark.stop()
    return rows + _b11_on_hosts(nps, repeat, tiny)


def _b11_on_hosts(nps, repeat: int, tiny: bool) -> list[dict]:
    """B11 again on the test cluster's hosts (network namespaces, 4 hosts x 4 cores, a Spark
    standalone master): ranks spread over hosts, each host with its own address and executor.
    The hosts share this machine's cores, so they show the cross-host path, not parallel
    starts."""
    import importlib.util

    from pyspark.sql import SparkSession

    from netns_cluster import NetnsCluster
    from sparkhvd import HorovodRunner

    variant = "4 hosts (network namespaces)"
    if tiny:
        return [{"case": "B11", "variant": variant, "unit": "s", "skipped": "not in --tiny"}]
    cluster = NetnsCluster(tempfile.mkdtemp(prefix="bench-b11-hosts-"), hosts=4, cores=4)
    try:
        cluster.up()
    except RuntimeError as exc:  # not root, no `ip`, or the cluster did not come up
        cluster.down()
        return [{"case": "B11", "variant": variant, "unit": "s", "skipped": str(exc)[:200]}]
    rows: list[dict] = []
    try:
        spark = (SparkSession.builder.master(cluster.master_url).appName("bench-b11")
                 .config("spark.driver.host", cluster.driver_ip)
                 .config("spark.driver.bindAddress", cluster.driver_ip)
                 .config("spark.executor.cores", "4").config("spark.cores.max", "16")
                 .config("spark.executor.memory", "1g")
                 .config("spark.pyspark.python", sys.executable).getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        from sparkhvd.spark.slots import check_slots

        check_slots(spark.sparkContext, 16, wait_s=120)
        sc, python = spark.sparkContext, sys.executable
        out = tempfile.mkdtemp(prefix="bench-b11-")
        backends = ["horovod"] * (importlib.util.find_spec("horovod") is not None) + \
            ["torch"] * (importlib.util.find_spec("torch") is not None)
        for np_ in nps:
            def floor(n=np_):
                sc.parallelize(range(n), n).map(
                    lambda _: subprocess.run([python, "-c", "pass"]).returncode).collect()

            floor()
            rows.append({"case": "B11", "variant": f"{variant}: floor, np={np_}", "unit": "s",
                         "np": np_, "hosts": 4, **timed(floor, repeat)})
            for backend in backends:
                def runner(n=np_, b=backend):
                    HorovodRunner(np=n, spark=spark, backend=b, output_dir=out).run(
                        _launch_probe, join_group=b == "torch")

                runner()
                rows.append({"case": "B11", "variant": f"{variant}: backend={backend}, np={np_}"
                             ": total", "unit": "s", "np": np_, "hosts": 4,
                             "backend_on_hosts": backend, **timed(runner, repeat)})
        spark.stop()
    finally:
        cluster.down()
    return rows
