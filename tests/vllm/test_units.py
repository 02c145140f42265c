"""Pure parts of the connector: configuration, parameter parsing, descriptor planning."""

from __future__ import annotations

import logging
import time

import pytest

from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError
from kvlink.vllm.layout import Geometry
from kvlink.vllm.plan import LayerMap, build_plan
from tests.fakes import FakeBootstrapClient, RecordingPullTable


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConnectorConfigError) as ei:
        ConnectorConfig.from_extra({"lease_secs": 3})
    msg = str(ei.value)
    assert "lease_secs" in msg and "lease_s" in msg and "bootstrap_url" in msg


@pytest.mark.parametrize("extra, key", [({"lease_s": 0}, "lease_s"), ({"transport_port": 70000}, "transport_port"),
                                        ({"crc": "yes"}, "crc"), ({"bootstrap_url": "http://x:1/kv"}, "bootstrap_url"),
                                        ({"transport_streams": 0}, "transport_streams"),
                                        ({"transport_streams": 17}, "transport_streams"),  # the engine's limit
                                        ({"bootstrap_max_connections": 0}, "bootstrap_max_connections"),
                                        ({"transport_max_peers": 4097}, "transport_max_peers"),
                                        ({"transport_max_peers": True}, "transport_max_peers"),
                                        ({"transport_max_conns": 0}, "transport_max_conns"),
                                        ({"stream_layer_on_entry": 1}, "stream_layer_on_entry")])
def test_bad_values_name_the_key(extra, key):
    with pytest.raises(ConnectorConfigError, match=key):
        ConnectorConfig.from_extra(extra)


def test_config_is_frozen():
    cfg = ConnectorConfig.from_extra({"lease_s": 5})
    with pytest.raises(Exception):
        cfg.lease_s = 6  # type: ignore[misc]


def test_plan_one_descriptor_per_run_and_layer():
    g = Geometry(0, 100, 0)
    layers = [LayerMap("l0", g, 7, g, 1, 100), LayerMap("l1", Geometry(10_000, 100, 0), 8, g, 1, 100)]
    plan = build_plan(layers, [(1, 4), (2, 5), (8, 9)])
    assert len(plan) == 4 and plan.nbytes == 2 * 300
    assert plan.local_offsets.tolist() == [100, 800, 10_100, 10_800]
    assert plan.remote_offsets.tolist() == [400, 900, 400, 900]
    assert plan.remote_region_ids.tolist() == [7, 7, 8, 8]
    assert plan.lengths.tolist() == [200, 100, 200, 100]


def test_remote_source_parsing():
    pytest.importorskip("vllm")
    from kvlink.vllm.params import BadParams, RemoteSource

    s = RemoteSource.from_params({"remote_bootstrap_addr": "127.0.0.1:5", "transfer_id": "t"})
    assert s.bootstrap_url == "http://127.0.0.1:5" and s.block_ids is None
    s = RemoteSource.from_params({"remote_bootstrap_addr": "http://h:1", "remote_engine_id": "e",
                                  "remote_request_id": "r", "remote_block_ids": [[1, 2]]})
    assert s.block_ids == ((1, 2),)
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


@pytest.mark.parametrize("extra, named", [
    ({"engine_lease_s": float("inf")}, "engine_lease_s"),  # crashed prefill's first step (heartbeat interval)
    ({"engine_lease_s": 601.0}, "engine_lease_s"),  # the bootstrap server refused every registration
    ({"engine_lease_s": 1e-9}, "engine_lease_s"),  # heartbeats in a busy loop
    ({"lease_s": 900.0}, "lease_s"),  # every publish refused
    ({"bootstrap_timeout_s": float("inf")}, "bootstrap_timeout_s"),  # OverflowError at the first call
    ({"pull_timeout_s": 1e10}, "pull_timeout_s"),
    ({"transfer_timeout_s": 7200.0}, "transfer_timeout_s"),  # refused by the transport at start, by its name
    ({"connect_timeout_s": 1e-4}, "connect_timeout_s"),
    ({"release_poll_s": 1e-12}, "release_poll_s"),
    ({"transport_advertise": "2001:db8::5:7000"}, "transport_advertise"),  # IPv6 needs brackets
    ({"bootstrap_token": "secret-é"}, "bootstrap_token"),  # latin-1 on the wire, UTF-8 compared: never equal
    ({"bootstrap_token": "a\nb"}, "bootstrap_token"),  # an HTTP header cannot carry it
    ({"transport_token": "t" * 1025}, "transport_token"),  # the transport takes 1..1024 bytes
    ({"transport_token": "\ud800"}, "transport_token"),  # no UTF-8 bytes at all
    ({"transport_host": 123}, "transport_host"),
    ({"bootstrap_host": ""}, "bootstrap_host"),
    ({"transport_streams": True}, "transport_streams"),
])
def test_settings_that_would_fail_later_are_refused_at_start_by_name(extra, named):
    """Values that passed start-up and failed at the first step (an engine crash), at every request or every
    call to the bootstrap server, or that made a busy loop, are refused when the config is read."""
    pytest.importorskip("vllm")
    from kvlink.vllm.config import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorConfig.from_extra(extra)


