"""Lock-step (``stream_lockstep``, kvlink/vllm/lockstep.py) through real vLLM servers and the concurrent
proxy: decode's first step starts while prefill still computes the prompt's last layers, each of its layers
waiting for that layer's KV, and the step's end waiting for prefill's record.

Prefill is tests.fakes_connector.SlowLayersConnector (each layer of a streaming step 150 ms longer on entry
and on exit), computing 512-token chunks, so prompts of one chunk and of several stream, and lock-step
engages every time, not when this host's timing allows. Decode runs ``stream_lockstep`` with
``kv_load_failure_policy: fail``, prefix caching on (vLLM's default: an armed request's blocks enter the
cache when vLLM takes it, before their KV is confirmed; the step that takes it evicts them and waits for
the pull), and a stall
allowance large enough that it arms as soon as every position has a layer announced.

Outputs must equal a single server's; a decode whose connector overwrites each landed layer of an armed
request with noise in its step must change them (and proves lock-step engaged); the trace shows decode's
engine collecting the request before prefill published it. A prefill that dies after the last layer's
announcement fails decode's request with an error, never with tokens from KV that was not confirmed, and
decode serves on with nothing held. Prompts that share a prefix, matching each other's blocks in decode's
prefix cache, answer as a single server; an armed request vLLM has no room for holds up no other step.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import trace_lines
from tests.vllm.helpers import (Server, assert_each_streamed, complete, concurrent_proxy, free_port,
                                held_until_decode_waits, kv_config, metric, text, token_prompts, wait_for)

CHUNKS = ("--max-num-batched-tokens", "512", "--max-num-seqs", "16")
LOCKSTEP = dict(stream_lockstep=True, stream_lockstep_stall_ms=10_000, lookup_wait_s=20.0, pull_timeout_s=60.0)


def lockstep_decode(tiny_model, log, connector: str | None = None, env=None) -> Server:
    kv = dict(kv_config("kv_consumer", **LOCKSTEP), kv_load_failure_policy="fail")
    if connector:
        kv.update(kv_connector=connector, kv_connector_module_path="tests.fakes_connector")
    return Server(tiny_model, kv, cpu=1, log=log, env=env)


def slow_prefill(tiny_model, log, bport: int, engine_id: str, connector: str = "SlowLayersConnector",
                 env=None) -> Server:
    kv = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True), engine_id=engine_id,
              kv_connector=connector, kv_connector_module_path="tests.fakes_connector")
    return Server(tiny_model, kv, cpu=0, log=log, extra_args=CHUNKS, env=env)


@pytest.fixture(scope="module")
def ls(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lockstep")
    traced = {"KVLINK_TRACE": str(logs / "trace.jsonl")}
    bport, dport = free_port(), free_port()
    pre = slow_prefill(tiny_model, logs / "prefill.log", bport, "prefill-ls", env=traced)
    dying = slow_prefill(tiny_model, logs / "prefill-dying.log", dport, "prefill-dying", "DyingLayersConnector")
    dec = lockstep_decode(tiny_model, logs / "decode.log", env=traced)
    bad = lockstep_decode(tiny_model, logs / "corrupt.log", "LockstepCorruptingConnector")
    plain = Server(tiny_model, None, cpu=1, log=logs / "plain.log")
    servers, proxies = [pre, dying, dec, bad, plain], []
    try:
        for s in servers:
            s.wait_ready()

        def proxy(prefill, port, engine_id, decode):
            proxies.append(concurrent_proxy(prefill.url, decode.url, port, engine_id))
            return proxies[-1].url

        yield {"pre": pre, "dec": dec, "bad": bad, "plain": plain, "trace": logs / "trace.jsonl",
               "pd": proxy(pre, bport, "prefill-ls", dec), "pd_bad": proxy(pre, bport, "prefill-ls", bad),
               "pd_dying": proxy(dying, dport, "prefill-dying", dec), "dying": dying, "bport": bport}
    finally:
        for p in proxies:
            p.stop()
        for s in servers:
            s.stop()


def test_lockstep_outputs_equal_a_single_server_from_one_block_to_several_chunks(ls):
    """Prompts shorter than one block up to three chunks; each one armed (handed to vLLM before its KV
    landed) and confirmed at the end of its step; none failed."""
    sizes = [7, 31, 100, 500, 700, 1500]
    prompts = token_prompts(sizes, seed=80)
    want = [text(complete(ls["plain"].url, p)) for p in prompts]
    armed0, ok0 = metric(ls["dec"], "kvlink_lockstep_armed_total"), metric(ls["dec"], "kvlink_lockstep_ok_total")
    assert_each_streamed(ls["pd"], ls["pre"], ls["dec"], sizes, prompts, want)
    assert wait_for(lambda: metric(ls["dec"], "kvlink_lockstep_ok_total") - ok0 == len(sizes))
    assert metric(ls["dec"], "kvlink_lockstep_armed_total") - armed0 == len(sizes)
    assert metric(ls["dec"], "kvlink_lockstep_failed_total") == 0
    assert wait_for(lambda: metric(ls["dec"], "kvlink_pulls_in_progress") == 0)


def test_negative_control_noise_over_each_landed_layer_in_the_step_changes_the_output(ls):
    prompts = token_prompts([300, 900], seed=81)
    want = [text(complete(ls["plain"].url, p)) for p in prompts]
    got = [text(complete(ls["pd_bad"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]


def test_decode_collects_the_request_before_prefill_publishes_it(ls):
    """The point of lock-step: vLLM's scheduler on decode has the request (``recv_collected``) while prefill
    has not published it yet, and decode's step that samples the first token waited for the record."""
    prompt = token_prompts([700], seed=82)[0]
    want = text(complete(ls["plain"].url, prompt))
    start = len(trace_lines(ls["trace"]))
    assert_each_streamed(ls["pd"], ls["pre"], ls["dec"], [700], [prompt], [want])
    evs = trace_lines(ls["trace"])[start:]
    (pub,) = [e for e in evs if e["ev"] == "publish"]
    rid = next(e["rid"] for e in evs if e["ev"] == "answer" and e["transfer_id"] == pub["transfer_id"])
    (coll,) = [e for e in evs if e["ev"] == "recv_collected" and rid in e["rids"]]
    assert coll["t"] < pub["t"], "decode's engine had the request only after prefill published it"
    (done,) = [e for e in evs if e["ev"] == "pull_done" and e["rid"] == rid]
    assert done["t"] < pub["t"] and not done["failed"]


