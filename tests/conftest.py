"""Shared fixtures: one local-mode SparkSession (2 task slots) for the whole test session."""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _a_temp_folder_of_its_own() -> None:
    """Each test process (a pytest-xdist worker, or pytest itself) gets a ``TMPDIR`` of its own,
    removed at its end: what the product keeps in the temp folder (dataset caches, host copies,
    run staging) and the tests that look for what a run left there see only their own process'
    runs, however many processes run tests side by side."""
    import atexit
    import shutil
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    folder = tempfile.mkdtemp(prefix=f"sparkhvd-tests-{worker}-")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None
    atexit.register(shutil.rmtree, folder, True)


_a_temp_folder_of_its_own()

#: The JVMs the tests start (local sessions, spark-submit, standalone masters and workers, the
#: Spark Connect server) live seconds to minutes, so the JIT's second tier and the parallel
#: collector cost them CPU they never earn back: about 6 of a session's 16 CPU seconds to start
#: on this 2-core machine. A test environment's choice, never the product's (users' JVM flags are
#: theirs); what a test checks does not depend on how the JVM compiles.
_TEST_JVM_FLAGS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("SPARK_SUBMIT_OPTS", _TEST_JVM_FLAGS)
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", _TEST_JVM_FLAGS)


def _executor_jvm_flags() -> None:
    """The same flags for the executors of the standalone and network-namespace clusters
    (started by their workers with the application's ``spark.executor.extraJavaOptions``),
    through a ``spark-defaults.conf`` every ``spark-submit`` of the tests reads: the fixtures'
    sessions, the drivers the tests start as subprocesses, the Connect servers. A test that sets
    the option itself still wins."""
    if "SPARK_CONF_DIR" in os.environ:
        return
    folder = os.path.join(os.environ["TMPDIR"], "spark-conf")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "spark-defaults.conf"), "w") as f:
        f.write(f"spark.executor.extraJavaOptions {_TEST_JVM_FLAGS}\n")
    os.environ["SPARK_CONF_DIR"] = folder


_executor_jvm_flags()

#: Where DeepSpeed's JIT-built ops are kept: the environment's own folder, where `make setup`
#: built its CPU communication op (scripts/setup.sh), so no test compiles it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch-extensions"))


#: fixture -> the marker of what it starts (see pyproject.toml's markers).
_STARTS = {"spark": "spark", "azurite": "azurite", "standalone": "cluster",
           "netns_cluster": "netns", "cluster_spark": "netns", "connect_server": "connect",
           "any_spark": "spark"}


#: Markers of tests that start something (Spark, rank processes, servers, clusters).
_STARTING_MARKERS = ("spark", "ranks", "azurite", "cluster", "netns", "notebook", "connect")


def pytest_configure(config):
    """The suite's own clock (tests/suite_clock.py): a limit per test, the slowest at the end."""
    import suite_clock

    config.pluginmanager.register(suite_clock, "suite_clock")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark each test by what its fixtures start (so `make unit` really starts nothing), and
    tests/unit's as ``unit`` (a profile picks the stack-independent ones once: the Makefile).

    The multi-host tests go first, as one xdist group: they replace this process' SparkContext
    with the cluster's (their fixtures are module-scoped, so the cluster is gone before any
    test of the local session starts), and they are the longest work of a run, which a worker
    should start while the others take everything else. First of the hooks (``tryfirst``):
    pytest-xdist's own turns the group marker into the test's group as it collects -- after
    this one, or every worker would start its own cluster of hosts beside the others'."""
    for item in items:
        for fixture, marker in _STARTS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(getattr(pytest.mark, marker))
        starts = [m for m in _STARTING_MARKERS if item.get_closest_marker(m)]
        if "unit" in item.path.parent.name:
            if starts:
                raise pytest.UsageError(
                    f"{item.nodeid} starts something ({', '.join(starts)}): tests/unit is for "
                    "tests that start nothing; move it to tests/integration or tests/cluster.")
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("spark") or item.get_closest_marker("cluster") or \
                item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.ranks)
        if item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.xdist_group("netns"))
    items.sort(key=lambda item: item.get_closest_marker("netns") is None)


