"""Data parallelism through real vLLM: one server with ``--data-parallel-size 2`` and ``kv_role="kv_both"``
hands requests to itself. vLLM runs a dense model's DP ranks as independent engines (engine ids suffixed
``_dp0`` / ``_dp1``) and spreads requests over them, so a decode on one DP rank pulls from the prefill of
the other as often as from its own.

The bootstrap and transport ports are fixed, as a deployment behind the concurrent proxy sets them: DP
rank 0's embedded bootstrap server listens there and rank 1 publishes to it, and DP rank d's transport
listens on transport_port + d (before, rank 1 tried to listen on both of rank 0's ports and the server
failed to start). Checked: answers equal the server's own without params (a single server),
sequential pairing with both DP ranks as prefill, concurrent pairing streamed through
``kvlink proxy --mode concurrent`` (one ``--prefill-bootstrap`` for both ranks, no engine id: the rank that
takes the request is vLLM's choice), and a negative control whose connector corrupts what it pulled.

Two engines on the 2-core test machine: each gets both cores (``VLLM_CPU_OMP_THREADS_BIND`` "0|1").
"""

from __future__ import annotations

from tests.ports import free_port
from tests.vllm.helpers import Server, complete, concurrent_proxy, kv_config, metric, text, token_prompts

DP_ARGS = ("--data-parallel-size", "2", "--no-enable-prefix-caching",  # decode pulls, never hits its own cache
           "--max-num-batched-tokens", "64")  # prefill in chunks: streamed pieces before the last one
LENGTHS = [20, 64, 300, 301, 302, 303, 450, 451]


def dp_server(model: str, tmp_path, name: str, corrupt: bool = False, env: dict | None = None) -> tuple[Server, int]:
    """``env``: more environment of the server (tests/vllm/test_dp_moe.py: its collectives shim)."""
    bport, tport = free_port(), free_port(2)
    kv = kv_config("kv_both", transport_backend="tcp", engine_lease_s=120.0, bootstrap_host="127.0.0.1",
                   bootstrap_port=bport, transport_port=tport, stream_kv=True, lookup_wait_s=10.0,
                   pull_timeout_s=60.0)
    if corrupt:  # tests/fakes_connector.py: noise over every block it pulled
        kv.update(kv_connector="CorruptingConnector", kv_connector_module_path="tests.fakes_connector")
    srv = Server(model, dict(kv, kv_load_failure_policy="recompute"), cpu="0|1", log=tmp_path / f"{name}.log",
                 extra_args=DP_ARGS, env=env)
    srv.wait_ready(300)
    return srv, bport


def per_engine(srv: Server, name: str) -> dict[str, float]:
    """A kvlink series on the server's /metrics, per vLLM engine (DP rank) label."""
    import re
    import urllib.request

    with urllib.request.urlopen(srv.url + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    out: dict[str, float] = {}
    for line in lines:
        m = re.match(rf'{re.escape(name)}{{.*engine="(\d+)".*}} (\S+)$', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_dp2_both_ranks_prefill_and_decode_as_a_single_server(tiny_model, tmp_path):
    srv, bport = dp_server(tiny_model, tmp_path, "dp2")
    proxy = concurrent_proxy(srv.url, srv.url, bport)  # no engine id: vLLM picks the DP rank
    try:
        prompts = token_prompts(LENGTHS, seed=80)
        want, engines = [], set()
        for p in prompts:  # three requests a prompt: vLLM's balancer takes turns, so both ranks prefill
            want.append(w := text(complete(srv.url, p)))
            params = complete(srv.url, p, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
            engines.add(params["remote_engine_id"].rsplit("_", 1)[-1])
            assert params["remote_bootstrap_addr"] == f"http://127.0.0.1:{bport}"  # rank 1 publishes to rank 0's
            assert text(complete(srv.url, p, params)) == w
        assert engines == {"dp0", "dp1"}, engines  # both DP ranks were prefill
        assert metric(srv, "kvlink_blocks_pulled_total") > 0
        both_ranks_stream(srv, proxy, prompts, want)
    finally:
        proxy.stop()
        srv.stop()


def both_ranks_stream(srv: Server, proxy, prompts, want: list[str]) -> None:
    """Through the concurrent proxy, streamed, each prompt answers ``want``; each DP rank streamed pieces
    (per engine label), blocks were pulled and none failed (a failed pull is recomputed: it would hide
    wrong KV)."""
    pulled = metric(srv, "kvlink_blocks_pulled_total")
    sent0 = per_engine(srv, "kvlink_pieces_sent_total")
    for p, w in zip(prompts, want):  # with a plain request before each: both ranks take turns as prefill
        assert text(complete(srv.url, p)) == w
        assert text(complete(proxy.url, p, timeout=120)) == w
    sent = per_engine(srv, "kvlink_pieces_sent_total")
    assert all(sent[e] > sent0.get(e, 0.0) for e in ("0", "1")), (sent0, sent)  # each rank streamed
    assert metric(srv, "kvlink_blocks_pulled_total") > pulled
    assert metric(srv, "kvlink_pulls_failed_total") == 0, "a pull failed (decode recomputed the prompt)"


def test_dp2_negative_control_corrupted_pulls_change_the_output(tiny_model, tmp_path):
    srv, bport = dp_server(tiny_model, tmp_path, "dp2-corrupt", corrupt=True)
    try:
        corrupted_answers_differ(srv, bport)
    finally:
        srv.stop()


def corrupted_answers_differ(srv: Server, bport: int) -> None:
    """On a server whose connector corrupts what it pulled: handed over by params, and through the
    concurrent proxy (streamed), every answer differs from the server's own."""
    proxy = concurrent_proxy(srv.url, srv.url, bport)  # no engine id: vLLM picks the DP rank
    try:
        prompts = token_prompts([300, 450], seed=81)
        want = [text(complete(srv.url, p)) for p in prompts]
        params = [complete(srv.url, p, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
                  for p in prompts]
        got = [text(complete(srv.url, p, k)) for p, k in zip(prompts, params)]
        assert all(g != w for g, w in zip(got, want)), got
        prompts = token_prompts([301, 451], seed=82)
        want = [text(complete(srv.url, p)) for p in prompts]
        got = [text(complete(proxy.url, p, timeout=120)) for p in prompts]
        assert all(g != w for g, w in zip(got, want)), got
    finally:
        proxy.stop()