def test_prefill_dying_after_the_last_layer_fails_the_request_and_decode_serves_on(ls):
    """Decode's step began with the KV of a prefill that then died before its record: the request ends
    with an error (kv_load_failure_policy fail), not with tokens, and nothing stays held."""
    dec = ls["dec"]
    failed0 = metric(dec, "kvlink_lockstep_failed_total")
    prompt = token_prompts([700], seed=83)[0]
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(ls["pd_dying"] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with held_until_decode_waits(ls["dying"], dec, slowed=False):
            with urllib.request.urlopen(req, timeout=120) as r:
                out = json.loads(r.read())
        print("answer:", out)
        finish = out["choices"][0].get("finish_reason")
        assert finish not in ("length", "stop"), f"tokens from unconfirmed KV: {out}"
    except urllib.error.HTTPError as e:
        print("answer:", e.code, e.read()[:300])
        assert e.code >= 500
    assert wait_for(lambda: metric(dec, "kvlink_lockstep_failed_total") > failed0), "lock-step did not engage"
    assert wait_for(lambda: metric(dec, "kvlink_pulls_in_progress") == 0)
    assert wait_for(lambda: (dec.metric("vllm:kv_cache_usage_perc") or 0.0) == 0.0), "decode holds blocks"
    other = token_prompts([250], seed=84)[0]
    assert text(complete(dec.url, other, timeout=120)) == text(complete(ls["plain"].url, other))
    # the same prompt again, on decode alone: what its prefix cache kept of the failed request is right
    assert text(complete(dec.url, prompt, timeout=120)) == text(complete(ls["plain"].url, prompt))


def test_mixed_aborts_in_lockstep_leave_nothing_held(ls):
    """60 requests, 6 at a time, through the proxy; 40 clients hang up at random times, some while decode's
    step already runs the request in lock-step (the pull is stopped, and vLLM gets the blocks back only once
    the READ on the wire settled; a pull of a request whose prefill leg the proxy cancelled first may fail
    there, which vLLM reports for a request already gone). Every answer that comes back is the single
    server's; afterwards neither side holds a block or waits for a pull, and both answer correctly."""
    import concurrent.futures as cf
    import random
    import socket

    dec, pre = ls["dec"], ls["pre"]
    rng = random.Random(85)
    n = 60
    prompts = token_prompts([rng.randint(100, 900) for _ in range(n)], seed=85)
    kinds = ["client"] * 40 + ["finish"] * 20
    rng.shuffle(kinds)
    delays = [rng.uniform(0.2, 2.0) for _ in range(n)]
    armed0, cancelled0 = metric(dec, "kvlink_lockstep_armed_total"), metric(dec, "kvlink_lockstep_cancelled_total")

    def one(i):
        try:
            return text(complete(ls["pd"], prompts[i], timeout=delays[i] if kinds[i] == "client" else 180))
        except (TimeoutError, socket.timeout, OSError):
            if kinds[i] == "client":
                return None
            raise

    with cf.ThreadPoolExecutor(6) as ex:
        results = list(ex.map(one, range(n)))
    answered = [i for i, r in enumerate(results) if r is not None]
    print(f"{n - len(answered)} hung up, {len(answered)} answered; armed "
          f"{metric(dec, 'kvlink_lockstep_armed_total') - armed0:.0f}, stopped in lock-step "
          f"{metric(dec, 'kvlink_lockstep_cancelled_total') - cancelled0:.0f}")
    assert all(results[i] is not None for i in range(n) if kinds[i] != "client")
    assert [results[i] for i in answered] == [text(complete(ls["plain"].url, prompts[i])) for i in answered]
    assert metric(dec, "kvlink_lockstep_armed_total") > armed0
    assert wait_for(lambda: metric(pre, "kvlink_held_blocks") == 0), "prefill still holds blocks"
    assert wait_for(lambda: metric(dec, "kvlink_pulls_in_progress") == 0), "decode still waits for pulls"
    assert wait_for(lambda: (dec.metric("vllm:kv_cache_usage_perc") or 0.0) == 0.0), "decode holds blocks"
    other = token_prompts([450], seed=86)[0]
    assert text(complete(ls["pd"], other, timeout=120)) == text(complete(ls["plain"].url, other))


def test_a_decode_asked_for_lockstep_per_step_refuses_at_start_up(tiny_model, tmp_path):
    """The real path of a refusal: vLLM's decode, asked for lock-step with pieces per step (a layer's KV is
    never known to have landed before the step's end), does not start, and its log names the setting."""
    kv = dict(kv_config("kv_consumer", **LOCKSTEP, stream_granularity="step"), kv_load_failure_policy="fail")
    srv = Server(tiny_model, kv, cpu=1, log=tmp_path / "refused.log")
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            srv.wait_ready()
        log = srv.log.read_text(errors="replace")
        assert "stream_lockstep refused" in log and "stream_granularity" in log
    finally:
        srv.stop()


def test_prompts_sharing_a_prefix_in_decodes_prefix_cache_answer_as_a_single_server(ls):
    """Twelve requests, four at a time, whose prompts share their first 256 tokens (sixteen blocks), two of
    them the same prompt, with decode's prefix cache on: a request vLLM takes in the same step as an armed
    one may match its blocks (the step waits for that pull; the blocks then leave the cache), others match
    blocks decode computed or pulled before. Every answer is the single server's; afterwards nothing is
    held, and one of the prompts on decode alone answers right too."""
    import concurrent.futures as cf

    dec, pre = ls["dec"], ls["pre"]
    common = token_prompts([256], seed=87)[0]
    tails = token_prompts([40, 90, 130, 200, 260, 333, 17, 410, 70, 150, 90], seed=88)
    prompts = [common + t for t in tails] + [common + tails[1]]
    want = [text(complete(ls["plain"].url, p)) for p in prompts]
    shared0, failed0 = metric(dec, "kvlink_lockstep_shared_steps_total"), metric(dec, "kvlink_lockstep_failed_total")
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: text(complete(ls["pd"], p, timeout=240)), prompts))
    print(f"steps that named others' armed pulls: {metric(dec, 'kvlink_lockstep_shared_steps_total') - shared0:.0f}")
    assert got == want
    assert metric(dec, "kvlink_lockstep_failed_total") == failed0
    assert wait_for(lambda: metric(pre, "kvlink_held_blocks") == 0), "prefill still holds blocks"
    assert wait_for(lambda: metric(dec, "kvlink_pulls_in_progress") == 0), "decode still waits for pulls"
    assert wait_for(lambda: (dec.metric("vllm:kv_cache_usage_perc") or 0.0) == 0.0), "decode holds blocks"
    assert text(complete(dec.url, prompts[3], timeout=120)) == want[3]