def wait_for(condition, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition()`` until it is true (True) or ``timeout`` seconds passed (False): the
    tests wait for what they need, never for a guessed time."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def by_value(call, *modules):
    """Run ``call()`` with ``modules`` pickled by value: Spark's TorchDistributor pickles
    functions by reference, and test modules are not importable on its executors (sparkhvd's
    payload pickles them by value itself)."""
    import importlib

    picklers = [importlib.import_module(name) for name in ("cloudpickle", "pyspark.cloudpickle")
                if importlib.util.find_spec(name)]
    for pickler in picklers:
        for module in modules:
            pickler.register_pickle_by_value(module)
    try:
        return call()
    finally:
        for pickler in picklers:
            for module in modules:
                pickler.unregister_pickle_by_value(module)


def still_alive(pids, grace=20.0):
    """The PIDs still running (not zombies) after waiting up to ``grace`` seconds for them."""
    import time

    import psutil

    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # gone, between any two looks
            return False

    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if running(p)]
        if alive:
            time.sleep(0.3)
    return alive


def assert_no_rank_left(runner, grace=20.0):
    """No rank process of ``runner``'s last run is alive (PIDs from its run.json); the record."""
    import json

    record = json.loads(open(runner.last_run_dir.file("run.json")).read())
    pids = [int(p) for p in record["rank_pids"].values()]
    assert pids, "the run recorded its rank PIDs"
    alive = still_alive(pids, grace)
    assert not alive, f"rank processes still alive: {alive}"
    return record


#: The backend a profile trains on when a test is not about the backend: horovod where it is
#: installed (Spark 3.5 profiles), tf.distribute in the modern one (Spark 4, Keras 3).
HAS_HOROVOD = importlib.util.find_spec("horovod") is not None
PROFILE_BACKEND = "horovod" if HAS_HOROVOD else "tf"


@pytest.fixture(autouse=True)
def _function_end_work_stays_in_its_test():
    """Checkpoint helpers made in the test process register their function-end work there (as
    a rank's do, for its one function): forgotten after each test, so a test that failed while
    its save was held does not make a later test's ``function_ended()`` wait for it."""
    yield
    from sparkhvd.common import function_end

    function_end._CALLBACKS.clear()
    function_end._ON_RETURN.clear()


@pytest.fixture
def backend():
    """The profile's backend (see PROFILE_BACKEND), for tests of what sits beside training."""
    return PROFILE_BACKEND


@pytest.fixture(params=["barrier", "horovod"])
def launcher(request):
    """Both Spark launchers: sparkhvd's barrier stage and horovod.spark.run."""
    return request.param


