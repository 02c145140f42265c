"""A hybrid Mamba model (NemotronH: Mamba2 and attention layers alternate) through prefill and decode engines
in one process.

vLLM builds a MambaSpec group (one state block per request: conv state, then SSM state, in a page of a
buffer it shares with the attention group) and a FullAttentionSpec group. After loading a whole prompt vLLM
recomputes its last token, which would apply that token to a Mamba state twice; so prefill computes all but
the last prompt token (KVLinkScheduler.on_new_request) and decode derives the last state itself. vLLM CPU's
Mamba2 kernel fails with prefix caching on, so these engines run without it (mamba_cache_mode "none").
"""

from __future__ import annotations

import os

import pytest

from tests.vllm.helpers import Engines, corrupting_kv_config, decode, outputs, prefill, recording_kv_config, \
    token_prompts

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

LENGTHS = [3, 40, 63, 64, 65, 200, 700]
OFF = {"enable_prefix_caching": False}


@pytest.fixture(scope="module")
def engines(mamba_model):
    e = Engines(mamba_model)
    e.make("base", None, **OFF)
    e.make("pre", recording_kv_config("kv_producer"), **OFF)
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"), **OFF)
    e.make("dec_bad", corrupting_kv_config(), **OFF)
    for g in (0, 1):  # one KV cache group corrupted at a time: 0 the Mamba state, 1 attention
        e.make(f"dec_bad_g{g}", dict(corrupting_kv_config(), kv_connector=f"CorruptGroup{g}Connector"), **OFF)
    # --max-model-len sizes vLLM's Mamba block (one whole state per request): decode may allow longer prompts
    e.make("dec_long", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"),
           max_model_len=4096, **OFF)
    e.make("dec_long_bad", corrupting_kv_config(), max_model_len=4096, **OFF)
    # the SSM state in float16 on decode, bfloat16 on prefill (--mamba-ssm-cache-dtype): pages of one size
    e.make("pre_bf16", recording_kv_config("kv_producer"), mamba_ssm_cache_dtype="bfloat16", **OFF)
    e.make("base_f16", None, mamba_ssm_cache_dtype="float16", **OFF)
    e.make("dec_f16", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"),
           mamba_ssm_cache_dtype="float16", **OFF)
    yield e
    e.close()


def test_vllm_builds_a_mamba_and_an_attention_group(engines):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    cfg = engines.llms["dec"].llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    assert [type(g.kv_cache_spec) for g in cfg.kv_cache_groups] == [MambaSpec, FullAttentionSpec]
    w = engines.agents["dec"]._worker
    states = [n for n, lay in w.layouts.items() if lay.desc.startswith("state")]
    assert len(states) == 2 and all(w._layer_group[n] == 0 for n in states)


def test_outputs_equal_a_single_engine_with_every_state_and_block_pulled(engines):
    prompts = token_prompts(LENGTHS, seed=41)
    want = outputs(engines, "base", prompts)
    params = prefill(engines, [list(p) for p in prompts])  # prefill shortens its request's prompt in place
    agent = engines.agents["dec"]
    problems = []
    for p, w, kp in zip(prompts, want, params):
        assert kp["remote_num_tokens"] == len(p) - 1  # prefill left the last prompt token to decode
        assert len(kp["remote_block_ids"]) == 2  # a table per group
        before = agent.recorded_now()
        got = decode(engines, "dec", [p], [kp])[0]
        after = agent.recorded_now()
        ok, failed = after["pulls_ok"] - before["pulls_ok"], after["pulls_failed"] - before["pulls_failed"]
        if got != w or ok != 1 or failed:
            problems.append(f"{len(p)} tokens: output {'ok' if got == w else got} (want {w}), pulls ok {ok}, "
                            f"failed {failed}")
    assert not problems, "\n".join(problems)


def test_a_decode_with_another_max_model_len_pulls_the_state_and_kv(engines):
    """vLLM sizes a Mamba group's block by --max-model-len (2048 on prefill, 4096 here): the state and the
    attention KV are laid out alike, so decode pulls them (they were refused as another ``groups`` before)."""
    cfg = engines.llms["dec_long"].llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    pre = engines.llms["pre"].llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    assert cfg.kv_cache_groups[0].kv_cache_spec.block_size != pre.kv_cache_groups[0].kv_cache_spec.block_size
    prompts = token_prompts([65, 700], seed=47)
    want = outputs(engines, "base", prompts)
    agent = engines.agents["dec_long"]
    before = agent.recorded_now()
    got = decode(engines, "dec_long", prompts, prefill(engines, [list(p) for p in prompts]))
    after = agent.recorded_now()
    assert (after["pulls_ok"] - before["pulls_ok"], after["pulls_failed"] - before["pulls_failed"]) == (2, 0)
    assert got == want
    # control: the same decode with what it pulled corrupted answers otherwise
    assert decode(engines, "dec_long_bad", prompts[1:], prefill(engines, [list(p) for p in prompts[1:]])) != want[1:]


def test_a_decode_whose_ssm_state_is_another_dtype_is_refused_and_computes(engines):
    """vLLM CPU hands kvlink a Mamba layer's page as bytes, so the page's size is all its layout says: an SSM
    state in float16 on decode against bfloat16 on prefill fills pages of one size. The group's spec names
    each state's shape and dtype (``groups``): refused at first contact, nothing read, and decode answers
    as its own single engine."""
    prompts = token_prompts([300, 700], seed=48)
    lays = [engines.agents[n]._worker.layouts["model.layers.0.mixer"].desc for n in ("pre_bf16", "dec_f16")]
    assert lays[0] == lays[1]  # the bytes alone do not tell them apart
    want = outputs(engines, "base_f16", prompts)
    agent = engines.agents["dec_f16"]
    before = agent.recorded_now()
    got = decode(engines, "dec_f16", prompts, prefill(engines, [list(p) for p in prompts], name="pre_bf16"))
    after = agent.recorded_now()
    assert after.get("compat_refused.groups", 0) - before.get("compat_refused.groups", 0) == len(prompts)
    assert after.get("pulls_ok", 0) == before.get("pulls_ok", 0)
    assert got == want


def test_corrupted_state_and_kv_change_the_output(engines):
    prompts = token_prompts([300], seed=42)
    want = outputs(engines, "base", prompts)
    assert decode(engines, "dec_bad", prompts, prefill(engines, [list(p) for p in prompts])) != want


@pytest.mark.parametrize("group", [0, 1])
def test_corrupting_only_the_state_or_only_the_attention_kv_changes_the_output(engines, group):
    """Group 0 is the Mamba state (one block per request), group 1 the attention KV: each pulled on its
    own is what decode continues from."""
    prompts = token_prompts([300], seed=44 + group)
    want = outputs(engines, "base", prompts)
    assert decode(engines, f"dec_bad_g{group}", prompts, prefill(engines, [list(p) for p in prompts])) != want


def test_the_state_matters_and_a_failed_pull_recomputes(engines):
    """Without the pulled state (a failed pull: nothing moved) decode recomputes the whole prompt and still
    answers right; the engine keeps serving (failures are reported per request with several groups)."""
    prompts = token_prompts([120], seed=43)
    want = outputs(engines, "base", prompts)
    params = dict(prefill(engines, [list(p) for p in prompts])[0], remote_engine_id="no-such-engine")
    agent = engines.agents["dec"]
    before = agent.recorded_now()
    assert decode(engines, "dec", prompts, [params]) == want
    assert agent.recorded_now()["pulls_failed"] - before["pulls_failed"] == 1
