"""Pipeline parallelism with a hybrid Mamba model whose stages hold different kinds of KV cache layer, through
real vLLM: NemotronH "M***" at ``--pipeline-parallel-size 2`` puts a Mamba2 layer and an attention layer on
stage 0 and attention only on stage 1. Both stages register under one engine id, so their compatibility hash
must not depend on which kinds of layer a stage holds; each layer's own layout (the Mamba state's parts, the
attention block) is compared layer by layer where decode reads it (contact.py).

Checked: the PP=2 server and a PP=1 server of the same model answer alike on their own (the oracle); a
request prefilled on either and decoded on the other answers as the PP=1 server does alone, with blocks
pulled and no pull failed (a failed pull is recomputed and would hide a wrong mapping); the negative control:
noise written over what decode pulled changes the answers, both ways. vLLM CPU runs PP with the model
compiled only (test_pp.py), and its Mamba2 kernel without prefix caching (test_mamba.py).
"""

from __future__ import annotations

import pytest

from tests.ports import free_port
from tests.vllm.helpers import Server, complete, kv_config, metric, text, token_prompts

LENGTHS = [20, 64, 300, 301]
ARGS = ("--no-enable-prefix-caching", "--dtype", "float32")


def _server(model, tmp_path, name: str, pp: int, cpu, bport: int) -> Server:
    kv = kv_config("kv_both", transport_backend="tcp", engine_lease_s=120.0, bootstrap_host="127.0.0.1",
                   bootstrap_port=bport, lookup_wait_s=10.0, pull_timeout_s=60.0)
    kv.update(kv_connector="SwitchedCorruptingConnector", kv_connector_module_path="tests.fakes_connector",
              kv_load_failure_policy="recompute")
    flag = tmp_path / f"{name}.corrupt"
    srv = Server(model, kv, cpu=cpu, log=tmp_path / f"{name}.log", eager=False,
                 extra_args=(*ARGS, "--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "mp"),
                 env={"KVLINK_TEST_CORRUPT_WHILE": str(flag)})
    srv.flag = flag
    return srv


@pytest.fixture(scope="module")
def mamba_pp_model() -> str:
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("mamba_pp"))


@pytest.fixture(scope="module")
def servers(mamba_pp_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp_mamba")
    pp2 = _server(mamba_pp_model, tmp, "pp2", 2, "0|1", free_port())
    pp1 = _server(mamba_pp_model, tmp, "pp1", 1, 1, free_port())
    try:
        pp2.wait_ready(400)
        pp1.wait_ready(400)
        yield pp2, pp1
    finally:
        pp2.stop()
        pp1.stop()


def _handed(pre: Server, dec: Server, prompt: list[int]) -> str:
    params = complete(pre.url, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
    return text(complete(dec.url, prompt, params, timeout=120))


def test_stages_of_different_layer_kinds_hand_requests_to_a_pp1_engine_both_ways(servers):
    pp2, pp1 = servers
    prompts = token_prompts(LENGTHS, seed=93)
    own2 = [text(complete(pp2.url, p)) for p in prompts]
    own1 = [text(complete(pp1.url, p)) for p in prompts]
    assert own2 == own1
    assert len(set(own1)) == len(own1)
    pulled = (metric(pp1, "kvlink_blocks_pulled_total"), metric(pp2, "kvlink_blocks_pulled_total"))
    for p, w in zip(prompts, own1):
        assert _handed(pp2, pp1, p) == w  # PP=1 decode reads the state and KV from stage 0, KV from stage 1
        assert _handed(pp1, pp2, p) == w  # each PP=2 decode stage reads its own layers from the one rank
    assert metric(pp1, "kvlink_blocks_pulled_total") > pulled[0]
    assert metric(pp2, "kvlink_blocks_pulled_total") > pulled[1]
    assert metric(pp1, "kvlink_pulls_failed_total") == 0 and metric(pp2, "kvlink_pulls_failed_total") == 0


def test_noise_over_the_pulled_state_and_kv_changes_the_answers(servers):
    pp2, pp1 = servers
    prompts = token_prompts([64, 300], seed=94)
    own = [text(complete(pp1.url, p)) for p in prompts]
    pp1.flag.touch()
    pp2.flag.touch()
    try:
        assert all(_handed(pp2, pp1, p) != w for p, w in zip(prompts, own))
        assert all(_handed(pp1, pp2, p) != w for p, w in zip(prompts, own))
    finally:
        pp1.flag.unlink()
        pp2.flag.unlink()
