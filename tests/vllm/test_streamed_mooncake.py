"""Streamed KV over Mooncake's transfer engine (``transport_backend: mooncake``) through real vLLM servers:
a prefill streaming every layer of every 64-token chunk, decode paired concurrently through
``kvlink proxy --mode concurrent``. Decode's outputs equal a single server's and the whole-request
path's (sequential pairing over the same backend), pieces were read before prefill published, and a
decode whose connector corrupts what it pulled answers otherwise. The worker-level checks of the same
backend (a streamed pull lands whole, block for block) are in test_streamed_landing.py."""

from __future__ import annotations

import pytest

from tests.vllm.helpers import complete, metric, streamed_stack, text, token_prompts

pytest.importorskip("mooncake")


@pytest.fixture(scope="module")
def mc(tiny_model, tmp_path_factory):
    with streamed_stack(tiny_model, tmp_path_factory.mktemp("streamed-mooncake"), "prefill-mc",
                        transport_backend="mooncake") as st:
        yield st


def test_streamed_over_mooncake_equals_a_single_server(mc):
    prompts = token_prompts([7, 31, 64, 100, 230, 500], seed=90)
    sent0, streamed0 = metric(mc["pre"], "kvlink_pieces_sent_total"), metric(mc["dec"], "kvlink_blocks_streamed_total")
    got = [text(complete(mc["conc"], p, timeout=120)) for p in prompts]
    assert metric(mc["pre"], "kvlink_pieces_sent_total") > sent0, "prefill streamed no piece"
    assert metric(mc["dec"], "kvlink_blocks_streamed_total") > streamed0, "decode read no block from a piece"
    assert got == [text(complete(mc["seq"], p, timeout=120)) for p in prompts]
    assert got == [text(complete(mc["bad"].url, p)) for p in prompts]
    assert metric(mc["dec"], "kvlink_pulls_failed_total") == 0, "a pull failed (decode recomputed the prompt)"


def test_negative_control_corrupted_stream_over_mooncake_changes_the_output(mc):
    prompts = token_prompts([300, 500], seed=91)
    want = [text(complete(mc["dec"].url, p)) for p in prompts]
    streamed0 = metric(mc["bad"], "kvlink_blocks_streamed_total")
    got = [text(complete(mc["conc_bad"], p, timeout=120)) for p in prompts]
    assert metric(mc["bad"], "kvlink_blocks_streamed_total") > streamed0, "the corrupting decode read no piece"
    assert all(g != w for g, w in zip(got, want)), got
