"""A hybrid model (sliding-window and full-attention layers) through prefill and decode engines in one
process, with vLLM's hybrid KV cache manager on (KVLinkConnector is SupportsHMA).

The hybrid model's layers alternate a 64-token sliding window (layers 0 and 2) and full attention (1 and 3),
so vLLM builds two KV cache groups, a SlidingWindowSpec and a FullAttentionSpec, each with its own block
table and its own block ids. kvlink must publish both tables, pair each group's blocks by token position,
move every block of the full-attention group and only the in-window blocks of the sliding one, and write
each group's blocks into that group's layers only. Decode's null block holds noise, so reading it changes
the output.
"""

from __future__ import annotations

import os

import pytest

from tests.vllm.helpers import (BLOCK, Engines, corrupting_kv_config, decode, outputs, prefill, recording_kv_config,
                                token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

LENGTHS = [3, 40, 63, 64, 65, 96, 200, 700]
LAYERS_PER_GROUP = 2


@pytest.fixture(scope="module")
def engines(hybrid_model):
    from tests.vllm.test_sliding_window import fill_null_block

    e = Engines(hybrid_model)
    e.make("base", None)
    e.make("pre", recording_kv_config("kv_producer"))
    e.make("pre_chunked", recording_kv_config("kv_producer"), enable_chunked_prefill=True,
           max_num_batched_tokens=64)
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"))
    fill_null_block(e, "dec")
    e.make("dec_bad", corrupting_kv_config())
    for g in (0, 1):  # one KV cache group corrupted at a time
        e.make(f"dec_bad_g{g}", dict(corrupting_kv_config(), kv_connector=f"CorruptGroup{g}Connector"))
    yield e
    e.close()


@pytest.fixture
def dec_tables(engines, monkeypatch):
    """Decode's tables of each request, every group, as vLLM first hands them to the connector."""
    seen, rids = [], set()
    conn = engines.scheduler_connector("dec")
    real = conn.update_state_after_alloc

    def spy(request, blocks, num_external_tokens):
        if request.request_id not in rids:
            rids.add(request.request_id)
            seen.append(([[0 if b.is_null else b.block_id for b in g] for g in blocks.blocks], num_external_tokens))
        return real(request, blocks, num_external_tokens)

    monkeypatch.setattr(conn, "update_state_after_alloc", spy)
    return seen


def test_vllm_keeps_its_hybrid_kv_cache_manager_with_kvlink(engines):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    for name in ("pre", "dec"):
        cfg = engines.llms[name].llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        kinds = [type(g.kv_cache_spec) for g in cfg.kv_cache_groups]
        assert kinds == [SlidingWindowSpec, FullAttentionSpec], name
        groups = engines.agents[name]._worker._layer_group
        assert sorted(groups.values()) == [0, 0, 1, 1]


def test_each_group_moves_its_own_blocks_and_outputs_equal_a_single_engine(engines, dec_tables):
    prompts = token_prompts(LENGTHS, seed=31)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, prompts)
    agent = engines.agents["dec"]
    sched = engines.llms["dec"].llm_engine.engine_core.engine_core.scheduler.connector
    nudged0 = sched.recorded_now().get("pull_waits_nudged", 0)
    problems = []
    for p, w, kp in zip(prompts, want, params):
        assert isinstance(kp["remote_block_ids"][0], list) and len(kp["remote_block_ids"]) == 2  # one per group
        before = agent.recorded_now()
        got = decode(engines, "dec", [p], [kp])[0]
        after = agent.recorded_now()
        (swa, full), external = dec_tables[-1]
        end = -(-external // BLOCK)
        # From vLLM's own tables: every block of the full group, the sliding group's non-null ones.
        want_blocks = LAYERS_PER_GROUP * (sum(1 for b in full[:end] if b) + sum(1 for b in swa[:end] if b))
        moved = after["blocks_pulled"] - before["blocks_pulled"]
        # bytes: each group's blocks written into that group's layers only, nothing more
        moved_bytes = after["bytes_pulled"] - before["bytes_pulled"]
        if moved_bytes != want_blocks * agent._worker.block_bytes:
            problems.append(f"{len(p)} tokens: {moved_bytes} B pulled, {want_blocks} blocks of "
                            f"{agent._worker.block_bytes} B expected")
        if got != w or moved != want_blocks or after["pulls_ok"] - before["pulls_ok"] != 1:
            problems.append(f"{len(p)} tokens: output {'ok' if got == w else got}, blocks {moved} (vLLM's "
                            f"tables say {want_blocks}), pulls ok {after['pulls_ok'] - before['pulls_ok']}")
        if len(p) > 200:
            assert sum(1 for b in swa[:end] if b) < sum(1 for b in full[:end] if b)  # the window is smaller
    assert not problems, "\n".join(problems)
    # Sequential pulls too: decode's empty steps waited and the worker's nudge ended the waits (stepping back
    # to back, the engine took the GIL from the worker's threads in this one process: leases expired).
    assert sched.recorded_now().get("pull_waits_nudged", 0) > nudged0


def test_chunked_prefill_then_pull(engines):
    prompts = token_prompts([200, 700], seed=32)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, prompts, name="pre_chunked")
    assert decode(engines, "dec", prompts, params) == want


