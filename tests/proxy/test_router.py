"""kvlink proxy against fake backends: routing, pairing parameters, streaming, errors, timeouts."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request

import pytest

from kvlink.proxy.config import ProxyConfig
from tests.conftest import trace_lines
from tests.fakes_vllm_server import FakeVLLMServer


def post(url, body, timeout=20):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


def test_sequential_copies_prefill_params_into_decode(backends, proxy):
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    status, _, raw = post(url + "/v1/completions",
                          {"prompt": "x", "max_tokens": 8, "stream": True, "stream_options": {}} | {"stream": False})
    assert status == 200
    out = json.loads(raw)
    assert out["from"] == "d0"
    (_, pre), = p.bodies
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    (_, dec), = d.bodies
    assert dec["max_tokens"] == 8
    assert dec["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert dec["kv_transfer_params"]["remote_block_ids"] == [1, 2]


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_several_samples_go_to_decode_and_prefill_computes_one(backends, proxy, mode):
    """n > 1 is forwarded: prefill computes the prompt once (n=1, one token), decode samples n."""
    p, d = backends("p0"), backends("d0")
    extra = dict(mode="concurrent", prefill_bootstrap=("http://127.0.0.1:1",), prefill_engine_ids=("p0",)) \
        if mode == "concurrent" else {}
    url = proxy(prefill=(p.url,), decode=(d.url,), **extra)
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 8, "n": 3, "seed": 7})
    assert status == 200, raw
    (_, pre), = p.bodies
    (_, dec), = d.bodies
    assert (pre["n"], pre["max_tokens"]) == (1, 1)
    assert (dec["n"], dec["max_tokens"], dec["seed"]) == (3, 8, 7)


@pytest.mark.parametrize("stream", [False, True])
def test_no_answer_header_names_a_backend(backends, proxy, stream):
    """The client is not told the deployment's internal addresses (an earlier X-KVLink-Decode header named
    decode's URL on every answer)."""
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": "x", "stream": stream}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        assert r.status == 200
        headers = str(r.headers)
        r.read()
    for backend in (p.url, d.url):
        hostport = backend.split("://", 1)[1]
        assert hostport.split(":")[1] not in headers, headers  # neither the URL nor its port


def test_chat_streaming_passthrough(backends, proxy):
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    status, ctype, raw = post(url + "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}], "stream": True,
                               "max_completion_tokens": 5})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [ln for ln in raw.decode().split("\n\n") if ln]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    (path, pre), = p.bodies
    assert path == "/v1/chat/completions" and pre["max_completion_tokens"] == 1


def test_round_robin(backends, proxy):
    p = backends("p0")
    d0, d1 = backends("d0"), backends("d1")
    url = proxy(prefill=(p.url,), decode=(d0.url, d1.url))
    froms = [json.loads(post(url + "/v1/completions", {"prompt": "x"})[2])["from"] for _ in range(4)]
    assert froms == ["d0", "d1", "d0", "d1"]


def test_concurrent_pairs_by_transfer_id(backends, proxy):
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,), mode="concurrent",
                prefill_bootstrap=("http://127.0.0.1:9999",), prefill_engine_ids=("eng-p0",))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status == 200
    assert wait_for(lambda: p.bodies)  # decode's answer does not wait for prefill's
    (_, pre), = p.bodies
    (_, dec), = d.bodies
    tid = pre["kv_transfer_params"]["transfer_id"]
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
    assert dec["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": tid,
                                         "remote_bootstrap_addr": "http://127.0.0.1:9999",
                                         "remote_engine_id": "eng-p0"}


