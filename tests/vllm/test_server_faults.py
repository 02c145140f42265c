"""Fault tests against real servers: slow pulls vs short leases, hung prefill peers, concurrent pairing
faults. One prefill + one decode server for the module; the prefill's transport is reached through a
throttling Relay (advertised with ``transport_advertise``) so a pull can be held slow on purpose.

Prefill leases are short (LEASE_S) and decode's pull timeout is PULL_TIMEOUT_S; decode's bootstrap and
connect timeouts are far longer, so only the pull timeout can end a hung pull in time. The last test
kills the prefill server.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request
import uuid

import pytest

from tests.fakes import StalledPeer
from tests.fakes_vllm_server import AppThread
from tests.relay import Relay
from tests.vllm.helpers import Server, complete, free_port, kv_config, text, token_prompts

# The lease runs from prefill's publish; it must outlast the hop to decode on a loaded CI machine (a
# 3 s lease did not), yet be short enough that a deliberately slow pull outlives it.
LEASE_S = 6.0
PULL_TIMEOUT_S = 25.0
SLOW_RATE = 60 << 10  # bytes/s through the relay while throttled: ~600 KiB of KV takes ~10 s
ENGINE = "prefill-f"


@pytest.fixture(scope="module")
def faulty(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fault-servers")
    bport, tport = free_port(), free_port()
    relay = Relay(f"127.0.0.1:{tport}")
    pre_kv = dict(kv_config("kv_producer", bootstrap_port=bport, lease_s=LEASE_S, transport_port=tport,
                            transport_advertise=relay.address), engine_id=ENGINE)
    dec_kv = dict(kv_config("kv_consumer", pull_timeout_s=PULL_TIMEOUT_S, lease_s=60.0, transport_backend="tcp",
                            bootstrap_timeout_s=60.0, connect_timeout_s=60.0, transfer_timeout_s=60.0),
                  kv_load_failure_policy="recompute")
    pre = Server(tiny_model, pre_kv, cpu=0, log=logs / "prefill.log")
    # INFO: the test of kvlink's lines in vLLM's log needs the start-up line.
    dec = Server(tiny_model, dec_kv, cpu=1, log=logs / "decode.log", env={"VLLM_LOGGING_LEVEL": "INFO"})
    proxies = []
    try:
        pre.wait_ready()
        dec.wait_ready()
        from kvlink.proxy.config import ProxyConfig
        from kvlink.proxy.router import build_app

        burl = f"http://127.0.0.1:{bport}"
        seq = AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(dec.url,), timeout_s=60)))
        conc = AppThread(build_app(ProxyConfig(prefill=(pre.url,), decode=(dec.url,), mode="concurrent",
                                               timeout_s=60, prefill_bootstrap=(burl,),
                                               prefill_engine_ids=(ENGINE,))))
        proxies += [seq, conc]
        # Warm both servers and the sequential path (first requests pay for lazy set-up), so the
        # tests' leases start on servers that answer at their usual pace.
        warm = token_prompts([40], seed=29)[0]
        for url in (pre.url, dec.url, seq.url):
            complete(url, warm, max_tokens=2, timeout=120)
        yield {"pre": pre, "dec": dec, "seq": seq.url, "conc": conc.url, "relay": relay, "bootstrap": burl}
    finally:
        for p in proxies:
            p.stop()
        pre.stop()
        dec.stop()
        relay.close()


def metric(server, name) -> float:
    return server.metric(name) or 0.0


def baseline(f, prompt, max_tokens=10):
    """Computed on prefill without params: computing it on decode would fill decode's prefix cache and
    leave nothing to pull."""
    return text(complete(f["pre"].url, prompt, max_tokens=max_tokens))


def wait_metric(server, name, want, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric(name) == want:
            return True
        time.sleep(0.2)
    return False


def assert_nothing_held(f):
    assert wait_metric(f["pre"], "kvlink_held_blocks", 0.0), "prefill still holds blocks"
    assert wait_metric(f["dec"], "kvlink_pulls_in_progress", 0.0), "decode still has pulls in progress"


def test_kvlink_lines_reach_the_server_log(faulty):
    """kvlink logs through its own loggers; the plugin/connector hands them vLLM's handlers."""
    log = faulty["dec"].log.read_text(errors="replace")
    assert "kvlink: KVLinkConnector kv_consumer engine" in log
    assert "kvlink: kv_consumer worker tp0/1 transport 127.0.0.1:" in log
    assert "backend tcp" in log and "auth none (loopback only)" in log


