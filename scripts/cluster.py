"""Bring the multi-host test cluster up or down by hand, for debugging (`make cluster-up`).

    .venv/bin/python scripts/cluster.py up [--hosts 3]   # prints the master URL and addresses
    .venv/bin/python scripts/cluster.py down

The same cluster the tests use (tests/netns_cluster.py): network namespaces h1..hN on a private
bridge, a Spark standalone master on the bridge address, one 1-core worker per host. Its state
(PIDs, namespace names) is kept in .cluster/state.json; `down` stops exactly those.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
STATE = os.path.join(ROOT, ".cluster", "state.json")


def main(argv: list[str] | None = None) -> int:
    from netns_cluster import NetnsCluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--hosts", type=int, default=3)
    args = parser.parse_args(argv)
    if args.action == "down":
        if not os.path.exists(STATE):
            print("no cluster is up (no .cluster/state.json)")
            return 0
        NetnsCluster.load_and_stop(STATE)
        os.unlink(STATE)
        print("cluster stopped")
        return 0
    if os.path.exists(STATE):
        print(f"a cluster is already up ({STATE}): `make cluster-down` first", file=sys.stderr)
        return 1
    cluster = NetnsCluster(os.path.join(ROOT, ".cluster", "work"), hosts=args.hosts, tag="d0")
    try:
        cluster.up()
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    cluster.save(STATE)
    print(f"master:  {cluster.master_url}  (driver address {cluster.driver_ip})")
    for host in cluster.hosts:
        print(f"host {host.name}: namespace {host.ns}, {host.ip}")
    print("e.g.  .venv/bin/sparkhvd doctor --np 3 --master " + cluster.master_url)
    print("      ip netns exec " + cluster.hosts[0].ns + " sh   # a shell on h1's network")
    return 0


if __name__ == "__main__":
    sys.exit(main())
