"""Client and embedded server over loopback HTTP: the whole pairing flow, leases, long polls, metrics."""

from __future__ import annotations

import contextlib
import http.client
import threading
import time

import msgspec
import pytest

from kvlink.bootstrap import (
    BootstrapClient,
    BootstrapConfig,
    BootstrapServer,
    BootstrapUnavailable,
    Conflict,
    InvalidField,
    LookupTimeout,
    Outcome,
    RequestExpired,
    RequestRecord,
    RequestReleased,
    RequestStatus,
    TableFull,
    TooManyWaiters,
    Unauthorized,
    UnknownEngine,
    UnknownRequest,
)
from kvlink.bootstrap.schema import AbandonTransferBody, PublishBody, StreamPiece, checked
from tests.bootstrap.conftest import TOKEN


@pytest.fixture
def engine(client, make_registration):
    client.register_engine(make_registration("P"), lease_s=600.0)
    return "P"


def test_full_pairing_flow(client, make_registration):
    regs = [make_registration("P", tp_rank=r, tp_size=2, port=5000 + r) for r in range(2)]
    assert [client.register_engine(r, lease_s=30.0) for r in regs] == [True, True]
    assert client.register_engine(regs[0], lease_s=30.0) is False
    client.heartbeat("P", tp_rank=1)
    assert client.get_engine("P", tp_rank=1) == regs[1]
    assert client.engine_ranks("P") == regs

    client.publish("P", "prefill-req-1-abc", [[1, 2, 3], [7]], 48, lease_s=30.0, transfer_id="xfer-1")
    client.publish("P", "prefill-req-2-def", [[4]], 16, lease_s=30.0)
    found = client.lookup("P", ["prefill-req-1-abc", "prefill-req-2-def", "nope"])
    record = found["prefill-req-1-abc"]
    assert isinstance(record, RequestRecord)
    assert (record.block_ids, record.num_tokens, record.transfer_id) == ([[1, 2, 3], [7]], 48, "xfer-1")
    assert 0 < record.lease_remaining_s <= 30.0
    assert found["nope"] is RequestStatus.UNKNOWN
    assert client.lookup_transfer("xfer-1") == record

    assert client.renew("P", ["prefill-req-1-abc", "nope"], lease_s=60.0)[0] == {"nope": RequestStatus.UNKNOWN}
    assert client.release("P", "prefill-req-1-abc", Outcome.PULLED) is False
    assert client.release("P", "prefill-req-1-abc", Outcome.PULLED) is True  # idempotent (vllm#50565)
    client.release("P", "prefill-req-2-def", Outcome.ABANDONED)
    polled = client.poll_released("P")
    assert polled == [("prefill-req-1-abc", Outcome.PULLED), ("prefill-req-2-def", Outcome.ABANDONED)]
    assert all(type(outcome) is Outcome for _, outcome in polled)  # an enum, not the string that travelled
    assert client.poll_released("P") == []  # each reported once
    assert client.lookup("P", ["prefill-req-1-abc"]) == {"prefill-req-1-abc": RequestStatus.RELEASED}
    with pytest.raises(RequestReleased):
        client.lookup_transfer("xfer-1")
    assert client.unregister_engine("P", tp_rank=0) is True


def test_expiry_is_reported_to_both_sides(client, clock, engine):
    client.publish(engine, "r1", [[1]], 16, lease_s=5.0, transfer_id="t1")
    clock.advance(5.0)
    assert client.lookup(engine, ["r1"]) == {"r1": RequestStatus.EXPIRED}
    with pytest.raises(RequestExpired) as err:
        client.lookup_transfer("t1")
    assert err.value.status == 410 and err.value.field == "transfer_id"
    with pytest.raises(RequestExpired):
        client.release(engine, "r1", Outcome.PULLED)
    assert client.poll_released(engine) == [("r1", Outcome.EXPIRED)]
    assert client.poll_released(engine) == []


def test_errors_map_to_exceptions(client, engine, make_registration):
    with pytest.raises(Conflict) as err:
        client.register_engine(make_registration("P", num_blocks=1), lease_s=30.0)
    assert err.value.status == 409 and err.value.field == "registration.layers"
    client.publish(engine, "r1", [[1]], 16, lease_s=30.0)
    with pytest.raises(Conflict):
        client.publish(engine, "r1", [[2]], 16, lease_s=30.0)
    with pytest.raises(UnknownEngine) as err:
        client.lookup("nobody", ["r1"])
    assert isinstance(err.value, BootstrapUnavailable)  # "cannot pair with that engine now"
    with pytest.raises(UnknownEngine):
        client.heartbeat("nobody")
    with pytest.raises(UnknownRequest):
        client.lookup_transfer("never")
    with pytest.raises(UnknownRequest):
        client.release(engine, "never", Outcome.ABANDONED)
    with pytest.raises(UnknownEngine):
        client.lookup_transfer("never", wait_s=5.0, engine_id="nobody")  # fast, no wait


