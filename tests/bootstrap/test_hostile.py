"""Hostile and malformed input over raw HTTP: exact status codes, the culprit field named, never a 5xx."""

from __future__ import annotations

import http.client
import json
import pathlib
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = [
    "/v1/engine/register", "/v1/engine/heartbeat", "/v1/engine/unregister", "/v1/engine/get",
    "/v1/engine/ranks", "/v1/request/publish", "/v1/request/lookup", "/v1/request/lookup_transfer",
    "/v1/request/renew", "/v1/request/release", "/v1/request/poll_released",
]


def reg_body(**overrides) -> dict:
    reg = {
        "engine_id": "P", "tp_rank": 0, "tp_size": 1, "transport_addr": "127.0.0.1:5000",
        "layers": [{"name": "l0", "region_id": 0, "block_bytes": 4096, "num_blocks": 8,
                    "tokens_per_block": 16, "dtype": "bfloat16", "layout": "NHD"}],
        "protocol_version": 1, "compat_hash": "h",
    }
    reg.update(overrides)
    return {"registration": reg, "lease_s": 30.0}


@pytest.fixture
def registered(raw):
    status, _ = raw.post("/v1/engine/register", reg_body())
    assert status == 200
    return "P"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/request/publish", {"engine_id": "P", "request_id": "r", "block_ids": [[1]], "num_tokens": "7"},
         "num_tokens"),
        ("/v1/request/publish", {"engine_id": "P", "request_id": "r", "block_ids": [[1, "x"]], "num_tokens": 7},
         "block_ids[0][1]"),
        ("/v1/request/publish", {"engine_id": "P", "request_id": "r", "block_ids": [[1]], "num_tokens": 1.5},
         "num_tokens"),
        ("/v1/request/publish", {"engine_id": "P", "request_id": "", "block_ids": [[1]], "num_tokens": 1},
         "request_id"),
        ("/v1/request/publish", {"engine_id": "P", "request_id": "r", "block_ids": [[1]], "num_tokens": 1,
                                 "lease_s": -1}, "lease_s"),
        ("/v1/request/publish", {"engine_id": "P", "request_id": "r", "block_ids": [[1]], "num_tokens": True},
         "num_tokens"),
        ("/v1/request/publish", {"engine_id": "P", "request_id": "r", "num_tokens": 1}, "block_ids"),
        ("/v1/request/publish", {"engine_id": "P", "request_id": "r", "block_ids": [[1]], "num_tokens": 1,
                                 "sneaky": 1}, "sneaky"),
        ("/v1/engine/register", reg_body(block_size=16), "registration.block_size"),
        ("/v1/engine/register", reg_body(tp_rank=2, tp_size=2), "registration.tp_rank"),
        ("/v1/engine/register", reg_body(tp_rank=-1), "registration.tp_rank"),
        ("/v1/engine/register", reg_body(transport_addr="nohost"), "registration.transport_addr"),
        ("/v1/engine/register", reg_body(transport_addr="h:99999"), "registration.transport_addr"),
        ("/v1/engine/register", reg_body(layers=[{"name": "l0"}]), "registration.layers[0].region_id"),
        ("/v1/engine/register", {"registration": reg_body()["registration"]}, "lease_s"),
        ("/v1/request/release", {"engine_id": "P", "request_id": "r", "outcome": "expired"}, "outcome"),
        ("/v1/request/release", {"engine_id": "P", "request_id": "r", "outcome": "PULLED"}, "outcome"),
        ("/v1/request/release", {"engine_id": "P", "request_id": "r", "outcome": 1}, "outcome"),
        ("/v1/request/release", {"engine_id": "P", "request_id": "r"}, "outcome"),
        ("/v1/request/lookup", {"engine_id": "P", "request_ids": []}, "request_ids"),
        ("/v1/request/lookup", {"engine_id": "P", "request_ids": ["r"] * 513}, "request_ids"),
        ("/v1/request/lookup", {"engine_id": "P", "request_ids": ["r"], "wait_s": 1e9}, "wait_s"),
        ("/v1/request/lookup", {"engine_id": "P", "request_ids": "r"}, "request_ids"),
        ("/v1/request/lookup_transfer", {"transfer_id": "x" * 600}, "transfer_id"),
        ("/v1/request/poll_released", {"engine_id": "P", "ack": -1}, "ack"),
        ("/v1/transfer/abandon", {"transfer_id": "t", "request_id": ""}, "request_id"),
        ("/v1/transfer/abandon", {"engine_id": "", "transfer_id": "t"}, "engine_id"),
        ("/v1/engine/register", reg_body(instance=""), "registration.instance"),
        ("/v1/engine/register", reg_body(instance="x" * 65), "registration.instance"),
    ],
)
def test_bad_fields_are_named(raw, registered, path, body, field):
    status, answer = raw.post(path, body)
    assert status == 400, answer
    assert answer["code"] == "invalid"
    assert answer["field"] == field
    assert answer["error"]


