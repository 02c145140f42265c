"""Streamed KV through real vLLM servers: prefill computes in 64-token chunks and announces each chunk's
finished blocks; decode, paired concurrently through ``kvlink proxy --mode concurrent``, reads them while
prefill still computes and only the tail after prefill publishes.

Three servers: a streaming prefill, a decode, and a decode whose connector corrupts whatever it pulled
(the negative control). The baseline is a request without params on a decode server that is not pulling
those prompts (a single server): never on prefill, whose prefix cache would then hold the whole prompt
and leave nothing to stream.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import socket
import time

import pytest

from tests.fakes_vllm_server import AppThread
from tests.vllm.helpers import (Server, complete, corrupting_kv_config, free_port, kv_config, text,
                                token_prompts)

CHUNK = 64  # prefill's max_num_batched_tokens: a 500-token prompt is 8 engine steps, 7 of them streamed
SERVER_ARGS = ("--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def sd(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("streamed")
    bport = free_port()
    pre = Server(tiny_model, dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True),
                                  engine_id="prefill-s"), cpu=0, log=logs / "prefill.log", extra_args=SERVER_ARGS)
    dec_kv = dict(kv_config("kv_consumer", lookup_wait_s=10.0, transfer_timeout_s=10.0, pull_timeout_s=20.0),
                  kv_load_failure_policy="recompute")
    dec = Server(tiny_model, dec_kv, cpu=1, log=logs / "decode.log")
    bad = Server(tiny_model, corrupting_kv_config(lookup_wait_s=10.0), cpu=1, log=logs / "corrupt.log")
    proxies = []
    try:
        for s in (pre, dec, bad):
            s.wait_ready()
        from kvlink.proxy.config import ProxyConfig
        from kvlink.proxy.router import build_app

        def proxy(decode):
            p = AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(decode.url,), mode="concurrent",
                                                timeout_s=60, prefill_bootstrap=(f"http://127.0.0.1:{bport}",),
                                                prefill_engine_ids=("prefill-s",))))
            proxies.append(p)
            return p.url

        yield {"pre": pre, "dec": dec, "bad": bad, "conc": proxy(dec), "conc_bad": proxy(bad), "logs": logs}
    finally:
        for p in proxies:
            p.stop()
        for s in (pre, dec, bad):
            s.stop()


def baseline(sd, prompts, on="bad"):
    return [text(complete(sd[on].url, p)) for p in prompts]


def metric(server, name) -> float:
    return server.metric(name) or 0.0


def wait_zero(server, name, timeout=60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric(name) == 0.0:
            return True
        time.sleep(0.5)
    return False


def test_streamed_outputs_equal_a_single_server(sd):
    """Shorter than one block up to eight chunks; prefill streamed pieces and decode read blocks from them
    before prefill published (counted on both sides' /metrics)."""
    prompts = token_prompts([7, 31, 64, 100, 230, 500, 700], seed=40)
    want = baseline(sd, prompts)
    sent0, streamed0 = metric(sd["pre"], "kvlink_pieces_sent_total"), metric(sd["dec"], "kvlink_blocks_streamed_total")
    got = [text(complete(sd["conc"], p, timeout=120)) for p in prompts]
    assert got == want
    assert metric(sd["pre"], "kvlink_pieces_sent_total") > sent0
    assert metric(sd["dec"], "kvlink_blocks_streamed_total") > streamed0
    assert metric(sd["dec"], "kvlink_pulls_failed_total") == 0


def test_concurrent_streamed_requests(sd):
    rng = random.Random(41)
    prompts = token_prompts([rng.randint(5, 600) for _ in range(12)], seed=41)
    want = baseline(sd, prompts)
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: text(complete(sd["conc"], p, timeout=180)), prompts))
    assert got == want
    assert wait_zero(sd["pre"], "kvlink_held_blocks")


def test_negative_control_corrupted_stream_changes_the_output(sd):
    prompts = token_prompts([300, 500], seed=42)
    want = baseline(sd, prompts, on="dec")
    got = [text(complete(sd["conc_bad"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]


def test_aborts_mid_stream_leave_nothing_held(sd):
    """Clients hang up while prefill is still computing (concurrent pairing: the proxy cancels both sides):
    decode stops waiting, prefill is told to stop streaming, and no block stays held on either side."""
    rng = random.Random(43)
    prompts = token_prompts([rng.randint(200, 900) for _ in range(60)], seed=43)

    def one(i):
        try:
            complete(sd["conc"], prompts[i], max_tokens=32, timeout=rng.uniform(0.02, 0.6))
            return "ok"
        except (TimeoutError, socket.timeout, OSError):
            return "aborted"

    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(len(prompts))))
    assert results.count("aborted") > 0
    assert wait_zero(sd["pre"], "kvlink_held_blocks"), "prefill still holds blocks"
    assert wait_zero(sd["dec"], "kvlink_pulls_in_progress"), "decode still waits for pulls"
    p = token_prompts([450], seed=44)
    assert text(complete(sd["conc"], p[0], timeout=120)) == baseline(sd, p)[0]
