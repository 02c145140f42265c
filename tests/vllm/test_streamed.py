"""Streamed KV through real vLLM servers: prefill computes in 64-token chunks and announces each chunk's
finished blocks; decode, paired concurrently through ``kvlink proxy --mode concurrent``, reads them while
prefill still computes and only the tail after prefill publishes.

Three servers: a streaming prefill, a decode, and a decode whose connector corrupts whatever it pulled
(the negative control). The baseline is a request without params on a decode server that is not pulling
those prompts (a single server): never on prefill, whose prefix cache would then hold the whole prompt
and leave nothing to stream.

Aborts mid-stream on either side: the client of the proxy (both legs go), decode's request alone (it stops
the stream: prefill is told on its next piece), prefill's request alone (decode stops waiting and computes
the prompt), and 200 of them mixed. Prefill dying mid-stream: test_streamed_faults.py; no byte landing
after a cancelled piece's READ gave its blocks back: test_streamed_landing.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import socket
import threading
import time
import uuid

import pytest

from tests.fakes_vllm_server import AppThread
from tests.vllm.helpers import (Server, complete, concurrent_legs, corrupting_kv_config, free_port,
                                held_until_decode_waits, kv_config, metric, open_completion, scrape, text,
                                token_prompts, wait_for)

CHUNK = 64  # prefill's max_num_batched_tokens: a 500-token prompt is 8 engine steps, 7 of them streamed
LONG = 1900  # a prompt prefill computes in ~30 steps, in slow motion (SlowMotion) while a test acts mid-stream
PULL_TIMEOUT_S = 20.0
SERVER_ARGS = ("--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def sd(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("streamed")
    bport = free_port()
    pre = Server(tiny_model, dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True),
                                  engine_id="prefill-s"), cpu=0, log=logs / "prefill.log", extra_args=SERVER_ARGS)
    dec_kv = dict(kv_config("kv_consumer", lookup_wait_s=10.0, transfer_timeout_s=10.0, pull_timeout_s=PULL_TIMEOUT_S),
                  kv_load_failure_policy="recompute")
    dec = Server(tiny_model, dec_kv, cpu=1, log=logs / "decode.log")
    bad = Server(tiny_model, corrupting_kv_config(lookup_wait_s=10.0), cpu=1, log=logs / "corrupt.log")
    proxies = []
    try:
        for s in (pre, dec, bad):
            s.wait_ready()
        from kvlink.proxy.config import ProxyConfig
        from kvlink.proxy.router import build_app

        def proxy(decode):
            p = AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(decode.url,), mode="concurrent",
                                                timeout_s=60, prefill_bootstrap=(f"http://127.0.0.1:{bport}",),
                                                prefill_engine_ids=("prefill-s",))))
            proxies.append(p)
            return p.url

        yield {"pre": pre, "dec": dec, "bad": bad, "conc": proxy(dec), "conc_bad": proxy(bad), "logs": logs,
               "bootstrap": f"http://127.0.0.1:{bport}"}
    finally:
        for p in proxies:
            p.stop()
        for s in (pre, dec, bad):
            s.stop()


def baseline(sd, prompts, on="bad"):
    return [text(complete(sd[on].url, p)) for p in prompts]


def wait_zero(server, name, timeout=60.0) -> bool:
    return wait_for(lambda: server.metric(name) == 0.0, timeout)


def published(sd) -> float:
    """Requests prefill's bootstrap server has seen published."""
    return scrape(sd["bootstrap"], "kvlink_bootstrap_published_total") or 0.0


def mid_stream(sd, streamed0: float, published0: float) -> None:
    """Wait until decode has read a piece of the request under way while prefill has not published it."""
    assert wait_for(lambda: metric(sd["dec"], "kvlink_blocks_streamed_total") > streamed0), "decode read no piece"
    assert published(sd) == published0, "prefill finished before the test could act mid-stream"


