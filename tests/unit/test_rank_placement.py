"""In-rank bootstrap: thread sharing on CPU, GPU pinning (with a fake TensorFlow)."""
import types

import pytest

from sparkhvd.rank.devices import RankPlan, configure_tensorflow, detect_gpus, plan_rank


def test_cpu_cores_shared_among_local_ranks():
    plan = plan_rank(local_rank=1, local_size=2, cpu_count=8, gpus=[], environ={})
    assert plan.gpu_index is None
    assert plan.env == {"TF_NUM_INTRAOP_THREADS": "4", "TF_NUM_INTEROP_THREADS": "2",
                        "OMP_NUM_THREADS": "4", "HOROVOD_CYCLE_TIME": "5"}
    assert plan_rank(0, 4, 2, [], environ={}).env["TF_NUM_INTRAOP_THREADS"] == "1"


def test_user_settings_are_not_overridden():
    plan = plan_rank(0, 2, 8, [], environ={"OMP_NUM_THREADS": "3", "HOROVOD_CYCLE_TIME": "1"})
    assert "OMP_NUM_THREADS" not in plan.env and "HOROVOD_CYCLE_TIME" not in plan.env


def test_gpu_pinned_by_local_rank_with_memory_growth():
    plan = plan_rank(local_rank=1, local_size=2, cpu_count=16, gpus=["0", "1"], environ={})
    assert plan.gpu_index == 1 and plan.memory_growth
    assert plan.env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert plan_rank(3, 4, 16, ["0", "1"], environ={}).gpu_index == 1


def test_detect_gpus_from_cuda_visible_devices():
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


class _FakeConfig:
    def __init__(self, n):
        self.devices = [types.SimpleNamespace(name=f"/physical_device:GPU:{i}") for i in range(n)]
        self.growth = {}
        self.visible = None

    def list_physical_devices(self, kind):
        return self.devices if kind == "GPU" else []

    def set_memory_growth(self, dev, on):
        self.growth[dev.name] = on

    def set_visible_devices(self, dev, kind):
        self.visible = (dev.name, kind)


def _fake_tf(n):
    experimental = _FakeConfig(n)
    return types.SimpleNamespace(config=types.SimpleNamespace(experimental=experimental))


def test_configure_tensorflow_pins_one_gpu():
    tf = _fake_tf(2)
    name = configure_tensorflow(tf, RankPlan(gpu_index=1, memory_growth=True))
    assert name == "/physical_device:GPU:1"
    assert tf.config.experimental.visible == ("/physical_device:GPU:1", "GPU")
    assert tf.config.experimental.growth == {"/physical_device:GPU:0": True,
                                             "/physical_device:GPU:1": True}


def test_configure_tensorflow_cpu_plan_touches_nothing():
    tf = _fake_tf(2)
    assert configure_tensorflow(tf, RankPlan()) is None
    assert tf.config.experimental.visible is None


def test_elastic_results_ordered_by_final_rank_and_retried_tasks_dropped():
    from sparkhvd.common.protocol import ELASTIC_RESULT
    from sparkhvd.driver.launchers.horovod_spark import elastic_result

    launch_order = [None, (ELASTIC_RESULT, 1, None), (ELASTIC_RESULT, 0, b"model")]
    assert elastic_result(launch_order) == [b"model", None]


