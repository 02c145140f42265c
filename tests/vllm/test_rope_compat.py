"""Two engines of the same model path whose keys are rotated differently (``hf_overrides``: another
``rope_theta``), through real vLLM engines in one process: decode refuses prefill at first contact (compat
field ``rope``) and computes the prompt itself, where reading prefill's keys would answer wrong; an
engine with the same rotary settings pulls and answers as a single engine. Another override that changes
the hidden states (the norm's epsilon) is refused as ``weights``. The model is the tiny preset
made position-sensitive (helpers.position_sensitive_model): the tiny one's answer hardly depends on where
its keys sit, so another rotation would not show."""

from __future__ import annotations

import os

import pytest

from tests.vllm.helpers import (BLOCK, Engines, assert_refused_and_computed, decode, greedy, position_sensitive_model,
                                prefill, recording_kv_config, token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

OTHER_ROPE = {"rope_parameters": {"rope_theta": 50.0, "rope_type": "default"}}
OTHER_EPS = {"rms_norm_eps": 0.5}


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    e = Engines(position_sensitive_model(tiny_model, tmp_path_factory.mktemp("rope") / "model"))
    e.make("base", None)
    e.make("base_other", None, hf_overrides=OTHER_ROPE)
    e.make("pre", recording_kv_config("kv_producer"))
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"))
    e.make("dec_other", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"),
           hf_overrides=OTHER_ROPE)
    e.make("base_eps", None, hf_overrides=OTHER_EPS)
    e.make("dec_eps", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"),
           hf_overrides=OTHER_EPS)
    yield e
    e.close()


def want(engines, name, prompts):
    return [list(o.outputs[0].token_ids) for o in engines.generate(name, prompts, greedy())]


def test_the_rotary_settings_are_a_compat_field(engines):
    pre, other = engines.agents["pre"]._worker, engines.agents["dec_other"]._worker
    assert '"rope_theta":10000.0' in pre.compat["rope"] and '"rope_theta":50.0' in other.compat["rope"]
    assert pre.compat_hash == engines.agents["dec"]._worker.compat_hash != other.compat_hash
    # and so are the attention kernels, read from vLLM's own layers (on CPU the ISA its kernels pack for)
    assert pre.compat["attn"].startswith("CPU_ATTN/") and pre.compat["attn"] == other.compat["attn"]


def test_decode_with_other_rotary_settings_is_refused_and_computes_the_prompt_itself(engines):
    prompts = token_prompts([BLOCK * 6, BLOCK * 2 + 3], seed=81)
    assert_refused_and_computed(engines, "dec_other", "base", "base_other", prompts, "rope")
    # the same settings: pulled, and the single engine's answer
    params = prefill(engines, prompts)
    assert decode(engines, "dec", prompts, params) == want(engines, "base", prompts)
    assert engines.agents["dec"].recorded_now()["pulls_ok"] == len(prompts)


def test_decode_with_another_norm_epsilon_is_refused_as_weights(engines):
    """``--hf-overrides`` beyond rotary settings: the same path, other hidden states, so other KV for the same
    tokens (compat.overrides_desc)."""
    assert engines.agents["dec_eps"]._worker.compat["weights"].startswith("overrides=")
    assert "weights" not in engines.agents["pre"]._worker.compat
    prompts = token_prompts([BLOCK * 6, BLOCK * 2 + 3], seed=82)
    assert_refused_and_computed(engines, "dec_eps", "base", "base_eps", prompts, "weights")
