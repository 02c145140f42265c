"""Shared fixtures of the bootstrap suite: a fake clock, a table, servers, clients and raw HTTP (tests/fakes.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvlink.bootstrap import (
    BootstrapClient,
    BootstrapConfig,
    BootstrapServer,
    EngineRegistration,
    KVLayerSpec,
    PairingTable,
    TableLimits,
)
from tests.fakes import FakeClock, RawHTTP

TOKEN = "test-token-0123456789"


def registration(
    engine_id: str = "prefill-0",
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    port: int = 5000,
    num_layers: int = 2,
    num_blocks: int = 1024,
    compat_hash: str = "abc123",
    instance: str | None = None,
    launch: str | None = None,
) -> EngineRegistration:
    layers = [
        KVLayerSpec(name=f"model.layers.{i}.attn", region_id=i, block_bytes=32768, num_blocks=num_blocks,
                    tokens_per_block=16, dtype="bfloat16", layout="NHD")
        for i in range(num_layers)
    ]
    return EngineRegistration(
        engine_id=engine_id, dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank, tp_size=tp_size,
        pp_rank=pp_rank, pp_size=pp_size, transport_addr=f"127.0.0.1:{port}", layers=layers,
        protocol_version=1, compat_hash=compat_hash, instance=instance, launch=launch,
    )


@pytest.fixture(scope="session")
def make_registration() -> Callable[..., EngineRegistration]:
    return registration


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def limits() -> TableLimits:
    return TableLimits(default_request_lease_s=30.0, max_lease_s=600.0, max_tombstones=1000,
                       tombstone_ttl_s=300.0, max_pending_outcomes=1000)


@pytest.fixture
def table(clock: FakeClock, limits: TableLimits) -> PairingTable:
    return PairingTable(limits, clock=clock, server_id="table-1")


@pytest.fixture
def config() -> BootstrapConfig:
    """The config of the ``server`` fixture; override it in a test module to change limits."""
    return BootstrapConfig(host="127.0.0.1", port=0, token=TOKEN, max_wait_s=5.0, max_body_bytes=256 * 1024,
                           max_lookup_ids=512, sweep_interval_s=0.05)


@pytest.fixture
def server(config: BootstrapConfig, clock: FakeClock) -> Iterator[BootstrapServer]:
    """An embedded server on an ephemeral loopback port, with the test's fake clock for leases."""
    with BootstrapServer(config, clock=clock) as srv:
        yield srv


@pytest.fixture
def client(server: BootstrapServer) -> Iterator[BootstrapClient]:
    with BootstrapClient(server.url, token=TOKEN, timeout_s=5.0) as cli:
        yield cli


@pytest.fixture
def raw(server: BootstrapServer) -> RawHTTP:
    return RawHTTP(server.port, token=TOKEN)


@pytest.fixture
def token() -> str:
    return TOKEN
