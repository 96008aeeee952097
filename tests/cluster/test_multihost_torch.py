"""backend="torch" across hosts: the netns cluster (tests/netns_cluster.py), gloo over the veth,
and a host lost mid-run named in the error. Runs in the modern profile."""
import json
import os
import threading
import time

import pytest

from conftest import still_alive
from sparkhvd import HorovodRunner, TrainingError

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.netns, pytest.mark.torch_backend, pytest.mark.timeout(420)]

HOSTS = {"h1", "h2", "h3"}


def _allreduce():
    import os
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return (socket.gethostname(), os.environ.get("GLOO_SOCKET_IFNAME"), total.item(),
            os.environ["MASTER_ADDR"])


def test_ranks_on_three_hosts_with_gloo_on_the_veth(cluster_spark, tmp_path):
    results = HorovodRunner(np=3, spark=cluster_spark, backend="torch",
                            output_dir=str(tmp_path)).run_all(_allreduce)
    assert {host for host, *_ in results} == HOSTS
    assert {iface for _, iface, *_ in results} == {"eth0"}, "chosen automatically, never lo"
    assert {total for *_, total, _ in results} == {6.0}
    assert len({master for *_, master in results}) == 1 and results[0][3] != "127.0.0.1"


def _trains_forever():
    import os
    import socket
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"started on {socket.gethostname()} pid {os.getpid()}", flush=True)
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)


def test_a_host_that_dies_mid_run_is_named(cluster_spark, netns_cluster, tmp_path, rank_lines):
    def kill_when_started():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and \
                sum("started on" in line for line in rank_lines) < 3:
            time.sleep(0.2)
        kill_when_started.host = next(h for h in ("h3", "h2", "h1")
                                      if any(f"started on {h}" in line for line in rank_lines))
        netns_cluster.kill_host(kill_when_started.host)

    thread = threading.Thread(target=kill_when_started, daemon=True)
    thread.start()
    runner = HorovodRunner(np=3, spark=cluster_spark, backend="torch",
                           driver_log_verbosity="all", output_dir=str(tmp_path))
    try:
        with pytest.raises(TrainingError) as info:  # the hang guard is the test's timeout
            runner.run(_trains_forever)
        thread.join(10)
        record = json.loads(open(runner.last_run_dir.file("run.json")).read())
        hosts = {int(k): v for k, v in record["hosts"].items()}
        lost = kill_when_started.host
        err = info.value
        assert err.host == lost and hosts[err.rank] == lost, str(err)
        survivors = [int(pid) for r, pid in record["rank_pids"].items() if hosts[int(r)] != lost]
        assert still_alive(survivors, 30.0) == [], "no rank process left on the other hosts"
    finally:
        netns_cluster.restore_host(getattr(kill_when_started, "host", "h3"))


def test_sharded_checkpoints_and_library_checkpoints_from_hosts_that_cannot_see_the_run_folder(
        cluster_spark, tmp_path):
    """FSDP2 on three hosts: every rank's DCP shards reach the run folder through the driver's
    run-folder service (no host sees the driver's disk), and resume_from=True restores them
    exactly; a Hugging Face Trainer's own checkpoints land in the run folder the same way."""
    import os

    import torch_clients

    def runner(folder, **kw):
        return HorovodRunner(np=3, spark=cluster_spark, backend="torch",
                             output_dir=str(tmp_path / folder), **kw)

    straight = runner("a").run_all(torch_clients.fsdp2, epochs=3)
    runner("b").run_all(torch_clients.fsdp2, epochs=1)
    resumed = runner("b", resume_from=True)
    records = resumed.run_all(torch_clients.fsdp2, epochs=3)
    assert {r["start"] for r in records} == {1}
    assert [r["weights"] for r in records] == [straight[0]["weights"]] * 3
    record = json.loads(open(resumed.last_run_dir.file("checkpoints/epoch-0003.json")).read())
    assert {f["rank"] for f in record["files"].values()} == {0, 1, 2}

    hf = runner("hf", env={"HF_HUB_OFFLINE": "1"})
    hf.run(torch_clients.hf_trainer, output_dir="hf", save_steps=5)
    saved = os.listdir(hf.last_run_dir.file("hf"))
    assert {"checkpoint-5", "checkpoint-10"} <= set(saved), saved


@pytest.mark.long("three attempts (3, 2, then 3 hosts), each starting torch on every host, "
                  "paced to be caught mid-epoch: 100-135 s on 2 cores")
