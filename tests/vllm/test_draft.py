"""Speculative decoding with a draft model (vLLM's "draft_model" method; the tiny model drafts for itself):
the drafter's KV cache layers (``draft_model.model.layers.*``) sit beside the target's, prefill computes
them for the prompt, and kvlink moves them with the target's (decode's layers are checked by name at first
contact). Each server is ``kv_both`` and hands requests to itself (sequential pairing).

Checked, in process: every whole block decode pulled holds prefill's bytes, in the draft layers as in
the target's. Through servers: decode's answers equal the server's own without params, and the drafter's
pulled bytes are the ones it drafts from: with the draft model the same as the target, the drafter
proposes what the target picks, so a decode from pulled KV accepts every drafted token but its first
step's, as the server computing the prompt itself accepts every one. A decode whose connector puts noise over the draft
layers' pulled blocks answers the same (verification is lossless) but accepts far fewer; one that puts
noise over every pulled layer answers otherwise (the negative control).

Streamed (concurrent pairing, 64-token chunks): the draft layers share the target's layer numbers, so
layer-wise progress cannot name them and each step's blocks are announced whole, at the step's end, which
vLLM defers under speculative decoding until the drafter has written its KV (``wait_for_save`` after the
draft model runs). Answers equal a single server's, drafts are accepted as on the whole-request path, and
the corrupting decode answers otherwise.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.vllm.helpers import (BLOCK, Engines, Server, complete, decode, kv_config, metric, prefill,
                                recording_kv_config, streamed_stack, text, token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the in-process engines below (servers drop it)

LENGTHS = [20, 64, 300]
MAX_TOKENS = 24
SPEC_TOKENS = 2


def _server(model: str, logs, name: str, cpu: int, connector: str | None = None) -> Server:
    kv = dict(kv_config("kv_both", transport_backend="tcp", engine_lease_s=120.0),
              kv_load_failure_policy="recompute")
    if connector:  # tests/fakes_connector.py
        kv.update(kv_connector=connector, kv_connector_module_path="tests.fakes_connector")
    spec = json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": SPEC_TOKENS})
    return Server(model, kv, cpu=cpu, log=logs / f"{name}.log",
                  extra_args=["--no-enable-prefix-caching", "--speculative-config", spec])


@pytest.fixture(scope="module")
def sd(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("draft")
    yield from started({"good": _server(tiny_model, logs, "good", 0),
                        "draft_bad": _server(tiny_model, logs, "draft-corrupt", 1, "DraftCorruptingConnector"),
                        "bad": _server(tiny_model, logs, "corrupt", 1, "CorruptingConnector")})


def started(servers: dict[str, Server]):
    """A fixture's body: the servers once all are ready, stopped after the module (test_eagle.py too)."""
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def drafting(srv: Server, run) -> tuple[list[str], float, float]:
    """The answers ``run`` gets from ``srv``, and the tokens drafted and accepted meanwhile."""
    d0 = metric(srv, "vllm:spec_decode_num_draft_tokens_total")
    a0 = metric(srv, "vllm:spec_decode_num_accepted_tokens_total")
    out = run()
    drafted = metric(srv, "vllm:spec_decode_num_draft_tokens_total") - d0
    assert drafted > 0, "nothing was drafted"
    return out, drafted, metric(srv, "vllm:spec_decode_num_accepted_tokens_total") - a0