def failure_lines(server, since: int) -> list[str]:
    with open(server.log, "rb") as fh:
        fh.seek(since)
        return [ln for ln in fh.read().decode(errors="replace").splitlines() if "kvlink: pull for request" in ln]


def test_slow_pull_outlives_lease_thanks_to_renewals(faulty):
    f = faulty
    prompt = token_prompts([600], seed=30)[0]
    want = baseline(f, prompt)
    log_at = f["dec"].log.stat().st_size
    expired0 = metric(f["pre"], "kvlink_leases_expired_total")
    renewals0 = metric(f["dec"], "kvlink_lease_renewals_total")
    failed0 = metric(f["dec"], "kvlink_pulls_failed_total")
    f["relay"].throttle(SLOW_RATE)
    try:
        got = text(complete(f["seq"], prompt, timeout=60))
    finally:
        f["relay"].throttle(None)
    relay = f["relay"]
    nbytes, span = relay.throttled()
    # Failures first: a failed pull recomputes, so the answer and the timing below would hide why.
    assert metric(f["dec"], "kvlink_pulls_failed_total") == failed0, failure_lines(f["dec"], log_at)
    assert metric(f["pre"], "kvlink_leases_expired_total") == expired0, "prefill freed blocks under a pull"
    assert got == want
    assert relay.first_byte.is_set(), "the pull did not go through the relay"
    print(f"slow pull: {nbytes} B in {span:.2f} s through the relay")
    assert span > LEASE_S * 1.2, f"the pull was not slower than the lease: {nbytes} B in {span:.2f} s"
    assert metric(f["dec"], "kvlink_lease_renewals_total") > renewals0
    assert_nothing_held(f)


def test_client_abort_mid_pull_reaches_both_engines(faulty):
    """A client that hangs up while decode is pulling (the relay holds the READ back): the proxy cancels
    its decode request, decode cancels the pull and tells prefill "abandoned", prefill frees the blocks,
    and the next request through the same servers is answered correctly."""
    import http.client

    f = faulty
    prompt = token_prompts([600], seed=33)[0]
    cancelled0 = metric(f["dec"], "kvlink_pulls_cancelled_total")
    abandoned0 = metric(f["pre"], "kvlink_released_abandoned_total")
    host, port = f["seq"].removeprefix("http://").split(":")
    f["relay"].throttle(SLOW_RATE)
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8}),
                     {"Content-Type": "application/json"})
        assert wait_metric(f["dec"], "kvlink_pulls_in_progress", 1.0), "the pull never started"
        conn.close()  # the client hangs up mid-pull
        deadline = time.monotonic() + 30
        while metric(f["dec"], "kvlink_pulls_cancelled_total") <= cancelled0 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        f["relay"].throttle(None)
    assert metric(f["dec"], "kvlink_pulls_cancelled_total") == cancelled0 + 1
    assert_nothing_held(f)
    assert metric(f["pre"], "kvlink_released_abandoned_total") > abandoned0
    again = token_prompts([120], seed=34)[0]
    assert text(complete(f["seq"], again, timeout=60)) == baseline(f, again)


@pytest.mark.parametrize("where", ["bootstrap", "transport"])
def test_hung_prefill_peer_recomputes_within_pull_timeout(faulty, where):
    """The prefill peer accepts TCP and never answers: decode recomputes once pull_timeout_s passes,
    long before its bootstrap/connect timeouts (60 s each) would end the wait."""
    from kvlink.bootstrap import BootstrapClient
    import msgspec

    f = faulty
    prompt = token_prompts([200], seed=31 if where == "bootstrap" else 35)[0]  # each its own: nothing cached
    want = baseline(f, prompt)
    stalled = StalledPeer()
    try:
        params = {"do_remote_prefill": True, "remote_request_id": "never-answered",
                  "remote_block_ids": list(range(1, 8)), "remote_num_tokens": len(prompt)}
        if where == "bootstrap":
            params |= {"remote_bootstrap_addr": stalled.url, "remote_engine_id": ENGINE}
        else:
            # A registered engine with the right layout whose transport address hangs.
            with BootstrapClient(f["bootstrap"]) as cli:
                reg = cli.get_engine(ENGINE)
                cli.register_engine(msgspec.structs.replace(reg, engine_id="stalled",
                                                            transport_addr=stalled.address), 120.0)
                # Published, so that decode's first lease renewal succeeds and only the READ can hang.
                cli.publish("stalled", "never-answered", [params["remote_block_ids"]], len(prompt), 120.0)
            params |= {"remote_bootstrap_addr": f["bootstrap"], "remote_engine_id": "stalled"}
        failed0 = metric(f["dec"], "kvlink_pulls_failed_total")
        t0 = time.monotonic()
        got = text(complete(f["dec"].url, prompt, params, timeout=120))
        elapsed = time.monotonic() - t0
        assert stalled.accepted.is_set(), "decode never contacted the hung peer"
    finally:
        stalled.close()
    assert got == want
    assert elapsed < PULL_TIMEOUT_S + 8, f"decode waited {elapsed:.1f} s"
    assert metric(f["dec"], "kvlink_pulls_failed_total") == failed0 + 1
    assert_nothing_held(f)