def test_outcomes_travel_as_their_strings(raw, registered):
    """The wire format of an outcome is its value; the Outcome enum is only Python's view of it."""
    publish = {"engine_id": "P", "block_ids": [[1]], "num_tokens": 16, "lease_s": 30.0}
    for rid in ("p", "a"):
        assert raw.post("/v1/request/publish", publish | {"request_id": rid})[0] == 200
    for rid, outcome in (("p", "pulled"), ("a", "abandoned")):
        status, answer = raw.post("/v1/request/release", {"engine_id": "P", "request_id": rid, "outcome": outcome})
        assert (status, answer) == (200, {"already_released": False})
    status, answer = raw.post("/v1/request/poll_released", {"engine_id": "P"})
    assert status == 200
    assert [(r["request_id"], r["outcome"]) for r in answer["released"]] == [("p", "pulled"), ("a", "abandoned")]


@pytest.mark.parametrize("body", [b"{", b"", b"\xff\xfe\x00garbage", b"null", b"[1, 2]", b'"a string"',
                                  b'{"engine_id": "P", "engine_id": 1}', b"NaN",
                                  b'{"engine_id": "P", "request_ids": ["\xff\xfe"]}',  # not UTF-8 inside a string
                                  b'{"engine_id": "P", "request_ids": ["x\\udcff"]}'])  # a lone surrogate
def test_malformed_json_is_a_400(raw, registered, body):
    status, answer = raw.post("/v1/request/lookup", body)
    assert status == 400 and answer["code"] == "invalid"


def test_oversized_bodies_are_refused(raw, server, token):
    big = json.dumps({"engine_id": "P", "request_ids": ["x" * 500] * 1000})  # ~500 KiB > 256 KiB
    status, answer = raw.post("/v1/request/lookup", big)
    assert status == 413 and answer["code"] == "too_large"
    # Chunked, so the server cannot see the size up front.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.putrequest("POST", "/v1/request/lookup")
    conn.putheader("Authorization", f"Bearer {token}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"x" * 65536
    try:
        for _ in range(8):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
    except OSError:
        pass  # the server may close early; the answer is what matters
    response = conn.getresponse()
    assert response.status == 413
    conn.close()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "x-unknown"])
def test_compressed_bodies_are_refused(raw, server, registered, encoding):
    status, answer = raw.post("/v1/engine/ranks", b"\x1f\x8b garbage", headers={"Content-Encoding": encoding})
    assert status == 400
    # aiohttp's HTTP parser may refuse an encoding it cannot decode before the route runs (plain text).
    assert answer.get("field", "Content-Encoding") == "Content-Encoding"
    assert server.app.counters.errors.get("internal", 0) == 0


def test_broken_chunked_body_is_a_4xx(server, token):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/request/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
                     + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n")
        answer = sock.recv(64)
    assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer  # aiohttp's own parser answers
    assert server.app.counters.errors.get("internal", 0) == 0


def test_auth(raw, registered):
    body = {"engine_id": "P"}
    assert raw.post("/v1/engine/ranks", body, token=None) == (
        401, {"error": "missing bearer token", "code": "unauthorized", "field": "Authorization"})
    assert raw.post("/v1/engine/ranks", body, token="nope")[0] == 401
    assert raw.post("/v1/engine/ranks", body, token=None, headers={"Authorization": "Basic dXNlcjpwYXNz"})[0] == 401
    assert raw.post("/v1/engine/ranks", body, token=None, headers={"Authorization": "Bearer"})[0] == 401
    assert raw.post("/v1/engine/ranks", body, token="t\u00e9st")[0] == 401
    # Unknown routes and /metrics also fail closed: no route is revealed without the token.
    assert raw.post("/v1/nope", body, token=None)[0] == 401
    assert raw.request("GET", "/metrics", token=None)[0] == 401
    assert raw.request("GET", "/health", token=None)[0] == 200
    assert raw.post("/v1/engine/ranks", body)[0] == 200


def test_unknown_routes_and_methods(raw):
    status, answer = raw.post("/v1/nope", {})
    assert (status, answer["code"]) == (404, "not_found")
    status, answer = raw.request("GET", "/v1/request/lookup")
    assert (status, answer["code"]) == (405, "method_not_allowed")
    status, answer = raw.request("DELETE", "/health")
    assert status == 405


