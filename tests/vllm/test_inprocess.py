"""Prefill and decode LLMs in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, tests.vllm.helpers.Engines), real
kvlink transport."""

from __future__ import annotations

import os

import pytest

from tests.vllm.helpers import (BLOCK, Engines, corrupting_kv_config, decode, greedy, held_requests, prefill,
                                recording_kv_config, token_prompts)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

LENGTHS = [BLOCK // 3, BLOCK * 2, BLOCK * 6 + 7]  # shorter than a block, exact multiple, several blocks


@pytest.fixture(scope="module")
def engines(tiny_model):
    e = Engines(tiny_model)
    e.make("base", None)
    e.make("pre", recording_kv_config("kv_producer"))
    e.make("dec", dict(recording_kv_config("kv_consumer"), kv_load_failure_policy="recompute"))
    e.make("pre_short", recording_kv_config("kv_producer", lease_s=1.0))
    e.make("dec_bad", corrupting_kv_config())
    yield e
    e.close()


def test_decode_equals_baseline_and_blocks_are_freed(engines):
    prompts = token_prompts(LENGTHS, seed=1)
    want = [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]
    params = prefill(engines, prompts)
    for p, kp in zip(prompts, params):
        assert kp["do_remote_prefill"] is True and kp["remote_num_tokens"] == len(p)
        assert len(kp["remote_block_ids"]) == -(-len(p) // BLOCK)
    assert len(held_requests(engines.scheduler_side("pre"))) == len(prompts)
    before = engines.agents["dec"].recorded_now()
    got = decode(engines, "dec", prompts, params)
    assert got == want
    after = engines.agents["dec"].recorded_now()
    assert after["pulls_ok"] - before["pulls_ok"] == len(prompts)
    assert after["bytes_pulled"] > before["bytes_pulled"]
    # Prefill frees the blocks once it hears they were pulled (its engine must step to notice).
    import time

    deadline = time.monotonic() + 10
    while held_requests(engines.scheduler_side("pre")) and time.monotonic() < deadline:
        engines.generate("pre", token_prompts([4], seed=99), greedy(1))
        time.sleep(0.05)
    assert held_requests(engines.scheduler_side("pre")) == {}
    assert engines.scheduler_connector("pre").recorded_now()["held_requests"] == 0  # the gauge says so too


def test_corrupted_kv_changes_output(engines):
    """Negative control: the decode output really depends on the pulled KV."""
    prompts = token_prompts([BLOCK * 4], seed=2)
    want = [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]
    params = prefill(engines, prompts)
    got = decode(engines, "dec_bad", prompts, params)
    assert got != want


def test_requests_without_params_are_untouched(engines):
    prompts = token_prompts([50, 70], seed=3)
    want = [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]
    for name in ("pre", "dec"):
        outs = engines.generate(name, prompts, greedy())
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert all(o.kv_transfer_params is None for o in outs)
    assert held_requests(engines.scheduler_side("pre")) == {}


def test_malformed_params_computed_locally_with_error(engines):
    prompts = token_prompts([40], seed=4)
    want = [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]
    bad = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1",
           "remote_block_ids": "not-a-list", "remote_engine_id": "x", "remote_request_id": "y"}
    out = engines.generate("dec", prompts, greedy(params=bad))[0]
    assert list(out.outputs[0].token_ids) == want[0]
    assert "remote_block_ids" in out.kv_transfer_params["kvlink_error"]


def test_unreachable_prefill_recomputes(engines):
    prompts = token_prompts([70], seed=5)
    want = [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]
    from tests.vllm.helpers import free_port

    dead = {"do_remote_prefill": True, "remote_bootstrap_addr": f"http://127.0.0.1:{free_port()}",
            "remote_block_ids": [1, 2, 3], "remote_engine_id": "gone", "remote_request_id": "r"}
    got = decode(engines, "dec", prompts, [dead])
    assert got == want


def test_expired_lease_frees_blocks(engines):
    import time

    engines.generate("pre_short", token_prompts([80], seed=6), greedy(1, {"do_remote_decode": True}))
    side = engines.scheduler_side("pre_short")
    assert len(held_requests(side)) == 1
    deadline = time.monotonic() + 15
    while held_requests(side) and time.monotonic() < deadline:
        engines.generate("pre_short", token_prompts([4], seed=7), greedy(1))
        time.sleep(0.2)
    assert held_requests(side) == {}
    assert engines.scheduler_connector("pre_short").recorded_now()["leases_expired"] >= 1


def test_failed_pull_reported_per_request(engines, monkeypatch):
    """vLLM >= 0.32: a failed pull reaches the scheduler as failed_recving (per request) as well as
    invalid blocks, and the request is recomputed."""
    prompts = token_prompts([100], seed=8)
    want = [list(o.outputs[0].token_ids) for o in engines.generate("base", prompts, greedy())]
    agent = engines.agents["dec"]
    seen = []
    real = agent.get_transfer_results

    def spy(finished_req_ids):
        res = real(finished_req_ids)
        seen.append(res)
        return res

    monkeypatch.setattr(agent, "get_transfer_results", spy)
    from tests.vllm.helpers import free_port

    dead = {"do_remote_prefill": True, "remote_bootstrap_addr": f"http://127.0.0.1:{free_port()}",
            "remote_block_ids": [1, 2, 3, 4], "remote_engine_id": "gone", "remote_request_id": "r-2"}
    # (not "r" again: params of a prefill request decode already released are computed, not pulled)
    assert decode(engines, "dec", prompts, [dead]) == want
    failed = set().union(*(r.failed_recving for r in seen))
    assert len(failed) == 1
    assert failed <= set().union(*(r.finished_recving for r in seen))


def test_plugin_entry_point_alone_loads_the_connector(tiny_model, tmp_path):
    """In a fresh process, "kv_connector": "KVLinkConnector" without kv_connector_module_path works only
    through the vllm.general_plugins entry point declared in pyproject.toml."""
    import json
    import subprocess
    import sys

    from tests.vllm.helpers import BASE_ENV

    script = tmp_path / "plugin_probe.py"
    script.write_text(f'''
import importlib.metadata as md, json, sys
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "kvlink.vllm.plugin:register" in eps, eps
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    kv = KVTransferConfig(kv_connector="KVLinkConnector", kv_role="kv_producer")
    assert kv.kv_connector_module_path is None
    llm = LLM(model={tiny_model!r}, dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=32 << 20,
              block_size=32, max_model_len=512, kv_transfer_config=kv)
    sp = SamplingParams(max_tokens=1, extra_args={{"kv_transfer_params": {{"do_remote_decode": True}}}})
    out = llm.generate([{{"prompt_token_ids": list(range(10, 80))}}], sp, use_tqdm=False)
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    print("RESULT " + json.dumps({{"cls": type(conn).__module__ + "." + type(conn).__name__,
                                   "params": out[0].kv_transfer_params}}))
    llm.llm_engine.engine_core.shutdown()
''')
    env = dict(BASE_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0", PATH="/usr/bin:/bin")
    env["HOME"] = str(tmp_path)  # nothing from the caller's environment: no PYTHONPATH, cwd elsewhere;
    # kvlink comes from the editable install
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads(line[len("RESULT "):])
    assert res["cls"] == "kvlink.vllm.connector.KVLinkConnector"
    assert res["params"]["do_remote_prefill"] is True and res["params"]["remote_num_tokens"] == 70


def test_n_samples_of_one_prompt_pull_its_kv_once(engines):
    """n=3 seeded sampling: vLLM makes three child requests with the same kv_transfer_params. One pulls the
    prompt; the others wait for it, find its full blocks in decode's prefix cache and pull only the last
    (partial) block; none fails or recomputes, prefill frees the request once, and the samples equal the
    same engine's computed locally."""
    import time

    from vllm import SamplingParams

    def sampling(kp=None):
        return SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True,
                              extra_args={"kv_transfer_params": kp} if kp else None)

    prompts = token_prompts([BLOCK * 5 + 9], seed=21)  # 6 block positions, the last one partial
    # computed locally by an engine of the same settings (decode's own prefix cache must not hold the prompt)
    want = sorted(list(c.token_ids) for c in engines.generate("base", prompts, sampling())[0].outputs)
    assert len({tuple(w) for w in want}) > 1  # the samples differ: each child's own seed
    layers = len(engines.agents["dec"]._worker.layer_names)
    before = engines.agents["dec"].recorded_now()
    params = prefill(engines, prompts)
    out = engines.generate("dec", prompts, sampling(params[0]))[0].outputs
    assert sorted(list(c.token_ids) for c in out) == want
    after = engines.agents["dec"].recorded_now()
    assert after["pulls_failed"] == before["pulls_failed"]
    assert after["pulls_ok"] - before["pulls_ok"] == 3
    assert after["blocks_pulled"] - before["blocks_pulled"] == (6 + 2 * 1) * layers  # whole prompt once
    deadline = time.monotonic() + 10
    while held_requests(engines.scheduler_side("pre")) and time.monotonic() < deadline:
        engines.generate("pre", token_prompts([4], seed=98), greedy(1))
        time.sleep(0.05)
    assert held_requests(engines.scheduler_side("pre")) == {}
    sched = engines.scheduler_connector("dec").recorded_now()
    assert len(engines.scheduler_side("dec")._siblings) == 0
    assert sched["released_pulled"] >= 1


def test_n_samples_decode_the_pulled_kv_and_a_corrupted_pull_changes_them(engines):
    """The seeded samples above barely depend on the prompt with this tiny random model (another prompt gives
    the same texts), so they prove the path, not the bytes. With top_k=1 (vLLM refuses n > 1 at temperature
    0) each sample is the argmax: the three equal the engine's own, and a decode that corrupts what it pulled
    answers otherwise."""
    from vllm import SamplingParams

    def sampling(kp=None):
        return SamplingParams(n=3, temperature=1.0, top_k=1, seed=1234, max_tokens=8, ignore_eos=True,
                              extra_args={"kv_transfer_params": kp} if kp else None)

    def outputs(name, prompt, kp=None):
        return sorted(list(c.token_ids) for c in engines.generate(name, [prompt], sampling(kp))[0].outputs)

    right, other = token_prompts([BLOCK * 5 + 9, BLOCK * 5 + 9], seed=23)
    assert outputs("dec", right, prefill(engines, [right])[0]) == outputs("base", right)
    assert outputs("dec_bad", other, prefill(engines, [other])[0]) != outputs("base", other)