def test_prefill_unreachable_is_502_naming_backend(backends, proxy):
    from tests.proxy.conftest import free_port
    dead = f"http://127.0.0.1:{free_port()}"
    d = backends("d0")
    url = proxy(prefill=(dead,), decode=(d.url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
    err = json.loads(raw)["error"]
    assert status == 502 and err["stage"] == "prefill" and err["backend"] == dead
    assert "unreachable" in err["message"]
    assert d.bodies == []


def test_decode_hang_is_504_within_timeout(backends, proxy):
    p, d = backends("p0"), backends("d0", "hang")
    url = proxy(prefill=(p.url,), decode=(d.url,), timeout_s=1.0)
    t0 = time.monotonic()
    status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
    assert status == 504 and time.monotonic() - t0 < 5
    err = json.loads(raw)["error"]
    assert err["stage"] == "decode" and err["backend"] == d.url


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_client_gone_cancels_backend_requests(backends, proxy, mode):
    """A client that hangs up takes its backend requests with it, so vLLM aborts them and frees their
    blocks instead of computing them for nobody."""
    p = backends("p0", "hang" if mode == "concurrent" else "ok")
    d = backends("d0", "hang")
    url = proxy(prefill=(p.url,), decode=(d.url,), mode=mode, timeout_s=30.0,
                prefill_bootstrap=("http://127.0.0.1:1",) if mode == "concurrent" else ())
    with pytest.raises(OSError):  # socket.timeout is an OSError
        post(url + "/v1/completions", {"prompt": "x"}, timeout=0.5)
    assert wait_for(lambda: d.cancelled == 1), "decode request still running after the client left"
    if mode == "concurrent":
        assert wait_for(lambda: p.cancelled == 1), "prefill request still running after the client left"
    # The proxy serves the next client as before.
    d.behavior = p.behavior = "ok"
    assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200


def test_idle_backend_connections_are_not_reused_past_the_keepalive(backends, proxy, monkeypatch):
    """vLLM closes a connection idle for 5 s; the proxy must never send a request on one idle that
    long, or it races the close and fails a request the backend never saw."""
    from kvlink.proxy import router
    from tests.fakes_vllm_server import RawVLLMServer
    assert router.BACKEND_KEEPALIVE_S < 5.0  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default
    monkeypatch.setattr(router, "BACKEND_KEEPALIVE_S", 0.3)
    pre, d = RawVLLMServer(), backends("d0")
    try:
        url = proxy(prefill=(pre.url,), decode=(d.url,)) + "/v1/completions"
        assert post(url, {"prompt": "x"})[0] == 200
        assert post(url, {"prompt": "x"})[0] == 200
        assert (pre.connections, pre.requests) == (1, 2)  # back to back: the connection is reused
        time.sleep(0.6)
        assert post(url, {"prompt": "x"})[0] == 200
        assert (pre.connections, pre.requests) == (2, 3)  # idle past the keep-alive: a new one
    finally:
        pre.stop()


def test_request_the_backend_read_is_never_sent_twice(backends, proxy):
    from tests.fakes_vllm_server import RawVLLMServer
    pre, d = RawVLLMServer("drop"), backends("d0")
    try:
        status, _, raw = post(proxy(prefill=(pre.url,), decode=(d.url,)) + "/v1/completions",
                              {"prompt": "x"})
        err = json.loads(raw)["error"]
        assert status == 502 and err["stage"] == "prefill" and err["backend"] == pre.url
        assert (pre.connections, pre.requests) == (1, 1) and d.bodies == []
    finally:
        pre.stop()


def test_backend_that_accepts_no_connection_is_504_naming_the_connect_limit(backends, proxy):
    """A backend whose accept queue is full drops the SYN: the proxy gives up after its connect
    timeout, and says so, instead of reporting a slow answer."""
    import socket
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = []
    try:
        for _ in range(4):  # fill the accept queue (listen(0) holds one pending connection)
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(full.getsockname())
            fillers.append(c)
        time.sleep(0.2)
        dead = f"http://127.0.0.1:{full.getsockname()[1]}"
        d = backends("d0")
        url = proxy(prefill=(dead,), decode=(d.url,), connect_timeout_s=0.5, timeout_s=20.0)
        t0 = time.monotonic()
        status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
        err = json.loads(raw)["error"]
        assert status == 504 and err["stage"] == "prefill" and err["backend"] == dead
        assert err["message"] == "could not connect within 0.5 s"
        assert time.monotonic() - t0 < 10
    finally:
        for c in fillers:
            c.close()
        full.close()


def test_prefill_without_params_is_clear_502(backends, proxy):
    p, d = backends("p0", "no_params"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
    assert status == 502 and "kv_producer" in json.loads(raw)["error"]["message"]


def test_prefill_answer_is_handed_to_decode_as_sent(backends, proxy):
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200
    (_, dec), = d.bodies
    assert dec["kv_transfer_params"] == {
        "do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1", "remote_engine_id": "p0",
        "remote_request_id": "req-1", "remote_block_ids": [1, 2], "remote_num_tokens": 32, "remote_lease_s": 30.0}


def test_prefill_with_malformed_params_is_502_naming_the_field(backends, proxy):
    p, d = backends("p0", "bad_params"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
    err = json.loads(raw)["error"]
    assert status == 502 and err["stage"] == "prefill" and err["backend"] == p.url
    assert "remote_block_ids" in err["message"]
    assert d.bodies == []  # decode never sees params nobody could pull with


def test_prefill_that_kept_no_kv_lets_decode_compute(backends, proxy, caplog):
    p, d = backends("p0", "refuse"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    with caplog.at_level("WARNING", logger="kvlink.proxy.router"):
        assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200
    (_, dec), = d.bodies
    assert dec["kv_transfer_params"] == {"do_remote_prefill": False}
    assert "publish failed: bootstrap unreachable" in caplog.text


def test_backend_500_and_400(backends, proxy):
    p, d = backends("p0"), backends("d0", "error500")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
    assert status == 502 and json.loads(raw)["error"]["stage"] == "decode"
    p2, d2 = backends("p1", "bad_request"), backends("d1")
    url2 = proxy(prefill=(p2.url,), decode=(d2.url,))
    status, _, raw = post(url2 + "/v1/completions", {"prompt": "x"})
    assert status == 400 and "prompt too long" in json.loads(raw)["error"]["message"]


def test_stream_broken_midway_ends_with_error_event(backends, proxy):
    p, d = backends("p0"), backends("d0", "stream_break")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200
    last = raw.decode().strip().split("\n\n")[-1]
    assert last.startswith("data: ") and "error" in json.loads(last[6:])
    h = health(url)
    assert (h["served"], h["failed"]) == (0, 1)


def test_health_and_bad_json(backends, proxy):
    from tests.proxy.conftest import free_port
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        assert r.status == 200
    req = urllib.request.Request(url + "/v1/completions", data=b"{nope",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=5)
    assert ei.value.code == 400
    url2 = proxy(prefill=(f"http://127.0.0.1:{free_port()}",), decode=(d.url,))
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(url2 + "/health", timeout=5)
    assert ei.value.code == 503


def test_config_validation():
    with pytest.raises(ValueError, match="prefill-bootstrap"):
        ProxyConfig(prefill=("http://a",), decode=("http://b",), mode="concurrent")
    with pytest.raises(ValueError, match="mode"):
        ProxyConfig(prefill=("http://a",), decode=("http://b",), mode="fast")
    with pytest.raises(ValueError, match="http"):
        ProxyConfig(prefill=("a:1",), decode=("http://b",))
    # NaN connected nowhere, inf raised in aiohttp on every request: refused at start by the flag's name
    for kw, flag in (({"timeout_s": float("nan")}, "--timeout"), ({"timeout_s": float("inf")}, "--timeout"),
                     ({"connect_timeout_s": float("nan")}, "--connect-timeout")):
        with pytest.raises(ValueError, match=flag):
            ProxyConfig(prefill=("http://a",), decode=("http://b",), **kw)
    for token in ("a\nb", "secret-é"):  # every release call would fail (reports dropped, blocks held a lease)
        with pytest.raises(ValueError, match="bootstrap token"):
            ProxyConfig(prefill=("http://a",), decode=("http://b",), bootstrap_token=token)


@pytest.mark.parametrize("kw,option,field", [
    ({"prefill_engine_ids": ("e" * 257,)}, "--prefill-engine-id", "remote_engine_id"),
    ({"prefill_engine_ids": ("",)}, "--prefill-engine-id", "remote_engine_id"),
    ({"prefill_bootstrap": ("http://b:1/kv",)}, "--prefill-bootstrap", "remote_bootstrap_addr"),
    ({"prefill_bootstrap": ("ftp://b:1",)}, "--prefill-bootstrap", "remote_bootstrap_addr"),
])
def test_pairing_options_follow_the_params_rules_at_start_up(kw, option, field):
    """They become decode's kv_transfer_params: a value decode would refuse is refused when the proxy starts,
    not on every concurrent request."""
    kw = {"prefill_bootstrap": ("http://b:1",)} | kw
    with pytest.raises(ValueError, match=f"{option}.*{field}"):
        ProxyConfig(prefill=("http://a",), decode=("http://d",), mode="concurrent", **kw)


def test_prefill_bootstrap_is_kept_in_the_form_decode_gets():
    cfg = ProxyConfig(prefill=("http://a",), decode=("http://d",), mode="concurrent", prefill_bootstrap=("b:1/",))
    assert cfg.bootstrap_for(0) == "http://b:1"


def test_the_proxy_traces_both_legs_of_a_concurrent_request(traced, backends, proxy):
    url = proxy(prefill=(backends("p0").url,), decode=(backends("d0").url,), mode="concurrent",
                prefill_bootstrap=("http://127.0.0.1:9999",), prefill_engine_ids=("eng-p0",))
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": "x", "max_tokens": 4}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        assert r.status == 200
    assert wait_for(lambda: len(trace_lines(traced)) >= 5)  # decode's answer does not wait for prefill's
    evs = [e["ev"] for e in trace_lines(traced)]
    assert evs[0] == "proxy_request"
    assert sorted(evs[1:]) == ["proxy_decode_answer", "proxy_decode_sent", "proxy_prefill_answer",
                               "proxy_prefill_sent"]
    # Prefill's compute is the critical path: its request is on the wire before decode's is written.
    assert evs.index("proxy_prefill_sent") < evs.index("proxy_decode_sent"), evs


def health(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def test_decode_answer_does_not_wait_for_a_stuck_concurrent_prefill(backends, proxy):
    """Decode answered without prefill's KV (it recomputed the prompt after its wait): the client gets the
    answer at once, not when prefill ends, and prefill's request is cancelled soon after, so an overloaded
    prefill stops computing for nobody."""
    p, d = backends("p0", "hang"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,), mode="concurrent", timeout_s=30.0,
                prefill_bootstrap=("http://127.0.0.1:1",))
    t0 = time.monotonic()
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status == 200 and json.loads(raw)["from"] == "d0"
    assert time.monotonic() - t0 < 5, "the answer waited for prefill"
    assert wait_for(lambda: p.cancelled == 1), "prefill still running after decode answered"
    assert health(url)["failed"] == 0


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_min_tokens_stays_with_decode(backends, proxy, mode):
    """Prefill computes one token: vLLM refuses min_tokens above max_tokens, so prefill's copy drops it and
    decode's keeps it."""
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,), mode=mode,
                prefill_bootstrap=("http://127.0.0.1:1",) if mode == "concurrent" else ())
    assert post(url + "/v1/completions", {"prompt": "x", "max_tokens": 8, "min_tokens": 4})[0] == 200
    assert wait_for(lambda: p.bodies)
    (_, pre), (_, dec) = p.bodies[0], d.bodies[0]
    assert pre["max_tokens"] == 1 and "min_tokens" not in pre
    assert dec["max_tokens"] == 8 and dec["min_tokens"] == 4


def _client_gone_at(backends, proxy, monkeypatch, method: str, first_only: bool):
    """The proxy's streamed answer to a client that hung up: its ``method`` (write, prepare) raises as aiohttp
    does then (a ClientError, like a broken decode stream). Returns (/health, what was written)."""
    import aiohttp
    from aiohttp import web

    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    real = getattr(web.StreamResponse, method)
    calls = []

    async def failing(self, arg):
        if "Cache-Control" in self.headers:  # the proxy's answer, not the fake decode's
            calls.append(arg)
            if len(calls) == 1 or not first_only:
                raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await real(self, arg)

    monkeypatch.setattr(web.StreamResponse, method, failing)
    try:
        post(url + "/v1/completions", {"prompt": "x", "stream": True}, timeout=5)
    except OSError:
        pass  # the response may end abruptly
    assert wait_for(lambda: health(url)["client_gone"] == 1), (health(url), calls)
    return health(url), calls


def test_client_gone_mid_stream_is_not_a_decode_failure(backends, proxy, monkeypatch):
    """Writing to a client that hung up fails in aiohttp with a ClientError, like a broken decode stream; it
    must be told apart: no error event, no failure counted against decode."""
    h, writes = _client_gone_at(backends, proxy, monkeypatch, "write", first_only=True)
    assert h["failed"] == 0 and h["served"] == 0
    assert not any(b"error" in w for w in writes), writes


def test_a_concurrent_prefill_that_fails_at_once_lets_decode_compute_without_waiting(backends, proxy):
    """Prefill refuses the connection before decode's request is written: decode gets the request without a
    remote source (it computes the prompt) instead of waiting for a transfer nobody will publish."""
    from tests.proxy.conftest import free_port

    d = backends("d0")
    url = proxy(prefill=(f"http://127.0.0.1:{free_port()}",), decode=(d.url,), mode="concurrent",
                prefill_bootstrap=("http://127.0.0.1:1",))
    # the client's own kv_transfer_params (naming another request's blocks) must not reach decode either
    sneaky = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:2", "remote_engine_id": "pre",
              "remote_request_id": "someone-else", "remote_block_ids": [0, 1, 2]}
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4, "kv_transfer_params": sneaky})
    assert status == 200 and json.loads(raw)["from"] == "d0"
    (_, dec), = d.bodies
    assert "kv_transfer_params" not in dec and dec["max_tokens"] == 4


