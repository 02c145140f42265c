"""Pure parts of the connector: configuration, parameter parsing, descriptor planning."""

from __future__ import annotations

import time

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


# ----- lease renewal (pure: fake bootstrap client) --------------------------------------------------------


class _RenewClient:
    def __init__(self, failed=None, error=None):
        self.calls, self.failed, self.error = [], failed or {}, error

    def renew(self, engine_id, request_ids, lease_s):
        self.calls.append((engine_id, list(request_ids), lease_s))
        if self.error is not None:
            raise self.error
        return {rid: st for rid, st in self.failed.items() if rid in request_ids}


def _renewer(cli, terms):
    from kvlink.vllm.lease import LeaseRenewer

    lost = []
    renewed = []
    r = LeaseRenewer(lambda url: cli, lambda: list(terms.items()), lambda p, why: lost.append((p, why)),
                     lambda pulls, held_until: renewed.append((sorted(pulls), held_until)), spawn=lambda f: f())
    return r, lost, renewed


def test_renewer_renews_due_pulls_grouped_per_engine():
    from kvlink.vllm.lease import LeaseTerm

    cli = _RenewClient()
    terms = {"a": LeaseTerm("http://b", "e1", "r1", 3.0, next_renew=0.0),
             "b": LeaseTerm("http://b", "e1", "r2", 3.0, next_renew=0.0),
             "c": LeaseTerm("http://b", "e2", "r3", 3.0, next_renew=1e12)}
    r, lost, renewed = _renewer(cli, terms)
    before = time.monotonic()
    r.renew_due(now=100.0)
    assert cli.calls == [("e1", ["r1", "r2"], 3.0)]
    assert lost == [] and [pulls for pulls, _ in renewed] == [["a", "b"]]
    # the proof handed out: held for a lease from when the call was sent, no longer
    assert before + 3.0 <= renewed[0][1] <= time.monotonic() + 3.0
    assert terms["a"].next_renew > 100.0 and terms["c"].next_renew == 1e12


def test_renewer_reports_lost_leases_and_retries_unreachable():
    from kvlink.bootstrap import RequestStatus
    from kvlink.vllm.lease import LeaseTerm

    terms = {"a": LeaseTerm("http://b", "e1", "r1", 3.0, 0.0), "b": LeaseTerm("http://b", "e1", "r2", 3.0, 0.0)}
    r, lost, renewed = _renewer(_RenewClient(failed={"r2": RequestStatus.EXPIRED}), terms)
    r.renew_due(now=100.0)
    assert [p for p, _ in lost] == ["b"] and "expired" in lost[0][1]
    assert [pulls for pulls, _ in renewed] == [["a"]]  # no proof for the lost one
    terms = {"a": LeaseTerm("http://b", "e1", "r1", 3.0, 0.0)}
    r, lost, _ = _renewer(_RenewClient(error=ConnectionError("down")), terms)
    wait = r.renew_due(now=100.0)
    assert lost == [] and wait <= 0.5  # retried soon; the pull's own deadline bounds it


def test_a_hung_bootstrap_server_does_not_hold_back_renewals_at_healthy_ones():
    """One pull's bootstrap server never answers; pulls from another server keep being renewed (on the
    real renewer thread and pool)."""
    import threading

    from kvlink.vllm.lease import LeaseRenewer, LeaseTerm

    hung, ok = threading.Event(), _RenewClient()

    class _Hung:
        def renew(self, engine_id, request_ids, lease_s):
            hung.wait(30)
            raise ConnectionError("hung server gave up")

    renewed = []
    terms = {"h": LeaseTerm("http://hung", "e1", "r1", 0.3, 0.0), "o": LeaseTerm("http://ok", "e2", "r2", 0.3, 0.0)}
    r = LeaseRenewer(lambda url: _Hung() if "hung" in url else ok, lambda: list(terms.items()),
                     lambda p, why: None, lambda pulls, held_until: renewed.extend(pulls)).start()
    try:
        deadline = time.monotonic() + 20
        while renewed.count("o") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert renewed.count("o") >= 3 and "h" not in renewed
    finally:
        hung.set()
        r.stop()


