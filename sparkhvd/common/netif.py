"""Network interfaces: which address and interface of this host lead to a peer.

The one place that decides the Gloo/NCCL interface of a rank (:func:`collective_iface_env`):
names given by the user (``nics=``) win; otherwise each host uses the interface that routes to
the address the ranks rendezvous at -- interface *names* mean nothing across machines.
"""
from __future__ import annotations

import contextlib
import socket
from typing import Iterable, Optional

__side__ = "common"

#: The variables that name the interface collectives use (Horovod's Gloo, NCCL, PyTorch's Gloo).
IFACE_VARS = ("HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
#: Addresses that mean "this machine".
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: Optional[str]) -> bool:
    """Whether ``host`` names this machine through its loopback (``127.0.0.1``, ``localhost``)."""
    return host in LOOPBACK


def bind_address(host: str) -> str:
    """The address a driver's server listens on for ``host`` (the address the ranks are told):
    that address only, where it resolves and can be bound here -- not every interface, where
    anyone on another network could reach it; every interface (``""``) only where it cannot,
    or where a host name resolves to loopback here (Debian's ``127.0.1.1`` for the machine's
    name): executors elsewhere reach it by another address."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return ""
    if address.startswith("127.") and not is_loopback(host):
        return ""
    with contextlib.suppress(OSError), socket.socket() as probe:
        probe.bind((address, 0))
        return address
    return ""


def route_address(address: str) -> str:
    """This host's address on the route to ``address`` (no packet is sent; the hostname when
    there is no route)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])
    return socket.gethostname()


def iface_towards(address: str) -> Optional[str]:
    """The name of this host's network interface that routes to ``address``."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        local_ip = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local_ip for a in addrs):
            return str(name)
    return None


def collective_iface_env(nics: Optional[Iterable[str]], towards: Optional[str]) -> dict[str, str]:
    """``HOROVOD_GLOO_IFACE``/``NCCL_SOCKET_IFNAME`` for a rank on this host.

    ``nics`` (the user's names) win; else the interface routing to ``towards`` (the rendezvous
    or driver address), ``lo`` when that cannot be found; nothing when neither is known.
    """
    if nics:
        names = sorted(nics)  # Horovod's Gloo takes one interface, NCCL and torch's a list
        return {"HOROVOD_GLOO_IFACE": names[0], "NCCL_SOCKET_IFNAME": ",".join(names),
                "GLOO_SOCKET_IFNAME": ",".join(names)}
    if not towards:
        return {}
    iface = None
    with contextlib.suppress(OSError):
        iface = iface_towards(towards)
    return {name: iface or "lo" for name in IFACE_VARS}


class PortReservation:
    """Ports for this host's ranks, held until the ranks end.

    A port found by binding port 0 and closing the socket is free only for a moment: another
    task on the host (or an outgoing connection) could be handed it before the rank's server
    binds it. Two ``tf`` workers told the same port both listen on it (gRPC sets
    ``SO_REUSEPORT``), and the kernel hands each one connections meant for the other -- a run
    that hangs in its first all-reduce. So each port stays bound here, with ``SO_REUSEADDR``
    and ``SO_REUSEPORT`` and never listening, which keeps every other ``bind(0)`` and outgoing
    connection off it while the rank's own server (gRPC, torch's ``TCPStore``) can still bind
    and listen on it. Close it when the ranks have ended.

    Held on the wildcard address (IPv6's, which covers IPv4 too, where the host has it): the
    ranks' servers listen on every address, so a port held on one address only could still be
    handed to another process binding another (``127.0.0.1``, port 0) -- and gRPC's wildcard
    bind then fails with "Address already in use" ("Could not start gRPC server").
    """

    def __init__(self, count: int) -> None:
        self._held: list[socket.socket] = []
        try:
            for _ in range(count):
                self._held.append(_held_port())
        except BaseException:
            self.close()
            raise
        #: The reserved port numbers, one per rank.
        self.ports: list[int] = [s.getsockname()[1] for s in self._held]

    def close(self) -> None:
        for sock in self._held:
            sock.close()
        self._held = []

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _held_port() -> socket.socket:
    """A socket bound to a free port on every address of the host (see
    :class:`PortReservation`), not listening: IPv6's dual-stack wildcard, or IPv4's where the
    host has no IPv6."""
    try:
        return _bound(socket.AF_INET6, "::")
    except OSError:
        return _bound(socket.AF_INET, "")


def _bound(family: socket.AddressFamily, wildcard: str) -> socket.socket:
    sock = socket.socket(family)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4's addresses too
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((wildcard, 0))
    except BaseException:
        sock.close()
        raise
    return sock
