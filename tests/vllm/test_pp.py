"""Pipeline parallelism through real vLLM: a ``--pipeline-parallel-size 2`` server and a PP=1 server of the
same model hand requests to each other, both ways. Prefill's two stages each register the layers they hold;
decode at PP=1 reads its layers from both stages, and decode at PP=2 has each stage read its own layers from
the one PP=1 rank (kvlink/vllm/shard.py's routing, until now tested with synthetic ranks only).

vLLM CPU 0.32 runs PP only with the model compiled: with ``--enforce-eager`` it never sizes the buffer a
later stage receives its input in, and stage 1 asserts in ``sync_and_gather_intermediate_tensors`` at the
first request, with no connector at all. These servers are started without it.

Checked: both servers answer alike on their own (the oracle); a request prefilled on either and decoded on
the other answers as the decode server does alone, with blocks pulled and no pull failed (a failed pull is
recomputed and would hide a wrong mapping); prefill at PP=2 streaming its chunks to a PP=1 decode through
``kvlink proxy --mode concurrent``; and the negative control: the same pulls with noise written over what
decode pulled (tests/fakes_connector.py's SwitchedCorruptingConnector, on while a flag file exists) change
the answers, both ways. Host staging on a PP=2 prefill (`staging: always`, each stage staging its own
layers into a pool of its own) into the PP=1 decode, with its negative control. And TP and PP at once: a
TP=2 x PP=2 server and the PP=1 (TP=1) one, both ways (each decode rank reads its KV head range of its
layers from the prefill rank that holds them: four prefill ranks into one, one into four).
"""

from __future__ import annotations

import pytest

from tests.ports import free_port
from tests.vllm.helpers import (assert_noise_changes_both_ways, complete, concurrent_proxy, handed, metric,
                                pp_server, text, token_prompts)

LENGTHS = [20, 64, 300, 301, 450]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp")
    pports = (free_port(), free_port())
    pp2 = pp_server(tiny_model, tmp, "pp2", 2, "0|1", pports[0])
    pp1 = pp_server(tiny_model, tmp, "pp1", 1, 1, pports[1])
    try:
        pp2.wait_ready(400)
        pp1.wait_ready(400)
        yield pp2, pp1, pports[0]
    finally:
        pp2.stop()
        pp1.stop()


def test_pp2_and_pp1_hand_requests_to_each_other_and_answer_as_a_singlepp_server(servers):
    pp2, pp1, bport = servers
    prompts = token_prompts(LENGTHS, seed=90)
    own2 = [text(complete(pp2.url, p)) for p in prompts]
    own1 = [text(complete(pp1.url, p)) for p in prompts]
    assert own2 == own1  # the model split over two stages computes what one rank does
    assert len(set(own1)) == len(own1)  # every prompt's answer differs: another prompt's KV would show
    pulled = (metric(pp1, "kvlink_blocks_pulled_total"), metric(pp2, "kvlink_blocks_pulled_total"))
    for p, w in zip(prompts, own1):
        assert handed(pp2, pp1, p) == w  # PP=1 decode reads each layer from the stage that holds it
        assert handed(pp1, pp2, p) == w  # each PP=2 decode stage reads its layers from the one rank
    assert metric(pp1, "kvlink_blocks_pulled_total") > pulled[0]
    assert metric(pp2, "kvlink_blocks_pulled_total") > pulled[1]
    assert metric(pp1, "kvlink_pulls_failed_total") == 0 and metric(pp2, "kvlink_pulls_failed_total") == 0

    proxy = concurrent_proxy(pp2.url, pp1.url, bport)  # prefill at PP=2 streams its chunks to decode at PP=1
    try:
        sent = metric(pp2, "kvlink_pieces_sent_total")
        for p, w in zip(prompts, own1):
            assert text(complete(proxy.url, p, timeout=120)) == w
        assert metric(pp2, "kvlink_pieces_sent_total") > sent
        assert metric(pp1, "kvlink_pulls_failed_total") == 0
    finally:
        proxy.stop()


def test_pp_negative_control_noise_over_the_pulled_kv_changes_the_answers(servers):
    pp2, pp1, _ = servers
    assert_noise_changes_both_ways(pp2, pp1, token_prompts([300, 450], seed=91))


def test_pp2_prefill_staged_into_pp1_decode(servers, tiny_model, tmp_path):
    """Each prefill stage copies its layers of a finished request into its own staging pool and gives vLLM
    the blocks back; decode reads every layer from the pool of the stage that holds it."""
    _, pp1, _ = servers
    staged = pp_server(tiny_model, tmp_path, "pp2-staged", 2, "0|1", free_port(), role="kv_producer",
                     staging="always", staging_pool_mb=8)
    try:
        staged.wait_ready(400)
        prompts = token_prompts([20, 300, 450], seed=92)
        own = [text(complete(pp1.url, p)) for p in prompts]
        pulled, read = metric(pp1, "kvlink_blocks_pulled_total"), metric(pp1, "kvlink_bytes_pulled_total")
        for p, w in zip(prompts, own):
            assert handed(staged, pp1, p) == w
        assert metric(pp1, "kvlink_blocks_pulled_total") > pulled
        assert metric(pp1, "kvlink_pulls_failed_total") == 0
        # decode read every byte from the stages' pools: the bytes both stages staged, no more, no less
        assert metric(staged, "kvlink_bytes_staged_total") == metric(pp1, "kvlink_bytes_pulled_total") - read
        pp1.flag.touch()
        try:
            assert all(handed(staged, pp1, p) != w for p, w in zip(prompts[1:], own[1:]))
        finally:
            pp1.flag.unlink()
    finally:
        staged.stop()


def test_tp2_pp2_and_tp1_pp1_hand_requests_to_each_other(servers, tiny_model, tmp_path):
    _, pp1, _ = servers
    both = pp_server(tiny_model, tmp_path, "tp2pp2", 2, "0|1|0|1", free_port(), tp=2)
    try:
        both.wait_ready(400)
        prompts = token_prompts([20, 64, 300, 450], seed=93)
        own = [text(complete(pp1.url, p)) for p in prompts]
        assert [text(complete(both.url, p)) for p in prompts] == own
        pulled = (metric(pp1, "kvlink_blocks_pulled_total"), metric(both, "kvlink_blocks_pulled_total"))
        for p, w in zip(prompts, own):
            assert handed(both, pp1, p) == w  # one rank reads from four
            assert handed(pp1, both, p) == w  # four ranks read from one
        assert metric(pp1, "kvlink_blocks_pulled_total") > pulled[0]
        assert metric(both, "kvlink_blocks_pulled_total") > pulled[1]
        assert metric(pp1, "kvlink_pulls_failed_total") == 0 and metric(both, "kvlink_pulls_failed_total") == 0
        pp1.flag.touch()
        both.flag.touch()
        try:
            assert all(handed(both, pp1, p) != w for p, w in zip(prompts[2:], own[2:]))
            assert all(handed(pp1, both, p) != w for p, w in zip(prompts[2:], own[2:]))
        finally:
            pp1.flag.unlink()
            both.flag.unlink()
    finally:
        both.stop()
