"""Data parallelism with a Mixture-of-Experts model through real vLLM: the DP ranks run in lock-step.

With a dense model vLLM runs DP ranks as independent engines (tests/vllm/test_dp.py). With a MoE model every
forward is collective: each MoE layer gathers all ranks' tokens (``all_gatherv``) and scatters the experts'
sums back (``reduce_scatterv``), so a DP coordinator keeps the ranks in step and a rank with nothing to
compute (idle, or whose only request waits for remote KV) runs a dummy forward alongside the busy one.
Here kvlink's connector meets that: a decode request waiting for its pull on one rank while the other rank
prefills, dummy batches on the idle rank, concurrent pulls on both ranks.

vLLM CPU 0.32 lacks those two collectives (its CpuCommunicator raises NotImplementedError; vLLM's GPU
communicator has them): the server runs with tests/vllm/moe_dp_shim/ on its PYTHONPATH, a test-only
sitecustomize that implements them with gloo collectives. The first test checks that the DP server's own
answers (no params) equal a single non-DP server's, so the shim computes the model; each test also checks
from the log that the shim carried the MoE forwards of both ranks.

Model: the "moe" preset of kvlink/demo/tiny_model.py (DeepSeek-V2 MLA, layer 0 dense, layer 1 MoE with 4
routed experts and a shared one; MLA forces 16-token blocks on CPU). Server and checks are test_dp.py's:
``kv_role="kv_both"``, both DP ranks prefill (engine ids ``_dp0`` / ``_dp1``), answers equal the server's
own, the concurrent proxy streams, and a negative control whose connector corrupts what it pulled.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.vllm.helpers import ROOT, Server, complete, concurrent_proxy, metric, text, token_prompts
from tests.vllm.test_dp import LENGTHS, both_ranks_stream, corrupted_answers_differ, dp_server

SHIM = ROOT / "tests" / "vllm" / "moe_dp_shim"


@pytest.fixture(scope="module")
def moe_model() -> str:
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("moe"))


def shim_env() -> dict:
    """The server's PYTHONPATH as Server builds it, the shim first (its sitecustomize runs tools/nospin's)."""
    return {"PYTHONPATH": os.pathsep.join((str(SHIM), str(ROOT / "tools" / "nospin"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")))}


def assert_shim_carried_both_ranks(srv) -> None:
    """Two worker processes (the DP ranks) each ran both patched collectives: the MoE path was taken."""
    log = srv.log.read_text(errors="replace")
    for name in ("all_gatherv", "reduce_scatterv"):
        pids = set(re.findall(rf"moe_dp_shim: CpuCommunicator\.{name} used \(pid (\d+)\)", log))
        assert len(pids) == 2, (name, pids)


def test_moe_dp2_both_ranks_prefill_and_decode_as_a_single_server(moe_model, tmp_path):
    prompts = token_prompts(LENGTHS, seed=80)
    single = Server(moe_model, None, cpu=1, log=tmp_path / "single.log")  # no DP, no shim, no connector
    try:
        single.wait_ready(300)
        oracle = [text(complete(single.url, p)) for p in prompts]
    finally:
        single.stop()
    srv, bport = dp_server(moe_model, tmp_path, "moe-dp2", env=shim_env())
    proxy = concurrent_proxy(srv.url, srv.url, bport)  # no engine id: vLLM picks the DP rank
    try:
        want, params, engines = [], [], set()
        for p in prompts:  # one request at a time: the other rank is idle (dummy forwards) or waits for KV
            want.append(w := text(complete(srv.url, p)))
            kp = complete(srv.url, p, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
            # vLLM suffixes the DP rank ("<id>_dp1") and keeps the DP size for a MoE model's ranks: kvlink
            # used to append it again ("<id>_dp1-dp1")
            eid = kp["remote_engine_id"]
            assert "-dp" not in eid, eid
            engines.add(re.fullmatch(r".+_dp(\d)", eid).group(1))
            assert kp["remote_bootstrap_addr"] == f"http://127.0.0.1:{bport}"  # rank 1 publishes to rank 0's
            assert text(complete(srv.url, p, kp)) == w
        assert want == oracle  # the DP server (through the shim) answers as a single server
        assert len(set(want)) > 1  # the prompts' answers differ: a pull of the wrong KV would show
        assert engines == {"0", "1"}, engines  # both DP ranks were prefill
        pulled = metric(srv, "kvlink_blocks_pulled_total")
        assert pulled > 0
        assert_shim_carried_both_ranks(srv)

        # Concurrent: every prompt prefilled at once, then all decoded at once, both ranks pulling in the same
        # steps. vLLM CPU's bf16 answers depend on the batch: the 450-token prompt's answer changes with what it
        # is batched with (3 different answers seen, on a single non-DP server with no connector too). Judged:
        # the prompts whose answer is the same alone and batched without params (all others here).
        with ThreadPoolExecutor(len(prompts)) as ex:
            def together(kps):
                return list(ex.map(lambda a: text(complete(srv.url, a[0], a[1], timeout=120)), zip(prompts, kps)))

            batched = together([None] * len(prompts))
            params = list(ex.map(lambda p: complete(srv.url, p, {"do_remote_decode": True}, max_tokens=1,
                                                    timeout=120)["kv_transfer_params"], prompts))
            got = together(params)
        judged = [i for i, (w, b) in enumerate(zip(want, batched)) if w == b]
        assert len(judged) >= len(prompts) - 2, (want, batched)
        assert [got[i] for i in judged] == [want[i] for i in judged]
        assert metric(srv, "kvlink_blocks_pulled_total") > pulled
        both_ranks_stream(srv, proxy, prompts, want)
    finally:
        proxy.stop()
        srv.stop()


def test_moe_dp2_negative_control_corrupted_pulls_change_the_output(moe_model, tmp_path):
    srv, bport = dp_server(moe_model, tmp_path, "moe-dp2-corrupt", corrupt=True, env=shim_env())
    try:
        corrupted_answers_differ(srv, bport)
        assert_shim_carried_both_ranks(srv)
    finally:
        srv.stop()
