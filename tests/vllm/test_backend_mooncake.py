"""The connector end to end on real vLLM with the Mooncake transfer engine as
its transport backend (`transport_backend: mooncake`): the connector code is
the same; only the backend behind kvlink.backends.open_backend changes."""

from __future__ import annotations

import os

import pytest

from tests.vllm.helpers import (BLOCK, Engines, corrupting_kv_config, decode, greedy, prefill, recording_kv_config,
                                token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engines (Engines), also when run alone


@pytest.fixture(scope="module")
def mc_engines(tiny_model):
    e = Engines(tiny_model)
    e.make("base", None)
    e.make("pre", recording_kv_config("kv_producer", transport_backend="mooncake"))
    e.make("dec", dict(recording_kv_config("kv_consumer", transport_backend="mooncake"),
                       kv_load_failure_policy="recompute"))
    e.make("dec_bad", corrupting_kv_config(transport_backend="mooncake"))
    yield e
    e.close()


def test_prefill_to_decode_through_mooncake(mc_engines):
    e = mc_engines
    prompts = token_prompts([BLOCK // 2, BLOCK * 3 + 5], seed=11)
    want = [list(o.outputs[0].token_ids) for o in e.generate("base", prompts, greedy())]
    outs = e.generate("pre", prompts, greedy(1, {"do_remote_decode": True}))
    params = [o.kv_transfer_params for o in outs]
    agent = e.agents["dec"]
    assert agent._worker.engine.kind == "mooncake"
    before = agent.recorded_now()
    assert decode(e, "dec", prompts, params) == want
    after = agent.recorded_now()
    assert after["pulls_ok"] - before["pulls_ok"] == len(prompts)
    assert after["bytes_pulled"] > before["bytes_pulled"]


def test_negative_control_kv_corrupted_after_a_mooncake_pull_changes_the_output(mc_engines):
    """The equality above comes from the bytes Mooncake moved: a decode that overwrites them answers
    otherwise."""
    e = mc_engines
    prompts = token_prompts([BLOCK * 4], seed=12)
    want = [list(o.outputs[0].token_ids) for o in e.generate("base", prompts, greedy())]
    params = prefill(e, prompts)
    assert e.agents["dec_bad"]._worker.engine.kind == "mooncake"
    assert decode(e, "dec_bad", prompts, params) != want
