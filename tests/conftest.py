"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

TOKEN = b"kvlink-test-token"


@pytest.fixture
def token() -> bytes:
    return TOKEN


@pytest.fixture
def make_engine() -> Iterator[Callable[..., object]]:
    """Factory for engines on 127.0.0.1 (ephemeral port), closed after the test."""
    from kvlink.transport import Engine, EngineConfig

    made = []

    def make(**kw):
        kw.setdefault("token", TOKEN)
        kw.setdefault("op_timeout_s", 10.0)
        e = Engine(EngineConfig(**kw))
        made.append(e)
        return e

    yield make
    for e in reversed(made):
        e.close()


@pytest.fixture
def pair(make_engine):
    """A target with a 1 MiB random READ|WRITE region and an initiator connected to it."""
    from kvlink.transport import Access

    def build(crc: bool = False, streams: int = 2, size: int = 1 << 20, target_crc: bool | None = None):
        target = make_engine(name="target", crc=crc if target_crc is None else target_crc, streams=streams)
        init = make_engine(name="initiator", listen=None, crc=crc, streams=streams)
        src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        rsrc = target.register(src, Access.READ | Access.WRITE)
        rdst = init.register(dst)
        peer = init.connect(target.address)
        return Pair(target, init, peer, src, dst, rsrc, rdst)

    return build


class Pair:
    def __init__(self, target, init, peer, src, dst, rsrc, rdst):
        self.target, self.init, self.peer = target, init, peer
        self.src, self.dst, self.rsrc, self.rdst = src, dst, rsrc, rdst


@pytest.fixture
def traced(tmp_path):
    """kvlink.trace on, into a file of the test's own, for the test's duration: yields the file's path."""
    from kvlink import trace

    path = tmp_path / "trace.jsonl"
    trace.configure(str(path))
    yield path
    trace.configure(None)


def trace_lines(path) -> list[dict]:
    """The events of a KVLINK_TRACE file, in file order."""
    import json

    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