def assert_nothing_held(sd) -> None:
    assert wait_zero(sd["pre"], "kvlink_held_blocks"), "prefill still holds blocks"
    assert wait_zero(sd["dec"], "kvlink_pulls_in_progress"), "decode still waits for pulls"


def test_streamed_outputs_equal_a_single_server(sd):
    """Shorter than one block up to eight chunks; prefill streamed pieces and decode read blocks from them
    before prefill published (counted on both sides' /metrics)."""
    prompts = token_prompts([7, 31, 64, 100, 230, 500, 700], seed=40)
    want = baseline(sd, prompts)
    sent0, streamed0 = metric(sd["pre"], "kvlink_pieces_sent_total"), metric(sd["dec"], "kvlink_blocks_streamed_total")
    got = [text(complete(sd["conc"], p, timeout=120)) for p in prompts]
    assert got == want
    assert metric(sd["pre"], "kvlink_pieces_sent_total") > sent0
    assert metric(sd["dec"], "kvlink_blocks_streamed_total") > streamed0
    assert metric(sd["dec"], "kvlink_pulls_failed_total") == 0


def test_concurrent_streamed_requests(sd):
    rng = random.Random(41)
    prompts = token_prompts([rng.randint(5, 600) for _ in range(12)], seed=41)
    want = baseline(sd, prompts)
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: text(complete(sd["conc"], p, timeout=180)), prompts))
    assert got == want
    assert wait_zero(sd["pre"], "kvlink_held_blocks")


def test_negative_control_corrupted_stream_changes_the_output(sd):
    prompts = token_prompts([300, 500], seed=42)
    want = baseline(sd, prompts, on="dec")
    got = [text(complete(sd["conc_bad"], p, timeout=120)) for p in prompts]
    assert got[0] != want[0] and got[1] != want[1]


def test_decode_sent_another_prompt_than_prefill_does_not_use_the_streamed_kv(sd):
    """A router that sends the two legs of one transfer id different prompts (or two servers tokenizing one
    text otherwise): the first piece prefill streams carries its prompt's digest, decode sees it is not its
    own, reads nothing of it and computes its own prompt; prefill hears "abandoned" and frees the blocks."""
    pre, dec = sd["pre"], sd["dec"]
    a = token_prompts([500], seed=48)[0]
    b = list(a)
    b[250] = 4 if a[250] != 4 else 5
    want = baseline(sd, [b])[0]
    pre_params, dec_params = concurrent_legs(sd["bootstrap"], "prefill-s", "other-" + uuid.uuid4().hex)
    mismatch0, ok0 = metric(dec, "kvlink_prompt_mismatch_total"), metric(dec, "kvlink_pulls_ok_total")
    streamed0 = metric(dec, "kvlink_blocks_streamed_total")
    abandoned0 = metric(pre, "kvlink_released_abandoned_total")
    with cf.ThreadPoolExecutor(1) as ex:
        prefill_leg = ex.submit(complete, pre.url, a, pre_params, 1, 120.0)
        got = text(complete(dec.url, b, dec_params, 10, 120.0))
        prefill_leg.result(timeout=120)
    assert got == want
    assert metric(dec, "kvlink_prompt_mismatch_total") == mismatch0 + 1
    assert metric(dec, "kvlink_pulls_ok_total") == ok0
    assert metric(dec, "kvlink_blocks_streamed_total") == streamed0  # refused at the first piece: nothing read
    assert wait_for(lambda: metric(pre, "kvlink_released_abandoned_total") > abandoned0)
    assert_nothing_held(sd)