def test_an_armed_request_vllm_has_no_room_for_holds_up_no_other_step(ls, tiny_model, tmp_path):
    """A decode with room for two running requests: two long generations hold both slots while a PD request
    is armed. vLLM cannot take it (its blocks are not in the prefix cache yet), so no step of the two
    generations waits for its pull (``kvlink_lockstep_shared_steps`` stays put: the first version waited for
    it anyway); it is taken once a slot frees, its pull long ended. Every output, the armed request's
    included, is the single server's."""
    import concurrent.futures as cf
    import time

    LONG = 900  # tokens: the two generations outlast the armed request's prefill
    dec = Server(tiny_model, dict(kv_config("kv_consumer", **LOCKSTEP), kv_load_failure_policy="fail"), cpu=1,
                 log=tmp_path / "decode-2seqs.log", extra_args=("--max-num-seqs", "2"))
    proxy = None
    try:
        dec.wait_ready()
        proxy = concurrent_proxy(ls["pre"].url, dec.url, ls["bport"], "prefill-ls")
        longs = token_prompts([60, 70], seed=89)
        prompt = token_prompts([1200], seed=90)[0]  # three chunks: armed in the last, seconds after its pull began
        want_long = [text(complete(ls["plain"].url, p, max_tokens=LONG, timeout=300)) for p in longs]
        want = text(complete(ls["plain"].url, prompt))
        with cf.ThreadPoolExecutor(3) as ex:
            first = ex.submit(lambda: text(complete(dec.url, longs[0], max_tokens=LONG, timeout=300)))
            time.sleep(0.3)
            armed = ex.submit(lambda: text(complete(proxy.url, prompt, timeout=300)))
            assert wait_for(lambda: metric(dec, "kvlink_pulls_in_progress") >= 1, timeout=30)  # vLLM asked for it
            second = ex.submit(lambda: text(complete(dec.url, longs[1], max_tokens=LONG, timeout=300)))
            got = [first.result(), second.result(), armed.result()]
        assert got == [*want_long, want]
        assert metric(dec, "kvlink_lockstep_armed_total") == 1 and metric(dec, "kvlink_lockstep_ok_total") == 1
        assert metric(dec, "kvlink_lockstep_shared_steps_total") == 0, "a step waited for a pull vLLM had not taken"
        assert wait_for(lambda: metric(dec, "kvlink_pulls_in_progress") == 0)
        assert wait_for(lambda: (dec.metric("vllm:kv_cache_usage_perc") or 0.0) == 0.0), "decode holds blocks"
    finally:
        if proxy is not None:
            proxy.stop()
        dec.stop()