def test_not_found_and_gone_statuses(raw, registered):
    assert raw.post("/v1/request/lookup", {"engine_id": "X", "request_ids": ["r"]})[1]["code"] == "unknown_engine"
    status, answer = raw.post("/v1/request/lookup_transfer", {"transfer_id": "t"})
    assert (status, answer["code"], answer["field"]) == (404, "unknown_request", "transfer_id")
    status, answer = raw.post("/v1/request/lookup_transfer", {"transfer_id": "t", "wait_s": 0.05})
    assert (status, answer["code"]) == (404, "wait_timeout")
    status, answer = raw.post("/v1/engine/register", reg_body(compat_hash="other"))
    assert (status, answer["code"], answer["field"]) == (409, "conflict", "registration.compat_hash")


def test_garbage_on_the_socket_does_not_hurt(raw, server):
    """Broken HTTP framing is answered by aiohttp's parser (plain-text 400) or by closing; never a 5xx."""
    for junk in (b"\x00\x01\x02\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/request/lookup HTTP/1.1\r\n"
                 b"Content-Length: -5\r\n\r\n", b"A" * 70000 + b"\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            data = sock.recv(4096)
            assert not data.startswith(b"HTTP/1.1 5") and not data.startswith(b"HTTP/1.0 5")
    assert raw.request("GET", "/health")[0] == 200


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=25,
)
known_keys = st.sampled_from(["engine_id", "request_id", "request_ids", "transfer_id", "block_ids", "num_tokens",
                              "lease_s", "wait_s", "outcome", "registration", "ack", "server_id", "tp_rank"])
bodies = st.dictionaries(known_keys, json_values, max_size=8) | json_values


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(ROUTES), body=bodies)
def test_fuzzed_bodies_never_cause_a_5xx(raw, registered, path, body):
    status, answer = raw.post(path, json.dumps(body))
    assert status < 500, answer
    if status != 200:
        assert set(answer) == {"error", "code", "field"}


def test_no_pickle_in_the_package():
    root = pathlib.Path(__file__).resolve().parents[2] / "kvlink" / "bootstrap"
    sources = list(root.glob("*.py"))
    assert sources
    for source in sources:
        assert "pickle" not in source.read_text(), source


def test_a_string_that_is_not_unicode_never_reaches_a_table():
    """A Python str may hold a lone surrogate (a client's JSON escape in its request id, through vLLM): the
    embedded server's in-process publish would have stored it, and every later answer naming it (lookups,
    the engine's outcome polls) failed to encode: a 500 for every outcome of that engine."""
    from kvlink.bootstrap import BootstrapClient, InvalidField
    from kvlink.bootstrap.schema import PublishBody, checked

    with pytest.raises(InvalidField, match="not valid Unicode"):
        checked(PublishBody, engine_id="P", request_id="cmpl-\udcff", block_ids=[[1]], num_tokens=16)
    with BootstrapClient("http://127.0.0.1:9", timeout_s=0.5) as cli:  # refused before anything is sent
        with pytest.raises(InvalidField, match="not valid Unicode"):
            cli.publish("P", "cmpl-\udcff", [[1]], 16, lease_s=30.0)


def test_a_silent_connection_and_a_body_that_never_comes_are_let_go(token):
    """Without limits a connection that sends nothing was kept for aiohttp's default hour, so a few thousand
    of them (no token needed) left the server unable to accept anyone; a body announced and never sent held
    its handler for good."""
    import time

    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    cfg = BootstrapConfig(host="127.0.0.1", port=0, token=token, idle_timeout_s=0.5, body_timeout_s=0.5)
    with BootstrapServer(cfg) as srv:
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        t0 = time.monotonic()
        assert silent.recv(1) == b""  # closed by the server
        assert time.monotonic() - t0 < 5.0
        silent.close()
        slow = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        slow.sendall(b"POST /v1/request/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"engine")
        answer = b""
        while b"body not received" not in answer and (chunk := slow.recv(4096)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 400") and b"body not received within 0.5 s" in answer
        slow.close()


def test_an_answer_this_client_cannot_read_names_version_skew():
    """A server of another protocol version answering a field this client does not know: a BootstrapError
    that says so, not a bare msgspec error the caller does not handle."""
    import http.server
    import threading

    from kvlink.bootstrap import BootstrapClient, BootstrapError

    class Newer(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"ok": true, "from_the_future": 1}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Newer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with BootstrapClient(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=5.0) as cli:
            with pytest.raises(BootstrapError, match="another kvlink version") as err:
                cli.publish("P", "r1", [[1]], 16, lease_s=30.0)
        assert "from_the_future" in str(err.value)
        from kvlink.vllm.producer import _maybe_applied

        assert _maybe_applied(err.value)  # it answered 200: it applied the publish, whatever else it said
    finally:
        srv.shutdown()
        srv.server_close()
