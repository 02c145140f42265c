"""Streamed KV when prefill dies mid-stream, through real vLLM servers and the concurrent proxy.

A decode server (``kv_load_failure_policy: recompute``, a short ``pull_timeout_s``), a plain server for
the baselines (it never sees the prompts it did not compute itself, so nothing cached decides its
answer), and two streaming prefills, one per test: each test kills its own. Prefill computes in 64-token
chunks (``--max-num-batched-tokens``) and announces each chunk's finished blocks; its transport is reached
through a throttling Relay (``transport_advertise``) so a piece's READ can be held on the wire.

Each case: the client still gets the baseline's answer (decode recomputes), decode counts a failed pull
that ended well before its pull timeout (the dead peer is seen at once, not waited for), nothing is left
in progress, and decode goes on answering.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import urllib.request
from dataclasses import dataclass

import pytest

from tests.fakes_vllm_server import AppThread
from tests.relay import Relay
from tests.vllm.helpers import (Server, complete, free_port, held_until_decode_waits, kv_config, metric, scrape,
                                text, token_prompts, wait_for)

CHUNK = 64
PREFILL_ARGS = ("--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "16")
PULL_TIMEOUT_S = 30.0
LONG = 1900  # prompt tokens: ~30 chunks, computed in slow motion (SlowMotion) until the test stops prefill
SLOW_RATE = 16 << 10  # bytes/s through a throttled relay: a 2-block piece (64 KiB) takes ~4 s


@dataclass
class Prefill:
    server: Server
    relay: Relay
    bootstrap: str
    proxy: str  # a concurrent kvlink proxy in front of this prefill and the decode server


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    from kvlink.proxy.config import ProxyConfig
    from kvlink.proxy.router import build_app

    logs = tmp_path_factory.mktemp("streamed-faults")
    dec_kv = dict(kv_config("kv_consumer", pull_timeout_s=PULL_TIMEOUT_S, lookup_wait_s=20.0,
                            transfer_timeout_s=60.0, connect_timeout_s=20.0, transport_backend="tcp"),
                  kv_load_failure_policy="recompute")
    dec = Server(tiny_model, dec_kv, cpu=1, log=logs / "decode.log")
    plain = Server(tiny_model, None, cpu=1, log=logs / "plain.log")
    started, relays, proxies = [dec, plain], [], []
    prefills: dict[str, tuple] = {}
    try:
        for name in ("a", "b"):
            bport, tport = free_port(), free_port()
            relay = Relay(f"127.0.0.1:{tport}")
            relays.append(relay)
            kv = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=20.0, stream_kv=True,
                                transport_port=tport, transport_advertise=relay.address),
                      engine_id=f"prefill-{name}")
            pre = Server(tiny_model, kv, cpu=0, log=logs / f"prefill-{name}.log", extra_args=PREFILL_ARGS)
            started.append(pre)
            prefills[name] = (pre, relay, f"http://127.0.0.1:{bport}")
        for s in started:
            s.wait_ready()
        out = {"dec": dec, "plain": plain}
        for name, (pre, relay, burl) in prefills.items():
            proxy = AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(dec.url,), mode="concurrent",
                                                    timeout_s=120, prefill_bootstrap=(burl,),
                                                    prefill_engine_ids=(f"prefill-{name}",))))
            proxies.append(proxy)
            out[name] = Prefill(pre, relay, burl, proxy.url)
            # A short streamed request at full speed: decode connects to this prefill through its relay, so
            # what the relay throttles later is READ data, not the handshake.
            warm = token_prompts([300], seed=ord(name))[0]
            assert text(complete(proxy.url, warm, timeout=120)) == text(complete(plain.url, warm))
        yield out
    finally:
        for p in proxies:
            p.stop()
        for s in started:
            s.stop()
        for r in relays:
            r.close()


def failure_lines(server, since: int) -> list[str]:
    with open(server.log, "rb") as fh:
        fh.seek(since)
        return [ln for ln in fh.read().decode(errors="replace").splitlines() if "kvlink: pull for request" in ln]


def assert_recomputed_in_time(stack, got: str, want: str, elapsed: float, failed0: float, log_at: int):
    dec = stack["dec"]
    assert got == want
    assert metric(dec, "kvlink_pulls_failed_total") > failed0
    # The dead peer ends the pull (a dropped connection), not the pull timeout.
    failures = failure_lines(dec, log_at)
    print("decode:", *failures, sep="\n  ")
    assert not any("pull_timeout_s" in ln for ln in failures), failures
    assert elapsed < PULL_TIMEOUT_S, f"decode waited {elapsed:.1f} s after prefill died"
    assert wait_for(lambda: dec.metric("kvlink_pulls_in_progress") == 0.0), "decode still waits for a pull"
    with urllib.request.urlopen(dec.url + "/health", timeout=5) as r:
        assert r.status == 200
    other = token_prompts([250], seed=69)[0]
    assert text(complete(dec.url, other, timeout=120)) == text(complete(stack["plain"].url, other))


def test_prefill_killed_while_a_streamed_piece_is_read(stack):
    """The relay holds the first piece's READ on the wire; prefill dies under it."""
    p, dec = stack["a"], stack["dec"]
    prompt = token_prompts([LONG], seed=61)[0]
    want = text(complete(stack["plain"].url, prompt))
    failed0, pieces0 = metric(dec, "kvlink_pulls_failed_total"), metric(dec, "kvlink_pieces_total")
    log_at = dec.log.stat().st_size
    p.relay.throttle(SLOW_RATE)
    with cf.ThreadPoolExecutor(1) as ex:
        with held_until_decode_waits(p.server, dec, stopped_after=True):
            fut = ex.submit(lambda: text(complete(p.proxy, prompt, timeout=120)))
            assert p.relay.first_byte.wait(60), "decode never read from prefill"
        p.server.kill()
        p.relay.close()  # its connections to the dead process drop; no buffered byte trickles on
        t0 = time.monotonic()
        got = fut.result(timeout=120)
        elapsed = time.monotonic() - t0
    # Decode took a piece before anything else (a piece is taken only before the published record, and
    # the first READ follows the first thing taken): the READ the relay held was a piece's.
    assert wait_for(lambda: metric(dec, "kvlink_pieces_total") > pieces0), "decode read no piece: no stream"
    assert_recomputed_in_time(stack, got, want, elapsed, failed0, log_at)


