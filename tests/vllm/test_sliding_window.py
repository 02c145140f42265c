"""A sliding-window model through prefill and decode engines in one process (issue 9).

Every layer of the swa model attends to the last 64 tokens, so vLLM builds one KV cache group of
SlidingWindowSpec and its block tables hold the null block (id 0) at positions outside the window. Decode's
table for a long prompt is mostly null: kvlink must pair decode's and prefill's blocks by token position and
move only the blocks decode will read. Each prompt is decoded alone so that a wrong one is named, with the
numbers that tell why. A second prefill engine runs chunked prefill with a small token budget, so that vLLM
frees prefill's out-of-window blocks while it prefills and prefill's own table holds nulls too.

Decode's null block holds noise: vLLM never writes it, so it would hold zeros, and this tiny model can decode
the same tokens from zeros where a window's KV should be. With noise, reading a null block changes the output.
"""

from __future__ import annotations

import os

import pytest

from tests.vllm.helpers import (BLOCK, Engines, corrupting_kv_config, decode, outputs, prefill,
                                recording_kv_config, token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

WINDOW = 64
LAYERS = 2
# Inside one block, up to the window, one past it, then far beyond it (most of the table null).
LENGTHS = [3, 40, 63, 64, 65, 96, 200, 700]
# P = W-1 (mod BLOCK) with P >= W+BLOCK-1: the prompt's last token, which decode recomputes, attends back to
# position P-W, the last one of its block (test_window_of_the_recomputed_last_token).
EDGE_LENGTHS = [95, 127]
# Chunked prefill: a token budget of two blocks per step, so a long prompt takes many steps.
CHUNK_TOKENS = 64
CHUNKED_LENGTHS = [200, 700]


@pytest.fixture(scope="module")
def engines(swa_model):
    e = Engines(swa_model)
    e.make("base", None)
    e.make("pre", recording_kv_config("kv_producer"))
    e.make("pre_chunked", recording_kv_config("kv_producer"), enable_chunked_prefill=True,
           max_num_batched_tokens=CHUNK_TOKENS)
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"))
    fill_null_block(e, "dec")
    e.make("dec_bad", corrupting_kv_config())
    # Host staging on both sides (issue 10): prefill stages only the blocks its table still holds.
    e.make("pre_staged", recording_kv_config("kv_producer", staging="always", staging_pool_mb=4))
    e.make("dec_staged", dict(recording_kv_config("kv_consumer", staging="always", staging_pool_mb=4),
                              kv_load_failure_policy="recompute"))
    fill_null_block(e, "dec_staged")
    yield e
    e.close()


def null_block(engines, name: str) -> list:
    """The engine's null block in every layer (views into its KV cache)."""
    sched = engines.llms[name].llm_engine.engine_core.engine_core.scheduler
    null = sched.kv_cache_manager.block_pool.null_block.block_id
    return [t[null] for t in engines.agents[name]._worker.kv_caches.values()]


def fill_null_block(engines, name: str) -> None:
    import torch

    gen = torch.Generator().manual_seed(7)
    for block in null_block(engines, name):
        block.copy_(torch.randn(block.shape, generator=gen) * 4)


@pytest.fixture
def dec_tables(engines, monkeypatch):
    """Decode's block table of each request as vLLM first hands it to the connector (when it allocates for
    the load; it calls again once the load is done): a list of ([block id or 0 for null, ...],
    [in the local prefix cache, ...], external tokens), in order."""
    seen, rids = [], set()
    conn = engines.scheduler_connector("dec")
    real = conn.update_state_after_alloc

    def spy(request, blocks, num_external_tokens):
        if request.request_id not in rids:
            rids.add(request.request_id)
            group = blocks.blocks[0]
            seen.append(([0 if b.is_null else b.block_id for b in group],
                         [not b.is_null and b.block_hash is not None for b in group], num_external_tokens))
        return real(request, blocks, num_external_tokens)

    monkeypatch.setattr(conn, "update_state_after_alloc", spy)
    return seen


def blocks_to_move(ids: list[int], cached: list[bool], external: int) -> tuple[int, int]:
    """(first position decode lacks, number of real blocks from there to the prompt's end): worked out from
    vLLM's own table, independently of kvlink. Blocks allocated for the load have no hash yet; a hash marks a
    local prefix-cache hit, which always comes first."""
    first = max((i + 1 for i, c in enumerate(cached) if c), default=0)
    end = -(-(first * BLOCK + external) // BLOCK)
    return first, sum(1 for b in ids[first:end] if b != 0)


def stat_delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("pulls_ok", "pulls_failed", "blocks_pulled")}


def check_pull(engines, dec_tables, prompt, want, kp, label) -> list[str]:
    """Decode one prompt on "dec"; what went wrong, if anything, as readable lines."""
    agent = engines.agents["dec"]
    before = agent.recorded_now()
    start = len(dec_tables)
    got = decode(engines, "dec", [prompt], [kp])[0]
    d = stat_delta(before, agent.recorded_now())
    if len(dec_tables) - start != 1:
        return [f"{label}: {len(dec_tables) - start} pulls seen by the connector, expected 1"]
    ids, cached, external = dec_tables[-1]
    first, real = blocks_to_move(ids, cached, external)
    problems = []
    if got != want:
        problems.append(f"{label}: decode output {got} != single engine {want}")
    if d["pulls_ok"] != 1 or d["pulls_failed"] != 0:
        problems.append(f"{label}: pulls ok {d['pulls_ok']}, failed {d['pulls_failed']}")
    if d["blocks_pulled"] != real * LAYERS:
        problems.append(f"{label}: {d['blocks_pulled']} blocks pulled, expected {real} per layer x {LAYERS}")
    if problems:
        problems.append(f"    decode table {ids}, first position to pull {first}, external tokens {external}, "
                        f"prefill table {kp.get('remote_block_ids')}")
    return problems


def test_swa_model_has_one_sliding_window_group(engines):
    """The precondition of every test below: vLLM runs the model with windowed KV (null blocks in tables)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    sched = engines.llms["dec"].llm_engine.engine_core.engine_core.scheduler
    groups = sched.kv_cache_config.kv_cache_groups
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, SlidingWindowSpec), groups
    assert groups[0].kv_cache_spec.sliding_window == WINDOW and len(groups[0].layer_names) == LAYERS


def test_decode_equals_single_engine_below_at_and_beyond_the_window(engines, dec_tables):
    prompts = token_prompts(LENGTHS, seed=21)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, prompts)
    problems = []
    for n, p, w, kp in zip(LENGTHS, prompts, want, params):
        problems += check_pull(engines, dec_tables, p, w, kp, f"{n} tokens")
    assert not problems, "\n".join(problems)
    # The test means something only if decode's tables really held null blocks for the long prompts, so
    # that moving only the window is fewer blocks than the prompt has, and the null block still holds noise.
    for n, table in zip(LENGTHS, dec_tables):
        if n >= WINDOW + 2 * BLOCK:
            assert 0 in table[0] and blocks_to_move(*table)[1] < -(-n // BLOCK), (n, table[0])
    assert all(bool(b.any()) for b in null_block(engines, "dec")), "decode's null block was overwritten"


def test_window_of_the_recomputed_last_token_is_computed_locally(engines, dec_tables):
    """P = W-1 (mod BLOCK), P >= W+BLOCK-1, the whole prompt loaded. vLLM 0.32 sizes decode's window for P
    computed tokens (get_num_skipped_tokens(P) = P-W+1, here a whole number of blocks, so the block holding
    position P-W is null in decode's table), then rewinds to P-1 to recompute the last token, whose window
    starts at P-W. Prefill has dropped that block as well (its window after P tokens starts at P-W+1), so no
    pull can fill it. kvlink refuses such a pull (decode computes the prompt itself) instead of letting the
    model attend a null block: the decode output equals the single engine's, with decode's null block full
    of noise (any read of it would change the output), and nothing is pulled."""
    from kvlink.vllm.plan import window_start_lost

    prompts = token_prompts(EDGE_LENGTHS, seed=23)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, prompts)
    agent, sched = engines.agents["dec"], engines.scheduler_connector("dec")
    for n, p, w, kp in zip(EDGE_LENGTHS, prompts, want, params):
        assert window_start_lost(n, BLOCK, WINDOW), n  # the lengths are the edge case
        before, refused = agent.recorded_now(), sched.recorded_now()["window_refusals"]
        assert decode(engines, "dec", [p], [kp])[0] == w, f"{n} tokens"
        d = stat_delta(before, agent.recorded_now())
        assert d["pulls_ok"] == 0 and d["pulls_failed"] == 0 and d["blocks_pulled"] == 0, (n, d)
        assert sched.recorded_now()["window_refusals"] == refused + 1, n
    assert not any(window_start_lost(n, BLOCK, WINDOW) for n in LENGTHS)  # the others are pulled


def test_decode_of_a_chunked_prefill_equals_single_engine(engines, dec_tables):
    """Prefill ran in chunks of CHUNK_TOKENS: vLLM retired prefill's blocks below the window step by step, so
    both tables hold nulls and only the window's blocks, at the same positions, can be paired."""
    prompts = token_prompts(CHUNKED_LENGTHS, seed=25)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, prompts, name="pre_chunked")
    problems = []
    for n, p, w, kp in zip(CHUNKED_LENGTHS, prompts, want, params):
        problems += check_pull(engines, dec_tables, p, w, kp, f"{n} tokens, chunked prefill")
    assert not problems, "\n".join(problems)
    # The test means something only if prefill really retired blocks while it ran in chunks.
    for n, kp in zip(CHUNKED_LENGTHS, params):
        ids = kp["remote_block_ids"]
        flat = ids[0] if ids and isinstance(ids[0], list) else ids
        assert 0 in flat, f"{n} tokens: prefill's table {ids} has no null block: was the prefill chunked?"


def test_pull_after_a_local_prefix_cache_hit(engines, dec_tables):
    """Decode already holds the first blocks (it computed the shared prefix itself); the pull fills only
    the positions after its hit, and the hit's in-window blocks are read as they are. (vLLM offers a
    window model's hit when the earlier prompt ended at the shared prefix; one that ran on past it was
    not offered here.)"""
    shared = token_prompts([6 * BLOCK], seed=31)[0]
    second = shared + token_prompts([20], seed=33)[0]
    assert outputs(engines, "dec", [shared]) == outputs(engines, "base", [shared])  # now in decode's cache
    want = outputs(engines, "base", [second])[0]
    kp = prefill(engines, [second])[0]
    problems = check_pull(engines, dec_tables, second, want, kp, f"{len(second)} tokens after a local hit")
    assert not problems, "\n".join(problems)
    ids, cached, _ = dec_tables[-1]
    assert any(cached), f"no local prefix-cache hit: decode table {ids}"


def test_corrupted_pull_changes_output(engines):
    """Negative control: decode's output depends on exactly the blocks the pull wrote."""
    prompts = token_prompts([700], seed=41)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, prompts)
    agent = engines.agents["dec_bad"]
    before = agent.recorded_now()
    got = decode(engines, "dec_bad", prompts, params)
    assert stat_delta(before, agent.recorded_now())["pulls_ok"] == 1
    assert got != want