@pytest.fixture(scope="session")
def spark():
    """A real local[2] SparkSession on 127.0.0.1, created the way HorovodRunner creates one."""
    from sparkhvd.spark.session import get_or_create_session

    session = get_or_create_session(2)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def data():
    """The digits split as keyword arguments of ``digits_keras.train`` (the Keras tests)."""
    import digits_keras

    x_train, x_val, y_train, y_val = digits_keras.digits_split()
    return dict(x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def rank_lines():
    """Lines the driver shows from the ranks (what a user sees), as a list of strings."""
    from sparkhvd.driver.logs import rank_logger

    handler = _Capture()
    rank_logger.addHandler(handler)
    yield handler.lines
    rank_logger.removeHandler(handler)


AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")  # Azurite's well-known development key (public, not a secret)
AZURITE_BIN = os.path.join(os.path.dirname(__file__), "..", ".tools", "node_modules", ".bin",
                           "azurite-blob")


def _free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def gated_store(url: str):
    """A real checkpoint folder (``UrlStore`` on ``url``) whose writes wait for ``gate`` -- a
    save held in flight where a test needs one -- or fail with ``fail``; ``writing`` is set
    once a write began."""
    import threading

    from sparkhvd.checkpoint.stores import UrlStore

    class Gated(UrlStore):
        def __init__(self) -> None:
            super().__init__(url)
            self.gate = threading.Event()
            self.gate.set()
            self.writing = threading.Event()
            self.fail: OSError | None = None

        def write(self, name: str, data: bytes) -> None:
            self.writing.set()
            self.gate.wait(60)
            if self.fail is not None:
                raise self.fail
            super().write(name, data)

        def write_file(self, name: str, local_path: str) -> None:
            with open(local_path, "rb") as f:
                self.write(name, f.read())

        @contextlib.contextmanager
        def open_write(self, name: str):
            self.writing.set()
            self.gate.wait(60)
            if self.fail is not None:
                raise self.fail
            with super().open_write(name) as f:
                yield f

    return Gated()


class Azurite:
    """A running Azurite blob service on 127.0.0.1 and how to reach it through adlfs."""

    account = "devstoreaccount1"

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        self.endpoint = f"http://{host}:{port}/{self.account}"

    def connection_string(self, key: str = AZURITE_KEY) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={self.account};AccountKey={key};"
                f"BlobEndpoint={self.endpoint};")

    def url(self, container: str, path: str = "") -> str:
        return f"abfss://{container}@{self.account}.dfs.core.windows.net/{path}".rstrip("/")

    def options(self, **kw) -> dict:
        return {"connection_string": self.connection_string(**kw)}

    def make_container(self, name: str) -> None:
        from azure.storage.blob import BlobServiceClient

        client = BlobServiceClient.from_connection_string(self.connection_string())
        if not client.get_container_client(name).exists():
            client.create_container(name)

    @classmethod
    def start(cls, data_dir: str, host: str = "127.0.0.1") -> "Azurite":
        """Start azurite-blob on a port of ``host`` (127.0.0.1, or the test cluster's bridge
        address) that it chose itself (no free port to race for); stop it with :meth:`stop` (by
        PID). Telemetry is off: nothing leaves the host."""
        import re
        import select
        import subprocess
        import time

        if not os.path.exists(AZURITE_BIN):
            raise RuntimeError("Azurite is not installed in .tools/: install Node.js and run "
                               "'make setup'.")
        said: list[str] = []
        for _ in range(3):  # seen once: it said "starting" on the bridge and exited silently
            proc = subprocess.Popen(  # port 0: Azurite binds a free one and says which
                [AZURITE_BIN, "--blobHost", host, "--blobPort", "0",
                 "--location", str(data_dir), "--silent", "--loose", "--disableTelemetry",
                 # the Azure SDK speaks a newer API version than Azurite 3.35 knows:
                 "--skipApiVersionCheck"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                text=True)
            deadline = time.monotonic() + 60
            said = []
            while time.monotonic() < deadline and \
                    select.select([proc.stdout], [], [], deadline - time.monotonic())[0]:
                line = proc.stdout.readline()
                if not line:
                    break
                said.append(line)
                found = re.search(r"successfully listens on http://[^\s]+:(\d+)", line)
                if found:
                    service = cls(int(found.group(1)), host)
                    service.proc = proc
                    return service
            proc.kill()
            proc.wait()
            said.append(proc.stderr.read())
        raise RuntimeError(f"Azurite did not start (3 tries): {''.join(said)}")

    def stop(self) -> None:
        import subprocess

        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    """A real Azurite blob service, started on a free port and stopped by PID."""
    try:
        service = Azurite.start(str(tmp_path_factory.mktemp("azurite")))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        service.make_container("models")
        yield service
    finally:
        service.stop()


class StandaloneCluster:
    """A real Spark standalone master + workers on 127.0.0.1 (processes of pip's pyspark)."""

    def __init__(self, workdir, workers: int = 2, cores: int = 1) -> None:
        import pyspark

        self.home = os.path.dirname(pyspark.__file__)
        self.workdir = workdir
        self._ports: set[int] = set()
        self.port = self._new_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.procs: dict[str, "subprocess.Popen"] = {}
        self.env = {**os.environ, "SPARK_HOME": self.home, "SPARK_LOCAL_IP": "127.0.0.1",
                    "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1"}
        self.webui = self._new_port()
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.webui))
        for i in range(workers):
            self.start_worker(f"worker{i}", cores)

    def _start(self, name: str, cls: str, *args: str) -> None:
        import subprocess

        log = open(os.path.join(self.workdir, f"{name}.log"), "wb")
        self.procs[name] = subprocess.Popen(
            [os.path.join(self.home, "bin", "spark-class"), cls, *args], env=self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _new_port(self) -> int:
        """A free port this cluster has not handed out yet: the JVMs bind theirs seconds after
        they are chosen, so the kernel may offer a chosen port again in the meantime."""
        port = _free_port()
        while port in self._ports:
            port = _free_port()
        self._ports.add(port)
        return port

    def start_worker(self, name: str, cores: int = 1) -> None:
        work = os.path.join(self.workdir, name)
        os.makedirs(work, exist_ok=True)
        self._start(name, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                    "--cores", str(cores), "--memory", "2g", "--work-dir", work,
                    "--port", str(self._new_port()), "--webui-port", str(self._new_port()),
                    self.master_url)

    def alive_workers(self) -> int:
        """Workers the master currently sees as ALIVE (from its /json status page)."""
        from netns_cluster import alive_workers_at

        return alive_workers_at(f"http://127.0.0.1:{self.webui}")

    def wait_for_workers(self, n: int, timeout: float = 90) -> None:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_workers() >= n:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{n} worker(s) are not alive at {self.master_url} "
                           f"(alive: {self.alive_workers()})")

    def kill(self, name: str) -> None:
        """SIGKILL a process and its whole process group (the worker and its executors)."""
        import signal

        proc = self.procs.get(name)
        if proc and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)

    def stop(self) -> None:
        for name in list(self.procs)[::-1]:
            self.kill(name)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 with a SQLite backend, stopped by PID."""
    import signal
    import socket
    import time
    import urllib.request

    pytest.importorskip("mlflow", reason="the mlflow extra is part of the dev install")
    work = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{work}/mlflow.db",
         "--default-artifact-root", f"file://{work}/artifacts", "--workers", "1"],
        stdout=open(work / "server.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail("mlflow server did not start: "
                            + (work / "server.log").read_text()[-2000:])
            time.sleep(0.5)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


@pytest.fixture(scope="session")
def standalone(tmp_path_factory):
    """Master + two one-core workers on 127.0.0.1; every process stopped by PID at the end."""
    cluster = StandaloneCluster(str(tmp_path_factory.mktemp("standalone")), workers=2, cores=1)
    try:
        cluster.wait_for_workers(2)
        yield cluster
    finally:
        cluster.stop()


def connect_unavailable():
    """Why this environment cannot run a Spark Connect server and client, or ``None``."""
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        return (f"pip's pyspark {pyspark.__version__} ships no Spark Connect server (its jar "
                "comes from Maven with --packages); pyspark 4 does")
    try:
        import pyspark.sql.connect.session  # noqa: F401 - grpc & co (pyspark[connect])
    except ImportError as exc:
        return f"Spark Connect's client is not installed ({exc})"
    return None


class ConnectServer:
    """A real Spark Connect server (pip's pyspark: spark-submit --class ...SparkConnectServer)
    for ``master``, on a free port of 127.0.0.1; stopped by PID (its process group)."""

    CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"

    def __init__(self, workdir, master: str = "local[2]", **conf: str) -> None:
        import subprocess

        import pyspark

        home = os.path.dirname(pyspark.__file__)
        self.port = _free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.log = os.path.join(str(workdir), f"connect-{self.port}.log")
        settings = {"spark.connect.grpc.binding.address": "127.0.0.1",
                    "spark.connect.grpc.binding.port": str(self.port),
                    "spark.ui.enabled": "false", "spark.pyspark.python": sys.executable,
                    "spark.executorEnv.TF_CPP_MIN_LOG_LEVEL": "2", **conf}
        args = [os.path.join(home, "bin", "spark-submit"), "--class", self.CLASS,
                "--master", master]
        for key, value in settings.items():
            args += ["--conf", f"{key}={value}"]
        env = {**os.environ, "SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1",
               "PYSPARK_PYTHON": sys.executable}
        self.proc = subprocess.Popen(args, env=env, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._wait()

    def _wait(self, timeout: float = 120) -> None:
        import socket
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the Spark Connect server did not start: "
                                       + open(self.log, errors="replace").read()[-3000:]) from None
                time.sleep(0.3)

    def session(self):
        """A new Connect client session of this server (built directly: this process may hold
        a classic one; create(), since getOrCreate() returns any earlier server's session)."""
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        return ConnectSession.builder.remote(self.url).create()

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001 - then by force
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """A Spark Connect server on local[2] (a separate process, as a cluster's would be)."""
    why = connect_unavailable()
    if why:
        pytest.skip(f"{why}; the modern profile runs these")
    server = ConnectServer(tmp_path_factory.mktemp("connect"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _connect_session(connect_server):
    session = connect_server.session()
    yield session
    with __import__("contextlib").suppress(Exception):
        session.stop()


@pytest.fixture
def connect(_connect_session, monkeypatch):
    """A Spark Connect session (no SparkContext) on that server, with this process in connect
    mode for the test -- as ``SparkSession.builder.remote(...)`` puts a user's process (pyspark
    routes ``functions``/UDFs by that mode; this test process also holds a classic session)."""
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    return _connect_session


@pytest.fixture(params=["classic", pytest.param("connect", marks=pytest.mark.connect)])
def any_spark(request):
    """The same test on a classic session and on a Spark Connect session."""
    return request.getfixturevalue("spark" if request.param == "classic" else "connect")


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    """Three "hosts" (network namespaces) with a Spark standalone cluster; torn down by PID and
    by the names created, also after a failure (see tests/netns_cluster.py). Per module: each
    profile has one module of them, and the local session's tests come after it."""
    from netns_cluster import NetnsCluster, check_permitted

    try:
        check_permitted()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    cluster = NetnsCluster(str(tmp_path_factory.mktemp("netns")), hosts=3)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="module")
def cluster_spark(netns_cluster):
    """The driver's SparkSession on the namespace cluster (replaces the local one)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    os.environ["PYSPARK_PYTHON"] = sys.executable  # what pyspark gives the executors' workers
    session = (SparkSession.builder.master(netns_cluster.master_url).appName("sparkhvd-netns")
               .config("spark.driver.host", netns_cluster.driver_ip)
               .config("spark.driver.bindAddress", netns_cluster.driver_ip)
               .config("spark.executor.cores", "1").config("spark.cores.max", "3")
               .config("spark.executor.memory", "1g")
               .config("spark.pyspark.python", sys.executable)
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", "2")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    from sparkhvd.spark.slots import check_slots

    check_slots(session.sparkContext, 3, wait_s=90)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def cluster_azurite(netns_cluster, tmp_path_factory):
    """Azurite on the cluster's bridge address (reachable from every host namespace)."""
    service = Azurite.start(str(tmp_path_factory.mktemp("azurite-netns")),
                            host=netns_cluster.driver_ip)
    try:
        service.make_container("models")
        service.make_container("cache")
        yield service
    finally:
        service.stop()


# -- every way ranks start -------------------------------------------------------------------
@pytest.fixture(params=["barrier", "horovod", "local"])
def mode(request):
    """Every way ranks start: Spark barrier stage, horovod.spark.run, local processes."""
    return request.param


def runner_for(mode, spark, tmp_path, **kw):
    """A runner for ``mode`` (the :func:`mode` fixture's launchers)."""
    from sparkhvd import HorovodRunner

    if mode == "local":
        return HorovodRunner(np=-2, output_dir=str(tmp_path), **kw)
    return HorovodRunner(np=2, spark=spark, launcher=mode, output_dir=str(tmp_path), **kw)


@pytest.fixture
def spark_for(mode, request):
    return None if mode == "local" else request.getfixturevalue("spark")
