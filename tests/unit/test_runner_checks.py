"""Argument checks of the runner (SparkRunner, and HorovodRunner): immediate, specific errors."""
import pytest

from sparkhvd import HorovodRunner, PayloadError, SparkRunner


def test_horovod_runner_is_the_spark_runner_with_horovod_by_default():
    """SparkRunner is the runner, its backend always said; HorovodRunner, the Databricks-
    compatible name, differs only in ``backend="horovod"`` by default. Errors name the class
    the caller made."""
    assert issubclass(HorovodRunner, SparkRunner)
    assert HorovodRunner(np=2).backend == "horovod"
    assert HorovodRunner(np=2, backend="torch").backend == "torch"
    assert SparkRunner(np=2, backend="tf").backend == "tf"
    with pytest.raises(TypeError, match="backend"):
        SparkRunner(np=2)  # nothing about the name picks one
    with pytest.raises(TypeError, match="SparkRunner needs np"):
        SparkRunner(backend="torch")
    with pytest.raises(RuntimeError, match="No run of this SparkRunner is running"):
        SparkRunner(np=2, backend="torch").dump_stacks()


@pytest.mark.parametrize("bad", [0, 1.5, "2", None, True, [2]])
def test_np_must_be_nonzero_int(bad):
    with pytest.raises(ValueError, match="np must be a non-zero int") as info:
        HorovodRunner(np=bad)
    assert "np=-N" in str(info.value)


@pytest.mark.parametrize("np_", [1, 2, -1, -3])
def test_valid_np(np_):
    assert HorovodRunner(np=np_).np == np_


def test_verbosity_checked():
    with pytest.raises(ValueError, match="driver_log_verbosity must be one of"):
        HorovodRunner(np=2, driver_log_verbosity="loud")


def test_start_timeout_checked():
    with pytest.raises(ValueError, match="start_timeout"):
        HorovodRunner(np=2, start_timeout=0)


def test_env_values_must_be_strings():
    with pytest.raises(TypeError, match="env must map str to str"):
        HorovodRunner(np=2, env={"EPOCHS": 3})


def test_non_callable_fn_rejected_before_launch(tmp_path):
    with pytest.raises(PayloadError, match="must be callable"):
        HorovodRunner(np=2, output_dir=str(tmp_path)).run("train")
    assert not list(tmp_path.iterdir()), "nothing may be started for a bad argument"


@pytest.mark.parametrize("kwargs", [dict(np=2, min_np=3), dict(np=3, max_np=2),
                                    dict(np=-2, min_np=1), dict(np=2, min_np=0)])
def test_elastic_bounds_checked(kwargs):
    with pytest.raises(ValueError, match="min_np <= np <= max_np"):
        HorovodRunner(**kwargs)


def test_elastic_bounds_default_to_np():
    assert HorovodRunner(np=3, min_np=2).elastic == (2, 3)


def test_launcher_checked():
    with pytest.raises(ValueError, match="launcher must be one of"):
        HorovodRunner(np=2, launcher="mpi")
    with pytest.raises(ValueError, match="run_elastic"):
        HorovodRunner(np=2, min_np=1, launcher="barrier")


class _Conf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _SC:
    """A session view (sparkhvd.spark.sparkview.SparkView's conf and kind) without Spark."""

    connect = False

    def __init__(self, **conf):
        self._conf = _Conf(conf)

    def conf(self, key, default=None):
        return self._conf.get(key, default)


class _Connect(_SC):
    connect = True


def choose_launcher(requested="auto", view=None, elastic=None, backend="horovod"):
    from sparkhvd.driver.launchers import LaunchFacts
    from sparkhvd.driver.launchers import choose_launcher as choose

    return choose(LaunchFacts(backend, requested, bool(elastic)).with_session(view))


def test_auto_launcher_falls_back_to_horovod_for_elastic_and_dynamic_allocation():

    assert choose_launcher("auto", _SC()) == "barrier"
    assert choose_launcher("auto", _SC(), elastic=(1, 2)) == "horovod"
    dynamic = _SC(**{"spark.dynamicAllocation.enabled": "true"})
    assert choose_launcher("auto", dynamic) == "horovod"
    with pytest.raises(ValueError, match="dynamicAllocation"):
        choose_launcher("barrier", dynamic)


