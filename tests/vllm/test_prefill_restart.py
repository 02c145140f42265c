"""A prefill server replaced under the same engine id, with a decode that outlives it: restarted at the same
bootstrap and transport ports (a pod restarted with a fixed ``engine_id`` and ports), or rolled (a new
process registered with a shared bootstrap server while the old one still serves).

Decode keeps its connection to a prefill engine between requests. Before, the first pull after such a
restart went to the kept peer, whose reconnect heard the new process's name and failed the pull
(``engine_changed``): with ``kv_load_failure_policy`` "fail" (lock-step needs it) a client request failed
on every decode rank after every prefill restart. Now decode sees the kept peer stale (the old process's
connections closed), asks for the engine's ranks again and reads the new process.
"""

from __future__ import annotations

import contextlib

from tests.vllm.helpers import Server, complete, free_port, http_json, kv_config, text, token_prompts

ENGINE = "prefill-restart"
# A failed pull is a failed request, not a silent recompute.
DECODE_KV = dict(kv_config("kv_consumer", transport_backend="tcp", lookup_wait_s=10.0), kv_load_failure_policy="fail")


def _prefill_kv(**extra) -> dict:
    return dict(kv_config("kv_producer", transport_backend="tcp", lease_s=30.0, **extra), engine_id=ENGINE)


@contextlib.contextmanager
def _servers(model: str, logs, pre_kv: dict):
    """A prefill (``pre_kv``) and a decode (DECODE_KV) server, ready; every server in the list is stopped
    after (the test appends the ones it starts)."""
    pre = Server(model, pre_kv, cpu=0, log=logs / "prefill-1.log")
    dec = Server(model, DECODE_KV, cpu=1, log=logs / "decode.log")
    servers = [pre, dec]
    try:
        pre.wait_ready()
        dec.wait_ready()
        yield pre, dec, servers
    finally:
        for s in servers:
            s.stop()


def _pd(pre: Server, dec: Server, prompt: list[int]) -> str:
    """Sequential pairing by hand: prefill computes and publishes, decode pulls with its params."""
    status, out = http_json(pre.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, out
    return text(complete(dec.url, prompt, out["kv_transfer_params"], timeout=120))


def test_the_first_request_after_a_prefill_restart_is_pulled_from_the_new_process(tiny_model, tmp_path):
    bport, tport = free_port(), free_port()
    pre_kv = _prefill_kv(bootstrap_port=bport, transport_port=tport)
    with _servers(tiny_model, tmp_path, pre_kv) as (pre, dec, servers):
        prompts = token_prompts([120, 150, 90], seed=41)
        # Computed on prefill without params (on decode they would fill its prefix cache: nothing to pull).
        want = [text(complete(pre.url, p)) for p in prompts]
        assert _pd(pre, dec, prompts[0]) == want[0]
        pre.kill()  # SIGKILL: nothing unregistered; its connections close
        pre = Server(tiny_model, pre_kv, cpu=0, log=tmp_path / "prefill-2.log")  # same id and ports
        servers.append(pre)
        pre.wait_ready()
        assert _pd(pre, dec, prompts[1]) == want[1]
        assert _pd(pre, dec, prompts[2]) == want[2]
        assert (dec.metric("kvlink_pulls_failed_total") or 0) == 0
        assert dec.metric("kvlink_pulls_ok_total") == 3  # every answer came from pulled KV
        assert dec.metric("kvlink_remote_refreshed_total") == 1  # once, at the first pull after the restart


def test_a_rolling_restart_is_read_from_the_new_process_while_the_old_one_still_serves(tiny_model, tmp_path):
    """A standalone bootstrap server; the new prefill registers under the old one's engine id while the old
    one keeps serving (Kubernetes' default rolling update). Decode's connections to the old process are not
    stale: only the launch the new process's params name (``remote_launch``) tells decode to look the
    ranks up again. Before, decode read the new process's block ids in the old process's memory: fluent,
    wrong tokens. The old process's own publishes are refused by the server, so decode computes those."""
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    try:
        pre_kv = _prefill_kv(bootstrap_url=srv.url)
        with _servers(tiny_model, tmp_path, pre_kv) as (old, dec, servers):
            prompts = token_prompts([120, 150, 90], seed=43)
            want0 = text(complete(old.url, prompts[0]))
            assert _pd(old, dec, prompts[0]) == want0
            new = Server(tiny_model, pre_kv, cpu=0, log=tmp_path / "prefill-2.log")  # the old one keeps serving
            servers.append(new)
            new.wait_ready()
            # Computed on the new process (the old one never saw them: its blocks at those ids hold other KV).
            want = [text(complete(new.url, p)) for p in prompts[1:]]
            assert _pd(new, dec, prompts[1]) == want[0]
            assert dec.metric("kvlink_pulls_ok_total") == 2
            assert dec.metric("kvlink_remote_refreshed_total") == 1
            # The old process still answers; the server refuses its publish, so decode computes the prompt.
            assert _pd(old, dec, prompts[2]) == want[1]
            assert dec.metric("kvlink_pulls_ok_total") == 2
            assert (dec.metric("kvlink_pulls_failed_total") or 0) == 0
    finally:
        srv.stop()