def test_a_stream_longer_than_the_timeout_lives_while_its_tokens_keep_coming(backends, proxy):
    """--timeout bounds decode's silence, not the length of a generation: six events 0.3 s apart (1.8 s)
    pass through a proxy with a 1 s timeout."""
    p, d = backends("p0"), backends("d0", "slow_stream")
    url = proxy(prefill=(p.url,), decode=(d.url,), timeout_s=1.0)
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "stream": True})
    events = raw.decode().strip().split("\n\n")
    assert status == 200 and events[-1] == "data: [DONE]", events[-2:]
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == list(range(6))
    assert health(url)["failed"] == 0


def released(srv, engine_id, rid):
    from kvlink.bootstrap import BootstrapClient
    from kvlink.bootstrap.schema import RequestStatus
    from tests.bootstrap.conftest import TOKEN

    with BootstrapClient(srv.url, token=TOKEN) as cli:
        return cli.lookup(engine_id, [rid])[rid] is RequestStatus.RELEASED


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_a_prefill_request_decode_never_took_is_reported_abandoned(backends, proxy, bootstrap, tmp_path, mode):
    """Decode is down: prefill's finished request would hold its blocks until its lease ran out. The proxy
    reports it abandoned at prefill's bootstrap server (with the token), so prefill frees them now."""
    from kvlink.proxy.cli import _add_arguments, config_from_args
    from tests.bootstrap.conftest import TOKEN
    from tests.proxy.conftest import free_port
    import argparse

    p = FakeVLLMServer("p0", bootstrap_url=bootstrap.url, publish=True, token=TOKEN)
    try:
        token = tmp_path / "token"
        token.write_text(TOKEN + "\n")
        ap = argparse.ArgumentParser()
        _add_arguments(ap)
        cfg = config_from_args(ap.parse_args([
            "--prefill", p.url, "--decode", f"http://127.0.0.1:{free_port()}", "--mode", mode,
            "--prefill-bootstrap", bootstrap.url, "--bootstrap-token-file", str(token)]))
        assert TOKEN not in repr(cfg)
        url = proxy(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
        status, _, raw = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})
        assert status == 502 and json.loads(raw)["error"]["stage"] == "decode"
        assert wait_for(lambda: len(p.published) == 1)
        assert wait_for(lambda: released(bootstrap, "p0", p.published[0])), "prefill's blocks still held"
        assert health(url)["prefill_abandoned"] == 1
    finally:
        p.stop()