def test_client_validates_before_sending(make_registration):
    cli = BootstrapClient("http://127.0.0.1:9", timeout_s=0.5)  # nothing listens: only validation runs
    with pytest.raises(InvalidField) as err:
        cli.publish("P", "r", [[1, -2]], 16, lease_s=1.0)
    assert err.value.field == "block_ids[0][1]"
    with pytest.raises(InvalidField) as err:
        cli.lookup("P", [])
    assert err.value.field == "request_ids"
    reg = make_registration("P")
    bad = msgspec.structs.replace(reg, layers=[msgspec.structs.replace(reg.layers[0], block_bytes=0)])
    with pytest.raises(InvalidField) as err:
        cli.register_engine(bad, lease_s=1.0)
    assert err.value.field == "registration.layers[0].block_bytes"
    with pytest.raises(InvalidField) as err:
        cli.release("P", "r", "pulled")  # the string is the wire's form; in Python an outcome is the enum
    assert err.value.field == "outcome"
    with pytest.raises(InvalidField) as err:
        cli.release("P", "r", Outcome.EXPIRED)  # the server's verdict, never decode's report
    assert err.value.field == "outcome"


@pytest.mark.parametrize("url", ["ftp://x", "", "http://", "http://a b:1", "http://h:1/prefix", "http://h:1?q=1",
                                 "http://u@h:1", "h:99999", "h:port", "http://[::1", "h" * 513])
def test_client_refuses_a_url_it_would_not_talk_to_as_given(url):
    with pytest.raises(InvalidField) as err:
        BootstrapClient(url, timeout_s=1.0)
    assert err.value.field == "url"


@pytest.mark.parametrize("url,canonical", [("http://h:1", "http://h:1"), ("http://h:1/", "http://h:1"),
                                           ("h:1", "http://h:1"), ("HTTPS://h", "https://h"),
                                           ("[::1]:7", "http://[::1]:7")])
def test_client_url_canonical_form(url, canonical):
    assert BootstrapClient(url, timeout_s=1.0).url == canonical


def test_wrong_token_is_unauthorized(server, engine):
    with BootstrapClient(server.url, token="wrong", timeout_s=2.0) as cli:
        with pytest.raises(Unauthorized):
            cli.lookup(engine, ["r"])
        assert cli.health().status == "ok"  # /health needs no token


# ----- long polls -------------------------------------------------------------------------------------------


def test_long_poll_times_out_with_a_clear_error(client, engine):
    with pytest.raises(LookupTimeout) as err:
        client.lookup_transfer("never", wait_s=0.3)
    assert isinstance(err.value, TimeoutError) and err.value.field == "transfer_id"
    assert client.lookup(engine, ["never"], wait_s=0.2) == {"never": RequestStatus.UNKNOWN}


def test_long_poll_answered_by_a_publish_from_another_thread(client, server, engine, token):
    def publish_later() -> None:
        time.sleep(0.2)
        with BootstrapClient(server.url, token=token) as other:
            other.publish(engine, "r1", [[9]], 16, lease_s=30.0, transfer_id="router-42")

    thread = threading.Thread(target=publish_later)
    thread.start()
    record = client.lookup_transfer("router-42", wait_s=20.0)
    thread.join()
    assert (record.request_id, record.block_ids) == ("r1", [[9]])


def test_a_long_poll_for_a_stream_whose_prefill_restarted_hears_expired_at_once(server, client, make_registration):
    """Decode waits for the next progress (or the record) of a stream; prefill's process is replaced (another
    instance registers the engine): the poll answers 410 expired at once, not after its 20 s."""
    client.register_engine(make_registration("P", instance="a-0"), lease_s=60.0)
    client.stream_pieces("P", 0, 1, [StreamPiece(transfer_id="s1", request_id="r1", index=1, num_tokens=16,
                                                 block_ids=[[3]])])
    seen = client.lookup_transfer("s1", after=0)
    got: list = []

    def poll() -> None:
        t0 = time.monotonic()
        try:
            client.lookup_transfer("s1", after=seen.version, wait_s=20.0)
        except RequestExpired as e:
            got.append((e, time.monotonic() - t0))

    with BootstrapClient(server.url, token=TOKEN, timeout_s=5.0) as other:
        thread = threading.Thread(target=poll)
        thread.start()
        time.sleep(0.3)
        other.register_engine(make_registration("P", instance="a-1"), lease_s=60.0)
        thread.join(15.0)
    assert len(got) == 1 and got[0][1] < 10.0, got


def _body(engine: str, rid: str, blocks=((9,),), transfer_id: str | None = None) -> PublishBody:
    return checked(PublishBody, engine_id=engine, request_id=rid, block_ids=[list(b) for b in blocks], num_tokens=16,
                   lease_s=30.0, transfer_id=transfer_id, epoch=0)


def test_in_process_publish_wakes_a_long_poll_and_answers_like_http(client, server, engine):
    """The embedding process (prefill's scheduler) publishes into the table on the loop thread: a decode
    long-polling the transfer id wakes, and what it reads is what an HTTP publish would have put there."""
    got: list = []
    poll = threading.Thread(target=lambda: got.append(client.lookup_transfer("router-7", wait_s=20.0)))
    poll.start()
    time.sleep(0.2)
    server.publish(_body(engine, "r1", transfer_id="router-7"), timeout_s=5.0)
    poll.join(10.0)
    assert [(r.request_id, r.block_ids, r.transfer_id) for r in got] == [("r1", [[9]], "router-7")]
    server.publish(_body(engine, "r1", transfer_id="router-7"), timeout_s=5.0)  # the same again: a renewal
    with pytest.raises(Conflict):  # other content under the same id: refused, as over HTTP
        server.publish(_body(engine, "r1", blocks=((8,),), transfer_id="router-7"), timeout_s=5.0)
    with pytest.raises(UnknownEngine):
        server.publish(_body("nobody", "r2"), timeout_s=5.0)
    assert client.lookup(engine, ["r1", "r2"]) == {"r1": got[0], "r2": RequestStatus.UNKNOWN}


