"""Pipeline parallelism with a hybrid Mamba model whose stages hold different kinds of KV cache layer, through
real vLLM: NemotronH "M***" at ``--pipeline-parallel-size 2`` puts a Mamba2 layer and an attention layer on
stage 0 and attention only on stage 1. Both stages register under one engine id, so their compatibility hash
must not depend on which kinds of layer a stage holds; each layer's own layout (the Mamba state's parts, the
attention block) is compared layer by layer where decode reads it (contact.py).

Checked: the PP=2 server and a PP=1 server of the same model answer alike on their own (the oracle); a
request prefilled on either and decoded on the other answers as the PP=1 server does alone, with blocks
pulled and no pull failed (a failed pull is recomputed and would hide a wrong mapping); the negative control:
noise written over what decode pulled changes the answers, both ways. vLLM CPU runs PP with the model
compiled only (test_pp.py), and its Mamba2 kernel without prefix caching (test_mamba.py).
"""

from __future__ import annotations

import pytest

from tests.ports import free_port
from tests.vllm.helpers import (assert_noise_changes_both_ways, complete, handed, metric, pp_server, text,
                                token_prompts)

LENGTHS = [20, 64, 300, 301]


@pytest.fixture(scope="module")
def mamba_pp_model() -> str:
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("mamba_pp"))


@pytest.fixture(scope="module")
def servers(mamba_pp_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp_mamba")
    pp2 = pp_server(mamba_pp_model, tmp, "pp2", 2, "0|1", free_port())
    pp1 = pp_server(mamba_pp_model, tmp, "pp1", 1, 1, free_port())
    try:
        pp2.wait_ready(400)
        pp1.wait_ready(400)
        yield pp2, pp1
    finally:
        pp2.stop()
        pp1.stop()


def test_stages_of_different_layer_kinds_hand_requests_to_a_pp1_engine_both_ways(servers):
    pp2, pp1 = servers
    prompts = token_prompts(LENGTHS, seed=93)
    own2 = [text(complete(pp2.url, p)) for p in prompts]
    own1 = [text(complete(pp1.url, p)) for p in prompts]
    assert own2 == own1
    assert len(set(own1)) == len(own1)
    pulled = (metric(pp1, "kvlink_blocks_pulled_total"), metric(pp2, "kvlink_blocks_pulled_total"))
    for p, w in zip(prompts, own1):
        assert handed(pp2, pp1, p) == w  # PP=1 decode reads the state and KV from stage 0, KV from stage 1
        assert handed(pp1, pp2, p) == w  # each PP=2 decode stage reads its own layers from the one rank
    assert metric(pp1, "kvlink_blocks_pulled_total") > pulled[0]
    assert metric(pp2, "kvlink_blocks_pulled_total") > pulled[1]
    assert metric(pp1, "kvlink_pulls_failed_total") == 0 and metric(pp2, "kvlink_pulls_failed_total") == 0


def test_noise_over_the_pulled_state_and_kv_changes_the_answers(servers):
    pp2, pp1 = servers
    assert_noise_changes_both_ways(pp2, pp1, token_prompts([64, 300], seed=94))