def test_client_hangs_up_mid_stream_both_legs_stop(sd):
    """The client leaves while prefill is still streaming (the proxy cancels both legs): prefill's request is
    aborted before it publishes, so it sends no more pieces and keeps no block; decode's pull is cancelled."""
    pre, dec = sd["pre"], sd["dec"]
    prompt = token_prompts([LONG], seed=45)[0]
    sent0, aborted0 = metric(pre, "kvlink_pieces_sent_total"), metric(pre, "kvlink_aborted_transfers_total")
    published0 = published(sd)

    def pulls_ended() -> float:
        return metric(dec, "kvlink_pulls_cancelled_total") + metric(dec, "kvlink_pulls_failed_total")

    ended0 = pulls_ended()
    with held_until_decode_waits(sd["pre"], sd["dec"]):
        conn = open_completion(sd["conc"], prompt, max_tokens=8)
        mid_stream(sd, metric(dec, "kvlink_blocks_streamed_total"), published0)
        conn.close()
        assert wait_for(lambda: metric(pre, "kvlink_aborted_transfers_total") > aborted0), "prefill was not aborted"
    # Decode's pull ends either way: cancelled (its own abort came first) or failed (prefill's abandon did).
    assert wait_for(lambda: pulls_ended() > ended0), "decode's pull never ended"
    assert_nothing_held(sd)
    sent = metric(pre, "kvlink_pieces_sent_total") - sent0
    time.sleep(2.0)
    assert metric(pre, "kvlink_pieces_sent_total") - sent0 == sent, "prefill still sends pieces"
    print(f"client hung up: prefill sent {sent:.0f} pieces of {LONG // CHUNK}")
    assert sent > 0
    assert published(sd) == published0  # it stopped before the end of the prompt: never published


def test_decode_gives_up_mid_stream_prefill_stops_sending_pieces(sd):
    """Only decode's request goes away (its client hangs up) while prefill computes on: decode stops the
    stream (bootstrap /v1/stream/stop), prefill is told so on its next piece and sends no more, finishes,
    and frees the blocks once decode's "abandoned" reaches it."""
    pre, dec = sd["pre"], sd["dec"]
    prompt = token_prompts([LONG], seed=46)[0]
    tid = "stop-" + uuid.uuid4().hex
    pre_params, dec_params = concurrent_legs(sd["bootstrap"], "prefill-s", tid)
    sent0, ended0 = metric(pre, "kvlink_pieces_sent_total"), metric(pre, "kvlink_pieces_ended_total")
    abandoned0, published0 = metric(pre, "kvlink_released_abandoned_total"), published(sd)
    with cf.ThreadPoolExecutor(1) as ex:
        with held_until_decode_waits(sd["pre"], sd["dec"]):
            prefill_leg = ex.submit(complete, pre.url, prompt, pre_params, 1, 120.0)
            conn = open_completion(dec.url, prompt, dec_params, max_tokens=8)
            mid_stream(sd, metric(dec, "kvlink_blocks_streamed_total"), published0)
            conn.close()
            assert wait_for(lambda: metric(pre, "kvlink_pieces_ended_total") > ended0), "prefill was never told to stop"
        # Prefill counts the pieces of a call before the "ended" its answer carried: all it sent until told.
        told = metric(pre, "kvlink_pieces_sent_total") - sent0
        prefill_leg.result(timeout=120)  # prefill computed the whole prompt all the same
    assert published(sd) == published0 + 1
    time.sleep(1.0)
    sent = metric(pre, "kvlink_pieces_sent_total") - sent0
    print(f"decode gave up: prefill sent {sent:.0f} pieces of {LONG // CHUNK}")
    assert sent == told, f"prefill sent {sent - told:.0f} pieces after it was told the stream had ended"
    assert wait_for(lambda: metric(pre, "kvlink_released_abandoned_total") > abandoned0)
    assert_nothing_held(sd)


