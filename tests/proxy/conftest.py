"""Shared fixtures for proxy tests: fake vLLM servers (tests/fakes_vllm_server.py) and a proxy, each on its own
thread."""

from __future__ import annotations

import socket

import pytest

from kvlink.proxy.config import ProxyConfig
from kvlink.proxy.router import build_app
from tests.fakes_vllm_server import AppThread, FakeVLLMServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
