"""Several "hosts" on one machine: Linux network namespaces running a real Spark cluster.

Layout (addresses in a private /24 that exists only inside the namespaces we create)::

    root namespace (the driver)                       host namespaces
    bridge <prefix>br  10.231.N.1  --veth--  <prefix>-h1: eth0 10.231.N.11, hostname h1
      Spark master (standalone)     --veth--  <prefix>-h2: eth0 10.231.N.12, hostname h2
      Azurite (when asked)          --veth--  <prefix>-h3: eth0 10.231.N.13, hostname h3

Each host runs one 1-core Spark worker (pip's ``spark-class``) with the project's Python, under
``unshare --uts --mount``: its own hostname and ``/etc/hosts``, its own empty ``/tmp`` and
``HOME`` (tmpfs), the project's code and virtual environment mounted read-only, and tmpfs over
the driver's run-staging folder -- so nothing works by accident through the driver's disk. The
namespaces have no default route: nothing outside them and 127.0.0.0/8 can be contacted.

Everything is stopped by PID and by the names created here (never by a broad name), also when
setting up failed half way. Used by the ``netns_cluster`` fixture (tests/conftest.py) and by
``make cluster-up`` / ``make cluster-down`` (scripts/cluster.py).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

NEEDS = ("The multi-host tests create Linux network namespaces (`ip netns`, veth pairs, a "
         "bridge) and mount namespaces (`unshare --uts --mount`): they need root (CAP_SYS_ADMIN "
         "and CAP_NET_ADMIN), iproute2 and util-linux. Run them as root (CI does), or deselect "
         "them with -m 'not netns'.")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def check_permitted() -> None:
    """Raise RuntimeError(NEEDS) unless namespaces can be created here."""
    if not (shutil.which("ip") and shutil.which("unshare")):
        raise RuntimeError(NEEDS + " (`ip` or `unshare` is not installed)")
    probe = f"shvdprobe{os.getpid() % 10000}"
    out = _run("ip", "netns", "add", probe, check=False)
    if out.returncode:
        raise RuntimeError(f"{NEEDS} (`ip netns add` said: {out.stderr.strip()})")
    _run("ip", "netns", "del", probe, check=False)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def alive_workers_at(webui: str) -> int:
    """Workers a standalone master at ``webui`` sees as ALIVE, from its ``/json/`` page; 0 while
    it is not up. Spark starts the UI's server before it attaches the pages, so for a moment
    ``/json/`` is answered by the page at ``/``: HTML, with status 200 -- also "not up yet"."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{webui}/json/", timeout=5) as r:
            return int(json.load(r).get("aliveworkers", 0))
    except (OSError, ValueError):
        return 0


@dataclass
class Host:
    name: str      # hostname inside the namespace (h1, h2, ...)
    ns: str        # network namespace name
    veth: str      # root side of its veth pair
    ip: str