def test_prefill_aborted_mid_stream_decode_recomputes_at_once(sd):
    """Only prefill's request is aborted (its client hangs up) while decode reads its pieces: prefill marks the
    transfer abandoned, decode stops waiting then, not at its pull timeout, and computes the prompt."""
    pre, dec = sd["pre"], sd["dec"]
    prompt = token_prompts([LONG], seed=47)[0]
    want = baseline(sd, [prompt])[0]
    tid = "abort-" + uuid.uuid4().hex
    pre_params, dec_params = concurrent_legs(sd["bootstrap"], "prefill-s", tid)
    failed0, aborted0 = metric(dec, "kvlink_pulls_failed_total"), metric(pre, "kvlink_aborted_transfers_total")
    log_at = dec.log.stat().st_size
    with cf.ThreadPoolExecutor(1) as ex:
        with held_until_decode_waits(sd["pre"], sd["dec"]):
            conn = open_completion(pre.url, prompt, pre_params, max_tokens=1)
            decode_leg = ex.submit(complete, dec.url, prompt, dec_params, 10, 120.0)
            mid_stream(sd, metric(dec, "kvlink_blocks_streamed_total"), published(sd))
            conn.close()
            t0 = time.monotonic()
            assert wait_for(lambda: metric(pre, "kvlink_aborted_transfers_total") > aborted0), "prefill was not aborted"
        got = text(decode_leg.result(timeout=120))
        elapsed = time.monotonic() - t0
    assert got == want
    assert metric(pre, "kvlink_aborted_transfers_total") > aborted0
    assert metric(dec, "kvlink_pulls_failed_total") > failed0
    with open(dec.log, "rb") as fh:
        fh.seek(log_at)
        failures = [ln for ln in fh.read().decode(errors="replace").splitlines() if "kvlink: pull for request" in ln]
    assert failures and not any("pull_timeout_s" in ln for ln in failures), failures
    assert elapsed < PULL_TIMEOUT_S, f"decode waited {elapsed:.1f} s after prefill's request was aborted"
    assert_nothing_held(sd)


def test_mixed_aborts_mid_stream_leave_nothing_held(sd):
    """200 requests at once, mixed: clients that hang up on the proxy at random times (it cancels both legs),
    prefill requests aborted alone at random times (decode pulls what was published, or computes the prompt),
    and requests left to finish. Every answer that comes back is the single server's; afterwards nothing is
    held on either side and both servers still answer correctly."""
    rng = random.Random(43)
    n = 200
    prompts = token_prompts([rng.randint(200, 900) for _ in range(n)], seed=43)
    kinds = ["client"] * 130 + ["prefill"] * 35 + ["finish"] * 35
    rng.shuffle(kinds)
    # a client hangs up within 0.4 s; a prefill request is aborted within 1 s. How many clients hang up before
    # their answer depends on the machine's speed: at ~0.3 s a request under this load, about 3 in 4 of them;
    # on a machine 3x faster, about 1 in 4
    delays = [rng.uniform(0.02, 0.4 if k == "client" else 1.0) for k in kinds]

    def one(i):
        if kinds[i] == "prefill":  # only prefill's request is aborted, decode's waits for its KV
            pre_params, dec_params = concurrent_legs(sd["bootstrap"], "prefill-s", "mix-" + uuid.uuid4().hex)
            conn = open_completion(sd["pre"].url, prompts[i], pre_params, max_tokens=1)
            threading.Timer(delays[i], conn.close).start()
            return text(complete(sd["dec"].url, prompts[i], dec_params, timeout=120))
        try:
            timeout = delays[i] if kinds[i] == "client" else 120
            return text(complete(sd["conc"], prompts[i], timeout=timeout))
        except (TimeoutError, socket.timeout, OSError):
            if kinds[i] == "client":
                return None  # the client hung up
            raise

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(n)))
    answered = [i for i, r in enumerate(results) if r is not None]
    print(f"{n} requests in {time.monotonic() - t0:.1f} s: {n - len(answered)} hung up, {len(answered)} answered")
    assert sum(r is None for r in results) >= 20, "too few clients hung up to test aborts mid-stream"
    assert all(results[i] is not None for i in range(n) if kinds[i] != "client")
    want = baseline(sd, [prompts[i] for i in answered])
    assert [results[i] for i in answered] == want
    assert_nothing_held(sd)
    p = token_prompts([450], seed=44)
    assert text(complete(sd["conc"], p[0], timeout=120)) == baseline(sd, p)[0]