def test_connect_sessions_take_the_barrier_stage_and_refuse_horovod_spark_run():
    assert choose_launcher("auto", _Connect()) == "barrier"
    assert choose_launcher("barrier", _Connect(), backend="tf") == "barrier"
    for kw in ({"requested": "horovod"}, {"requested": "auto", "elastic": (1, 2)}):
        with pytest.raises(ValueError, match="needs a SparkContext; this is a Spark Connect"):
            choose_launcher(view=_Connect(), **kw)
    with pytest.raises(ValueError, match="Spark Connect session.*dynamicAllocation"):
        choose_launcher("auto", _Connect(**{"spark.dynamicAllocation.enabled": "true"}))


def test_a_remote_connect_servers_local_master_is_not_this_machine(monkeypatch):
    """A Connect server elsewhere running local[*]: its executors are on its machine, so the
    ranks reach this client at its routed address and share no disk with it."""
    from sparkhvd.spark import sparkview
    from sparkhvd.spark.sparkview import SparkView

    class Conf:
        def get(self, key, default=None):
            return {"spark.master": "local[4]"}.get(key, default)

    def session(host):
        cls = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})
        spark = cls()
        spark.conf, spark.client = Conf(), type("Client", (), {"host": host})()
        return spark

    monkeypatch.setattr(sparkview, "route_address", lambda host: f"route-to-{host}")
    remote = SparkView(session("connect.example"))
    assert remote.connect and not remote.executors_here()
    assert remote.driver_host() == "route-to-connect.example"
    local = SparkView(session("localhost"))
    assert local.executors_here() and local.driver_host() == "127.0.0.1"


def test_one_failed_question_to_the_jvm_is_not_a_stopped_session(monkeypatch):
    """A py4j error while asking whether the context stopped is asked again: a run is failed
    as "the SparkSession was stopped" only for a cleared context or a JVM that keeps failing."""
    from sparkhvd.spark import sparkview

    monkeypatch.setattr(sparkview, "STOPPED_ASK_GAP_S", 0.0)

    def context(answers):
        def is_stopped():
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        jvm_context = type("JavaSparkContext", (), {"isStopped": staticmethod(is_stopped)})()
        jsc = type("JavaContext", (), {"sc": lambda self: jvm_context})()
        return type("SparkContext", (), {"_jsc": jsc})()

    busy = ConnectionError("an answer from the Java side is empty")
    assert not sparkview.session_stopped(context([busy, False]))
    assert sparkview.session_stopped(context([busy, True]))
    assert sparkview.session_stopped(context([busy, busy, busy]))
    assert sparkview.session_stopped(type("SparkContext", (), {"_jsc": None})())
    assert sparkview.session_stopped(None)


def test_prepared_arguments_are_found_in_containers_and_opened_in_the_rank():
    """The preparation protocol, both halves, without Spark: the driver swaps each prepared
    argument (also inside lists, tuples and dicts) for what the ranks get; the rank opens it."""
    from sparkhvd.data.sharding import ShardSource
    from sparkhvd.driver.arguments import Prepared
    from sparkhvd.rank.arguments import open_argument

    source = ShardSource(files=("a.parquet",), row_counts=(10,), row_groups=((10,),),
                         stored={"x": "x"}, row_bytes=8, features=("x",), label=None)
    finished = []

    class Needs:
        def prepare_for_ranks(self):
            return source

        def after_run(self, succeeded):
            finished.append(succeeded)

    prepared = Prepared({"a": Needs(), "b": [1, (Needs(),)], "c": {"k": Needs()}, "d": "plain"})
    assert prepared.kwargs["a"] is source and prepared.kwargs["b"][1][0] is source
    assert prepared.kwargs["c"]["k"] is source and prepared.kwargs["d"] == "plain"
    prepared.finish(succeeded=True)
    assert finished == [True, True, True]
    opened = open_argument(prepared.kwargs["c"])
    assert type(opened["k"]).__name__ == "DatasetShard" and opened["k"].num_rows == 10
    assert opened["k"].steps_per_epoch(5, size=2) == 1

    class Breaks(Needs):
        def prepare_for_ranks(self):
            raise RuntimeError("no Spark")

    finished.clear()
    with pytest.raises(RuntimeError, match="no Spark"):
        Prepared({"a": Needs(), "b": Breaks()})
    assert finished == [False], "what was prepared before the failure is cleaned up"