def test_a_transport_token_is_any_text_the_handshake_takes():
    """The transport keys its handshake with the token's bytes: non-ASCII, tabs, a trailing newline pair as
    before (unlike the bootstrap token, which travels in an HTTP header)."""
    for token in ("pässwort-ünïcode", "two\twords", "secret\n"):
        assert ConnectorConfig.from_extra({"transport_token": token}).transport_token_bytes == token.encode()


def test_the_config_never_shows_its_secrets():
    cfg = ConnectorConfig(bootstrap_token="bt-secret", transport_token="tt-secret")
    assert "secret" not in repr(cfg) and "secret" not in str(cfg)


def test_a_rank_whose_port_would_pass_65535_stops_at_start_naming_the_setting():
    from kvlink.vllm import worker as W

    ok = W.KVLinkWorker(ConnectorConfig(transport_port=65534), W.RankInfo("e", 1, 2, 0, 1, "m"), "kv_producer")
    ok.shutdown()
    for cfg, key in ((ConnectorConfig(transport_port=65535), "transport_port"),
                     (ConnectorConfig(transport_advertise="h:65535"), "transport_advertise")):
        with pytest.raises(RuntimeError, match=f"{key}.*would need 65536"):
            W.KVLinkWorker(cfg, W.RankInfo("e", 1, 2, 0, 1, "m"), "kv_producer")


# ----- lease renewal (pure: fake bootstrap client) --------------------------------------------------------


def _renew(cli, rids=("a", "b"), request_ids=("r1", "r2")):
    from kvlink.vllm.lease import LeaseCalls
    from kvlink.vllm.pulls import Renew

    table = RecordingPullTable()
    LeaseCalls(lambda url: cli, table.apply, spawn=lambda f: f(), reader="dec@1234").run(
        Renew(("http://b", "e1"), tuple(request_ids), tuple(rids), 3.0))
    return table.events


def test_a_decode_engine_names_itself_as_a_reader_within_what_the_wire_allows():
    from kvlink.bootstrap.schema import MAX_READER, RenewBody, checked
    from kvlink.vllm.lease import reader_of

    assert reader_of("dec", None) == "dec" and reader_of("dec_dp1", "1732700000123456789") == "dec_dp1@1732700000123456789"
    for launch in ("1" * 63, "1" * 64, "9" * 400):
        r = reader_of("e" * 256, launch)
        assert len(r) <= MAX_READER and r != reader_of("e" * 256, launch + "0")
        checked(RenewBody, engine_id="p", request_ids=["r"], lease_s=30.0, reader=r)  # accepted on the wire


def test_lease_call_renews_a_group_in_one_call_and_hands_back_the_proof():
    cli = FakeBootstrapClient()
    before = time.monotonic()
    (ev,) = _renew(cli)
    assert cli.renewals == [("e1", ["r1", "r2"], 3.0)] and cli.readers == ["dec@1234"]
    kind, group, rids, held_until = ev
    assert (kind, group, rids) == ("held", ("http://b", "e1"), ("a", "b"))
    # the proof handed out: held for a lease from when the call was sent, no longer
    assert before + 3.0 <= held_until <= time.monotonic() + 3.0


def test_the_proof_is_only_as_long_as_the_server_granted():
    """Decode asks for 3 s; prefill published with 1 s, so the server grants 1: the proof handed out ends a
    granted lease after the call was sent, not decode's own."""
    before = time.monotonic()
    (ev,) = _renew(FakeBootstrapClient(granted_s=1.0))
    assert before + 1.0 <= ev[3] <= time.monotonic() + 1.0


def test_lease_call_reports_lost_leases_and_retries_unreachable():
    from kvlink.bootstrap import RequestStatus

    events = _renew(FakeBootstrapClient(lost={"r2": RequestStatus.EXPIRED}))
    assert [e[0] for e in events] == ["lost", "held"]
    assert events[0][2] == "b" and "expired" in events[0][3]
    assert events[1][2] == ("a",)  # no proof for the lost one
    assert _renew(FakeBootstrapClient(error=ConnectionError("down"))) == [("retry", ("http://b", "e1"), ("a", "b"))]


