"""How ranks are laid out for PyTorch, without starting anything: torchrun's variables, the two
numberings (host: torchrun's; task: TorchDistributor's), several ranks per task with a GPU fake,
and the settings that refuse what cannot work."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sparkhvd.common import protocol
from sparkhvd.common.backends import RunTag, get_backend
from sparkhvd.common.identity import RankIdentity


def _slots(per_task: bool, ranks_per_task: int = 1, hosts=("b", "a", "b")) -> dict:
    slots: dict = {}
    for partition, host in enumerate(hosts):
        ports = [5000 + 10 * partition + i for i in range(ranks_per_task)]
        slots.update(protocol.rank_slots(partition, host, f"10.0.0.{ord(host)}", ports,
                                         ranks_per_task, per_task))
    return slots


def test_torchrun_numbering_counts_local_ranks_per_host():
    envs = get_backend("torch").assign(_slots(per_task=False))
    # ranks contiguous per host: partitions 0 and 2 (host b) are ranks 0 and 1
    got = {p: (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"])
           for p, e in envs.items()}
    assert got == {0: ("0", "0", "2", "0"), 2: ("1", "1", "2", "0"), 1: ("2", "0", "1", "1")}
    assert {e["GROUP_WORLD_SIZE"] for e in envs.values()} == {"2"}


@pytest.mark.parametrize("backend", ["torch", "tf"])
def test_every_rank_is_told_the_host_of_every_rank(backend):
    """What a resize deals by (each host the rows its ranks were reading): the hosts of the
    ranks in rank order, the same for all of them, however the backend numbers them."""
    from sparkhvd.common.backends import assign_with_hosts
    from sparkhvd.common.identity import rank_hosts

    envs = assign_with_hosts(get_backend(backend), _slots(per_task=False))
    assert {e[protocol.RANK_HOSTS_ENV] for e in envs.values()} == {"b,b,a"}
    assert rank_hosts(3, envs[1]) == ("b", "b", "a") and rank_hosts(2, envs[1]) == ()


def test_torchdistributor_numbering_makes_every_task_its_own_node():
    envs = get_backend("torch").assign(_slots(per_task=True))
    got = {p: (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"])
           for p, e in envs.items()}
    assert got == {0: ("0", "0", "1", "0"), 1: ("1", "0", "1", "1"), 2: ("2", "0", "1", "2")}
    assert {e["GROUP_WORLD_SIZE"] for e in envs.values()} == {"3"}
    # the cores are still shared by the ranks on a host: host b runs two
    assert [envs[p][protocol.HOST_RANKS_ENV] for p in (0, 1, 2)] == ["2", "1", "2"]


def test_several_ranks_per_task_are_a_node_each_with_their_own_port():
    envs = get_backend("torch").assign(_slots(per_task=True, ranks_per_task=2, hosts=("h", "h")))
    assert sorted(envs) == [0, 1, 2, 3]
    assert [(envs[s]["RANK"], envs[s]["LOCAL_RANK"], envs[s]["GROUP_RANK"]) for s in range(4)] \
        == [("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert {envs[s]["MASTER_PORT"] for s in range(4)} == {"5000"}, "rank 0's reserved port"
    tf = get_backend("tf").assign(_slots(per_task=True, ranks_per_task=2, hosts=("h", "h")))
    workers = json.loads(tf[0]["TF_CONFIG"])["cluster"]["worker"]
    assert len(set(workers)) == 4, "every rank has its own port"
    assert RankIdentity.from_env(tf[3]) == (3, 4, 1, 2)


def test_torchruns_run_variables_and_none_that_would_lie():
    backend = get_backend("torch")
    run_env = backend.start("127.0.0.1", None, False, RunTag("20261124-1200-abcd", 1, 2))
    assert run_env["TORCHELASTIC_RUN_ID"] == "20261124-1200-abcd"
    assert (run_env["TORCHELASTIC_RESTART_COUNT"], run_env["TORCHELASTIC_MAX_RESTARTS"]) == \
        ("1", "2")
    env = backend.assign(_slots(per_task=False))[0]
    assert (env["ROLE_NAME"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("default", "0", "3")
    for lie in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"):
        assert lie not in env and lie not in run_env
    from sparkhvd.common.environment import run_variable

    assert all(run_variable(k) for k in (*env, *run_env) if not k.startswith("SPARKHVD_")), \
        "a rank's scrub keeps every variable the backend set"


class _FakeGpus:
    addresses = ["2", "3"]


def test_a_tasks_gpus_are_its_nodes_gpus_with_a_gpu_fake(monkeypatch):
    """Several ranks per task: CUDA_VISIBLE_DEVICES is the task's GPUs (as TorchDistributor sets
    it) and each rank is pinned to GPU LOCAL_RANK of them; one rank per task keeps the task's
    GPU as the pin (SPARKHVD_TASK_GPUS)."""
    from sparkhvd.executor.barrier import _rank_env
    from sparkhvd.rank.devices import detect_gpus, plan_rank

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = protocol.TaskSpec(payload=b"", options={}, env={}, driver=("127.0.0.1", 1),
                             token="t", start_timeout=1.0, backend="torch", run_env={},
                             ranks_per_task=2, node_per_task=True)
    for local_rank in (0, 1):
        env = _rank_env(spec, {"LOCAL_RANK": str(local_rank)}, _FakeGpus(), True)
        assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
        assert protocol.TASK_GPUS_ENV not in env
        plan = plan_rank(local_rank, 2, 16, detect_gpus(env), env)
        assert plan.gpu_index == local_rank, "cuda:LOCAL_RANK of the task's GPUs"
    mine = protocol.TaskSpec(**{**spec.__dict__, "env": {"CUDA_VISIBLE_DEVICES": ""}})
    assert _rank_env(mine, {}, _FakeGpus(), True)["CUDA_VISIBLE_DEVICES"] == "", "the user's wins"
    one = protocol.TaskSpec(**{**spec.__dict__, "ranks_per_task": 1, "node_per_task": False})
    env = _rank_env(one, {}, _FakeGpus(), True)
    assert env[protocol.TASK_GPUS_ENV] == "2,3" and "CUDA_VISIBLE_DEVICES" not in env


def test_settings_refuse_what_cannot_be_numbered():
    from sparkhvd.driver.settings import ScalingConfig

    assert ScalingConfig(np=4, ranks_per_task=2).node_per_task
    assert ScalingConfig(np=2, local_ranks="task").node_per_task
    assert not ScalingConfig(np=2).node_per_task
    assert ScalingConfig(np=-4, ranks_per_task=2).tasks == 2
    with pytest.raises(ValueError, match="np=3 is not a multiple of ranks_per_task=2.*np=4"):
        ScalingConfig(np=3, ranks_per_task=2)
    with pytest.raises(ValueError, match="local_ranks='host' cannot number ranks_per_task=2"):
        ScalingConfig(np=4, ranks_per_task=2, local_ranks="host")
    with pytest.raises(ValueError, match="local_ranks must be"):
        ScalingConfig(np=2, local_ranks="gpu")
    from sparkhvd import HorovodRunner

    with pytest.raises(ValueError, match="horovod's rendezvous cannot"):
        HorovodRunner(np=4, ranks_per_task=2)  # backend="horovod"


def test_the_drop_in_counts_gpus_as_sparks_class(monkeypatch):
    """use_gpu=True on a cluster: spark.task.resource.gpu.amount ranks per task, num_processes a
    multiple of it -- the same rules and words as pyspark's TorchDistributor, with the fix."""
    from sparkhvd.spark import session, sparkview
    from sparkhvd.torch.distributor import TorchDistributor

    conf = {"spark.task.resource.gpu.amount": "2"}
    monkeypatch.setattr(session, "get_or_create_session", lambda np, spark=None: spark)
    monkeypatch.setattr(sparkview.SparkView, "__init__", lambda self, s: None)
    monkeypatch.setattr(sparkview.SparkView, "conf", lambda self, k, d=None: conf.get(k, d))
    assert TorchDistributor._task_gpus(SimpleNamespace(), 4) == 2
    with pytest.raises(RuntimeError, match=r"\(3\) must be a multiple"):
        TorchDistributor._task_gpus(SimpleNamespace(), 3)
    conf.clear()
    with pytest.raises(RuntimeError, match="was unset.*use_gpu=False"):
        TorchDistributor._task_gpus(SimpleNamespace(), 2)


@pytest.mark.parametrize("frame, named", [
    ("lightning/pytorch/strategies/ddp.py", "Trainer"),
    ("pytorch_lightning/strategies/ddp.py", "Trainer"),
    ("lightning/fabric/strategies/ddp.py", "Fabric"),
    ("lightning_fabric/strategies/ddp.py", "Fabric")])
def test_the_numbering_hint_names_what_the_user_ran(frame, named):
    """Trainer(devices=1, num_nodes=N) and Fabric(devices=1, num_nodes=N) fail alike under
    torchrun's numbering; the fix names the one in the traceback."""
    from sparkhvd.common.events import known_fix

    trace = (f'File "/site-packages/{frame}", line 86, in root_device\n'
             "    return self.parallel_devices[self.local_rank]\nIndexError: list index out of "
             "range\n")
    fix = known_fix(IndexError("list index out of range"), trace,
                    {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    other = "Fabric" if named == "Trainer" else "Trainer"
    assert f"Lightning's {named} has fewer devices" in fix and f"{named}(devices=" in fix
    assert other not in fix and "local_ranks='task'" in fix
