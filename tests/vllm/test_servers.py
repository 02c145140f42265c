"""Prefill + decode OpenAI servers with KVLinkConnector and the kvlink proxy, all on loopback.

One prefill and one decode server for the whole module (start-up dominates); the decode server also
gives the baseline (requests without kv_transfer_params run there as on a plain server). The last test
kills the prefill server.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import socket
import time
import urllib.request

import pytest

from tests.fakes_vllm_server import AppThread
from tests.vllm.helpers import (Server, complete, corrupting_kv_config, free_port, http_json, kv_config, text,
                                token_prompts)


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    bport = free_port()
    pre_kv = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0), engine_id="prefill-0")
    dec_kv = dict(kv_config("kv_consumer", lookup_wait_s=10.0, transfer_timeout_s=10.0),
                  kv_load_failure_policy="recompute")
    pre = Server(tiny_model, pre_kv, cpu=0, log=logs / "prefill.log")
    dec = Server(tiny_model, dec_kv, cpu=1, log=logs / "decode.log")
    bad = Server(tiny_model, corrupting_kv_config(lookup_wait_s=10.0), cpu=1, log=logs / "corrupt.log")
    proxies = []
    try:
        for s in (pre, dec, bad):
            s.wait_ready()
        from kvlink.proxy.config import ProxyConfig
        from kvlink.proxy.router import build_app

        def proxy(decode, mode):
            conc = dict(mode="concurrent", prefill_bootstrap=(f"http://127.0.0.1:{bport}",),
                        prefill_engine_ids=("prefill-0",)) if mode == "conc" else {}
            proxies.append(AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(decode.url,), timeout_s=60,
                                                           **conc))))
            return proxies[-1].url

        yield {"pre": pre, "dec": dec, "seq": proxy(dec, "seq"), "conc": proxy(dec, "conc"), "logs": logs,
               "seq_bad": proxy(bad, "seq"), "conc_bad": proxy(bad, "conc")}
    finally:
        for p in proxies:
            p.stop()
        for s in (pre, dec, bad):
            s.stop()


def baseline(pd, prompts):
    """Computed on prefill without params: on decode it would fill decode's prefix cache, and the PD
    request would then pull almost nothing."""
    return [text(complete(pd["pre"].url, p)) for p in prompts]


def held_blocks(pd) -> float | None:
    return pd["pre"].metric("kvlink_held_blocks")


def wait_held_zero(pd, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if held_blocks(pd) == 0.0:  # present once anything was held
            return True
        time.sleep(0.5)
    return False


@pytest.mark.parametrize("mode", ["seq", "conc"])
def test_pd_equals_baseline(pd, mode):
    prompts = token_prompts([7, 64, 230], seed=10)
    want = baseline(pd, prompts)
    got = [text(complete(pd[mode], p)) for p in prompts]
    assert got == want


@pytest.mark.parametrize("mode", ["seq", "conc"])
def test_negative_control_corrupted_kv_changes_the_output(pd, mode):
    """The same pairing into a decode whose connector overwrites what it pulled with noise: other answers,
    so the equality above comes from the moved KV."""
    prompts = token_prompts([64, 230], seed=12)
    want = baseline(pd, prompts)
    got = [text(complete(pd[f"{mode}_bad"], p)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]


def test_decode_metrics_time_each_pull_and_its_handoff(pd):
    """Every pulled request lands once in kvlink_pull_seconds and once in kvlink_handoff_seconds (KV in
    place until vLLM's step collects it) on decode's /metrics."""
    dec = pd["dec"]

    def counts():
        return [dec.metric(n) or 0.0 for n in ("kvlink_pulls_ok_total", "kvlink_pull_seconds_count",
                                                "kvlink_handoff_seconds_count")]

    before = counts()
    prompts = token_prompts([40, 120], seed=13)
    assert [text(complete(pd["seq"], p)) for p in prompts] == baseline(pd, prompts)
    deadline = time.monotonic() + 20
    while (grown := [a - b for a, b in zip(counts(), before)]) != [2.0, 2.0, 2.0]:
        assert time.monotonic() < deadline, f"pulls_ok, pull_s, handoff_s grew by {grown}, expected 2 each"
        time.sleep(0.5)


def test_the_default_backend_copies_a_same_host_prefill_directly(pd):
    """transport_backend "auto" on one host: decode's READs copy prefill's memory (process_vm_readv), not
    TCP, and the answer is the single server's."""
    local0 = pd["dec"].metric("kvlink_bytes_local_total") or 0.0
    prompts = token_prompts([600], seed=16)
    assert [text(complete(pd["seq"], p)) for p in prompts] == baseline(pd, prompts)
    deadline = time.monotonic() + 20
    while (pd["dec"].metric("kvlink_bytes_local_total") or 0.0) <= local0:
        assert time.monotonic() < deadline, "no byte copied same-host"
        time.sleep(0.3)


@pytest.mark.parametrize("mode", ["seq", "conc"])
def test_several_samples_through_the_proxy_pull_once(pd, mode):
    """n=3, seeded sampling, through kvlink proxy: the samples equal a server computing them locally, no pull
    fails (no sample recomputes the prompt), and prefill holds nothing afterwards."""
    from tests.vllm.helpers import http_json

    def samples(url, prompt, **sampling):
        status, out = http_json(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                          "n": 3, "seed": 5, "temperature": 1.0,
                                                          "ignore_eos": True, **sampling}, timeout=60)
        assert status == 200, out
        return sorted(c["text"] for c in out["choices"])

    prompt = token_prompts([150], seed=14 if mode == "seq" else 15)[0]
    failed = pd["dec"].metric("kvlink_pulls_failed_total") or 0.0
    ok = pd["dec"].metric("kvlink_pulls_ok_total") or 0.0
    got = samples(pd[mode], prompt)
    assert got == samples(pd["pre"].url, prompt)
    assert len(set(got)) > 1
    assert (pd["dec"].metric("kvlink_pulls_failed_total") or 0.0) == failed
    deadline = time.monotonic() + 20
    while (pd["dec"].metric("kvlink_pulls_ok_total") or 0.0) - ok < 3:
        assert time.monotonic() < deadline, "every sample's pull is reported ok"
        time.sleep(0.3)
    assert wait_held_zero(pd)
    # Negative control: n=3 into a decode that corrupts what it pulled. top_k=1 (vLLM refuses n > 1 with
    # temperature 0): the tiny random model's seeded samples hardly depend on the prompt, its argmax does.
    other, right = token_prompts([150, 150], seed=118 if mode == "seq" else 119)
    assert samples(pd[f"{mode}_bad"], other, top_k=1) != samples(pd["pre"].url, other, top_k=1)
    assert samples(pd[mode], right, top_k=1) == samples(pd["pre"].url, right, top_k=1)  # (the same, decoded right)
    assert wait_held_zero(pd)