def test_prefill_killed_between_pieces_while_decode_waits(stack):
    """Decode has read the pieces so far and waits (long poll) for more; prefill dies still computing."""
    p, dec = stack["b"], stack["dec"]
    prompt = token_prompts([LONG], seed=62)[0]
    want = text(complete(stack["plain"].url, prompt))
    failed0, streamed0 = metric(dec, "kvlink_pulls_failed_total"), metric(dec, "kvlink_blocks_streamed_total")
    published0 = scrape(p.bootstrap, "kvlink_bootstrap_published_total") or 0.0
    log_at = dec.log.stat().st_size
    with cf.ThreadPoolExecutor(1) as ex:
        with held_until_decode_waits(p.server, dec, stopped_after=True) as forward:
            fut = ex.submit(lambda: text(complete(p.proxy, prompt, timeout=120)))
            assert wait_for(lambda: metric(dec, "kvlink_blocks_streamed_total") > streamed0), "decode read no piece"
        assert (scrape(p.bootstrap, "kvlink_bootstrap_published_total") or 0.0) == published0, \
            "prefill finished before the test could stop it: make LONG larger"
        p.server.pause()  # all of it now; its forward was stopped already
        for attempt in range(40):  # wait for a moment when no READ is owed an answer
            time.sleep(0.5)
            if not p.relay.awaiting_answer():
                break
            forward.window()  # the worker alone, briefly: the READ on the wire gets its answer
        else:
            pytest.fail("decode always had a READ on the wire")
        assert not fut.done(), "decode finished: prefill published just before it was paused"
        print(f"prefill paused between pieces at attempt {attempt + 1}")
        p.server.kill()
        p.relay.close()
        t0 = time.monotonic()
        got = fut.result(timeout=120)
        elapsed = time.monotonic() - t0
    assert_recomputed_in_time(stack, got, want, elapsed, failed0, log_at)
