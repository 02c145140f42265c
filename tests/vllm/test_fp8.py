"""An fp8 KV cache (vLLM's ``kv_cache_dtype`` "fp8", e4m3 in uint8 tensors) through real vLLM engines in one
process: decode's output equals a single fp8 engine's, a negative control corrupts the pulled blocks, and
an engine whose K/V scales differ from prefill's (same model path, other files) is refused at first contact
and computes the prompt itself, instead of decoding prefill's bytes with its own scales.

The model is the tiny preset with per-layer K/V scales in its checkpoint (compressed-tensors'
``kv_cache_scheme``, which vLLM CPU loads), so a scale is not the default 1.0 on either side."""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
    # (vLLM CPU's own limit, cpu_attn.py: its fp8 cache kernels are AVX-512 or AMX only; kvlink's handling
    # of fp8 scales is covered at unit level in test_tp_mapping.py and test_worker.py)
    pytest.skip("vLLM CPU runs an fp8 KV cache only on x86 with AVX-512 or AMX; this host has neither",
                allow_module_level=True)

from tests.vllm.helpers import (BLOCK, Engines, assert_refused_and_computed, corrupting_kv_config, decode, greedy,
                                prefill, recording_kv_config, token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

LENGTHS = [BLOCK // 3, BLOCK * 2, BLOCK * 6 + 7]
FP8 = dict(kv_cache_dtype="fp8")


def with_kv_scales(src: str, dst, scales: list[tuple[float, float]]) -> str:
    """A copy of model ``src`` at ``dst`` whose checkpoint holds these (K, V) scales, one pair per layer."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(f"{dst}/model.safetensors")
    for i, (k, v) in enumerate(scales):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    with open(f"{dst}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                            "symmetric": True}}
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "model"
    with_kv_scales(tiny_model, path, [(0.5, 0.25), (1.5, 0.75)])
    e = Engines(str(path))
    e.make("base", None, **FP8)
    e.make("pre", recording_kv_config("kv_producer"), **FP8)
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"), **FP8)
    e.make("dec_bad", corrupting_kv_config(), **FP8)
    # The same path, rewritten with other scales (a host with another revision of the checkpoint): the
    # engines made from now on load these; the ones above keep what they loaded.
    with_kv_scales(tiny_model, path, [(0.125, 2.0), (1.0, 1.0)])
    e.make("base_other", None, **FP8)
    e.make("dec_other", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"), **FP8)
    yield e
    e.close()


def want(engines, name, prompts):
    return [list(o.outputs[0].token_ids) for o in engines.generate(name, prompts, greedy())]


def test_the_cache_is_fp8_and_its_scales_are_the_checkpoints(engines):
    worker = engines.agents["pre"]._worker
    assert next(iter(worker.kv_caches.values())).dtype == torch.uint8  # vLLM keeps fp8 in uint8 tensors
    assert worker.compat["kv_format"] == "fp8_e4m3"
    assert sorted(worker.kv_scales.values()) == [(0.5, 0.25), (1.5, 0.75)]
    assert sorted(engines.agents["dec_other"]._worker.kv_scales.values()) == [(0.125, 2.0), (1.0, 1.0)]


def test_fp8_decode_equals_a_single_fp8_engine(engines):
    prompts = token_prompts(LENGTHS, seed=71)
    params = prefill(engines, prompts)
    before = engines.agents["dec"].recorded_now()
    assert decode(engines, "dec", prompts, params) == want(engines, "base", prompts)
    after = engines.agents["dec"].recorded_now()
    assert after["pulls_ok"] - before.get("pulls_ok", 0) == len(prompts)


def test_fp8_corrupted_blocks_change_the_output(engines):
    prompts = token_prompts([BLOCK * 6], seed=72)
    params = prefill(engines, prompts)
    assert decode(engines, "dec_bad", prompts, params) != want(engines, "base", prompts)


def test_an_engine_with_other_kv_scales_is_refused_and_computes_the_prompt_itself(engines):
    assert_refused_and_computed(engines, "dec_other", "base", "base_other",
                                token_prompts([BLOCK * 6, BLOCK * 3 + 5], seed=73), "kv_scales")
