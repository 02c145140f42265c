"""Fixtures for the backend suite: the same checks against the native engine
('tcp') and Mooncake, real engines on 127.0.0.1, and a Mooncake target in its
own process for the faults (stopped or killed peer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

TOKEN = b"kvlink-backend-test-token"
SIZE = 4 << 20
HERE = os.path.dirname(__file__)


class Pair:
    """A target with a random READ|WRITE region, an initiator connected to it."""

    def __init__(self, target, init, peer, src, dst, rsrc, rdst):
        self.target, self.init, self.peer = target, init, peer
        self.src, self.dst, self.rsrc, self.rdst = src, dst, rsrc, rdst


@pytest.fixture
def make_backend() -> Iterator:
    """Factory: open_backend(kind, EngineConfig(...), options) on 127.0.0.1, closed after the test."""
    from kvlink.backends import MooncakeConfig, open_backend
    from kvlink.transport import EngineConfig

    made = []

    def make(kind: str, options=None, **kw):
        kw.setdefault("token", TOKEN)
        kw.setdefault("op_timeout_s", 20.0)
        if kind == "mooncake" and options is None:
            options = MooncakeConfig()  # defaults, whatever the environment of the test run
        b = open_backend(kind, EngineConfig(**kw), options)
        made.append(b)
        return b

    yield make
    # Destroying a Mooncake engine takes about a second: close them side by side.
    closers = [threading.Thread(target=b.close) for b in reversed(made)]
    for t in closers:
        t.start()
    for t in closers:
        t.join()


@pytest.fixture
def make_pair(make_backend):
    from kvlink.transport import Access

    def build(kind: str, size: int = SIZE, options=None) -> Pair:
        target = make_backend(kind, options=options, name="target")
        init = make_backend(kind, options=options, name="initiator", listen=None)
        src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        rsrc = target.register(src, Access.READ | Access.WRITE)
        rdst = init.register(dst)
        return Pair(target, init, init.connect(target.address), src, dst, rsrc, rdst)

    return build


@pytest.fixture(params=["tcp", "mooncake"])
def kind(request) -> str:
    return request.param


class TargetProcess:
    def __init__(self, size: int):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "mc_target.py"), TOKEN.decode(), str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise RuntimeError("mooncake target process failed to start")
        d = json.loads(line)
        self.address, self.region, self.seed = d["address"], d["region"], d["seed"]

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def mc_target() -> Iterator:
    """Factory: a Mooncake target process serving a patterned READ|WRITE region; killed after the test."""
    made = []

    def start(size: int = 64 << 20) -> TargetProcess:
        t = TargetProcess(size)
        made.append(t)
        return t

    yield start
    for t in made:
        t.kill()