def test_a_publish_after_release_is_refused_over_http_and_in_process(client, server, engine):
    client.publish(engine, "r1", [[9]], 16, lease_s=30.0, transfer_id="t1")
    client.release(engine, "r1", Outcome.PULLED)
    with pytest.raises(RequestReleased) as err:
        client.publish(engine, "r1", [[9]], 16, lease_s=30.0, transfer_id="t1")
    assert (err.value.status, err.value.code, err.value.field) == (410, "released", "request_id")
    with pytest.raises(RequestReleased):
        server.publish(_body(engine, "r1", transfer_id="t1"), timeout_s=5.0)
    assert client.lookup(engine, ["r1"]) == {"r1": RequestStatus.RELEASED}


def test_in_process_publish_to_a_stopped_server_is_unavailable(config, clock, make_registration):
    srv = BootstrapServer(config, clock=clock)
    with pytest.raises(BootstrapUnavailable, match="not running"):  # never started
        srv.publish(_body("P", "r1"), timeout_s=1.0)
    with srv:
        with BootstrapClient(srv.url, token=TOKEN) as cli:
            cli.register_engine(make_registration("P"), lease_s=600.0)
        srv.publish(_body("P", "r1"), timeout_s=1.0)
    with pytest.raises(BootstrapUnavailable, match="not running") as err:  # stopped
        srv.publish(_body("P", "r2"), timeout_s=1.0)
    # as a refused connection: certainly not applied (the scheduler frees the blocks at once)
    assert isinstance(err.value.__cause__, ConnectionRefusedError)


def test_in_process_publish_the_loop_never_got_to_is_not_applied(server, client, engine):
    """A loop thread that does not get to the call in time: the call is cancelled before it ran, so it is
    certainly not applied (a refused connection: the scheduler frees the blocks and abandons the transfer id
    at once, instead of holding them for a lease as after a lost answer)."""
    from kvlink.vllm.producer import _maybe_applied

    started, release = threading.Event(), threading.Event()
    server._loop.call_soon_threadsafe(lambda: (started.set(), release.wait(10.0)))  # the loop thread, stuck
    assert started.wait(5.0)
    try:
        with pytest.raises(BootstrapUnavailable, match="did not get to it in 0.2 s; not applied") as err:
            server.publish(_body(engine, "r1"), timeout_s=0.2)
        assert isinstance(err.value.__cause__, ConnectionRefusedError) and not _maybe_applied(err.value)
    finally:
        release.set()
    assert client.lookup(engine, ["r1"]) == {"r1": RequestStatus.UNKNOWN}  # cancelled before it ran


def test_abandon_wakes_a_long_poll_with_released(client, server, engine, token):
    """A decode waiting for a transfer id hears 'released' as soon as prefill abandons it."""
    from kvlink.bootstrap.errors import RequestReleased

    abandoned = threading.Event()

    def abandon_later() -> None:
        with BootstrapClient(server.url, token=token) as other:
            while server_waiting(server.url, token) == 0:  # abandon only once the long poll waits
                time.sleep(0.01)
            assert other.abandon_transfer(engine, "router-43") is False
            abandoned.set()

    thread = threading.Thread(target=abandon_later)
    thread.start()
    with pytest.raises(RequestReleased) as err:  # within one server-side wait (max_wait_s is 5 s)
        client.lookup_transfer("router-43", wait_s=4.0)
    thread.join()
    assert abandoned.is_set() and err.value.field == "transfer_id"
    assert client.abandon_transfer(engine, "router-43") is True  # idempotent
    with pytest.raises(RequestReleased):
        client.lookup_transfer("router-43", wait_s=5.0)  # the tombstone answers later lookups at once


def test_abandon_route_validates_and_needs_the_engine(raw, token):
    status, body = raw.post("/v1/transfer/abandon", {"engine_id": "P", "transfer_id": "t", "x": 1}, token=token)
    assert status == 400
    status, body = raw.post("/v1/transfer/abandon", {"engine_id": "nobody", "transfer_id": "t"}, token=token)
    assert status == 404 and body["code"] == "unknown_engine"
    status, body = raw.post("/v1/transfer/abandon", {"transfer_id": "t"}, token=token)  # no engine: the proxy
    assert (status, body) == (200, {"already_released": False})


