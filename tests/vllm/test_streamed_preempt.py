"""Streamed KV when vLLM preempts a streaming request on prefill, through real vLLM servers and the concurrent
proxy.

Prefill's KV cache holds 24 blocks of 32 tokens (``--num-gpu-blocks-override``), and it computes two
requests side by side, 64 tokens of each per step (``--long-prefill-token-threshold``); each layer of a
streaming step is slowed (tests.fakes_connector.SlowLayersConnector), so decode reads pieces while prefill
computes. Two prompts of 500 tokens need 32 blocks: once the cache is full, vLLM preempts the later
request, whose blocks go back (and are handed to the other), and runs it again once the first request's
blocks are free. Prefill then streams it again at a higher epoch (its blocks and what was announced may
be others), and decode reads what that epoch announces and the record; whatever it read before must not
count.

Checked: vLLM preempted (its counter on /metrics), a piece of a restarted epoch was sent (prefill's
KVLINK_TRACE), both answers equal a single server's, decode read blocks from pieces and no pull failed
(decode would recompute a failed one and answer right all the same), nothing is left held; and the same
through a decode whose connector corrupts what it pulled changes the answers (the negative control).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from tests.conftest import trace_lines
from tests.vllm.helpers import (Server, complete, concurrent_proxy, corrupting_kv_config, free_port, kv_config,
                                metric, text, token_prompts, wait_for)

PREFILL_ARGS = ("--num-gpu-blocks-override", "24", "--max-model-len", "600", "--max-num-batched-tokens", "128",
                "--long-prefill-token-threshold", "64", "--max-num-seqs", "16")
PROMPT = 500  # tokens: 16 blocks of 32 (tests.vllm.helpers.BLOCK); two need more than prefill's 24


@pytest.fixture(scope="module")
def st(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("streamed-preempt")
    bport = free_port()
    pre_kv = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=30.0, stream_kv=True),
                  engine_id="prefill-p", kv_connector="SlowLayersConnector",
                  kv_connector_module_path="tests.fakes_connector")
    pre = Server(tiny_model, pre_kv, cpu=0, log=logs / "prefill.log", extra_args=PREFILL_ARGS,
                 env={"KVLINK_TRACE": str(logs / "trace.jsonl")})
    dec = Server(tiny_model, dict(kv_config("kv_consumer", lookup_wait_s=10.0, transfer_timeout_s=10.0,
                                            pull_timeout_s=60.0), kv_load_failure_policy="recompute"),
                 cpu=1, log=logs / "decode.log")
    bad = Server(tiny_model, corrupting_kv_config(lookup_wait_s=10.0, pull_timeout_s=60.0), cpu=1,
                 log=logs / "corrupt.log")
    proxies = []
    try:
        for s in (pre, dec, bad):
            s.wait_ready()

        proxies += [concurrent_proxy(pre.url, d.url, bport, "prefill-p") for d in (dec, bad)]
        yield {"pre": pre, "dec": dec, "bad": bad, "conc": proxies[0].url, "conc_bad": proxies[1].url,
               "trace": logs / "trace.jsonl"}
    finally:
        for p in proxies:
            p.stop()
        for s in (pre, dec, bad):
            s.stop()


def preemptions(server) -> float:
    return server.metric("vllm:num_preemptions_total") or 0.0


def side_by_side(url: str, prompts) -> list[str]:
    """The prompts sent at once (the first ahead: vLLM preempts the one that came later)."""
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        futs = [ex.submit(lambda p: text(complete(url, p, timeout=240)), p) for p in prompts]
        return [f.result() for f in futs]


def restarted_pieces(st) -> list:
    return [p for e in trace_lines(st["trace"]) if e["ev"] == "piece_send" for p in e["pieces"] if p[3] > 0]


def test_a_request_preempted_mid_stream_streams_again_and_decodes_as_a_single_server(st):
    prompts = token_prompts([PROMPT, PROMPT], seed=70)
    want = [text(complete(st["bad"].url, p)) for p in prompts]  # a single server (no params: it pulls nothing)
    pre0, streamed0 = preemptions(st["pre"]), metric(st["dec"], "kvlink_blocks_streamed_total")
    restarted0 = len(restarted_pieces(st))
    got = side_by_side(st["conc"], prompts)
    assert preemptions(st["pre"]) > pre0, "vLLM preempted nothing: the test did not reach its case"
    assert len(restarted_pieces(st)) > restarted0, "no piece of a restarted (preempted) request was sent"
    assert metric(st["dec"], "kvlink_blocks_streamed_total") > streamed0
    assert got == want
    assert metric(st["dec"], "kvlink_pulls_failed_total") == 0, "a pull failed (decode recomputed the prompt)"
    assert wait_for(lambda: st["pre"].metric("kvlink_held_blocks") == 0.0), "prefill still holds blocks"
    assert wait_for(lambda: st["dec"].metric("kvlink_pulls_in_progress") == 0.0), "decode still waits for pulls"


def test_negative_control_a_corrupted_restarted_stream_changes_the_output(st):
    prompts = token_prompts([PROMPT, PROMPT], seed=71)
    want = [text(complete(st["dec"].url, p)) for p in prompts]
    pre0 = preemptions(st["pre"])
    got = side_by_side(st["conc_bad"], prompts)
    assert preemptions(st["pre"]) > pre0, "vLLM preempted nothing: the test did not reach its case"
    assert got[0] != want[0] and got[1] != want[1]