def pd(srv: Server, prompts) -> list[str]:
    """Each prompt prefilled and then decoded from the pulled KV, on the same server."""
    out = []
    for p in prompts:
        params = complete(srv.url, p, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        out.append(text(complete(srv.url, p, params, max_tokens=MAX_TOKENS)))
    return out


def single(srv: Server, prompts) -> list[str]:
    return [text(complete(srv.url, p, max_tokens=MAX_TOKENS)) for p in prompts]


def test_draft_layers_are_pulled_and_drafted_from(sd):
    """Alone, the server accepts every drafted token. From pulled KV, every one but those of each request's
    first drafting step on decode (vLLM drafts that step with the target's last prompt token computed alone;
    measured: 18 drafted and 16 accepted a request, against 16 of 16, at every prompt length)."""
    srv = sd["good"]
    prompts = token_prompts(LENGTHS, seed=95)
    want, drafted, accepted = drafting(srv, lambda: single(srv, prompts))
    assert accepted == drafted
    pulled0 = metric(srv, "kvlink_blocks_pulled_total")
    got, drafted, accepted = drafting(srv, lambda: pd(srv, prompts))
    assert got == want
    assert metric(srv, "kvlink_blocks_pulled_total") > pulled0
    assert metric(srv, "kvlink_pulls_failed_total") == 0, "a pull failed (decode recomputed the prompt)"
    assert drafted - accepted <= SPEC_TOKENS * len(prompts), (drafted, accepted)


def test_noise_over_the_draft_layers_keeps_the_answers_and_costs_acceptance(sd):
    srv = sd["draft_bad"]
    prompts = token_prompts(LENGTHS, seed=96)
    want = single(srv, prompts)
    got, drafted, accepted = drafting(srv, lambda: pd(srv, prompts))
    assert got == want  # the target verifies every drafted token
    assert accepted < drafted / 2, (drafted, accepted)  # measured: 1 of 46


def test_negative_control_noise_over_every_pulled_layer_changes_the_answers(sd):
    every_answer_changes(sd["bad"])


def every_answer_changes(srv: Server) -> None:
    """On a server whose connector corrupts what it pulled, every answer from pulled KV differs."""
    prompts = token_prompts(LENGTHS, seed=97)
    want = single(srv, prompts)
    got = pd(srv, prompts)
    assert all(g != w for g, w in zip(got, want)), got


def test_the_pulled_draft_layers_hold_prefills_bytes(tiny_model):
    """Every whole block of the prompt decode pulled equals prefill's, in every layer, the drafter's
    included, and prefill's drafter had written them (not zero). (The last block is partial: decode writes
    its own tokens there, in a packed layout a test cannot slice by token.)"""
    torch = pytest.importorskip("torch")
    spec = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": SPEC_TOKENS}
    e = Engines(tiny_model)
    try:
        e.make("pre", recording_kv_config("kv_producer"), speculative_config=spec)
        e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"),
               speculative_config=spec)
        prompt = token_prompts([BLOCK * 3 + 5], seed=98)[0]
        params = prefill(e, [prompt])[0]
        decode(e, "dec", [prompt], [params])
        pulled = list(e.agents["dec"].pulls.values())[-1].local_block_ids
        pre_kv, dec_kv = e.agents["pre"]._worker.kv_caches, e.agents["dec"]._worker.kv_caches
        assert sum(n.startswith("draft_model.") for n in dec_kv) == 2, sorted(dec_kv)
        for name, t in dec_kv.items():
            for pos in range(3):  # the whole blocks
                theirs = pre_kv[name][params["remote_block_ids"][pos]]
                assert theirs.any(), (name, pos)
                assert torch.equal(t[pulled[pos]], theirs), (name, pos)
    finally:
        e.close()


@pytest.fixture(scope="module")
def streamed(tiny_model, tmp_path_factory):
    spec = json.dumps({"method": "draft_model", "model": tiny_model, "num_speculative_tokens": SPEC_TOKENS})
    with streamed_stack(tiny_model, tmp_path_factory.mktemp("draft-streamed"), "prefill-draft",
                        ("--speculative-config", spec)) as st:
        yield st


def test_streamed_with_draft_layers_equals_a_single_server(streamed):
    st = streamed
    prompts = token_prompts([20, 100, 300, 500], seed=99)
    streamed0 = metric(st["dec"], "kvlink_blocks_streamed_total")
    got, drafted, accepted = drafting(st["dec"], lambda: [text(complete(st["conc"], p, max_tokens=MAX_TOKENS,
                                                                         timeout=120)) for p in prompts])
    assert metric(st["dec"], "kvlink_blocks_streamed_total") > streamed0, "decode read no block from a piece"
    assert got == [text(complete(st["bad"].url, p, max_tokens=MAX_TOKENS)) for p in prompts]
    assert metric(st["dec"], "kvlink_pulls_failed_total") == 0, "a pull failed (decode recomputed the prompt)"
    assert drafted - accepted <= SPEC_TOKENS * len(prompts), (drafted, accepted)  # as the whole-request path


def test_negative_control_streamed_with_draft_layers(streamed):
    streamed_answers_change(streamed)


def streamed_answers_change(st: dict) -> None:
    """Through the streamed stack's corrupting decode, every answer differs from the server's own."""
    prompts = token_prompts([300, 500], seed=100)
    want = [text(complete(st["dec"].url, p, max_tokens=MAX_TOKENS)) for p in prompts]
    got = [text(complete(st["conc_bad"], p, max_tokens=MAX_TOKENS, timeout=120)) for p in prompts]
    assert all(g != w for g, w in zip(got, want)), got