def test_an_elastic_run_loses_a_host_goes_on_with_two_and_grows_back(
        cluster_spark, netns_cluster, cluster_azurite, tmp_path, rank_lines):
    """np=3, min_np=2 on three hosts: a host dies mid-epoch -> the run relaunches from its
    newest step checkpoint with the 2 hosts left (never waiting for the lost one); the host
    comes back -> the run grows back to 3 at its next step. Every id once per epoch (the steps
    since the checkpoint, lost with the host, are trained again, not counted twice). The
    relaunches read no row from the files: what the hosts kept, and the driver's copies."""
    import elastic_training as et
    from conftest import wait_for
    from sparkhvd import DataFrameDataset
    from sparkhvd.runfolder.service import row_copies_folder
    from sparkhvd.spark.slots import check_slots

    # A host an earlier test restored has a worker again, but its executor may still be
    # registering: with min_np=2 the run would start on 2 hosts, not the 3 it must lose one of.
    check_slots(cluster_spark.sparkContext, 3, wait_s=120)
    n = 253
    df = cluster_spark.range(n).selectExpr(
        "id", "array(CAST(id % 7 AS FLOAT), CAST(id % 5 AS FLOAT), 1.0F) AS x",
        "CAST(id % 7 + 2 * (id % 5) AS FLOAT) AS y")
    lost: dict = {}

    def trouble():
        def mid_epoch():
            ranks = et.read_lines(rank_lines).get(0, {})
            return len(ranks) == 3 and all(any(e == 1 and s >= 5 for e, s, _ in r["steps"])
                                           for r in ranks.values())
        assert wait_for(mid_epoch, 240, 0.2)
        lost["host"] = "h3"
        netns_cluster.kill_host("h3")
        assert wait_for(lambda: len(et.read_lines(rank_lines).get(1, {})) == 2, 240, 0.2)
        netns_cluster.restore_host("h3")

    thread = threading.Thread(target=trouble, daemon=True)
    try:
        with DataFrameDataset(df, ["x", "id"], "y", cache_url=cluster_azurite.url(
                "cache", "elastic"), storage_options=cluster_azurite.options()) as ds:
            runner = HorovodRunner(np=3, min_np=2, max_np=3, resize_check_s=2,
                                   spark=cluster_spark, backend="torch",
                                   driver_log_verbosity="all", output_dir=str(tmp_path / "runs"))
            thread.start()
            result = runner.run(et.train_ids, data=ds, epochs=2, log_dir=None,
                                step_s=(0.1, 0.6, 0.05), every_steps=2,
                                hold=(1, 3))  # at 2 ranks: until it grows
        thread.join(60)
        record = runner.last_run_dir.record
        assert [a["size"] for a in record["attempts"]] == [3, 2, 3], record["attempts"]
        first, second = record["resizes"]
        assert (first["from"], first["to"]) == (3, 2) and "h3" in first["why"], first
        assert (second["from"], second["to"]) == (2, 3) and "growing" in second["why"]
        assert result == {"world": 3, "change": (2, 3)}
        restored = record["attempts"][1]["restored"].rsplit("/", 1)[-1]
        name = restored.rsplit(".", 1)[0]
        epoch, step = int(name.split("-")[1]), int(name.rsplit("-", 1)[1])
        logs = et.read_lines(rank_lines)
        for entry in logs[0].values():  # lost with the host: trained again after the restore
            entry["steps"] = [(e, s, i) for e, s, i in entry["steps"]
                              if e < epoch or (e == epoch and s <= step)]
        for e in range(2):
            ids = et.ids_of_epoch(logs, e)
            assert len(ids) == len(set(ids)), f"epoch {e}: an id trained twice"
            assert set(ids) <= set(range(n)) and n - len(ids) < 3 * 4, f"epoch {e}"
        # this small table's row groups went to the driver as attempt 1 read them: the
        # relaunches read what their hosts kept, the new host the driver's copies -- nothing
        # from the files -- and the copies went with the run
        later = [entry["read"] for attempt in (1, 2) for entry in logs[attempt].values()]
        assert sum(files for files, _, _ in later) == 0, logs
        assert any(driver > 0 for _, _, driver in later), logs
        assert not os.path.exists(row_copies_folder(runner.last_run_dir.run_id))
    finally:
        thread.join(60)
        if "host" in lost and netns_cluster.alive_workers() < 3:
            netns_cluster.restore_host(lost["host"])
