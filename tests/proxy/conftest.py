"""Shared fixtures for proxy tests: fake vLLM servers (tests/fakes_vllm_server.py) and a proxy, each on its own
thread, and a real bootstrap server."""

from __future__ import annotations

import pytest

from kvlink.proxy.config import ProxyConfig
from kvlink.proxy.router import build_app
from tests.fakes_vllm_server import AppThread, FakeVLLMServer
from tests.ports import free_port  # noqa: F401 - test_router imports it from here


@pytest.fixture
def backends():
    made = []

    def make(name, behavior="ok"):
        b = FakeVLLMServer(name, behavior)
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()


@pytest.fixture
def proxy():
    made = []

    def make(**kw):
        kw.setdefault("timeout_s", 5.0)
        cfg = ProxyConfig(**kw)
        t = AppThread(build_app(cfg))
        made.append(t)
        return t.url

    yield make
    for t in made:
        t.stop()


@pytest.fixture
def bootstrap():
    """A real bootstrap server with prefill engine "p0" registered (token ``TOKEN``)."""
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer
    from tests.bootstrap.conftest import TOKEN, registration

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0, token=TOKEN)).start()
    with BootstrapClient(srv.url, token=TOKEN) as cli:
        cli.register_engine(registration("p0"), lease_s=60.0)
    yield srv
    srv.stop()
