"""Host staging forced on CPU (``staging: always``) between real prefill and decode servers and the kvlink
proxy: prefill's engine loop stages by itself, decode reads prefill's pool into its landing pool. Prefill's
transport is reached through a throttling Relay so a pull can be held mid-way; the last two tests kill
decode (mid-pull), then prefill (after staging).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import urllib.request

import pytest

from tests.fakes_vllm_server import AppThread
from tests.relay import Relay
from tests.vllm.helpers import Server, complete, free_port, http_json, kv_config, text, token_prompts

LEASE_S = 6.0
STAGED = dict(staging="always", staging_pool_mb=8)


@pytest.fixture(scope="module")
def staged(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("staged-servers")
    bport, tport = free_port(), free_port()
    relay = Relay(f"127.0.0.1:{tport}")
    pre_kv = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=LEASE_S, transport_port=tport,
                            transport_advertise=relay.address, **STAGED), engine_id="prefill-s")
    dec_kv = dict(kv_config("kv_consumer", pull_timeout_s=25.0, transport_backend="tcp", **STAGED),
                  kv_load_failure_policy="recompute")
    pre = Server(tiny_model, pre_kv, cpu=0, log=logs / "prefill.log")
    dec = Server(tiny_model, dec_kv, cpu=1, log=logs / "decode.log")
    s = {"pre": pre, "dec": dec, "relay": relay, "dec_kv": dec_kv, "model": tiny_model, "logs": logs}
    proxy = None
    try:
        pre.wait_ready()
        dec.wait_ready()
        from kvlink.proxy.config import ProxyConfig
        from kvlink.proxy.router import build_app

        proxy = AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(dec.url,), timeout_s=60)))
        warm = token_prompts([40], seed=40)[0]
        for url in (pre.url, dec.url, proxy.url):
            complete(url, warm, max_tokens=2, timeout=120)
        s["seq"] = proxy.url
        yield s
    finally:
        if proxy is not None:
            proxy.stop()
        s["pre"].stop()
        s["dec"].stop()  # the one running now (a test restarts decode)
        relay.close()


def metric(server, name) -> float:
    return server.metric(name) or 0.0


def wait_metric(server, name, ok, timeout=30.0) -> bool:
    """Until ``ok(value)``; the series must exist (a gauge that is absent or renamed never passes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = server.metric(name)
        if v is not None and ok(v):
            return True
        time.sleep(0.2)
    return False


def baseline(s, prompt, max_tokens=10):
    return text(complete(s["pre"].url, prompt, max_tokens=max_tokens))


def prefill_only(s, prompt) -> dict:
    status, out = http_json(s["pre"].url + "/v1/completions",
                            {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, out
    return out["kv_transfer_params"]


def test_pd_staged_equals_baseline(staged):
    prompts = token_prompts([10, 64, 300, 700], seed=41)
    staged0 = metric(staged["pre"], "kvlink_staged_total")
    for p in prompts:
        assert text(complete(staged["seq"], p)) == baseline(staged, p)
    assert metric(staged["pre"], "kvlink_staged_total") - staged0 == len(prompts)
    assert metric(staged["dec"], "kvlink_bytes_landed_total") > 0
    assert wait_metric(staged["pre"], "kvlink_staging_used_blocks", lambda v: v == 0)


def test_prefill_gives_its_blocks_back_before_decode_pulls(staged):
    prompt = token_prompts([300], seed=42)[0]
    want = baseline(staged, prompt)
    staged0 = metric(staged["pre"], "kvlink_staged_total")
    params = prefill_only(staged, prompt)
    # Decode has not asked yet: prefill holds the request in its pool, none of vLLM's blocks.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(staged["pre"], "kvlink_staged_total") == staged0:
        time.sleep(0.2)
    assert wait_metric(staged["pre"], "kvlink_held_blocks", lambda v: v == 0)
    assert metric(staged["pre"], "kvlink_staging_used_blocks") == 10  # 300 tokens: 10 blocks
    assert metric(staged["pre"], "kvlink_held_requests") == 1
    assert text(complete(staged["dec"].url, prompt, params)) == want
    assert wait_metric(staged["pre"], "kvlink_staging_used_blocks", lambda v: v == 0)


def _kill_decode_mid_pull(s, prompt, via_proxy: bool) -> None:
    """A staged pull crawling through the relay; decode dies with it on the wire."""
    from kvlink.proxy.config import ProxyConfig
    from kvlink.proxy.router import build_app

    s["relay"].throttle(20 << 10)
    proxy = AppThread(build_app(ProxyConfig(prefill=(s["pre"].url,), decode=(s["dec"].url,), timeout_s=60))) \
        if via_proxy else None  # in front of the decode running now (a test restarts it)
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            if proxy is not None:
                fut = ex.submit(lambda: complete(proxy.url, prompt, timeout=60))
            else:  # prefill, then decode, without the proxy: nobody but decode could report the request
                params = prefill_only(s, prompt)
                fut = ex.submit(lambda: complete(s["dec"].url, prompt, params, timeout=60))
            assert s["relay"].first_byte.wait(60), "the pull never started"
            assert wait_metric(s["pre"], "kvlink_staging_used_blocks", lambda v: v == 22, timeout=10)
            s["dec"].kill()
            with pytest.raises(Exception):
                fut.result(timeout=60)
    finally:
        s["relay"].throttle(None)
        if proxy is not None:
            proxy.stop()


def _restart_decode(s) -> None:
    s["dec"] = Server(s["model"], s["dec_kv"], cpu=1, log=s["logs"] / f"decode-{time.monotonic_ns()}.log")
    s["dec"].wait_ready()


def test_decode_killed_mid_pull_prefill_frees_the_staged_copy_at_lease_expiry(staged):
    s = staged
    prompt = token_prompts([700], seed=43)[0]
    expired0 = metric(s["pre"], "kvlink_leases_expired_total")
    try:
        _kill_decode_mid_pull(s, prompt, via_proxy=False)
        assert wait_metric(s["pre"], "kvlink_staging_used_blocks", lambda v: v == 0, timeout=LEASE_S + 20)
        assert metric(s["pre"], "kvlink_leases_expired_total") > expired0
        assert metric(s["pre"], "kvlink_held_requests") == 0
        again = token_prompts([50], seed=44)[0]
        assert text(complete(s["pre"].url, again, max_tokens=4))  # prefill keeps serving
    finally:
        _restart_decode(s)


def test_decode_killed_mid_pull_behind_the_proxy_prefill_frees_the_staged_copy_as_abandoned(staged):
    """Behind the proxy, decode's death fails the proxy's decode leg: the proxy reports prefill's request
    abandoned (kvlink/proxy/release.py). Decode was reading it on a lease the bootstrap server gave it, and the
    proxy cannot tell a dead decode from one still reading, so the server holds the report until that lease
    runs out (bootstrap.md, ``release``); prefill then frees its staged copy as abandoned, not expired."""
    s = staged
    prompt = token_prompts([700], seed=46)[0]
    expired0 = metric(s["pre"], "kvlink_leases_expired_total")
    abandoned0 = metric(s["pre"], "kvlink_released_abandoned_total") or 0.0
    try:
        _kill_decode_mid_pull(s, prompt, via_proxy=True)
        t0 = time.monotonic()
        assert wait_metric(s["pre"], "kvlink_staging_used_blocks", lambda v: v == 0, timeout=LEASE_S + 20)
        assert metric(s["pre"], "kvlink_leases_expired_total") == expired0, "freed by the lease, not the report"
        assert metric(s["pre"], "kvlink_released_abandoned_total") == abandoned0 + 1
        assert time.monotonic() - t0 < LEASE_S + 5  # (decode's lease, then prefill's next poll)
        assert metric(s["pre"], "kvlink_held_requests") == 0
    finally:
        _restart_decode(s)


def test_prefill_killed_after_staging_decode_recomputes(staged):
    """Last: prefill dies holding only the staged copy; decode computes the prompt within its timeout."""
    s = staged
    prompt = token_prompts([200], seed=45)[0]
    want = baseline(s, prompt)
    params = prefill_only(s, prompt)
    assert wait_metric(s["pre"], "kvlink_staging_used_blocks", lambda v: v == 7)
    s["pre"].kill()
    s["relay"].close()
    t0 = time.monotonic()
    assert text(complete(s["dec"].url, prompt, params, timeout=60)) == want
    assert time.monotonic() - t0 < 30
    with urllib.request.urlopen(s["dec"].url + "/health", timeout=5) as r:
        assert r.status == 200