def test_abandon_over_http_names_its_request_or_omits_the_engine(client, engine):
    client.publish(engine, "sub-0", [[5, 6]], 32, lease_s=30.0, transfer_id="T")
    with pytest.raises(Conflict) as err:
        client.abandon_transfer(engine, "T", request_id="sub-1")
    assert (err.value.status, err.value.field) == (409, "request_id") and "sub-0" in str(err.value)
    with pytest.raises(Conflict) as err:
        client.abandon_transfer(None, "T")
    assert err.value.field == "engine_id" and repr(engine) in str(err.value)
    assert client.lookup_transfer("T", peek=True).request_id == "sub-0"  # (a peek hands nothing)
    assert client.abandon_transfer(None, "never-taken") is False
    with pytest.raises(RequestReleased):
        client.lookup_transfer("never-taken", wait_s=5.0)  # at once
    assert client.abandon_transfer(engine, "T") is False  # positional, as before: its request is released
    assert client.poll_released(engine) == [("sub-0", Outcome.ABANDONED)]


def test_unset_abandon_fields_stay_off_the_wire():
    """An older server refuses fields it does not know: a call that sets none of the new ones sends none."""
    encode = msgspec.json.encode
    with_engine = checked(AbandonTransferBody, engine_id="P", transfer_id="t")
    assert encode(with_engine) == b'{"engine_id":"P","transfer_id":"t"}'
    assert encode(checked(AbandonTransferBody, engine_id=None, transfer_id="t")) == b'{"transfer_id":"t"}'


def server_waiting(url: str, token: str) -> float:
    """Long polls in progress at the server (its /metrics gauge)."""
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvlink_bootstrap_waiting "):
                return float(line.split()[1])
    return 0.0


def test_grouped_long_poll_waits_for_every_id(client, server, engine, token):
    def publish_later() -> None:
        with BootstrapClient(server.url, token=token) as other:
            for rid in ("a", "b"):
                time.sleep(0.1)
                other.publish(engine, rid, [[1]], 16, lease_s=30.0)

    thread = threading.Thread(target=publish_later)
    thread.start()
    found = client.lookup(engine, ["a", "b"], wait_s=20.0)
    thread.join()
    assert all(isinstance(found[rid], RequestRecord) for rid in ("a", "b"))


@pytest.mark.parametrize("config", [BootstrapConfig(max_wait_s=0.2)], ids=["max_wait_0.2"])
def test_client_waits_longer_than_the_server_bound(server, make_registration):
    cli = BootstrapClient(server.url, timeout_s=2.0)
    cli.register_engine(make_registration("P"), lease_s=60.0)
    timer = threading.Timer(0.5, cli.publish, args=("P", "r", [[1]], 16, 30.0, "late"))
    timer.start()
    try:
        assert cli.lookup_transfer("late", wait_s=20.0).request_id == "r"
    finally:
        timer.cancel()
    with pytest.raises(LookupTimeout):
        cli.lookup_transfer("never", wait_s=0.5)


@pytest.mark.parametrize("config", [BootstrapConfig(max_waiters=1)], ids=["max_waiters_1"])
def test_waiters_are_bounded(server):
    results: list[object] = []

    def wait() -> None:
        try:
            BootstrapClient(server.url).lookup_transfer("a", wait_s=1.0)
        except LookupTimeout as err:
            results.append(err)

    waiting = threading.Thread(target=wait)
    waiting.start()
    deadline = time.monotonic() + 10
    while server.app.counters.waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(TooManyWaiters) as err:
        BootstrapClient(server.url).lookup_transfer("b", wait_s=1.0)
    assert err.value.status == 429
    waiting.join()
    assert len(results) == 1


@pytest.mark.parametrize("config", [BootstrapConfig(max_requests_per_engine=1, max_engines=1)], ids=["full_at_1"])
def test_a_full_table_refuses_over_http_and_in_process_and_counts_it(server, make_registration):
    client = BootstrapClient(server.url)
    client.register_engine(make_registration("P"), lease_s=600.0)
    with pytest.raises(TableFull) as err:
        client.register_engine(make_registration("Q"), lease_s=600.0)
    assert err.value.status == 429 and err.value.field == "registration.engine_id"
    client.publish("P", "r1", [[1]], 16, lease_s=30.0)
    with pytest.raises(TableFull) as err:
        client.publish("P", "r2", [[2]], 16, lease_s=30.0, transfer_id="t2")
    assert "max_requests_per_engine" in str(err.value)
    with pytest.raises(TableFull):
        server.publish(_body("P", "r3"), timeout_s=5.0)
    client.publish("P", "r1", [[1]], 16, lease_s=30.0)  # a renewal of the live one still goes through
    assert client.lookup("P", ["r1", "r2", "r3"])["r2"] is RequestStatus.UNKNOWN
    with pytest.raises(UnknownRequest):  # nothing stored under its transfer id either
        client.lookup_transfer("t2")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    assert "kvlink_bootstrap_refused_full_total 3.0" in text


@pytest.mark.parametrize("config", [BootstrapConfig(max_ranks_per_engine=1)], ids=["ranks_at_1"])
def test_ranks_per_engine_are_bounded_over_http_and_counted(server, make_registration):
    client = BootstrapClient(server.url)
    client.register_engine(make_registration("P", tp_size=2), lease_s=600.0)
    with pytest.raises(TableFull) as err:
        client.register_engine(make_registration("P", tp_rank=1, tp_size=2, port=5001), lease_s=600.0)
    assert (err.value.status, err.value.code) == (429, "table_full") and "max_ranks_per_engine" in str(err.value)
    assert [r.tp_rank for r in client.engine_ranks("P")] == [0]
    assert b"kvlink_bootstrap_refused_full_total 1.0" in server.app.metrics.render()