class NetnsCluster:
    """A Spark standalone cluster of ``hosts`` namespaces (see the module docstring)."""

    def __init__(self, workdir: str, hosts: int = 3, tag: Optional[str] = None,
                 cores: int = 1) -> None:
        import pyspark

        self.workdir = os.path.abspath(workdir)
        self.tag = tag or f"{os.getpid() % 4096:03x}"
        self.prefix = f"shvd{self.tag}"
        subnet = 20 + int(self.tag, 16) % 200
        self.driver_ip = f"10.231.{subnet}.1"
        self.bridge = f"{self.prefix}br"
        self.hosts = [Host(f"h{i}", f"{self.prefix}-h{i}", f"{self.prefix}h{i}",
                           f"10.231.{subnet}.{10 + i}") for i in range(1, hosts + 1)]
        self.spark_home = os.path.dirname(pyspark.__file__)
        self.python = sys.executable
        self.repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.procs: dict[str, subprocess.Popen] = {}
        self.master_port = 0
        self.webui = 0
        self.cores = cores  # per worker (host)

    @property
    def master_url(self) -> str:
        return f"spark://{self.driver_ip}:{self.master_port}"

    # -- bring up ------------------------------------------------------------------------------
    def up(self, timeout: float = 120) -> "NetnsCluster":
        check_permitted()
        os.makedirs(self.workdir, exist_ok=True)
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.driver_ip}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for host in self.hosts:
                _run("ip", "netns", "add", host.ns)
                _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
                     "netns", host.ns)
                _run("ip", "link", "set", host.veth, "master", self.bridge)
                _run("ip", "link", "set", host.veth, "up")
                _run("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
                _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
                _run("ip", "-n", host.ns, "link", "set", "lo", "up")
            with open(os.path.join(self.workdir, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n"
                        f"{self.driver_ip} driver\n"
                        + "".join(f"{h.ip} {h.name}\n" for h in self.hosts))
            self.master_port, self.webui = _free_port(self.driver_ip), _free_port(self.driver_ip)
            self._start("master", None, [
                os.path.join(self.spark_home, "bin", "spark-class"),
                "org.apache.spark.deploy.master.Master", "--host", self.driver_ip,
                "--port", str(self.master_port), "--webui-port", str(self.webui)])
            for host in self.hosts:
                self.start_worker(host)
            try:
                self.wait_for_workers(len(self.hosts), timeout)
            except RuntimeError:  # a worker JVM that died while starting (a busy machine):
                died = [h for h in self.hosts if self.procs[h.name].poll() is not None]
                if not died:  # once more, then give up with its logs
                    raise
                for host in died:
                    self.start_worker(host)
                self.wait_for_workers(len(self.hosts), timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _env(self, local_ip: str) -> dict:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SPARK_HOME": self.spark_home,
                "SPARK_LOCAL_IP": local_ip, "PYSPARK_PYTHON": self.python,
                "SPARK_NO_DAEMONIZE": "1", "JAVA_HOME": os.environ.get("JAVA_HOME", ""),
                "LANG": "C.UTF-8"}

    def _start(self, name: str, host: Optional[Host], cmd: list[str]) -> None:
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
        if host is not None:
            cmd = ["ip", "netns", "exec", host.ns, "unshare", "--uts", "--mount",
                   "--propagation", "private", "sh", "-c", self._host_script(host, cmd)]
        self.procs[name] = subprocess.Popen(
            cmd, env=self._env(host.ip if host else self.driver_ip), stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _host_script(self, host: Host, cmd: list[str]) -> str:
        import shlex

        staging = os.path.join(os.path.expanduser("~"), ".cache")
        hide = [p for p in (staging, os.path.join(self.repo, "runs")) if os.path.isdir(p)]
        repo = shlex.quote(self.repo)
        readonly = [f"mount --bind {repo} {repo}", f"mount -o remount,bind,ro {repo}"]
        lines = ["set -e", f"hostname {host.name}",
                 f"mount --bind {shlex.quote(os.path.join(self.workdir, 'hosts'))} /etc/hosts",
                 # the driver's disk stays out of reach: read-only code, empty /tmp and HOME
                 *readonly,
                 f"exec 3< {repo}",  # the code, even when it lies under the /tmp hidden next
                 "mount -t tmpfs -o size=4g tmpfs /tmp",
                 # (the path as given: canonicalised, it would name the new, empty folder)
                 f"if [ ! -d {repo} ]; then mkdir -p {repo}; "
                 f"mount --no-canonicalize --bind /proc/self/fd/3 {repo}; {readonly[1]}; fi",
                 "exec 3<&-",
                 *[f"mount -t tmpfs tmpfs {shlex.quote(p)}" for p in hide],
                 "mkdir -p /tmp/home /tmp/spark-work", "export HOME=/tmp/home",
                 "export TMPDIR=/tmp",  # the driver's own (tests/conftest.py) is not here
                 "exec " + " ".join(shlex.quote(c) for c in cmd)]
        return "\n".join(lines)

    def start_worker(self, host: Host) -> None:
        self._start(host.name, host, [
            os.path.join(self.spark_home, "bin", "spark-class"),
            "org.apache.spark.deploy.worker.Worker", "--host", host.ip, "--cores", str(self.cores),
            "--memory", "2g", "--work-dir", "/tmp/spark-work", self.master_url])

    def alive_workers(self) -> int:
        return alive_workers_at(f"http://{self.driver_ip}:{self.webui}")

    def wait_for_workers(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_workers() >= n:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{n} worker(s) are not alive at {self.master_url} (alive: "
                           f"{self.alive_workers()}); logs in {self.workdir}")

    # -- trouble -------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def pids_in(self, host: Host) -> list[int]:
        """Every process of a host namespace (``ip netns pids``)."""
        out = _run("ip", "netns", "pids", host.ns, check=False)
        return [int(p) for p in out.stdout.split()]

    def kill_host(self, name: str) -> None:
        """The machine dies: SIGKILL every process in its namespace."""
        host = self.host(name)
        for _ in range(5):
            pids = self.pids_in(host)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.wait(30)

    def cut_network(self, name: str) -> None:
        """The machine drops off the network without closing anything (its veth goes down)."""
        _run("ip", "link", "set", self.host(name).veth, "down")

    def restore_host(self, name: str) -> None:
        """Network back and a fresh worker (after kill_host / cut_network)."""
        self.kill_host(name)
        host = self.host(name)
        _run("ip", "link", "set", host.veth, "up")
        self.start_worker(host)
        self.wait_for_workers(len(self.hosts))

    # -- tear down -----------------------------------------------------------------------------
    def down(self) -> None:
        """Stop every process by PID, then delete the namespaces and the bridge by name."""
        for host in self.hosts:
            try:
                self.kill_host(host.name)
            except Exception:  # noqa: BLE001 - keep tearing down
                pass
        for _name, proc in list(self.procs.items()):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(30)
        self.procs.clear()
        for host in self.hosts:
            _run("ip", "netns", "del", host.ns, check=False)
            _run("ip", "link", "del", host.veth, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    # -- for make cluster-up / cluster-down ----------------------------------------------------
    def save(self, path: str) -> None:
        state = {"workdir": self.workdir, "tag": self.tag, "master_url": self.master_url,
                 "driver_ip": self.driver_ip, "hosts": [asdict(h) for h in self.hosts],
                 "pids": {n: p.pid for n, p in self.procs.items()}}
        with open(path, "w") as f:
            json.dump(state, f, indent=2)

    @classmethod
    def load_and_stop(cls, path: str) -> None:
        with open(path) as f:
            state = json.load(f)
        cluster = cls(state["workdir"], hosts=len(state["hosts"]), tag=state["tag"])
        for _name, pid in state["pids"].items():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        cluster.down()