def test_a_sequential_pulls_first_proof_checks_its_params_against_prefills_record():
    """Sequential params come from decode's client: before a pull whose block ids they named is trusted, the
    record prefill published for the request must name the same ones, for decode's own prompt (its digest at
    the record's token count), the exact count a Mamba state needs, from the launch decode reads through."""
    from kvlink.bootstrap import RequestRecord, RequestStatus
    from kvlink.vllm.lease import LeaseCalls, RecordCheck
    from kvlink.vllm.pulls import Renew

    def rec(rid, blocks, sha="A32", num_tokens=32, launch=None):
        return RequestRecord(engine_id="e1", request_id=rid, block_ids=blocks, num_tokens=num_tokens,
                             lease_remaining_s=3.0, prompt_sha=sha, launch=launch)

    mine = ((32, "A32"),)  # decode's own digest of its 32-token prompt
    cli = FakeBootstrapClient(records={"r1": rec("r1", [[1, 2]]), "r2": rec("r2", [[1, 3]]),
                                       "r3": RequestStatus.RELEASED, "r5": rec("r5", [[1, 2]], sha="B32"),
                                       "r6": rec("r6", [[1, 2]], sha="A30", num_tokens=30),
                                       "r7": rec("r7", [[1, 2]], num_tokens=30), "r8": rec("r8", [[1, 2]], launch="L2")})
    checks = {"a": RecordCheck(((1, 2),), mine), "b": RecordCheck(((1, 2),), mine), "c": RecordCheck(((4,),), mine),
              "e": RecordCheck(((1, 2),), mine),  # another prompt of as many tokens
              "f": RecordCheck(((1, 2),), mine),  # prefill computed 30 tokens: not decode's prompt
              "g": RecordCheck(((1, 2),), (), num_tokens=32),  # a Mamba state after 30 tokens, loaded as after 32
              "h": RecordCheck(((1, 2),), mine, launch="L1")}  # published by another launch than the ranks read
    table = RecordingPullTable()
    rids = ("a", "b", "c", "d", "e", "f", "g", "h")
    LeaseCalls(lambda url: cli, table.apply, spawn=lambda f: f()).run(
        Renew(("http://b", "e1"), ("r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8"), rids, 3.0,
              tuple(checks.items())))
    lost = {e[2]: e[3] for e in table.events if e[0] == "lost"}
    assert set(lost) == {"b", "c", "e", "f", "g", "h"} and "other block ids" in lost["b"] and "released" in lost["c"]
    assert "another prompt" in lost["e"] and "another prompt" in lost["f"] and "Mamba" in lost["g"]
    assert "another launch" in lost["h"]
    assert [e[2] for e in table.events if e[0] == "held"] == [("a", "d")]  # d: nothing to check (a record's)
    failing = FakeBootstrapClient()
    failing.lookup = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down"))
    table = RecordingPullTable()
    LeaseCalls(lambda url: failing, table.apply, spawn=lambda f: f()).run(
        Renew(("http://b", "e1"), ("r1",), ("a",), 3.0, (("a", RecordCheck(((1, 2),))),)))
    assert table.events == [("retry", ("http://b", "e1"), ("a",))]  # nothing unchecked is trusted


def test_a_hung_bootstrap_server_does_not_hold_back_renewals_at_healthy_ones():
    """One pull's bootstrap server never answers; pulls from another server keep being renewed, through a
    real decode worker's ticker thread, lease pool and pull table."""
    import threading

    from kvlink.vllm.pulls import Lease
    from kvlink.vllm.worker import KVLinkWorker, RankInfo
    from tests.vllm.test_pulls import spec

    hung, ok = threading.Event(), FakeBootstrapClient()
    w = KVLinkWorker(ConnectorConfig(), RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    from kvlink.vllm.lease import LeaseCalls

    w._leases = LeaseCalls(lambda url: FakeBootstrapClient(hang_until=hung) if "hung" in url else ok, w._apply)
    w._thread = threading.Thread(target=w._run, daemon=True)
    w._thread.start()
    try:
        for rid, url in (("h", "http://hung"), ("o", "http://ok")):
            w._apply(lambda t, now, rid=rid: t.submit(spec(rid), now) and None)
            w._apply(lambda t, now, rid=rid, url=url: [
                a for a in t.resolved(rid, "remote", [(1, 11)], Lease(url, "e", "p-" + rid, 0.3), 0.0, now, now)
                if type(a).__name__ == "Renew"])
        deadline = time.monotonic() + 20
        while len(ok.renewals) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ok.renewals) >= 3  # renewed every third of its 0.3 s lease while the other server hangs
    finally:
        hung.set()
        w.shutdown()


# ----- tensor parallelism -----------------------------------------------------------------------------------


def test_an_incompatible_engine_is_refused_naming_both_sides_values_and_counted_by_reason(caplog):
    """First contact compares the compat fields; a mismatch names each differing field with prefill's and
    decode's values (logged once per engine), fails every pull and is counted by its reason."""
    torch = pytest.importorskip("torch")
    from kvlink.bootstrap import EngineRegistration
    from kvlink.vllm.contact import PullFailed
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    w = KVLinkWorker(ConnectorConfig(transport_backend="tcp"), RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        w.register_kv_caches({"l0": torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)})
        theirs = dict(w.compat, kv_dtype="float8_e4m3fn", kv_heads=8)
        cli = FakeBootstrapClient(engine=EngineRegistration(
            engine_id="pre", tp_rank=0, tp_size=2, transport_addr="127.0.0.1:9", layers=[],
            protocol_version=w.compat["protocol_version"], compat_hash="v-other", compat=theirs))
        with caplog.at_level(logging.ERROR, logger="kvlink"):
            for _ in range(2):
                with pytest.raises(PullFailed, match=r"compat mismatch with pre \(kv_dtype, kv_heads\)") as e:
                    w._remote(cli, "http://b", "pre")
                assert e.value.reason == "kv_dtype"
        assert caplog.text.count("is not compatible") == 1  # once per engine
        assert "'kv_dtype': ('float8_e4m3fn', 'bfloat16')" in caplog.text and "'kv_heads': (8, 2)" in caplog.text
    finally:
        w.shutdown()