# ----- tensor parallelism -----------------------------------------------------------------------------------


def test_unequal_tp_is_refused_with_a_clear_message():
    """Unequal TP is refused at first contact, naming both sizes (equal TP=2 runs in test_tp.py)."""
    pytest.importorskip("vllm")
    from kvlink.bootstrap import EngineRegistration
    from kvlink.vllm.worker import KVLinkWorker, PullFailed, RankInfo

    class Cli:
        def get_engine(self, engine_id, tp_rank=0, dp_rank=0):
            return EngineRegistration(engine_id=engine_id, tp_rank=tp_rank, tp_size=2,
                                      transport_addr="127.0.0.1:9", layers=[], protocol_version=1,
                                      compat_hash="x")

    w = KVLinkWorker(ConnectorConfig(), RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        with pytest.raises(PullFailed, match=r"prefill engine pre runs TP=2, this decode TP=1: kvlink "
                                             r"supports equal TP only"):
            w._remote(Cli(), "http://b", "pre")
    finally:
        w.shutdown()


def test_transport_advertise_must_be_host_port():
    with pytest.raises(ConnectorConfigError, match="transport_advertise"):
        ConnectorConfig.from_extra({"transport_advertise": "nohost"})
    assert ConnectorConfig.from_extra({"transport_advertise": "127.0.0.1:5"}).transport_advertise


def test_each_tensor_parallel_rank_gets_its_own_port():
    cfg = ConnectorConfig.from_extra({"transport_port": 7000, "transport_advertise": "relay:9000"})
    assert [cfg.transport_listen(r) for r in range(2)] == ["127.0.0.1:7000", "127.0.0.1:7001"]
    assert [cfg.advertised(r) for r in range(2)] == ["relay:9000", "relay:9001"]
    assert ConnectorConfig().transport_listen(1) == "127.0.0.1:0" and ConnectorConfig().advertised(1) is None


# ----- security defaults, logging -------------------------------------------------------------------------


def test_unauthenticated_transport_is_loopback_only_by_default():
    assert ConnectorConfig().allow_insecure is False
    for host in ("127.0.0.1", "::1", "localhost"):
        assert ConnectorConfig.from_extra({"transport_host": host}).transport_host == host
    with pytest.raises(ConnectorConfigError, match=r"\['transport_host'\] is '0.0.0.0', not loopback, and no "
                                                   r"'transport_token' is set.*allow_insecure"):
        ConnectorConfig.from_extra({"transport_host": "0.0.0.0"})
    assert ConnectorConfig.from_extra({"transport_host": "0.0.0.0", "transport_token": "s"}).transport_token
    assert ConnectorConfig.from_extra({"transport_host": "10.1.2.3", "allow_insecure": True}).allow_insecure


def test_kvlink_logger_borrows_vllms_handlers_once():
    import logging

    from kvlink.vllm.plugin import attach_vllm_log_handlers

    ours, theirs = logging.getLogger("kvlink"), logging.getLogger("vllm")
    saved = (ours.handlers[:], ours.level, ours.propagate, theirs.handlers[:], theirs.level)
    handler = logging.StreamHandler()
    try:
        ours.handlers[:] = []
        ours.setLevel(logging.NOTSET)
        theirs.handlers[:] = []
        assert attach_vllm_log_handlers() is False  # vLLM's logging is off: nothing to borrow
        theirs.handlers[:] = [handler]
        theirs.setLevel(logging.INFO)
        assert attach_vllm_log_handlers() is True
        assert ours.handlers == [handler] and ours.level == logging.INFO and ours.propagate is False
        assert attach_vllm_log_handlers() is False and ours.handlers == [handler]  # idempotent
    finally:
        ours.handlers[:], theirs.handlers[:] = saved[0], saved[3]
        ours.setLevel(saved[1])
        ours.propagate = saved[2]
        theirs.setLevel(saved[4])