def test_streaming_through_proxy(pd):
    prompts = token_prompts([100], seed=11)
    assert complete(pd["seq"], prompts[0], stream=True) == baseline(pd, prompts)[0]


def test_32_concurrent_requests(pd):
    rng = random.Random(12)
    prompts = token_prompts([rng.randint(5, 300) for _ in range(32)], seed=12)
    want = baseline(pd, prompts)
    with cf.ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda p: text(complete(pd["seq"], p, timeout=120)), prompts))
    assert got == want
    assert wait_held_zero(pd)


def test_malformed_params_clear_error_and_no_harm(pd):
    prompts = token_prompts([60, 61], seed=13)
    want = baseline(pd, prompts)
    bad = {"do_remote_prefill": True, "remote_bootstrap_addr": 12}
    with cf.ThreadPoolExecutor(2) as ex:
        f_bad = ex.submit(complete, pd["dec"].url, prompts[0], bad)
        f_good = ex.submit(lambda: text(complete(pd["seq"], prompts[1])))
        out_bad = f_bad.result()
        assert f_good.result() == want[1]
    assert text(out_bad) == want[0]
    assert "remote_bootstrap_addr" in out_bad["kv_transfer_params"]["kvlink_error"]


def test_random_client_aborts_leave_no_blocks_held(pd):
    rng = random.Random(14)
    prompts = token_prompts([rng.randint(20, 400) for _ in range(200)], seed=14)

    def one(i):
        url = pd["seq"] if i % 2 == 0 else pd["conc"]
        try:
            complete(url, prompts[i], max_tokens=64, timeout=rng.uniform(0.05, 1.5))
            return "ok"
        except (TimeoutError, socket.timeout, OSError):
            return "aborted"

    with cf.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(200)))
    assert results.count("aborted") > 0
    assert wait_held_zero(pd, timeout=60), f"prefill still holds {held_blocks(pd)} blocks"
    # Whether an abort lands mid-pull depends on the machine's speed (a same-host pull takes ~15 ms on a
    # fast one): test_server_faults.py::test_client_abort_mid_pull_reaches_both_engines makes one that does.
    # Both servers still answer correctly.
    p = token_prompts([90], seed=15)
    assert text(complete(pd["seq"], p[0])) == baseline(pd, p)[0]


def test_prefill_killed_decode_recomputes(pd):
    """Last: kills the prefill server. Decode must recompute within its timeout and stay healthy."""
    prompts = token_prompts([150], seed=16)
    want = baseline(pd, prompts)
    status, out = http_json(pd["pre"].url + "/v1/completions",
                            {"model": "tiny", "prompt": prompts[0], "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200
    params = out["kv_transfer_params"]
    pd["pre"].kill()
    t0 = time.monotonic()
    assert text(complete(pd["dec"].url, prompts[0], params, timeout=60)) == want[0]
    assert time.monotonic() - t0 < 30
    with urllib.request.urlopen(pd["dec"].url + "/health", timeout=5) as r:
        assert r.status == 200