def test_concurrent_never_published_recomputes_and_holds_nothing(faulty):
    f = faulty
    prompt = token_prompts([150], seed=32)[0]
    want = baseline(f, prompt)
    params = {"do_remote_prefill": True, "transfer_id": "never-" + uuid.uuid4().hex,
              "remote_bootstrap_addr": f["bootstrap"], "remote_engine_id": ENGINE}
    t0 = time.monotonic()
    got = text(complete(f["dec"].url, prompt, params, timeout=120))
    elapsed = time.monotonic() - t0
    assert got == want
    assert elapsed < PULL_TIMEOUT_S + 8, f"decode waited {elapsed:.1f} s"
    assert_nothing_held(f)


def test_concurrent_prefill_abort_releases_waiting_decode(faulty):
    """Prefill's request is aborted before it publishes: prefill marks the transfer id abandoned, so the
    decode long-polling for it stops waiting at once and recomputes; nothing stays held."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.bootstrap.errors import RequestReleased

    f = faulty
    prompt = token_prompts([300], seed=33)[0]
    want = baseline(f, prompt)
    tid = "aborted-" + uuid.uuid4().hex
    aborted0 = metric(f["pre"], "kvlink_aborted_transfers_total")
    with cf.ThreadPoolExecutor(1) as ex:
        dec = ex.submit(complete, f["dec"].url, prompt,
                        {"do_remote_prefill": True, "transfer_id": tid, "remote_bootstrap_addr": f["bootstrap"],
                         "remote_engine_id": ENGINE}, 10, 120.0)
        # A long streamed prefill that the client walks away from after its first token: vLLM aborts it.
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
        req = urllib.request.Request(f["pre"].url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.readline().startswith(b"data: ")
        assert wait_metric(f["pre"], "kvlink_aborted_transfers_total", aborted0 + 1)
        with BootstrapClient(f["bootstrap"]) as cli, pytest.raises(RequestReleased):
            cli.lookup_transfer(tid)
        assert text(dec.result(timeout=120)) == want
    assert_nothing_held(f)


def test_concurrent_prefill_killed_mid_pull_recomputes(faulty):
    """Last: kills the prefill server while decode is reading its blocks (pull held slow)."""
    f = faulty
    prompt = token_prompts([600], seed=34)[0]
    want = baseline(f, prompt)
    f["relay"].throttle(SLOW_RATE / 4)
    log_at = f["dec"].log.stat().st_size
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(lambda: text(complete(f["conc"], prompt, timeout=120)))
        assert f["relay"].first_byte.wait(60), "the pull never started"
        f["pre"].kill()
        # A dead process's connections drop; the relay would otherwise keep feeding decode the bytes the
        # kernel had buffered, at the throttled rate, for longer than the pull timeout.
        f["relay"].close()
        t0 = time.monotonic()
        got = fut.result(timeout=120)
        elapsed = time.monotonic() - t0
    assert got == want
    assert metric(f["dec"], "kvlink_pulls_failed_total") >= 1
    # The dropped connection fails the READ at once (the transport's PeerClosed), not the pull timeout.
    failures = failure_lines(f["dec"], log_at)
    assert failures and not any("pull_timeout_s" in ln for ln in failures), failures
    assert elapsed < PULL_TIMEOUT_S, f"decode waited {elapsed:.1f} s after prefill died"
    assert wait_metric(f["dec"], "kvlink_pulls_in_progress", 0.0)
    with urllib.request.urlopen(f["dec"].url + "/health", timeout=5) as r:
        assert r.status == 200