@pytest.mark.horovod
def test_barrier_ranks_are_contiguous_per_host_in_partition_order():
    from sparkhvd.common.backends.horovod import assign_ranks

    slots, envs = assign_ranks({0: "b", 1: "a", 2: "b", 3: "a"})
    ranks = {p: (e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_CROSS_RANK"])
             for p, e in envs.items()}
    assert ranks == {0: ("0", "0", "0"), 2: ("1", "1", "0"), 1: ("2", "0", "1"),
                     3: ("3", "1", "1")}
    assert {e["HOROVOD_SIZE"] for e in envs.values()} == {"4"}
    assert len(slots) == 4


def test_gpu_assigned_by_spark_wins_over_local_rank():
    from sparkhvd.common.protocol import TASK_GPUS_ENV

    plan = plan_rank(0, 2, 16, ["0", "1", "2", "3"], environ={TASK_GPUS_ENV: "2"})
    assert plan.gpu_index == 2
    # An address this process cannot see falls back to the local rank.
    assert plan_rank(1, 2, 16, ["0", "1"], environ={TASK_GPUS_ENV: "7"}).gpu_index == 1


def test_barrier_task_finds_the_interface_that_reaches_the_driver():
    from sparkhvd.common.netif import iface_towards

    assert iface_towards("127.0.0.1") == "lo"


def test_tf_backend_ranks_are_contiguous_per_host_with_a_tf_config_each():
    import json

    from sparkhvd.common.backends import TaskInfo
    from sparkhvd.common.backends.tf import Backend

    tasks = {0: TaskInfo(0, "b", "10.0.0.2", 5001), 1: TaskInfo(1, "a", "10.0.0.1", 5002),
             2: TaskInfo(2, "b", "10.0.0.2", 5003)}
    envs = Backend().assign(tasks)
    workers = ["10.0.0.2:5001", "10.0.0.2:5003", "10.0.0.1:5002"]
    for partition, rank, local in ((0, 0, 0), (2, 1, 1), (1, 2, 0)):
        config = json.loads(envs[partition]["TF_CONFIG"])
        assert config == {"cluster": {"worker": workers}, "task": {"type": "worker",
                                                                   "index": rank}}
        assert envs[partition]["SPARKHVD_RANK"] == str(rank)
        assert envs[partition]["SPARKHVD_LOCAL_RANK"] == str(local)


def test_tf_backend_refuses_two_ranks_on_one_address_and_port():
    from sparkhvd.common.backends import TaskInfo
    from sparkhvd.common.backends.tf import Backend

    tasks = {0: TaskInfo(0, "a", "10.0.0.1", 5001), 1: TaskInfo(1, "a", "10.0.0.1", 5001)}
    with pytest.raises(RuntimeError, match="10.0.0.1:5001"):
        Backend().assign(tasks)


def test_a_reserved_port_is_kept_from_others_until_closed_and_the_ranks_server_can_use_it():
    import socket

    from sparkhvd.common.netif import PortReservation

    with PortReservation(2) as reserved:
        assert len(set(reserved.ports)) == 2
        for _ in range(200):  # nobody else is handed it ...
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                assert other.getsockname()[1] not in reserved.ports
        for address in ("127.0.0.1", "127.0.0.2"):  # ... on any of the host's addresses
            with socket.socket() as plain, pytest.raises(OSError):
                plain.bind((address, reserved.ports[0]))
        # ... but the rank's server binds and listens on it, as gRPC does (every address)
        with socket.socket(socket.AF_INET6) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("::", reserved.ports[0]))
            server.listen(1)
            socket.create_connection(("127.0.0.1", reserved.ports[0]), timeout=5).close()
        with socket.socket() as server:  # SO_REUSEADDR alone (libuv's TCPStore) will do too
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", reserved.ports[1]))
            server.listen(1)
    with socket.socket() as after:  # closed: free again
        after.bind(("127.0.0.1", reserved.ports[1]))


def test_torch_backend_gives_every_rank_torchruns_variables():
    """MASTER_ADDR/PORT are rank 0's host and the port its task reserved; ranks contiguous per
    host, as on the other backends."""
    from sparkhvd.common.backends import TaskInfo, get_backend
    from sparkhvd.common.identity import RankIdentity

    tasks = {0: TaskInfo(0, "b", "10.0.0.2", 5001), 1: TaskInfo(1, "a", "10.0.0.1", 5002),
             2: TaskInfo(2, "b", "10.0.0.2", 5003)}
    envs = get_backend("torch").assign(tasks)
    for partition, rank, local, host in ((0, 0, 0, 0), (2, 1, 1, 0), (1, 2, 0, 1)):
        env = envs[partition]
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.2", "5001")
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "3")
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(local), "2" if host == 0
                                                                 else "1")
        assert env["GROUP_RANK"] == env["NODE_RANK"] == str(host)
        assert RankIdentity.from_env(env) == (rank, 3, local, 2 if host == 0 else 1)


def test_a_plain_torchrun_rank_knows_its_rank_and_sparkhvds_names_win():
    """A script using sparkhvd's helpers under ``torchrun`` alone is rank RANK of WORLD_SIZE
    (not every rank "rank 0 of 1", each writing the checkpoints); inside a sparkhvd run the
    SPARKHVD_* names come first."""
    from sparkhvd.common.identity import RankIdentity

    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert RankIdentity.from_env(torchrun) == (3, 4, 1, 2)
    ours = {**torchrun, "SPARKHVD_RANK": "0", "SPARKHVD_SIZE": "2"}
    assert RankIdentity.from_env(ours)[:2] == (0, 2)
    assert RankIdentity.from_env({}) == (0, 1, 0, 1)


def test_the_collective_interface_is_chosen_in_one_place():
    from sparkhvd.common.netif import collective_iface_env

    assert collective_iface_env({"eth1", "eth0"}, "10.0.0.1") == {
        "HOROVOD_GLOO_IFACE": "eth0", "NCCL_SOCKET_IFNAME": "eth0,eth1",
        "GLOO_SOCKET_IFNAME": "eth0,eth1"}
    assert set(collective_iface_env(None, "127.0.0.1").values()) == {"lo"}
    assert collective_iface_env(None, None) == {}


def test_torch_pins_the_planned_gpu_and_leaves_every_gpu_visible():
    from sparkhvd.rank.devices import RankPlan, configure_torch

    class Cuda:
        current = None

        @staticmethod
        def is_available():
            return True

        @staticmethod
        def device_count():
            return 2

        @classmethod
        def set_device(cls, index):
            cls.current = index

    class Torch:
        cuda = Cuda

    assert configure_torch(Torch, RankPlan(gpu_index=3)) == "cuda:1" and Cuda.current == 1
    assert configure_torch(Torch, RankPlan()) is None