def test_staged_on_both_sides_moves_only_the_window_and_decodes_equal(engines):
    """Prefill's table holds nulls outside the window: it stages only the blocks it holds and publishes the
    slot table by position; decode lands and copies only the blocks inside its window."""
    from tests.vllm.helpers import greedy

    prompts = token_prompts(LENGTHS, seed=61)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, prompts, name="pre_staged")
    planner = engines.scheduler_side("pre_staged")._planner
    while planner.busy():  # one process: the prefill engine stages only when it steps
        engines.generate("pre_staged", token_prompts([4], seed=99), greedy(1))
    staged_blocks = planner.pool.in_use
    assert staged_blocks < sum(-(-n // BLOCK) for n in LENGTHS)  # the out-of-window blocks were not staged
    agent = engines.agents["dec_staged"]
    before = agent.recorded_now()
    got = decode(engines, "dec_staged", prompts, params)
    assert got == want
    after = agent.recorded_now()
    delta = stat_delta(before, after)
    assert delta["pulls_ok"] == len(prompts) and delta["pulls_failed"] == 0
    # Every block pulled (per layer) went through the landing pool: 16 KiB per block and layer here.
    assert after["bytes_landed"] - before.get("bytes_landed", 0) == delta["blocks_pulled"] * 16 * 1024
    assert all(bool(b.any()) for b in null_block(engines, "dec_staged")), "decode's null block was overwritten"