def test_a_request_decode_answered_is_left_to_decode(backends, proxy, bootstrap):
    """Decode took the request: only decode may report it (its READs are trusted on prefill holding the
    blocks), so the proxy does not."""
    from tests.bootstrap.conftest import TOKEN

    p = FakeVLLMServer("p0", bootstrap_url=bootstrap.url, publish=True, token=TOKEN)
    try:
        d = backends("d0")
        url = proxy(prefill=(p.url,), decode=(d.url,))
        assert post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})[0] == 200
        time.sleep(0.5)
        assert p.published and not released(bootstrap, "p0", p.published[0])
        assert health(url)["prefill_abandoned"] == 0
    finally:
        p.stop()


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_prefill_never_computes_logprobs_and_prompt_logprobs_go_to_decode_alone(backends, proxy, mode):
    """Prefill's leg is one token and its params: logprob fields only make its answer large (with echo or
    prompt_logprobs, one entry per prompt token). A request for prompt logprobs goes to decode alone: vLLM
    computes those only over a prompt it computes itself, so prefill's work would be for nobody."""
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,), mode=mode,
                prefill_bootstrap=("http://127.0.0.1:1",) if mode == "concurrent" else ())
    assert post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 2, "echo": False})[0] == 200
    assert wait_for(lambda: p.bodies)
    (_, pre), (_, dec) = p.bodies[0], d.bodies[0]
    assert not {"logprobs", "echo"} & set(pre) and dec["logprobs"] == 2
    for path, ask in (("/v1/completions", {"prompt_logprobs": 3}), ("/v1/completions", {"prompt_logprobs": 0}),
                      ("/v1/completions", {"echo": True, "logprobs": 0}), ("/v1/chat/completions", {"echo": True})):
        prompt = {"messages": [{"role": "user", "content": "y"}]} if "chat" in path else {"prompt": "y"}
        status, _, raw = post(url + path, {**prompt, "max_tokens": 4, **ask})
        assert status == 200 and json.loads(raw)["from"] == "d0"
        assert d.bodies[-1][1].get("kv_transfer_params") is None and len(p.bodies) == 1, ask
    assert post(url + "/v1/completions", {"prompt": "z", "echo": True})[0] == 200  # echo alone: no prompt logprobs
    assert wait_for(lambda: len(p.bodies) == 2)