@pytest.mark.parametrize("config", [BootstrapConfig(max_waiters=3)], ids=["max_waiters_3"])
def test_a_grouped_poll_counts_each_id_it_waits_on(server, make_registration):
    cli = BootstrapClient(server.url)
    cli.register_engine(make_registration("P"), lease_s=60.0)
    with pytest.raises(TooManyWaiters):
        cli.lookup("P", ["a", "b", "c", "d"], wait_s=1.0)
    assert cli.lookup("P", ["a", "b", "c"], wait_s=0.1)["a"] is RequestStatus.UNKNOWN


def test_stop_ends_long_polls(make_registration):
    srv = BootstrapServer(BootstrapConfig(max_wait_s=30.0)).start()
    cli = BootstrapClient(srv.url, timeout_s=1.0, retries=1)
    cli.register_engine(make_registration("P"), lease_s=60.0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            cli.lookup_transfer("never", wait_s=25.0)
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            errors.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + 10
    while srv.app.counters.waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.stop()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], BootstrapUnavailable)


# ----- observability ----------------------------------------------------------------------------------------


def test_metrics_need_the_token_and_count(client, server, engine, token):
    client.publish(engine, "r1", [[1]], 16, lease_s=30.0)
    client.lookup(engine, ["r1", "r2"])
    client.release(engine, "r1", Outcome.PULLED)
    with pytest.raises(UnknownRequest):
        client.lookup_transfer("x")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 401
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    assert "kvlink_bootstrap_engine_ranks 1.0" in text
    assert "kvlink_bootstrap_published_total 1.0" in text
    assert "kvlink_bootstrap_looked_up_total 3.0" in text
    assert 'kvlink_bootstrap_released_total{outcome="pulled"} 1.0' in text
    assert 'kvlink_bootstrap_errors_total{code="unknown_request"} 1.0' in text


def test_two_servers_in_one_process_keep_their_own_metrics(server, client, engine):
    with BootstrapServer(BootstrapConfig()) as other:
        assert other.app.metrics.registry is not server.app.metrics.registry
        assert b"kvlink_bootstrap_engine_ranks 0.0" in other.app.metrics.render()
        assert b"kvlink_bootstrap_engine_ranks 1.0" in server.app.metrics.render()


def test_health(client, engine):
    health = client.health()
    assert (health.status, health.engines, health.requests) == ("ok", 1, 0)