def test_corrupted_kv_changes_output(engines):
    prompts = token_prompts([300], seed=33)
    want = outputs(engines, "base", prompts)
    assert decode(engines, "dec_bad", prompts, prefill(engines, prompts)) != want


@pytest.mark.parametrize("group", [0, 1])
def test_each_groups_pulled_blocks_are_read_corrupting_one_group_changes_the_output(engines, group):
    """Noise over the pulled blocks of one KV cache group only (in that group's layers): each group's
    bytes are what decode reads, not only some group's."""
    prompts = token_prompts([300], seed=34 + group)
    want = outputs(engines, "base", prompts)
    assert decode(engines, f"dec_bad_g{group}", prompts, prefill(engines, prompts)) != want


def test_a_group_kind_kvlink_cannot_move_is_refused_naming_its_spec():
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                            MLAAttentionSpec)

    from kvlink.vllm.connector import _check_groups

    def config(*specs):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=2048, shapes=((4, 8),), dtypes=(torch.float32,))
    aligned = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align")
    assert _check_groups(config(mamba, full), staged=False) == ((None, None), (2048, 16), 1)  # state: backoff 1
    with pytest.raises(RuntimeError, match=r"mamba_cache_mode 'none'.*group 0 has mode 'align'"):
        _check_groups(config(aligned, full), staged=False)
    other = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"same tokens per block; this model's groups have \[16, 32\]"):
        _check_groups(config(full, other), staged=False)
    assert _check_groups(config(full, full), staged=False) == ((None, None), (16, 16), 0)
    with pytest.raises(RuntimeError, match="host staging moves one KV cache group; this model has 2"):
        _check_groups(config(full, full), staged=True)
    from vllm.v1.kv_cache_interface import KVCacheSpec

    class Odd(KVCacheSpec):  # a kind kvlink has never seen
        pass

    with pytest.raises(RuntimeError, match=r"cannot move KV cache group 1 \(Odd"):
        _check_groups(config(full, Odd(block_size=16)), staged=False)
    assert MLAAttentionSpec  # MLA is a FullAttentionSpec: accepted (tests/vllm/test_mla.py)


def test_a_failed_pull_is_reported_per_request_and_the_engine_keeps_serving(engines):
    """With several KV cache groups vLLM stops the engine on block-level load failures (a block id names a
    block within its group only): kvlink reports a failed pull per request alone, and decode recomputes."""
    prompts = token_prompts([150], seed=34)
    want = outputs(engines, "base", prompts)
    params = dict(prefill(engines, prompts)[0], remote_engine_id="no-such-engine")
    agent = engines.agents["dec"]
    before = agent.recorded_now()
    assert decode(engines, "dec", prompts, [params]) == want
    assert agent.recorded_now()["pulls_failed"] - before["pulls_failed"] == 1
    assert decode(engines, "dec", prompts, prefill(engines, prompts)) == want  # and serves the next one