def test_a_prefill_answer_larger_than_a_token_and_its_params_is_a_502(backends, proxy):
    p, d = backends("p0", "huge"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
    assert status == 502 and "larger than" in json.loads(raw)["error"]["message"] and not d.bodies


@pytest.mark.parametrize("body,why", [(b"[" * 200_000, "nested too deeply"),
                                      (b'{"seed": ' + b"9" * 5000 + b"}", "digits"),
                                      (b"\xff\xfe{", "not valid JSON"),
                                      (b'{"prompt": "x", "temperature": NaN}', "NaN is not JSON"),
                                      (b'{"prompt": "x", "temperature": 1e400}', "1e400 is out of range")])
def test_bodies_the_parser_chokes_on_are_json_400s_naming_why(backends, proxy, body, why):
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url,), decode=(d.url,))
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json; charset=nope"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=10)
    assert ei.value.code == 400
    answer = json.loads(ei.value.read())
    assert why in answer["error"]["message"] and not p.bodies


def test_a_client_gone_before_the_headers_is_not_a_decode_failure(backends, proxy, monkeypatch):
    h, _ = _client_gone_at(backends, proxy, monkeypatch, "prepare", first_only=False)
    assert h["failed"] == 0


def test_a_prefill_url_listed_twice_pairs_each_listing_with_its_own_engine_id(backends, proxy):
    p, d = backends("p0"), backends("d0")
    url = proxy(prefill=(p.url, p.url), decode=(d.url,), mode="concurrent",
                prefill_bootstrap=("http://127.0.0.1:1",), prefill_engine_ids=("e0", "e1"))
    for _ in range(4):
        assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200
    assert [b["kv_transfer_params"]["remote_engine_id"] for _, b in d.bodies] == ["e0", "e1", "e0", "e1"]


def test_backend_bodies_are_written_as_the_client_wrote_them():
    """The proxy encodes backend bodies with msgspec (a body of token ids is encoded on the event loop, where
    every other client's stream waits); what msgspec will not write goes through json.dumps, so every body
    the parser took reaches the backends with the same values."""
    from kvlink.proxy.router import _encode, _parse

    for raw in (b'{"prompt": [1, 2, 3], "temperature": 0.7, "stop": ["\\u00e9"]}',
                b'{"seed": ' + b"9" * 30 + b'}',  # beyond 64 bits
                b'{"prompt": "\\ud800"}'):  # a lone surrogate
        body = _parse(raw)
        assert json.loads(_encode(body)) == body
