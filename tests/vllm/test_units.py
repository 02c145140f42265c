"""Pure parts of the connector: configuration, parameter parsing, descriptor planning."""

from __future__ import annotations

import pytest

from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError
from kvlink.vllm.plan import LayerMap, build_plan, coalesce


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConnectorConfigError) as ei:
        ConnectorConfig.from_extra({"lease_secs": 3})
    msg = str(ei.value)
    assert "lease_secs" in msg and "lease_s" in msg and "bootstrap_url" in msg


@pytest.mark.parametrize("extra, key", [({"lease_s": 0}, "lease_s"), ({"transport_port": 70000}, "transport_port"),
                                        ({"crc": "yes"}, "crc"), ({"bootstrap_url": "x:1"}, "bootstrap_url"),
                                        ({"transport_streams": 0}, "transport_streams")])
def test_bad_values_name_the_key(extra, key):
    with pytest.raises(ConnectorConfigError, match=key):
        ConnectorConfig.from_extra(extra)


def test_config_is_frozen():
    cfg = ConnectorConfig.from_extra({"lease_s": 5})
    with pytest.raises(Exception):
        cfg.lease_s = 6  # type: ignore[misc]


def test_coalesce_runs():
    assert coalesce([(5, 10), (6, 11), (7, 12), (9, 13), (10, 14), (3, 20)]) == [
        (5, 10, 3), (9, 13, 2), (3, 20, 1)]
    assert coalesce([]) == []


def test_plan_one_descriptor_per_run_and_layer():
    layers = [LayerMap("l0", 0, 7, 100), LayerMap("l1", 10_000, 8, 100)]
    plan = build_plan(layers, [(1, 4), (2, 5), (8, 9)])
    assert len(plan) == 4 and plan.nbytes == 2 * 300
    assert plan.local_offsets.tolist() == [100, 800, 10_100, 10_800]
    assert plan.remote_offsets.tolist() == [400, 900, 400, 900]
    assert plan.remote_region_ids.tolist() == [7, 7, 8, 8]
    assert plan.lengths.tolist() == [200, 100, 200, 100]


def test_remote_source_parsing():
    pytest.importorskip("vllm")
    from kvlink.vllm.metadata import BadParams, RemoteSource

    s = RemoteSource.from_params({"remote_bootstrap_addr": "127.0.0.1:5", "transfer_id": "t"})
    assert s.bootstrap_url == "http://127.0.0.1:5" and s.block_ids is None
    s = RemoteSource.from_params({"remote_bootstrap_addr": "http://h:1", "remote_engine_id": "e",
                                  "remote_request_id": "r", "remote_block_ids": [[1, 2]]})
    assert s.block_ids == (1, 2)
    for bad in ({"transfer_id": "t"}, {"remote_bootstrap_addr": "http://h:1"},
                {"remote_bootstrap_addr": "http://h:1", "remote_engine_id": "e", "remote_request_id": "r",
                 "remote_block_ids": [-1]},
                {"remote_bootstrap_addr": "http://h:1", "transfer_id": 5}):
        with pytest.raises(BadParams):
            RemoteSource.from_params(bad)


def test_plugin_register_is_idempotent():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvlink.vllm.plugin import register

    register()
    register()
    assert "KVLinkConnector" in KVConnectorFactory._registry


def test_kv_role_and_extra_config_checked_at_startup():
    pytest.importorskip("vllm")
    from kvlink.vllm.config import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match="valid keys"):
        ConnectorConfig.from_extra({"bogus": 1})
