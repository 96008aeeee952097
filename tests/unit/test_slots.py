"""Slot counting from master URLs and Spark settings (pure), and the early error."""
import pytest

from sparkhvd import NotEnoughSlotsError
from sparkhvd.spark.slots import check_slots, count_slots


@pytest.mark.parametrize("master,expected", [
    ("local", 1), ("local[2]", 2), ("local[8]", 8), ("local[*]", 6), ("local[3, 4]", 3),
    ("local-cluster[2,3,1024]", 6),
])
def test_local_masters(master, expected):
    assert count_slots(master, {}, cpu_count=6).slots == expected


def test_task_cpus_divides_cores():
    found = count_slots("local[4]", {"spark.task.cpus": "2"}, cpu_count=8)
    assert found.slots == 2
    assert "spark.task.cpus=2" in found.detail


def test_cluster_uses_registered_executor_cores():
    found = count_slots("spark://10.0.0.1:7077", {}, cpu_count=2, executor_cores=[4, 4, 2])
    assert found.slots == 10
    found = count_slots("yarn", {"spark.task.cpus": "3"}, cpu_count=2, executor_cores=[4, 4])
    assert found.slots == 2  # 4 // 3 per executor: slots do not span executors


def test_cluster_falls_back_to_default_parallelism():
    assert count_slots("yarn", {}, cpu_count=2, default_parallelism=12).slots == 12


def test_gpus_limit_slots_per_executor():
    conf = {"spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "1"}
    found = count_slots("spark://h:7077", conf, cpu_count=2, executor_cores=[12, 12, 12])
    assert found.slots == 3  # seed 001's GPU-large pool: 3 executors x 1 GPU
    conf["spark.executor.resource.gpu.amount"] = "4"
    conf["spark.task.resource.gpu.amount"] = "0.5"
    assert count_slots("spark://h:7077", conf, cpu_count=2, executor_cores=[4]).slots == 4


def test_task_gpu_without_executor_gpu_has_no_slots():
    found = count_slots("yarn", {"spark.task.resource.gpu.amount": "1"}, cpu_count=2,
                        executor_cores=[4])
    assert found.slots == 0
    assert "spark.executor.resource.gpu.amount" in found.fix


def test_bad_number_in_conf_is_named():
    with pytest.raises(ValueError, match="spark.task.cpus='two'"):
        count_slots("local[2]", {"spark.task.cpus": "two"}, cpu_count=2)


class _FakeConf:
    def __init__(self, items):
        self._items = items

    def getAll(self):
        return list(self._items.items())


class _FakeContext:
    master = "local[2]"
    defaultParallelism = 2

    def getConf(self):
        return _FakeConf({})


def test_check_slots_error_states_found_needed_and_fix():
    with pytest.raises(NotEnoughSlotsError) as info:
        check_slots(_FakeContext(), 3)
    msg = str(info.value)
    assert "np=3 needs 3" in msg and "has 2" in msg and "local[N]" in msg
    assert check_slots(_FakeContext(), 2).slots == 2
