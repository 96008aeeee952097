"""A torch rank joins as soon as rank 0's store listens (sparkhvd.rank.rendezvous): which calls
wait for the store, and the wait itself (a socket of this test, on 127.0.0.1)."""
from __future__ import annotations

import socket

import pytest

from sparkhvd.rank import rendezvous


@pytest.fixture
def env(monkeypatch):
    for name, value in {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return monkeypatch


@pytest.mark.parametrize("args, kwargs, waits", [
    (("gloo",), {}, True),                                    # torchrun's env:// as users call it
    ((), {"backend": "gloo", "init_method": "env://"}, True),
    (("gloo", "tcp://10.0.0.1:1"), {}, False),                # the user's own rendezvous
    (("gloo",), {"store": object()}, False),
    (("gloo",), {"rank": 0, "world_size": 2}, False),          # rank 0 hosts the store
    (("gloo", None, None, 2, 1), {}, True),                    # rank 1, given by position
])
def test_only_a_default_env_rendezvous_of_another_rank_waits(env, args, kwargs, waits):
    assert rendezvous._env_rendezvous(args, kwargs) is waits


def test_rank_0_and_an_agent_store_never_wait(env):
    env.setenv("RANK", "0")
    assert not rendezvous._env_rendezvous(("gloo",), {})
    env.setenv("RANK", "1")
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert not rendezvous._env_rendezvous(("gloo",), {})


def test_the_wait_ends_when_the_port_listens_or_at_its_limit():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    assert not rendezvous.wait_for_store("127.0.0.1", port, limit_s=0.05)  # bound, not listening
    listener.listen(1)
    try:
        assert rendezvous.wait_for_store("127.0.0.1", port, limit_s=5)
    finally:
        listener.close()


def test_a_host_that_does_not_resolve_is_left_to_torch_at_once():
    assert not rendezvous.wait_for_store("no-such-host.invalid", 29500, limit_s=60)


def test_the_wait_is_never_longer_than_the_calls_own_timeout(env):
    """init_process_group(timeout=...) bounds the wait too (torch then says what it says)."""
    import datetime
    import types

    waited = {}
    module = types.SimpleNamespace(init_process_group=lambda *a, **k: "joined")
    rendezvous._wrap(module)
    env.setattr(rendezvous, "wait_for_store",
                lambda host, port, limit: waited.setdefault("limit", limit))
    assert module.init_process_group("gloo", timeout=datetime.timedelta(seconds=7)) == "joined"
    assert waited["limit"] == 7
