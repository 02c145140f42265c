"""kvlink proxy against backends and clients that misbehave in one way each (a review's findings): every
request ends within the proxy's timeout, memory stays flat, the client hears an error that names the
failure, and prefill's KV is reported not taken whenever decode's answer did not go through."""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from tests.bootstrap.conftest import TOKEN
from tests.fakes_vllm_server import FakeVLLMServer, RawVLLMServer, ScriptedVLLMServer
from tests.proxy.test_router import health, post, released, wait_for


@pytest.fixture
def scripted():
    made = []

    def make(name, handler, **kw):
        made.append(ScriptedVLLMServer(name, handler, **kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def test_a_decode_that_never_reads_the_body_ends_within_the_timeout(proxy):
    """Decode accepts the connection and reads nothing (a frozen server the kernel still accepts for): the
    request body (16 MiB) cannot be written, so no read timeout ever starts; the headers' own bound ends it."""
    p = RawVLLMServer("answer")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    accepted = []  # (kept: a connection closed would fail the write at once)
    threading.Thread(target=lambda: accepted.append(hole.accept()), daemon=True).start()
    try:
        url = proxy(prefill=(p.url,), decode=(f"http://127.0.0.1:{hole.getsockname()[1]}",), timeout_s=1.0)
        t0 = time.monotonic()
        status, _, raw = post(url + "/v1/completions", {"prompt": "x" * (16 << 20)}, timeout=30)
        assert status == 504 and b"no answer within 1 s" in raw and time.monotonic() - t0 < 10
    finally:
        hole.close()
        p.stop()


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_a_decode_stream_that_stalls_reports_prefills_kv_not_taken(bootstrap, proxy, scripted, mode):
    """Decode sends its stream's headers and then nothing: the client gets an error event naming decode, and
    prefill's published request is reported abandoned (before: only a non-streamed 504 was)."""
    async def stall(self, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(10)
        return resp

    p = FakeVLLMServer("p0", bootstrap_url=bootstrap.url, publish=True, token=TOKEN)
    d = scripted("d0", stall)
    try:
        url = proxy(prefill=(p.url,), decode=(d.url,), timeout_s=1.0, mode=mode, bootstrap_token=TOKEN,
                    prefill_bootstrap=(bootstrap.url,), prefill_engine_ids=("p0",))
        status, _, raw = post(url + "/v1/completions", {"prompt": "x", "stream": True})
        assert status == 200 and b'"stage": "decode"' in raw and b"nothing for 1 s" in raw
        assert wait_for(lambda: len(p.published) == 1)
        assert wait_for(lambda: released(bootstrap, "p0", p.published[0]), 5)
        assert health(url)["failed"] == 1
    finally:
        p.stop()


@pytest.mark.parametrize("chunks", [[b'data: {"i": 0}\n\ndata: {"i": 1, "te'],
                                    [b'data: {"i": 0}\n\n', b'data: {"i": 1, "te']],
                         ids=["cut event after a whole one", "cut event in a chunk of its own"])
def test_an_error_event_after_a_cut_event_is_an_event_of_its_own(backends, proxy, scripted, chunks):
    """The cut event is dropped (an SSE parser would take it for a whole one and fail on its JSON), also when
    its first bytes came in a chunk holding no whole event (a byte of it once went on for each such chunk,
    and the error event glued to it, "ddata: ...", was a field parsers ignore: the client never heard that
    decode's stream broke). Every event the client gets parses; the last one names decode's failure."""
    async def cut(self, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
            await asyncio.sleep(0.1)
        request.transport.close()
        return resp

    url = proxy(prefill=(backends("p0").url,), decode=(scripted("d0", cut).url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "stream": True})
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and all(e.startswith("data: ") for e in events), events
    assert [json.loads(e.removeprefix("data: ")).get("i") for e in events[:-1]] == [0]
    assert json.loads(events[-1].removeprefix("data: "))["error"]["stage"] == "decode"


def test_a_large_decode_answer_streams_through_without_being_held(backends, proxy, scripted):
    """A 300 MiB non-streamed answer (a garbage backend, or prompt logprobs of a long prompt) goes through as
    it comes: the first bytes arrive before the last are sent, and the proxy (in this process) does not grow
    by the answer's size."""
    mib = 1 << 20

    async def huge(self, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for _ in range(300):
            await resp.write(b"x" * mib)
        await resp.write_eof()
        return resp

    url = proxy(prefill=(backends("p0").url,), decode=(scripted("d0", huge).url,), timeout_s=30.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    req = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "x"}',
                                 headers={"Content-Type": "application/json"})
    n = 0
    with urllib.request.urlopen(req, timeout=60) as r:
        while chunk := r.read(mib):
            n += len(chunk)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert n == 300 * mib and grown_mib < 100, grown_mib


def test_a_decode_content_type_aiohttp_cannot_build_is_passed_through(bootstrap, proxy, scripted):
    """``application/json,charset=utf-8`` (a comma for the semicolon) made the proxy's own response raise: a
    bare 500 counted as served, and prefill's KV not reported. It is passed through as decode gave it."""
    async def odd(self, request, body):
        return web.Response(body=b'{"error": "x"}', status=400, headers={"Content-Type": "application/json,charset=utf-8"})

    p = FakeVLLMServer("p0", bootstrap_url=bootstrap.url, publish=True, token=TOKEN)
    try:
        url = proxy(prefill=(p.url,), decode=(scripted("d0", odd).url,), bootstrap_token=TOKEN)
        status, ctype, raw = post(url + "/v1/completions", {"prompt": "x"})
        assert (status, ctype, raw) == (400, "application/json,charset=utf-8", b'{"error": "x"}')
        assert wait_for(lambda: len(p.published) == 1)
        assert wait_for(lambda: released(bootstrap, "p0", p.published[0]), 5)
    finally:
        p.stop()


def test_a_client_that_stops_reading_lets_decode_go_within_the_timeout(backends, proxy, scripted):
    state = {"done": None}

    async def flood(self, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(2000):
                await resp.write(b"data: " + b"y" * 65536 + b"\n\n")
        except BaseException as e:
            state["done"] = type(e).__name__
            raise
        state["done"] = "finished"
        return resp

    url = proxy(prefill=(backends("p0").url,), decode=(scripted("d0", flood).url,), timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = b'{"prompt": "x", "stream": true}'
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        assert wait_for(lambda: state["done"] is not None, 10)  # decode's request ended (closed by the proxy)
        assert state["done"] != "finished" and wait_for(lambda: health(url)["client_gone"] == 1)
    finally:
        s.close()


def test_requests_both_backends_refuse_take_no_report(bootstrap, proxy, scripted, monkeypatch):
    """Concurrent pairing, a request both vLLM servers refuse (400): prefill published nothing, so nothing is
    reported (each report waits up to 2 s for a record on one of four threads: a flood of bad requests would
    crowd out real reports)."""
    from kvlink.proxy import release

    monkeypatch.setattr(release, "MAX_PENDING", 4)  # (reports waiting beyond it are dropped and counted)

    async def bad(self, request, body):
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    url = proxy(prefill=(scripted("p0", bad).url,), decode=(scripted("d0", bad).url,), mode="concurrent",
                prefill_bootstrap=(bootstrap.url,), prefill_engine_ids=("p0",), bootstrap_token=TOKEN)
    for _ in range(20):
        assert post(url + "/v1/completions", {"prompt": "x"})[0] == 400
    h = health(url)
    assert h["prefill_abandoned"] == 0 and h["reports_dropped"] == 0


def test_abandons_are_bounded_too(proxy, scripted, monkeypatch):
    """A prefill that fails by itself has its transfer id given up at its bootstrap server; with that server
    hung, those calls pile up: at most MAX_PENDING wait, the rest are dropped and counted."""
    from kvlink.proxy import release

    monkeypatch.setattr(release, "MAX_PENDING", 8)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1024)  # accepts (in its backlog), never answers

    async def fail(self, request, body):
        await asyncio.sleep(0.05)
        return web.json_response({"error": "boom"}, status=500)

    async def ok(self, request, body):
        return web.json_response({"choices": [{"text": "hi"}]})

    try:
        url = proxy(prefill=(scripted("p0", fail).url,), decode=(scripted("d0", ok).url,), mode="concurrent",
                    prefill_bootstrap=(f"http://127.0.0.1:{hole.getsockname()[1]}",), prefill_engine_ids=("p0",),
                    bootstrap_token=TOKEN, connect_timeout_s=2.0)
        for _ in range(30):
            assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200
        assert wait_for(lambda: health(url)["reports_dropped"] > 0)
    finally:
        hole.close()


def test_a_body_nested_deeper_than_the_backends_can_be_sent_is_a_400(backends, proxy):
    url = proxy(prefill=(backends("p0").url,), decode=(backends("d0").url,))
    for depth in (300, 980, 2000):
        body = ('{"prompt": "x", "x": ' + "[" * depth + "]" * depth + "}").encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400 and b"nest" in e.value.read()
    assert post(url + "/v1/completions", {"prompt": "x", "x": [[[[1]]]]})[0] == 200


def _raw_decode(reply: bytes):
    """A decode that reads one request and sends ``reply`` (raw HTTP bytes), then closes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                head, _, buf = buf.partition(b"\r\n\r\n")
                n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
                while len(buf) < n:
                    buf += conn.recv(65536)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


def test_a_json_answer_cut_short_is_cut_short_for_the_client(backends, proxy):
    """Decode promises 1,000 bytes and sends 20: the client's read ends incomplete at once (the headers are
    sent as the answer starts; before, the client waited for the rest until its own timeout)."""
    srv, durl = _raw_decode(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                            b'{"choices": [{"text"')
    try:
        url = proxy(prefill=(backends("p0").url,), decode=(durl,), timeout_s=1.0)
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=20)
        conn.request("POST", "/v1/completions", body='{"prompt": "x"}', headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        t0 = time.monotonic()
        with pytest.raises(http.client.IncompleteRead):
            answer.read()
        assert time.monotonic() - t0 < 10 and wait_for(lambda: health(url)["failed"] == 1)
    finally:
        srv.close()


def test_a_compressed_decode_answer_arrives_whole(backends, proxy):
    import gzip

    body = json.dumps({"choices": [{"text": "hello " * 200}]}).encode()
    z = gzip.compress(body)
    srv, durl = _raw_decode(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(z), z))
    try:
        url = proxy(prefill=(backends("p0").url,), decode=(durl,))
        assert post(url + "/v1/completions", {"prompt": "x"}) == (200, "application/json", body)
    finally:
        srv.close()


def test_a_client_gone_after_a_refusal_still_has_prefill_stopped_and_is_not_held_up(proxy, scripted, monkeypatch):
    """Concurrent pairing: decode refuses the request, prefill is still computing. The client reads its 400
    and hangs up (or sends its next request on the same connection): prefill's leg is still cancelled at
    once, in the background, and the next request is not held up by it."""
    async def bad(self, request, body):
        return web.json_response({"error": {"message": "too long"}}, status=400)

    p = FakeVLLMServer("p0", "hang")
    try:
        url = proxy(prefill=(p.url,), decode=(scripted("d0", bad).url,), mode="concurrent", timeout_s=5.0,
                    prefill_bootstrap=("http://127.0.0.1:1",))
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
        times = []
        for _ in range(3):
            t0 = time.monotonic()
            conn.request("POST", "/v1/completions", body='{"prompt": "x"}', headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            assert answer.status == 400
            answer.read()
            times.append(time.monotonic() - t0)
        conn.close()
        assert max(times) < 0.15, times  # (the 0.2 s wait for prefill's own answer runs beside them)
        assert wait_for(lambda: p.cancelled == 3, 2.0)  # within the 0.2 s wait, not at the 5 s timeout
    finally:
        p.stop()


def test_sequential_a_client_gone_as_decodes_refusal_is_written_still_reports_prefills_kv(
        backends, proxy, bootstrap, monkeypatch):
    """Decode refused the request (a 4xx: it never saw it, so its connector reports nothing) and the client is
    gone as the proxy writes that answer: prefill's KV is still reported not taken, as with the client there
    (it once waited out its lease)."""
    import aiohttp

    real = web.StreamResponse.prepare

    async def gone(self, request):
        if type(self) is web.StreamResponse:  # the proxy's answer (the fakes answer web.Response)
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await real(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", gone)
    p = FakeVLLMServer("p0", bootstrap_url=bootstrap.url, publish=True, token=TOKEN)
    try:
        d = backends("d0", "bad_request")
        url = proxy(prefill=(p.url,), decode=(d.url,), bootstrap_token=TOKEN)
        try:
            post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4}, timeout=5)
        except OSError:
            pass
        assert wait_for(lambda: health(url)["client_gone"] == 1)
        assert wait_for(lambda: len(p.published) == 1)
        assert wait_for(lambda: released(bootstrap, "p0", p.published[0]), 3), "prefill's blocks held to the lease"
    finally:
        p.stop()


def test_a_beam_search_request_is_not_a_502_blaming_the_prefill_config(backends, proxy, scripted):
    """vLLM runs ``use_beam_search`` through BeamSearchParams, which carry no kv_transfer_params: prefill's
    answer has ``"kv_transfer_params": null`` like a server without the connector. Such a request goes to
    decode alone (it was a 502 blaming prefill's configuration; concurrent pairing computed the prompt on
    prefill for nobody)."""
    async def vllm_like(self, request, body):
        params = None if body.get("use_beam_search") else {"do_remote_prefill": False}  # (refusal: decode computes)
        return web.json_response({"choices": [{"text": "h"}], "kv_transfer_params": params})

    url = proxy(prefill=(scripted("p0", vllm_like).url,), decode=(backends("d0").url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4, "use_beam_search": True, "n": 2})
    assert status == 200, raw


def test_the_clients_authorization_reaches_backends_that_need_it(proxy, scripted):
    """vLLM's --api-key answers 401 to a request without ``Authorization: Bearer <key>``: the client's key
    reaches both backends (and /v1/models), so the proxy fronts such servers."""
    async def keyed(self, request, body):
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return web.json_response({"choices": [{"text": "h"}], "kv_transfer_params": {"do_remote_prefill": False}})

    d = scripted("d0", keyed)
    url = proxy(prefill=(scripted("p0", keyed).url,), decode=(d.url,))
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers={"Authorization": "Bearer k"}),
                                timeout=10) as r:
        assert r.status == 200 and d.models_auth == ["Bearer k"]
    req = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "x"}',
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    assert status == 200


def test_concurrent_a_decode_5xx_gives_prefill_its_grace_like_a_4xx(backends, proxy, scripted):
    """connector.md: in concurrent pairing, when decode's answer did not go through (an error answer, a broken
    stream), prefill's own answer gets 0.2 s before its leg is cancelled: after a 5xx as after a 4xx (a 5xx
    once cancelled it at once, so its own error answer was never heard)."""
    cancelled = []

    async def slow_refusal(self, request, body):
        try:
            await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            cancelled.append(1)
            raise
        return web.json_response({"error": {"message": "engine dead"}}, status=500)

    for behavior, status in (("bad_request", 400), ("error500", 502)):
        cancelled.clear()
        url = proxy(prefill=(scripted("p0", slow_refusal).url,), decode=(backends("d0", behavior).url,),
                    mode="concurrent", prefill_bootstrap=("http://127.0.0.1:1",), prefill_engine_ids=("p0",))
        assert post(url + "/v1/completions", {"prompt": "x"})[0] == status
        time.sleep(0.5)
        assert not cancelled, f"decode {behavior}: prefill cancelled before its 0.2 s"


def test_a_decode_5xx_with_an_empty_body_is_named_as_empty(backends, proxy, scripted):
    async def empty(self, request, body):
        return web.Response(status=503, body=b"")

    url = proxy(prefill=(backends("p0").url,), decode=(scripted("d0", empty).url,))
    status, _, raw = post(url + "/v1/completions", {"prompt": "x"})
    message = json.loads(raw)["error"]["message"]
    assert status == 502 and "HTTP 503: b''" in message and "larger" not in message, message
