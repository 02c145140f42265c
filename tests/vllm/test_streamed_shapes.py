"""Streamed KV for the other model shapes that vLLM CPU serves with one full-attention KV cache group: MLA (a
tiny DeepSeek-V2, one 576-wide latent per token and layer, no K/V split, announced when its attention op
returns) and an fp8 KV cache (e4m3 bytes in uint8 tensors, per-layer K/V scales in the checkpoint).

Real servers for each shape: a prefill that streams every layer of every 64-token chunk, a decode, and a
decode whose connector corrupts whatever it pulled (the negative control, and the single server for the
baseline: a request without params pulls nothing). Decode is paired concurrently through
``kvlink proxy --mode concurrent`` and, for the same prompts, sequentially (``--mode sequential``: the
whole request published once prefill ends, nothing streamed).

Decode's output must equal the non-streamed path's for every prompt and the single server's, pieces must
have been read before prefill published, and the corrupting decode's output must change. vLLM's MLA on CPU
rounds a token computed alone (decode's path: PD decode computes the last prompt token so) otherwise than
inside a chunk, which flips near-ties of the random model with no connector involved (test_mla.py,
``stable``). So for MLA the single server is held to prompts of 64k + 1 tokens: in prefill's chunks it
computes the last token alone, as decode does, over the same context; fp8 is held to it for every prompt.

The layouts' byte-for-byte checks are tests/vllm/test_mla.py and test_fp8.py (in-process engines,
sequential pairing); this module proves streaming moves those layouts as the whole-request path does."""

from __future__ import annotations

import pytest

from tests.vllm.helpers import complete, metric, streamed_stack, text, token_prompts

ALONE = [65, 129, 257, 449]  # 64k + 1 tokens: the single server computes the last one alone, as decode does
OTHER = [7, 31, 64, 100, 230, 500]  # shorter than one block up to eight chunks


@pytest.fixture(scope="module", params=["mla", "fp8"])
def shape(request, tiny_model, tmp_path_factory):
    """(model path, server arguments, prompt lengths held to the single server) of one shape."""
    if request.param == "mla":
        from kvlink.demo.tiny_model import ensure_model

        return str(ensure_model("mla")), (), ALONE
    from tests.vllm.test_fp8 import with_kv_scales

    path = with_kv_scales(tiny_model, tmp_path_factory.mktemp("fp8") / "model", [(0.5, 0.25), (1.5, 0.75)])
    return path, ("--kv-cache-dtype", "fp8"), ALONE + OTHER


@pytest.fixture(scope="module")
def sd(shape, tmp_path_factory):
    model, args, single = shape
    with streamed_stack(model, tmp_path_factory.mktemp("streamed-shapes"), "prefill-shape", args) as st:
        yield dict(st, single=single)


def test_streamed_outputs_equal_a_single_server_and_the_whole_request_path(sd):
    lengths = ALONE + OTHER
    prompts = token_prompts(lengths, seed=60)
    sent0, streamed0 = metric(sd["pre"], "kvlink_pieces_sent_total"), metric(sd["dec"], "kvlink_blocks_streamed_total")
    got = [text(complete(sd["conc"], p, timeout=120)) for p in prompts]
    assert metric(sd["pre"], "kvlink_pieces_sent_total") > sent0, "prefill streamed no piece"
    assert metric(sd["dec"], "kvlink_blocks_streamed_total") > streamed0, "decode read no block from a piece"
    whole = [text(complete(sd["seq"], p, timeout=120)) for p in prompts]
    assert got == whole
    held = [i for i, n in enumerate(lengths) if n in sd["single"]]
    want = [text(complete(sd["bad"].url, prompts[i])) for i in held]
    assert [got[i] for i in held] == want
    assert metric(sd["dec"], "kvlink_pulls_failed_total") == 0


def test_negative_control_corrupted_stream_changes_the_output(sd):
    """Prompts whose PD output equals the single server's on either shape (64k + 1 tokens), so only the
    corrupted KV can make the outputs differ."""
    prompts = token_prompts([257, 449], seed=61)
    want = [text(complete(sd["dec"].url, p)) for p in prompts]
    streamed0 = metric(sd["bad"], "kvlink_blocks_streamed_total")
    got = [text(complete(sd["conc_bad"], p, timeout=120)) for p in prompts]
    assert metric(sd["bad"], "kvlink_blocks_streamed_total") > streamed0, "the corrupting decode read no piece"
    assert got != want