def test_a_long_poll_whose_client_left_frees_its_slot(server, raw, token):
    import socket as _socket

    sock = _socket.create_connection(("127.0.0.1", server.port), timeout=5)
    body = b'{"transfer_id": "t", "wait_s": 60.0}'
    sock.sendall(b"POST /v1/request/lookup_transfer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
                 + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while server.app.counters.waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.app.counters.waiting == 1
    sock.close()
    deadline = time.monotonic() + 3.0  # the poll itself would wait max_wait_s = 5 s
    while server.app.counters.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.app.counters.waiting == 0
    assert server.app._waiters == {}


def test_a_server_from_before_streamed_kv_is_asked_without_after(config, clock, make_registration, monkeypatch):
    """A bootstrap server that does not know ``after`` (an older standalone one) refuses it as an unknown
    field: the client asks again without it, from then on, and gets the published record (nothing streams)."""
    from kvlink.bootstrap import schema as s

    # the body as it was before streamed KV
    OldLookupTransferBody = msgspec.defstruct(  # noqa: N806
        "OldLookupTransferBody", [("transfer_id", s.RequestId), ("wait_s", s.WaitS, 0.0),
                                  ("engine_id", s.EngineId | None, None)], bases=(s._Strict,), kw_only=True,
        namespace={"after": None, "layers": False, "peek": False, "reader": None})  # not fields: what today's handler reads, an older one never did

    with monkeypatch.context() as m:
        m.setattr(s, "LookupTransferBody", OldLookupTransferBody)
        old = BootstrapServer(config, clock=clock).start()
    try:
        from tests.bootstrap.conftest import TOKEN

        with BootstrapClient(old.url, token=TOKEN, timeout_s=5.0) as cli:
            cli.register_engine(make_registration("P"), lease_s=600.0)
            with pytest.raises(InvalidField) as err:
                cli._call("/v1/request/lookup_transfer", s.LookupTransferBody(transfer_id="t1", after=0),
                          RequestRecord)
            assert err.value.field == "after"  # what the older server says, so the fallback is needed
            cli.publish("P", "r1", [[1, 2]], 32, lease_s=30.0, transfer_id="t1")
            record = cli.lookup_transfer("t1", after=0)
            assert (record.request_id, record.partial) == ("r1", False)
            assert cli._no_progress
            assert cli.lookup_transfer("t1", after=3).request_id == "r1"
    finally:
        old.stop()


def test_a_server_from_before_layer_wise_progress_is_asked_for_whole_blocks(config, clock, make_registration,
                                                                            monkeypatch):
    """A bootstrap server that knows ``after`` but not ``layers`` refuses the field: the client asks again
    without it, from then on, and gets whole-block progress (and later the published record)."""
    from kvlink.bootstrap import schema as s

    OldLookupTransferBody = msgspec.defstruct(  # noqa: N806
        "OldLookupTransferBody", [("transfer_id", s.RequestId), ("wait_s", s.WaitS, 0.0),
                                  ("engine_id", s.EngineId | None, None),
                                  ("after", s.Annotated[int, s.Meta(ge=0)] | None, None)],
        bases=(s._Strict,), kw_only=True, namespace={"layers": False, "peek": False, "reader": None})

    with monkeypatch.context() as m:
        m.setattr(s, "LookupTransferBody", OldLookupTransferBody)
        old = BootstrapServer(config, clock=clock).start()
    try:
        from tests.bootstrap.conftest import TOKEN

        with BootstrapClient(old.url, token=TOKEN, timeout_s=5.0) as cli:
            cli.register_engine(make_registration("P"), lease_s=600.0)
            cli.stream_pieces("P", 0, 1, [s.StreamPiece(transfer_id="t1", request_id="r1", index=1,
                                                        num_tokens=16, block_ids=[[1]], step_block_ids=[[2]],
                                                        layers=3)])
            progress = cli.lookup_transfer("t1", after=0, layers=True)
            assert cli._no_layers and not cli._no_progress
            assert (progress.partial, progress.block_ids, progress.step_block_ids, progress.layers) == (
                True, [[1]], [], 0)
            cli.publish("P", "r1", [[1, 2]], 40, lease_s=30.0, transfer_id="t1")
            assert cli.lookup_transfer("t1", after=progress.version, layers=True).partial is False
    finally:
        old.stop()


def test_the_prompt_digest_travels_over_http_and_a_malformed_one_is_refused(client, engine):
    client.publish(engine, "r1", [[1]], 16, lease_s=30.0, transfer_id="pd-1", prompt_sha="ab" * 16)
    assert client.lookup_transfer("pd-1").prompt_sha == "ab" * 16
    with pytest.raises(InvalidField) as err:
        client.publish(engine, "r2", [[2]], 16, lease_s=30.0, prompt_sha="not-hex")
    assert "prompt_sha" in str(err.value)
    with pytest.raises(InvalidField):  # ("$" in the pattern let a trailing newline through)
        client.publish(engine, "r3", [[2]], 16, lease_s=30.0, prompt_sha="ab" * 16 + "\n")


def test_a_conflicting_streamed_piece_leaves_the_rest_of_its_call_applied(client, engine):
    def piece(tid: str, rid: str, blocks: list[int]) -> StreamPiece:
        return StreamPiece(transfer_id=tid, request_id=rid, index=1, num_tokens=16, block_ids=[blocks])

    assert client.stream_pieces(engine, 0, 1, [piece("t", "r", [5])]) == []
    assert client.stream_pieces(engine, 0, 1, [piece("t", "other", [7]), piece("u", "g", [9])]) == ["t"]
    assert client.lookup_transfer("u", after=0).block_ids == [[9]]
    assert client.lookup_transfer("t", after=0).request_id == "r"


def test_a_replaced_launch_is_refused_over_http_and_its_heartbeater_stops_renewing(client, make_registration):
    from kvlink.bootstrap import Heartbeater

    client.register_engine(make_registration("P", instance="a-0", launch="A"), lease_s=30.0)
    client.register_engine(make_registration("P", port=6001, instance="b-0", launch="B"), lease_s=30.0)
    with pytest.raises(Conflict) as err:
        client.publish("P", "r1", [[1]], 16, lease_s=30.0, transfer_id="t1", launch="A")
    assert err.value.field == "launch"
    with pytest.raises(Conflict):
        client.stream_pieces("P", 0, 1, [StreamPiece(transfer_id="t2", request_id="r2", index=1, num_tokens=16,
                                                 block_ids=[[3]])], launch="A")
    with pytest.raises(Conflict) as err:
        client.heartbeat("P", instance="a-0")
    assert err.value.field == "instance"
    old = Heartbeater(client, make_registration("P", instance="a-0", launch="A"), lease_s=30.0, interval_s=0.05)
    old.registered.set()  # as after its first registration: from now on it only heartbeats
    with pytest.raises(Conflict):
        old.beat()
    assert client.get_engine("P").instance == "b-0"  # never registered back over B
    client.publish("P", "r3", [[1]], 16, lease_s=30.0, transfer_id="t3", launch="B")
    assert client.lookup_transfer("t3").block_ids == [[1]]
    assert b"launch" not in msgspec.json.encode(make_registration("Q"))  # unset: off the wire
    client.release("P", "r3", Outcome.PULLED)
    with pytest.raises(Conflict) as err:  # A's poll would take B's outcome
        client.poll_released("P", launch="A")
    assert err.value.field == "launch"
    assert client.poll_released("P", launch="B") == [("r3", Outcome.PULLED)]


def test_a_server_from_before_polls_named_their_launch_and_last_answer_is_polled_without_them(config, clock, make_registration,
                                                                           monkeypatch):
    """A bootstrap server that does not know a poll's ``launch`` or ``seen`` refuses each as an unknown field:
    the client polls again without it, from then on, and gets its outcomes."""
    from kvlink.bootstrap import schema as s

    OldPollReleasedBody = msgspec.defstruct(  # noqa: N806
        "OldPollReleasedBody", [("engine_id", s.EngineId), ("server_id", str | None, None), ("ack", int, 0)],
        bases=(s._Strict,), kw_only=True, namespace={"launch": None, "seen": None})  # not fields: what today's handler reads
    with monkeypatch.context() as m:
        m.setattr(s, "PollReleasedBody", OldPollReleasedBody)
        old = BootstrapServer(config, clock=clock).start()
    try:
        from tests.bootstrap.conftest import TOKEN

        with BootstrapClient(old.url, token=TOKEN, timeout_s=5.0) as cli:
            cli.register_engine(make_registration("P", launch="L"), lease_s=600.0)
            cli.publish("P", "r1", [[1]], 16, lease_s=30.0, launch="L")
            cli.release("P", "r1", Outcome.PULLED)
            with pytest.raises(InvalidField) as err:
                cli._call("/v1/request/poll_released", s.PollReleasedBody(engine_id="P", launch="L"),
                          s.PollReleasedAnswer)
            assert err.value.field == "launch"  # what the older server says, so the fallback is needed
            assert cli.poll_released("P", launch="L") == [("r1", Outcome.PULLED)]
            assert cli._no_poll_launch and cli._no_poll_seen
            assert cli.poll_released("P", launch="L") == []  # acknowledged as before
    finally:
        old.stop()


def test_the_process_instance_travels_and_a_new_one_drops_the_old_records(client, make_registration):
    client.register_engine(make_registration("P", instance="0123abcd"), lease_s=30.0)
    assert client.get_engine("P").instance == "0123abcd"
    client.publish("P", "r1", [[1]], 16, lease_s=30.0, transfer_id="t1")
    client.register_engine(make_registration("P", instance="4567ef01"), lease_s=30.0)  # restarted, same port
    with pytest.raises(RequestExpired):
        client.lookup_transfer("t1")
    assert b"instance" not in msgspec.json.encode(make_registration("Q"))  # unset: off the wire
    with pytest.raises(InvalidField) as err:
        client.register_engine(make_registration("Q", instance="x" * 65), lease_s=30.0)
    assert err.value.field == "registration.instance"


@pytest.mark.parametrize("retry, applied", [
    ("refused", True),
    ((409, b'{"error": "other blocks", "code": "conflict", "field": "block_ids"}'), False),
    ((409, b'{"error": "launch replaced", "code": "conflict", "field": "launch"}'), True),
    ((410, b'{"error": "ended", "code": "expired", "field": "request_id"}'), True),
    ((410, b'{"error": "ended", "code": "released", "field": "request_id"}'), False),
])
def test_a_call_whose_first_try_went_unanswered_may_have_been_applied_unless_the_server_refuses_it(retry, applied):
    """The first attempt reached a server that (maybe) applied it and went away before answering. If the
    retry finds the port closed, the caller must not conclude "not applied" (prefill would free blocks a
    decode, handed the record by the first attempt, may be reading). If the live server refuses the retry's
    content (409), it was not applied: a publish applied once answers its retry 200. But a retry refused
    because another launch registered the engine since (409 launch), or because the engine's requests were
    dropped since (410 expired), may follow a first attempt the server applied and handed out before: maybe
    applied. 410 released: decode is done with it. A call refused at connect from the first attempt was never
    applied."""
    import socket as _socket

    from kvlink.bootstrap import BootstrapClient, BootstrapError, BootstrapUnavailable, Conflict, RequestGone
    from kvlink.vllm.producer import _maybe_applied

    lsock = _socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(2)
    port = lsock.getsockname()[1]

    def serve():
        conn, _ = lsock.accept()
        conn.recv(65536)  # the publish went out ...
        conn.close()  # ... and got no answer
        if retry != "refused":
            status, body = retry
            conn, _ = lsock.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 %d Refused\r\nContent-Type: application/json\r\nContent-Length: " % status
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            conn.close()
        lsock.close()  # (refused: the retry finds the port closed)

    t = threading.Thread(target=serve)
    t.start()
    with BootstrapClient(f"http://127.0.0.1:{port}", timeout_s=5.0, retries=2, backoff_s=0.05) as cli:
        with pytest.raises(BootstrapError) as err:
            cli.publish("P", "r1", [[1]], 16, lease_s=30.0)
    t.join(5)
    want = {"refused": BootstrapUnavailable, 409: Conflict, 410: RequestGone}[retry if retry == "refused" else retry[0]]
    assert isinstance(err.value, want)
    assert err.value.maybe_applied == _maybe_applied(err.value) == applied
    with BootstrapClient(f"http://127.0.0.1:{port}", timeout_s=1.0, retries=1, backoff_s=0.05) as cli:
        with pytest.raises(BootstrapUnavailable) as err:  # refused from the first attempt: never applied
            cli.publish("P", "r1", [[1]], 16, lease_s=30.0)
    assert not err.value.maybe_applied and not _maybe_applied(err.value)


def test_a_server_from_before_router_releases_is_looked_up_without_it_and_not_released_by_the_router(
        config, clock, make_registration, monkeypatch):
    """A bootstrap server that knows no ``router`` refuses the field. The router's lookups go again without it
    (nothing on such a server depends on who looks); its release is not made (the old server would free the
    blocks at once, also under a decode still reading them): the request stays held, its lease frees it."""
    from kvlink.bootstrap import schema as s

    OldLookupTransferBody = msgspec.defstruct(  # noqa: N806
        "OldLookupTransferBody", [("transfer_id", s.RequestId), ("wait_s", s.WaitS, 0.0),
                                  ("engine_id", s.EngineId | None, None),
                                  ("after", s.Annotated[int, s.Meta(ge=0)] | None, None), ("layers", bool, False)],
        bases=(s._Strict,), kw_only=True, omit_defaults=True, namespace={"peek": False, "reader": None})
    OldReleaseBody = msgspec.defstruct(  # noqa: N806
        "OldReleaseBody", [("engine_id", s.EngineId), ("request_id", s.RequestId), ("outcome", s.Outcome)],
        bases=(s._Strict,), kw_only=True, namespace={"router": False, "reader": None})

    with _older_server(config, clock, make_registration, monkeypatch, LookupTransferBody=OldLookupTransferBody,
                       ReleaseBody=OldReleaseBody) as cli:
        assert cli.lookup_transfer("t1", peek=True).request_id == "r1" and cli._no_peek
        with pytest.raises(InvalidField) as err:
            cli.release("P", "r1", Outcome.ABANDONED, router=True)
        assert err.value.field == "router"
        assert cli.lookup("P", ["r1"])["r1"].request_id == "r1"  # still held
        assert cli.release("P", "r1", Outcome.PULLED) is False  # decode's own release works as ever


def test_a_server_from_before_readers_is_asked_without_naming_one(config, clock, make_registration, monkeypatch):
    """A bootstrap server that knows no ``reader`` refuses the field: lookups, renewals and releases go again
    without it (one engine's release then frees at once, as such a server always did)."""
    from kvlink.bootstrap import schema as s

    OldLookupTransferBody = msgspec.defstruct(  # noqa: N806
        "OldLookupTransferBody", [("transfer_id", s.RequestId), ("wait_s", s.WaitS, 0.0),
                                  ("engine_id", s.EngineId | None, None),
                                  ("after", s.Annotated[int, s.Meta(ge=0)] | None, None), ("layers", bool, False),
                                  ("peek", bool, False)],
        bases=(s._Strict,), kw_only=True, omit_defaults=True, namespace={"reader": None})
    OldRenewBody = msgspec.defstruct(  # noqa: N806
        "OldRenewBody", [("engine_id", s.EngineId), ("request_ids", s.RequestIds), ("lease_s", s.LeaseS)],
        bases=(s._Strict,), kw_only=True, namespace={"reader": None})
    OldReleaseBody = msgspec.defstruct(  # noqa: N806
        "OldReleaseBody", [("engine_id", s.EngineId), ("request_id", s.RequestId), ("outcome", s.Outcome),
                           ("router", bool, False)],
        bases=(s._Strict,), kw_only=True, omit_defaults=True, namespace={"reader": None})

    with _older_server(config, clock, make_registration, monkeypatch, LookupTransferBody=OldLookupTransferBody,
                       RenewBody=OldRenewBody, ReleaseBody=OldReleaseBody) as cli:
        assert cli.lookup_transfer("t1", reader="d@1").request_id == "r1" and cli._no_reader
        cli._no_reader = False
        assert cli.renew("P", ["r1"], 30.0, reader="d@1") == ({}, 30.0) and cli._no_reader
        cli._no_reader = False
        assert cli.release("P", "r1", Outcome.PULLED, reader="d@1") is False and cli._no_reader
        assert cli.lookup("P", ["r1"])["r1"] is RequestStatus.RELEASED


@contextlib.contextmanager
def _older_server(config, clock, make_registration, monkeypatch, **bodies):
    """A server whose request bodies are ``bodies`` (schema name -> an older struct), engine "P" registered
    and its request "r1" published under transfer id "t1"; yields a client of it."""
    from kvlink.bootstrap import schema as s
    from tests.bootstrap.conftest import TOKEN

    with monkeypatch.context() as m:
        for name, body in bodies.items():
            m.setattr(s, name, body)
        old = BootstrapServer(config, clock=clock).start()
    try:
        with BootstrapClient(old.url, token=TOKEN, timeout_s=5.0) as cli:
            cli.register_engine(make_registration("P"), lease_s=600.0)
            cli.publish("P", "r1", [[1, 2]], 32, lease_s=30.0, transfer_id="t1")
            yield cli
    finally:
        old.stop()


def test_a_poll_tells_the_server_which_answer_it_last_got(server, client, clock, engine):
    """The client sends the ``now`` of the last answer it got, so the server counts the engine in touch as of
    an answer prefill surely had (PairingTable.poll_released), never as of a poll whose answer may be lost."""
    polled = lambda: server.table._engines[engine].polled_at  # noqa: E731
    client.poll_released(engine)
    first, before = clock(), polled()
    clock.advance(5)
    client.poll_released(engine)
    assert polled() == first and before != first  # as of the first answer, not this poll (first + 5)
    clock.advance(5)
    client.poll_released(engine)
    assert polled() == first + 5
