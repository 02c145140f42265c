"""Streamed KV through prefill's host staging pool (``staging: always`` forces it on CPU), real vLLM servers.

A streamed request gets its pool slots when it starts computing; after each attention layer prefill copies
the step's new blocks of that layer into them and announces the slots, so decode reads the pool while
prefill computes; at the end only what was not copied yet is staged. Prefill's connector is
tests.fakes_connector.SlowLayersConnector (150 ms more per layer of a streaming step), so decode reads
during the forward every time. Two decodes read it layer by layer as it is copied: one with its KV in host
memory, and one that lands through its own staging pool (each READ lands in landing slots, then only the
layers it read are copied into the blocks). Outputs must equal a single server's; a decode that
corrupts what it pulled must change them; aborted streamed requests give their slots back.
"""

from __future__ import annotations

import time

import pytest

from tests.fakes_vllm_server import AppThread
from tests.vllm.helpers import (Server, assert_each_streamed, complete, corrupting_kv_config, free_port, kv_config,
                                metric, open_completion, text, token_prompts, wait_for)

STAGED = dict(staging="always", staging_pool_mb=16)
ONE_CHUNK = ("--max-num-batched-tokens", "1024", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def ss(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("streamed-staged")
    bport = free_port()
    pre_kv = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True, **STAGED),
                  engine_id="prefill-ss", kv_connector="SlowLayersConnector",
                  kv_connector_module_path="tests.fakes_connector")
    pre = Server(tiny_model, pre_kv, cpu=0, log=logs / "prefill.log", extra_args=ONE_CHUNK)
    dec = Server(tiny_model, dict(kv_config("kv_consumer", lookup_wait_s=20.0, pull_timeout_s=60.0),
                                  kv_load_failure_policy="recompute"), cpu=1, log=logs / "decode.log")
    landed = Server(tiny_model, dict(kv_config("kv_consumer", lookup_wait_s=20.0, pull_timeout_s=60.0,
                                               transport_backend="tcp", **STAGED),
                                     kv_load_failure_policy="recompute"), cpu=1, log=logs / "decode-staged.log")
    bad = Server(tiny_model, corrupting_kv_config(lookup_wait_s=20.0), cpu=1, log=logs / "corrupt.log")
    bad_landed = Server(tiny_model, corrupting_kv_config(lookup_wait_s=20.0, transport_backend="tcp", **STAGED), cpu=1,
                        log=logs / "corrupt-staged.log")
    proxies = []
    try:
        for s in (pre, dec, landed, bad, bad_landed):
            s.wait_ready()
        from kvlink.proxy.config import ProxyConfig
        from kvlink.proxy.router import build_app

        def proxy(decode):
            p = AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(decode.url,), mode="concurrent",
                                                timeout_s=120, prefill_bootstrap=(f"http://127.0.0.1:{bport}",),
                                                prefill_engine_ids=("prefill-ss",))))
            proxies.append(p)
            return p.url

        yield {"pre": pre, "dec": dec, "landed": landed, "bad": bad, "bad_landed": bad_landed, "conc": proxy(dec),
               "conc_landed": proxy(landed), "conc_bad": proxy(bad), "conc_bad_landed": proxy(bad_landed)}
    finally:
        for p in proxies:
            p.stop()
        for s in (pre, dec, landed, bad, bad_landed):
            s.stop()


def baseline(ss, prompts):
    return [text(complete(ss["bad"].url, p)) for p in prompts]  # a decode server not pulling: a single server


def test_streamed_through_the_pool_equals_a_single_server_and_is_read_during_the_forward(ss):
    sizes = [7, 31, 100, 700, 1000, 1900]  # 1900: two chunks of 1024
    prompts = token_prompts(sizes, seed=70)
    assert_each_streamed(ss["conc"], ss["pre"], ss["dec"], sizes, prompts, baseline(ss, prompts))
    assert metric(ss["pre"], "kvlink_staged_total") >= len(sizes)


def test_a_decode_landing_through_its_own_pool_reads_layer_by_layer_and_equals_a_single_server(ss):
    sizes = [31, 700, 1900]
    prompts = token_prompts(sizes, seed=71)
    assert_each_streamed(ss["conc_landed"], ss["pre"], ss["landed"], sizes, prompts, baseline(ss, prompts))
    assert metric(ss["landed"], "kvlink_bytes_landed_total") > 0


def test_negative_control_corrupted_pool_stream_changes_the_output(ss):
    prompts = token_prompts([300, 900], seed=72)
    want = [text(complete(ss["dec"].url, p)) for p in prompts]
    got = [text(complete(ss["conc_bad"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]


def test_negative_control_corrupted_after_landing_through_decodes_pool_changes_the_output(ss):
    """The same for a decode that lands through its own pool: the equality above comes from the bytes the
    landing copies put in vLLM's blocks."""
    prompts = token_prompts([300, 900], seed=75)
    want = [text(complete(ss["dec"].url, p)) for p in prompts]
    got = [text(complete(ss["conc_bad_landed"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]
    assert metric(ss["bad_landed"], "kvlink_bytes_landed_total") > 0


def test_aborted_streamed_requests_give_their_slots_back(ss):
    """Client hang-ups while prefill streams into the pool: the slots reserved for them return (the pool's
    gauge comes back to zero once decode is done with everything), and the next request is right."""
    prompts = token_prompts([1000, 1000, 1000], seed=73)
    for p in prompts:
        conn = open_completion(ss["conc"], p)
        time.sleep(0.4)  # prefill is mid-forward (150 ms a layer)
        conn.close()
    check = token_prompts([500], seed=74)[0]
    assert text(complete(ss["conc"], check, timeout=120)) == baseline(ss, [check])[0]
    assert ss["pre"].metric("kvlink_staging_used_blocks") is not None  # the gauge exists (0 is not "absent")
    assert wait_for(lambda: metric(ss["pre"], "kvlink_staging_used_blocks") == 0, 60), "prefill still holds slots"
    assert wait_for(lambda: metric(ss["dec"], "kvlink_pulls_in_progress") == 0, 60)
