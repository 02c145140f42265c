"""Speculative decoding with an EAGLE head (vLLM's "eagle" method, the one production deployments run): the
head is one Llama decoder layer fed by the target's hidden state and the next token's embedding, with a
KV cache layer of its own, named as the target's next layer (``model.layers.2.self_attn.attn`` behind the
2-layer tiny model), in the target's KV cache group. Prefill's head writes its KV for the prompt; kvlink
moves that layer with the target's.

The head (tests/vllm/eagle_model.py) is the target's first layer refolded into EAGLE's shape, so it drafts
what the target picks most of the time, from its own KV cache: acceptance says whether the head's pulled
bytes are the ones prefill's head wrote. (A random head drafts nothing the target accepts, pulled or not.)

Checked, in process: every whole block decode pulled holds prefill's bytes in every layer, the head's
included. Through kv_both servers handing requests to themselves (sequential pairing): answers equal the
server's own; drafts from pulled KV are accepted about as often as on the server alone; noise over the
head's pulled blocks only keeps the answers (verification is lossless) and costs acceptance; noise over
every pulled layer changes the answers (the negative control). Streamed (concurrent pairing, 64-token
chunks): the head's layer has a layer number of its own, so layer-wise progress names it like the
target's; answers equal a single server's, acceptance stays, the corrupting decode answers otherwise.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.vllm.helpers import (BLOCK, Engines, Server, complete, decode, kv_config, metric, prefill,
                                recording_kv_config, streamed_stack, text, token_prompts)
from tests.vllm.test_draft import (LENGTHS, MAX_TOKENS, SPEC_TOKENS, drafting, every_answer_changes, pd, single,
                                   started, streamed_answers_change)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the in-process engines below (servers drop it)

HEAD_LAYER = "model.layers.2.self_attn.attn"


@pytest.fixture(scope="module")
def eagle_head(tiny_model, tmp_path_factory) -> str:
    from tests.vllm.eagle_model import build_eagle_head

    return build_eagle_head(tiny_model, tmp_path_factory.mktemp("eagle") / "head")


def _spec(head: str) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": SPEC_TOKENS}


def _server(model: str, head: str, logs, name: str, cpu: int, connector: str | None = None) -> Server:
    kv = dict(kv_config("kv_both", transport_backend="tcp", engine_lease_s=120.0),
              kv_load_failure_policy="recompute")
    if connector:
        kv.update(kv_connector=connector, kv_connector_module_path="tests.fakes_connector")
    return Server(model, kv, cpu=cpu, log=logs / f"{name}.log",
                  extra_args=["--no-enable-prefix-caching", "--speculative-config", json.dumps(_spec(head))])


@pytest.fixture(scope="module")
def sd(tiny_model, eagle_head, tmp_path_factory):
    logs = tmp_path_factory.mktemp("eagle-servers")
    yield from started({"good": _server(tiny_model, eagle_head, logs, "good", 0),
                        "head_bad": _server(tiny_model, eagle_head, logs, "head-corrupt", 1,
                                            "EagleCorruptingConnector"),
                        "bad": _server(tiny_model, eagle_head, logs, "corrupt", 1, "CorruptingConnector")})


def test_head_layer_is_pulled_and_drafted_from(sd):
    """From pulled KV the head's drafts are accepted as often as on the server alone, but for each request's
    first drafting step on decode (drafted from the last prompt token computed alone; measured: 64 drafted
    and 39 accepted alone, 70 and 39 from pulled KV, for these three prompts)."""
    srv = sd["good"]
    prompts = token_prompts(LENGTHS, seed=95)
    want, drafted, accepted = drafting(srv, lambda: single(srv, prompts))
    assert accepted > drafted / 3, (drafted, accepted)  # the head drafts what the target picks
    pulled0 = metric(srv, "kvlink_blocks_pulled_total")
    got, drafted2, accepted2 = drafting(srv, lambda: pd(srv, prompts))
    assert got == want
    assert metric(srv, "kvlink_blocks_pulled_total") > pulled0
    assert metric(srv, "kvlink_pulls_failed_total") == 0, "a pull failed (decode recomputed the prompt)"
    assert drafted2 - accepted2 <= drafted - accepted + SPEC_TOKENS * len(prompts), (drafted, accepted,
                                                                                    drafted2, accepted2)


def test_noise_over_the_head_layer_keeps_the_answers_and_costs_acceptance(sd):
    srv = sd["head_bad"]
    prompts = token_prompts(LENGTHS, seed=96)
    want, drafted1, accepted1 = drafting(srv, lambda: single(srv, prompts))
    got, drafted, accepted = drafting(srv, lambda: pd(srv, prompts))
    assert got == want  # the target verifies every drafted token
    assert accepted1 > drafted1 / 2, (drafted1, accepted1)  # measured: 43 of 58 alone
    assert accepted < drafted / 4, (drafted, accepted)  # measured: 9 of 126 from noise


def test_negative_control_noise_over_every_pulled_layer_changes_the_answers(sd):
    every_answer_changes(sd["bad"])


def test_the_pulled_head_layer_holds_prefills_bytes(tiny_model, eagle_head):
    """Every whole block of the prompt decode pulled equals prefill's, in every layer, the head's included,
    and prefill's head had written them (not zero). A decode whose connector puts noise over the head's
    layer (EagleCorruptingConnector) differs from prefill there and only there: the check sees that layer.
    (The last block is partial: decode writes its own tokens there.)"""
    torch = pytest.importorskip("torch")
    spec = _spec(eagle_head)
    e = Engines(tiny_model)
    try:
        e.make("pre", recording_kv_config("kv_producer"), speculative_config=spec)
        e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"),
               speculative_config=spec)
        e.make("dec_bad", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute",
                               kv_connector="EagleCorruptingConnector",
                               kv_connector_module_path="tests.fakes_connector"), speculative_config=spec)
        prompt = token_prompts([BLOCK * 3 + 5], seed=98)[0]
        pre_kv = e.agents["pre"]._worker.kv_caches
        assert HEAD_LAYER in pre_kv and len(pre_kv) == 3, sorted(pre_kv)
        differs = {}
        for dec in ("dec", "dec_bad"):
            params = prefill(e, [prompt])[0]
            decode(e, dec, [prompt], [params])
            pulled = list(e.agents[dec].pulls.values())[-1].local_block_ids
            dec_kv = e.agents[dec]._worker.kv_caches
            assert sorted(dec_kv) == sorted(pre_kv)
            differs[dec] = set()
            for name, t in dec_kv.items():
                for pos in range(3):  # the whole blocks
                    theirs = pre_kv[name][params["remote_block_ids"][pos]]
                    assert theirs.any(), (name, pos)
                    if not torch.equal(t[pulled[pos]], theirs):
                        differs[dec].add(name)
        assert differs == {"dec": set(), "dec_bad": {HEAD_LAYER}}, differs
    finally:
        e.close()


@pytest.fixture(scope="module")
def streamed(tiny_model, eagle_head, tmp_path_factory):
    with streamed_stack(tiny_model, tmp_path_factory.mktemp("eagle-streamed"), "prefill-eagle",
                        ("--speculative-config", json.dumps(_spec(eagle_head)))) as st:
        yield st


def test_streamed_with_the_head_layer_equals_a_single_server(streamed):
    st = streamed
    prompts = token_prompts([20, 100, 300, 500], seed=99)
    want, drafted1, accepted1 = drafting(st["bad"], lambda: [text(complete(st["bad"].url, p, max_tokens=MAX_TOKENS))
                                                             for p in prompts])
    streamed0 = metric(st["dec"], "kvlink_blocks_streamed_total")
    got, drafted, accepted = drafting(st["dec"], lambda: [text(complete(st["conc"], p, max_tokens=MAX_TOKENS,
                                                                         timeout=120)) for p in prompts])
    assert metric(st["dec"], "kvlink_blocks_streamed_total") > streamed0, "decode read no block from a piece"
    assert got == want
    assert metric(st["dec"], "kvlink_pulls_failed_total") == 0, "a pull failed (decode recomputed the prompt)"
    assert drafted - accepted <= drafted1 - accepted1 + SPEC_TOKENS * len(prompts), (drafted1, accepted1,
                                                                                    drafted, accepted)


def test_negative_control_streamed_with_the_head_layer(streamed):
    streamed_answers_change(streamed)
