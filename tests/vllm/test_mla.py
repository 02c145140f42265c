"""MLA (a tiny DeepSeek-V2: one 512 + 64 latent per token and layer, no K/V split) through real vLLM engines in
one process: decode's output equals a single engine's, with the KV moved straight and through host staging
on both sides; a negative control corrupts the pulled latents and the output changes."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tests.vllm.helpers import (BLOCK, Engines, corrupting_kv_config, decode, greedy, prefill, recording_kv_config,
                                token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

LENGTHS = [BLOCK // 3, BLOCK * 2, BLOCK * 9 + 5]
STAGED = dict(staging="always", staging_pool_mb=4)


@pytest.fixture(scope="session")
def mla_model() -> str:
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("mla"))


@pytest.fixture(scope="module")
def engines(mla_model):
    e = Engines(mla_model)
    e.make("base", None)
    e.make("chunked", None, max_num_batched_tokens=63, max_num_seqs=8)  # the oracle's own check, below
    e.make("pre", recording_kv_config("kv_producer"))
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"))
    e.make("dec_bad", corrupting_kv_config())
    e.make("pre_staged", recording_kv_config("kv_producer", **STAGED))
    e.make("dec_staged", dict(recording_kv_config("kv_consumer", **STAGED), kv_load_failure_policy="recompute"))
    yield e
    e.close()


def mla_block(engines) -> int:
    """Tokens per block of the MLA cache as vLLM built it: the engines ask for 32; vLLM CPU takes that on
    some machines and forces 16 on others (seen: with and without AMX)."""
    return next(iter(engines.agents["pre"]._worker.kv_caches.values())).shape[2]


def want(engines, prompts):
    return [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]


def stable(engines, prompts) -> list[bool]:
    """Per prompt: whether vLLM's own greedy output survives computing the prompt in other chunks.

    vLLM's MLA computes a token in a chunk of one (what a PD decode does with the last prompt token) with
    other rounding than in a whole-prompt pass (its prefill and decode paths), and with random weights that
    sometimes flips a near-tie, with no connector involved. Decode's output is held to a single engine's
    only where vLLM itself is stable; the latents are compared byte for byte everywhere."""
    chunked = [list(engines.generate("chunked", [p], greedy())[0].outputs[0].token_ids) for p in prompts]
    return [c == w for c, w in zip(chunked, want(engines, prompts))]


def latents_equal(engines, pre: str, dec: str, prompt: list[int], params: dict) -> None:
    """Every prompt latent decode pulled equals prefill's, byte for byte, but the last prompt token's
    (decode recomputes that one, as vLLM does when a connector supplies the whole prompt)."""
    spec = list(engines.agents[dec].pulls.values())[-1]
    remote = params["remote_block_ids"]
    last = len(prompt) - 1
    pre_kv, dec_kv = engines.agents[pre]._worker.kv_caches, engines.agents[dec]._worker.kv_caches
    for name, t in dec_kv.items():
        for pos, lb in enumerate(spec.local_block_ids):
            # The prompt's tokens in this block (decode writes the tokens it generates after them).
            keep = [i for i in range(mla_block(engines)) if pos * mla_block(engines) + i < last]
            got, exp = t[lb][:, keep], pre_kv[name][remote[pos]][:, keep]
            assert torch.equal(got, exp), (name, pos)


def test_the_latent_cache_is_one_tensor_per_layer_without_a_kv_split(engines):
    worker = engines.agents["pre"]._worker
    t = next(iter(worker.kv_caches.values()))
    block = mla_block(engines)
    assert block in (16, BLOCK)
    assert list(t.shape[1:]) == [1, block, 576]  # vLLM CPU's MLA layout
    assert worker.layout.segments == 1 and worker.layout.segment_bytes == block * 576 * 2


def test_mla_decode_equals_baseline(engines):
    prompts = token_prompts(LENGTHS * 2, seed=51)
    params = prefill(engines, prompts)
    before = engines.agents["dec"].recorded_now()
    ok = stable(engines, prompts)
    assert sum(ok) >= len(prompts) // 2, "vLLM's own MLA output is too unstable here for an output oracle"
    expected = want(engines, prompts)
    for p, kp, w, s in zip(prompts, params, expected, ok):
        got = decode(engines, "dec", [p], [kp])[0]
        latents_equal(engines, "pre", "dec", p, kp)
        if s:
            assert got == w
    after = engines.agents["dec"].recorded_now()
    assert after["pulls_ok"] - before.get("pulls_ok", 0) == len(prompts)
    block = mla_block(engines)
    blocks = 2 * sum(-(-n // block) for n in LENGTHS)
    assert after["bytes_pulled"] - before.get("bytes_pulled", 0) == blocks * 2 * block * 576 * 2


def test_mla_corrupted_latents_change_output(engines):
    prompts = token_prompts([BLOCK * 6], seed=52)
    params = prefill(engines, prompts)
    assert decode(engines, "dec_bad", prompts, params) != want(engines, prompts)


def test_mla_staged_on_both_sides_equals_baseline(engines):
    import time

    prompts = token_prompts(LENGTHS * 2, seed=53)
    params = prefill(engines, prompts, name="pre_staged")
    planner = engines.scheduler_side("pre_staged")._planner
    deadline = time.monotonic() + 20
    while planner.busy():  # one process: the prefill engine stages only when it steps
        assert time.monotonic() < deadline
        engines.generate("pre_staged", token_prompts([4], seed=99), greedy(1))
    ok = stable(engines, prompts)
    assert sum(ok) >= len(prompts) // 2, "vLLM's own MLA output is too unstable here for an output oracle"
    got = decode(engines, "dec_staged", prompts, params)
    assert [g for g, s in zip(got, ok) if s] == [w for w, s in zip(want(engines, prompts), ok) if s]
    assert engines.agents["dec_staged"].recorded_now()["bytes_landed"] > 0