def test_fp8_formats_sharing_the_uint8_tensor_dtype_are_told_apart():
    """vLLM keeps every fp8 KV cache in uint8 tensors: prefill in e4m3 and decode in e5m2 would copy the bytes
    exactly and decode would misread them. The format joins the compatibility check (only for fp8, so other
    setups keep their hash); vLLM's "fp8" is e4m3."""
    torch = pytest.importorskip("torch")
    from kvlink.vllm.compat import compat_diff, compat_hash, kv_format
    from kvlink.vllm.worker import KVLinkWorker, RankInfo
    from types import SimpleNamespace

    assert (kv_format("auto"), kv_format("bfloat16"), kv_format("fp8"), kv_format("fp8_e5m2")) == (
        "", "", "fp8_e4m3", "fp8_e5m2")
    # ROCm's fnuz e4m3 means other values than NVIDIA's (and CPU's) fn: told apart by the platform's fp8 dtype
    assert [kv_format(cd, "torch.float8_e4m3fnuz") for cd in ("fp8", "fp8_e4m3", "fp8_e5m2", "auto")] == [
        "fp8_e4m3fnuz", "fp8_e4m3fnuz", "fp8_e5m2", ""]
    assert kv_format("fp8", "torch.float8_e4m3fn") == "fp8_e4m3"
    # The other quantized formats vLLM keeps in uint8/int8 tensors are named too (and get their scales
    # compared); the plain float dtypes say nothing the tensor does not.
    assert [kv_format(cd) for cd in ("nvfp4", "int8_per_token_head", "turboquant_k8v4", "float16", "float32")] == [
        "nvfp4", "int8_per_token_head", "turboquant_k8v4", "", ""]
    compats = {}
    for fmt in ("fp8_e4m3", "fp8_e5m2", "nvfp4", ""):
        w = KVLinkWorker(ConnectorConfig(transport_backend="tcp"), RankInfo("e", 0, 1, 0, 1, "m", kv_format=fmt),
                         "kv_consumer")
        try:
            scales = {"l0": SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)}  # vLLM's attention module
            w.register_kv_caches({"l0": torch.zeros(4, 2, 16, 64, dtype=torch.uint8)}, scales)
            compats[fmt] = w.compat
            assert w.kv_scales == ({"l0": (1.0, 1.0)} if fmt else {})
        finally:
            w.shutdown()
    assert compat_hash(compats["fp8_e4m3"]) != compat_hash(compats["fp8_e5m2"])
    assert compat_diff(compats["fp8_e4m3"], compats["fp8_e5m2"]) == {"kv_format": ("fp8_e5m2", "fp8_e4m3")}
    assert compat_diff(compats["nvfp4"], compats[""]) == {"kv_format": (None, "nvfp4")}
    assert "kv_format" not in compats[""]


def test_the_weights_beyond_the_model_path_join_the_compat_check():
    """A revision rolled out on one side only, or ``--quantization`` on one side: the same path and tokens,
    other KV. Both join the compatibility fields where set; an engine with neither keeps its hash."""
    from types import SimpleNamespace as NS

    from kvlink.vllm.compat import compat_diff, compat_fields, compat_hash, weights_desc

    def fields(mc):
        return compat_fields(model="m", kv_dtype="bfloat16", layout="x", tokens_per_block=16, num_layers=2,
                             kv_heads=2, weights=weights_desc(mc))

    plain = fields(NS(revision=None, quantization=None))
    assert "weights" not in plain and plain == compat_fields(model="m", kv_dtype="bfloat16", layout="x",
                                                             tokens_per_block=16, num_layers=2, kv_heads=2)
    a, b = fields(NS(revision="a1", quantization=None)), fields(NS(revision="b2", quantization=None))
    assert compat_diff(a, b) == {"weights": ("revision=b2,quantization=", "revision=a1,quantization=")}
    assert compat_diff(plain, fields(NS(revision=None, quantization="fp8"))) == {
        "weights": ("revision=,quantization=fp8", None)}
    # --hf-overrides beyond the rotary ones (rope_desc's): the same path computing other hidden states
    eps, topk = fields(NS(hf_overrides={"rms_norm_eps": 0.3})), fields(NS(hf_overrides={"num_experts_per_tok": 2}))
    assert len({compat_hash(f) for f in (plain, eps, topk)}) == 3
    assert compat_diff(eps, fields(NS(hf_overrides={"rms_norm_eps": 0.3}))) == {}  # as the other side's, in any order
    assert fields(NS(hf_overrides={"rope_theta": 5.0, "rope_parameters": {}})) == plain  # rope_desc's business
    assert fields(NS(hf_overrides={"max_position_embeddings": 65536})) == plain  # the context limit: likewise
    with_rev = fields(NS(revision="a1", quantization=None, hf_overrides={"rms_norm_eps": 0.3}))
    assert with_rev["weights"].startswith("revision=a1,quantization=,overrides=")

    def override(config):
        return config

    assert fields(NS(hf_overrides=override))["weights"].endswith("override")  # a function: by its name


def test_mamba_states_laid_out_or_typed_otherwise_do_not_pair():
    """A Mamba layer's state page holds the conv state and the SSM state. Two engines whose pages are as large
    but hold them otherwise (the conv state transposed, VLLM_SSM_CONV_STATE_LAYOUT; the SSM state in
    float16 against bfloat16, --mamba-ssm-cache-dtype) would copy the bytes exactly and decode would misread
    them: the layout's description names each part's offset, dtype, shape and strides."""
    from kvlink.vllm.layout import state_layout

    nb, page = 6, 8192

    def parts(conv_transposed=False, ssm_dtype="bfloat16"):
        conv = ((3, 96), (96, 1)) if conv_transposed else ((96, 3), (3, 1))
        return [(1000, (nb, *conv[0]), (page // 2, *conv[1]), 2, "bfloat16"),
                (1000 + 576, (nb, 2, 16, 8), (page // 2, 128, 8, 1), 2, ssm_dtype)]

    base = state_layout(parts())
    assert base.segment_bytes == state_layout(parts(True)).segment_bytes == 576 + 2 * 256
    assert base.desc == state_layout(parts()).desc
    assert base.desc != state_layout(parts(conv_transposed=True)).desc
    assert base.desc != state_layout(parts(ssm_dtype="float16")).desc
    many = state_layout([(1000 + 16 * i, (nb, 8), (page // 2, 1), 2, "bfloat16") for i in range(40)])
    assert many.desc.startswith(f"state:{many.segment_bytes}:sha256:") and len(many.desc) < 80


def test_compat_refusals_are_a_prometheus_counter_labelled_by_reason():
    pytest.importorskip("vllm")
    from functools import partial
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvlink.vllm.stats import KVLinkPromMetrics, KVLinkStats

    reg = CollectorRegistry()
    m = KVLinkPromMetrics(SimpleNamespace(kv_transfer_config=None), {c: partial(c, registry=reg) for c in (Counter, Gauge, Histogram)}, ["engine"],
                          {0: ["0"]})
    stats = KVLinkStats()
    for reason in ("layout", "layout", "kv_heads"):
        stats.add(f"compat_refused.{reason}")
    m.observe(stats.data, 0)
    got = {r: reg.get_sample_value("kvlink_compat_refused_total", {"engine": "0", "reason": r})
           for r in ("layout", "kv_heads", "model")}
    assert got == {"layout": 2.0, "kv_heads": 1.0, "model": None}
    assert stats.reduce()["compat_refused.layout"] == 2  # and in vLLM's log line


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


def test_mooncake_settings_are_validated_at_startup_naming_the_key():
    cfg = ConnectorConfig.from_extra({"transport_backend": "mooncake", "mooncake": {"settle_s": 2.0}})
    assert cfg.mooncake_config.settle_s == 2.0 and "mooncake_config" not in ConnectorConfig.valid_keys()
    with pytest.raises(ConnectorConfigError, match=r"unknown kv_connector_extra_config\['mooncake'\] key\(s\) "
                                                   r"\['bogus'\]; valid keys: protocol"):
        ConnectorConfig.from_extra({"transport_backend": "mooncake", "mooncake": {"bogus": 1}})
    with pytest.raises(ConnectorConfigError, match=r"\['mooncake'\]: max_queued must be an int >= 2"):
        ConnectorConfig.from_extra({"transport_backend": "mooncake", "mooncake": {"max_queued": 1}})
    with pytest.raises(ConnectorConfigError, match="must be an object"):
        ConnectorConfig.from_extra({"mooncake": "tcp"})


def test_why_not_streamable_names_each_reason_and_refuses_micro_batching():
    from kvlink.vllm.connector import why_not_streamable

    layer, step = ConnectorConfig(stream_kv=True), ConnectorConfig(stream_kv=True, stream_granularity="step")
    assert why_not_streamable(layer, False, 0, (None,), False) is None
    assert why_not_streamable(layer, True, 0, (None,), False) is None  # staged per layer streams
    assert "host staging" in why_not_streamable(step, True, 0, (None,), False)
    assert why_not_streamable(layer, False, 1, (None,), False) == "Mamba state"
    assert why_not_streamable(layer, False, 0, (None, None), False) == "several KV cache groups"
    assert why_not_streamable(layer, False, 0, ((4096, 0),), False) == "sliding window"
    # vLLM's micro-batches each run a layer's hooks (the first would announce a layer the others have not
    # written), each on a CUDA stream of its own
    assert "micro-batching" in why_not_streamable(layer, False, 0, (None,), True)
    assert "micro-batching" in why_not_streamable(step, False, 0, (None,), True)


def test_the_rotary_settings_are_described_compactly_and_digested_when_long():
    from types import SimpleNamespace

    from kvlink.vllm.compat import compat_diff, compat_fields, rope_desc

    def cfg(**d):
        return SimpleNamespace(to_dict=lambda: dict(d, hidden_size=256, vocab_size=1024))

    def fields(rope):
        return compat_fields(model="m", kv_dtype="bf16", layout="x", tokens_per_block=16, num_layers=2, kv_heads=2,
                             rope=rope)

    default = {"rope_theta": 10000.0, "rope_type": "default"}
    a = rope_desc(cfg(rope_parameters=default, max_position_embeddings=4096))
    assert a == '{"rope_parameters":{"rope_theta":10000.0,"rope_type":"default"}}'
    assert rope_desc(cfg(rope_parameters=default, max_position_embeddings=8192)) == a  # unscaled: no matter
    yarn = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}
    b = rope_desc(cfg(rope_parameters=yarn, max_position_embeddings=4096))
    assert compat_diff(fields(a), fields(b)) == {"rope": (b, a)}
    assert rope_desc(cfg(rope_parameters=yarn, max_position_embeddings=8192)) != b  # scaled for another context
    # LongRoPE: vLLM takes the long factors where max_model_len exceeds the original context
    long = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
            "original_max_position_embeddings": 4096}
    short_side = rope_desc(cfg(rope_parameters=long, max_position_embeddings=131072), max_model_len=4096)
    long_side = rope_desc(cfg(rope_parameters=long, max_position_embeddings=131072), max_model_len=32768)
    assert '"kvlink_longrope_long":false' in short_side and '"kvlink_longrope_long":true' in long_side
    many = rope_desc(cfg(rope_parameters={"rope_theta": 1.0, "long_factor": [1.0] * 64}))
    assert many.startswith("sha256:") and len(many) == 31
    assert rope_desc(None) == "" and rope_desc(cfg()) == "{}"
    assert '"dual_chunk_attention_config"' in rope_desc(cfg(dual_chunk_attention_config={"chunk_size": 8}))
    # per layer type (transformers 5: {"full_attention": {...}, "sliding_attention": {...}}): a nested scaled
    # rope is scaled too, and its context and LongRoPE choice join as above
    nested = {"full_attention": yarn, "sliding_attention": default}
    assert (rope_desc(cfg(rope_parameters=nested, max_position_embeddings=4096))
            != rope_desc(cfg(rope_parameters=nested, max_position_embeddings=8192)))
    nested_long = {"full_attention": long, "sliding_attention": default}
    assert len({rope_desc(cfg(rope_parameters=nested_long, max_position_embeddings=131072), max_model_len=n)
                for n in (4096, 32768)}) == 2


def test_the_transport_name_says_engine_rank_and_process_and_fits_the_limit():
    from kvlink.transport.config import MAX_NAME
    from kvlink.vllm.contact import engine_name

    assert engine_name("prefill-0", 1, "0123456789abcdef") == "prefill-0/tp1/0123456789abcdef"
    long = engine_name("e" * 200, 3, "0123456789abcdef")
    assert len(long) == MAX_NAME and long.endswith("/tp3/0123456789abcdef")


def test_the_attention_kernels_are_a_compat_field():
    """Two engines whose KV tensors look alike but whose kernels lay a block's bytes out otherwise (another
    backend, or vLLM CPU's AMX packing against its vector kernels' layout) get different compat hashes and
    are refused by name at first contact."""
    from types import SimpleNamespace

    from kvlink.vllm.compat import attn_desc, compat_fields, compat_hash

    def layer(backend, isa=None):
        return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend),
                               **({"isa": isa} if isa else {}))

    ctx = {"l0": layer("CPU_ATTN", "amx"), "l1": layer("CPU_ATTN", "amx"), "mlp": object()}
    assert attn_desc(ctx, ["l0", "l1"]) == "CPU_ATTN/amx"
    assert attn_desc({"l0": layer("FLASH_ATTN"), "l1": layer("B12X")}, ["l0", "l1"]) == "B12X,FLASH_ATTN"
    assert attn_desc({}, ["l0"]) == ""  # nothing known: nothing added, both sides alike
    base = dict(model="m", kv_dtype="bfloat16", layout="x", tokens_per_block=16, num_layers=2, kv_heads=2)
    amx, vec = compat_fields(**base, attn="CPU_ATTN/amx"), compat_fields(**base, attn="CPU_ATTN/vec")
    assert compat_hash(amx) != compat_hash(vec)
    from tests.vllm.test_tp_mapping import _local, _reg

    from kvlink.vllm.contact import PullFailed, legs_for

    local = _local(0, 1, heads_per_rank=2)
    local = local.__class__(**{**local.__dict__, "compat": vec, "compat_hash": compat_hash(vec)})
    with pytest.raises(PullFailed) as e:
        legs_for("pre", [_reg(0, 1, "ab", 2 * 16 * 64 * 2, compat_hash=compat_hash(amx), compat=amx)], local)
    assert e.value.reason == "attn" and "CPU_ATTN/amx" in e.value.detail


def test_context_parallelism_is_refused_with_the_reason():
    """DCP/PCP ranks keep every n-th token of a block: a block moved to or from an engine without it holds
    other positions, so the connector refuses to start rather than read them."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvlink.vllm.connector import why_not_context_parallel

    assert why_not_context_parallel(SimpleNamespace(decode_context_parallel_size=1,
                                                    prefill_context_parallel_size=1)) is None
    assert why_not_context_parallel(SimpleNamespace()) is None  # a vLLM without it
    why = why_not_context_parallel(SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1))
    assert "decode_context_parallel_size=2" in why and "interleaved" in why
    assert "prefill_context_parallel_size=4" in why_not_context_parallel(
        SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=4))


def test_a_head_dimension_that_is_not_the_ranks_kv_heads_is_refused():
    """Some GPU backends (b12x, rocm_attn) put the K or V slot where others put the KV head and every head in
    the last dimension: cut by heads (decode at another TP), a block would be read as half of K or V. The
    worker refuses such a cache at registration, naming the numbers; a per-head one passes."""
    from kvlink.vllm.worker import head_dim_mismatch

    assert head_dim_mismatch(2, 1, 2, 4) is None  # TP=2 of 4 heads: 2 a rank
    assert head_dim_mismatch(1, 3, 8, 2) is None  # 2 heads replicated over TP=8: 1 a rank
    assert head_dim_mismatch(0, 0, 1, 8) is None  # MLA / unknown: nothing to compare
    assert head_dim_mismatch(2, 0, 2, 3) is None  # (3 heads over TP=2: vLLM itself refuses it)
    why = head_dim_mismatch(2, 0, 1, 8)  # a K/V slot dimension of 2, 8 heads on the one rank
    assert "holds 2" in why and "holds 8 of the model's 8 KV heads" in why


def test_a_rank_s_transport_port_counts_dp_ranks_pp_stages_and_tp_ranks_and_its_stream_rank_does_not():
    """Every DP rank reads the same transport_port, so DP rank d's ranks listen past DP rank d-1's; the
    rank a piece is streamed under counts the engine's own TP x PP ranks only (a DP rank is an engine)."""
    from kvlink.vllm.worker import RankInfo

    seen = {}
    for dp in range(2):
        for pp in range(2):
            for tp in range(3):
                r = RankInfo(f"e_dp{dp}", tp, 3, 0, 1, "m", pp_rank=pp, pp_size=2, dp_local=dp)
                seen[r.port_index] = (dp, pp, tp)
                assert r.index == pp * 3 + tp
    assert sorted(seen) == list(range(12))


def test_engine_id_carries_the_dp_rank_once():
    """vLLM's engine core appends ``_dp<rank>`` under data parallelism; a MoE model's ranks keep the DP size
    (a dense model's are each told 1), and kvlink used to append the rank again (``e_dp1-dp1``)."""
    from types import SimpleNamespace as NS

    from kvlink.vllm.connector import engine_id_of

    def cfg(eid, size, rank):
        return NS(kv_transfer_config=NS(engine_id=eid), parallel_config=NS(data_parallel_size=size,
                                                                          data_parallel_rank=rank))

    assert engine_id_of(cfg("e", 1, 0)) == "e"
    assert engine_id_of(cfg("e_dp1", 1, 0)) == "e_dp1"  # a dense model's DP rank 1 (vLLM's suffix)
    assert engine_id_of(cfg("e_dp1", 2, 1)) == "e_dp1"  # a MoE model's DP rank 1
    assert engine_id_of(cfg("e", 2, 1)) == "e-dp1"  # a vLLM that left the id alone: ranks still differ
    assert engine_id_of(cfg("e_dp0", 2, 1)) == "e_dp0-dp1"


def test_the_launch_is_vllms_instance_id_where_one_config_reaches_every_process_else_none():
    """Several nodes per engine (the others start headless and build configs of their own) or one process
    per rank (external_launcher): ranks would name other launches than the scheduler, and the bootstrap
    server would refuse every publish; there kvlink names none (unfenced)."""
    from types import SimpleNamespace as NS

    from kvlink.vllm.connector import launch_of

    def cfg(iid, nodes=1, backend="mp"):
        return NS(instance_id=iid, parallel_config=NS(nnodes_within_dp=nodes, distributed_executor_backend=backend))

    assert launch_of(cfg("1764201234567890123")) == "1764201234567890123"
    assert launch_of(cfg("1764201234567890123_dp1", backend="ray")) == "1764201234567890123_dp1"
    assert launch_of(cfg("x" * 80)) == "x" * 64  # (the schema's bound)
    assert launch_of(cfg("17642", nodes=2)) is None
    assert launch_of(cfg("17642", backend="external_launcher")) is None
    assert launch_of(cfg("")) is None and launch_of(NS()) is None


def test_nospin_patches_vllm_s_queue_loop_when_it_is_imported():
    """tools/nospin (on every test server's path): vLLM's shm_broadcast naps instead of sched_yield."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import vllm.distributed.device_communicators.shm_broadcast as m; "
            "print(m.sched_yield.__module__, m.sched_yield.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root / "tools" / "nospin")})
    assert r.stdout.split()[-2:] == ["sitecustomize", "_nap"], r.stdout + r.stderr


def test_decode_expects_the_name_a_registration_implies_and_refuses_one_no_engine_carries():
    from types import SimpleNamespace

    from kvlink.vllm.contact import PullFailed, engine_name, expected_name

    reg = SimpleNamespace(engine_id="e" * 100, tp_rank=2, instance="0123456789abcdef")
    assert expected_name(reg) == engine_name(reg.engine_id, 2, reg.instance)
    assert expected_name(SimpleNamespace(engine_id="e", tp_rank=0, instance=None)) is None  # an older kvlink
    for bad in ("i" * 64, "caf\u00e9"):
        with pytest.raises(PullFailed, match="no kvlink engine name carries") as e:
            expected_name(SimpleNamespace(engine_id="e", tp_rank=0, instance=bad))
        assert e.value.reason == "engine_changed"


def test_the_connector_asks_vllm_for_heads_outermost_blocks_except_for_mla():
    """kvlink asks for HND (LBHNC), as NIXL does, so a decode rank at another TP reads its heads of a block as one
    range; vLLM's own resolution takes it where every backend can lay blocks out so (a GPU's FlashAttention:
    LBNHC or LBHNC) and keeps its default otherwise; MLA's latent has no heads (no preference)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    from kvlink.vllm import plugin
    from kvlink.vllm.config import ConnectorConfigError

    plugin.register()

    def resolve(supported, mla=False, kv=None):
        cfg = NS(kv_transfer_config=kv or KVTransferConfig(kv_connector="KVLinkConnector", kv_role="kv_both"),
                 model_config=NS(use_mla=mla), cache_config=NS(kv_cache_layout=None))
        return resolve_kv_cache_layout(cfg, [supported] * 2).name

    assert resolve(["LBNHC", "LBHNC"]) == "LBHNC"  # vLLM's first choice would be NHD
    assert resolve(["LBNHC", "LBHNC"], mla=True) == "LBNHC"
    assert resolve(["LBNHC"]) == "LBNHC"  # a backend without HND: vLLM's choice, with a warning
    # beside NIXL in a MultiConnector: one layout, named alike (vLLM refuses two names)
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    ours = {"kv_connector": "KVLinkConnector", "kv_role": "kv_both"}
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                             kv_connector_extra_config={"connectors": [ours, nixl]})
    cfg = NS(kv_transfer_config=multi, model_config=NS(use_mla=False), cache_config=NS(kv_cache_layout=None))
    assert MultiConnector.get_required_kvcache_layout(cfg) == "LBHNC"
    # beside a connector that needs another layout: "any" leaves the choice to it (vLLM refuses two)
    hidden = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_both"}
    for layout, want in (("hnd", ValueError), ("any", "LBNHC")):
        ours = {**ours, "kv_connector_extra_config": {"kv_cache_layout": layout}}
        multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                 kv_connector_extra_config={"connectors": [ours, hidden]})
        cfg = NS(kv_transfer_config=multi, model_config=NS(use_mla=False), cache_config=NS(kv_cache_layout=None))
        if want is ValueError:
            with pytest.raises(ValueError, match="layout mismatch"):
                MultiConnector.get_required_kvcache_layout(cfg)
        else:
            assert MultiConnector.get_required_kvcache_layout(cfg) == want
    with pytest.raises(ConnectorConfigError, match="kv_cache_layout"):
        ConnectorConfig.from_extra({"kv_cache_layout": "nhd"})


def test_the_groups_of_a_model_with_many_mamba_groups_fit_a_registration():
    """vLLM splits a hybrid model's layers into groups of one size: few attention layers make many Mamba groups
    (Bamba-9B: 3 attention and 29 Mamba layers, 10 Mamba groups), and each names its states' shapes and dtypes.
    The field is kept within what a registration may carry (512 characters) as a digest past 256, and still
    tells two models apart."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    import msgspec
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvlink.bootstrap import EngineRegistration, KVLayerSpec
    from kvlink.vllm.compat import PROTOCOL_VERSION, compat_fields, compat_hash
    from kvlink.vllm.connector import groups_desc

    def fields(conv):
        attn = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        mamba = MambaSpec(block_size=16, shapes=(conv, (128, 64, 128)), dtypes=(torch.bfloat16, torch.bfloat16))
        cfg = NS(kv_cache_groups=[NS(kv_cache_spec=attn)] + [NS(kv_cache_spec=mamba)] * 10)
        return compat_fields(model="bamba", kv_dtype="bfloat16", layout="blocks:h", tokens_per_block=16,
                             num_layers=32, kv_heads=8, groups=groups_desc(cfg))

    compat = fields((8448, 3))
    reg = EngineRegistration(engine_id="pre", transport_addr="127.0.0.1:9", protocol_version=PROTOCOL_VERSION,
                             compat_hash=compat_hash(compat), compat=compat,
                             layers=[KVLayerSpec(name="a", region_id=1, block_bytes=64, num_blocks=8,
                                                 tokens_per_block=16, dtype="bfloat16", layout="blocks:h")])
    msgspec.json.decode(msgspec.json.encode(reg), type=EngineRegistration)  # as the bootstrap server reads it
    assert compat["groups"].startswith("FullAttentionSpec:16|MambaSpec:state:8448x3/bfloat16")
    assert compat["groups"] != fields((3, 8448))["groups"]  # a conv state stored transposed
