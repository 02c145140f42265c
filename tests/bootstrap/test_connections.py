"""The cap on open connections (max_connections, gate.py), over real sockets: beyond it a new connection is
answered 503 and closed unread, open ones are served, freed slots are taken again, and long polls leave room."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvlink.bootstrap import (
    BootstrapClient,
    BootstrapConfig,
    BootstrapUnavailable,
    RequestStatus,
    TooManyWaiters,
)
from kvlink.bootstrap import gate
from kvlink.bootstrap.schema import PublishBody, checked
from tests.bootstrap.conftest import TOKEN

CAP = 8


@pytest.fixture
def config() -> BootstrapConfig:
    return BootstrapConfig(host="127.0.0.1", port=0, token=TOKEN, max_connections=CAP, max_wait_s=10.0,
                           sweep_interval_s=0.05)


def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def idle(server) -> Iterator[list[socket.socket]]:
    """CAP connections that send nothing, each accepted (and counted) by the server."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(CAP)]
    try:
        until(lambda: server.app.counters.connections == CAP, f"{CAP} open connections")
        yield socks
    finally:
        for sock in socks:
            sock.close()


def read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:  # what we sent was never read: the close may reset once the answer is in
        pass
    return data


def get(sock: socket.socket, path: str) -> bytes:
    """One keep-alive GET on an open socket; its answer's head and body."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_beyond_the_cap_a_connection_is_refused_and_counted_while_open_ones_are_served(server, raw, idle):
    """Without the cap, thousands of sockets (no token needed) took every descriptor: nobody was served."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as extra:
        answer = read_all(extra)  # sent nothing: the server answers and closes on its own
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"Connection: close" in head, answer
    assert b'"code": "unavailable"' in body and b'"field": "max_connections"' in body and b"(8)" in body
    assert server.app.counters.connections_refused == 1
    assert server.app.counters.connections == CAP  # the refused one never counted, the open ones untouched

    # An open connection is still served, and stays open for the next request (keep-alive).
    assert get(idle[0], "/health").startswith(b"HTTP/1.1 200")
    assert get(idle[0], "/health").startswith(b"HTTP/1.1 200")

    # Freed slots are taken again.
    for sock in idle[:2]:
        sock.close()
    until(lambda: server.app.counters.connections == CAP - 2, "two connections to close")
    status, _ = raw.request("GET", "/health")
    assert status == 200
    until(lambda: server.app.counters.connections == CAP - 2, "the request's connection to close")
    metrics = get(idle[2], "/metrics").decode()
    assert "kvlink_bootstrap_connections_refused_total 1.0" in metrics
    assert f"kvlink_bootstrap_connections {CAP - 2}.0" in metrics


def test_a_client_refused_at_the_cap_is_told_unavailable_and_nothing_was_applied(server, make_registration):
    cli = BootstrapClient(server.url, token=TOKEN, timeout_s=2.0, retries=2, backoff_s=0.01)
    cli.register_engine(make_registration("P"), lease_s=600.0)
    cli.close()  # its keep-alive connection would hold a slot
    until(lambda: server.app.counters.connections == 0, "the client's connection to close")
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(CAP)]
    try:
        until(lambda: server.app.counters.connections == CAP, f"{CAP} open connections")
        cli = BootstrapClient(server.url, token=TOKEN, timeout_s=2.0, retries=2, backoff_s=0.01)
        with pytest.raises(BootstrapUnavailable, match="max_connections") as err:
            cli.publish("P", "r1", [[1]], 16, lease_s=30.0, transfer_id="t1")
        assert not err.value.maybe_applied  # every attempt was answered 503 before its request was read
        assert server.app.counters.connections_refused == 3  # the first try and both retries
        # The embedding process (prefill's scheduler) publishes in process: no connection, no cap.
        server.publish(checked(PublishBody, engine_id="P", request_id="r2", block_ids=[[2]], num_tokens=16,
                               lease_s=30.0), timeout_s=5.0)
    finally:
        for sock in socks:
            sock.close()
    until(lambda: server.app.counters.connections == 0, "the idle connections to close")
    found = cli.lookup("P", ["r1", "r2"])
    assert found["r1"] is RequestStatus.UNKNOWN and found["r2"].request_id == "r2"
    cli.publish("P", "r1", [[1]], 16, lease_s=30.0, transfer_id="t1")
    assert cli.lookup("P", ["r1"])["r1"].block_ids == [[1]]
    cli.close()


def test_long_polls_leave_connections_for_the_calls_that_end_them(server, make_registration):
    """Waiting decodes holding every connection would lock out the publish they wait for (standalone server:
    prefill publishes over HTTP), and every heartbeat with it."""
    polls = server.config.max_long_polls
    assert polls == 6  # of CAP 8
    publisher = BootstrapClient(server.url, token=TOKEN, timeout_s=5.0)
    publisher.register_engine(make_registration("P"), lease_s=600.0)
    results: list[object] = []

    def wait() -> None:
        with BootstrapClient(server.url, token=TOKEN, timeout_s=5.0) as cli:
            results.append(cli.lookup_transfer("t", wait_s=8.0).request_id)

    waiters = [threading.Thread(target=wait) for _ in range(polls)]
    for t in waiters:
        t.start()
    try:
        until(lambda: server.app.counters.waiting == polls, f"{polls} long polls")
        with BootstrapClient(server.url, token=TOKEN, timeout_s=5.0) as late:
            with pytest.raises(TooManyWaiters, match="long polls") as err:
                late.lookup_transfer("t", wait_s=8.0)
        assert err.value.status == 429
        publisher.publish("P", "r1", [[1]], 16, lease_s=30.0, transfer_id="t")  # a connection is left for it
    finally:
        for t in waiters:
            t.join(10)
        publisher.close()
    assert results == ["r1"] * polls


def test_the_descriptor_limit_is_checked_and_raised_when_allowed(monkeypatch):
    import resource

    limits = {"soft": 2048, "hard": 16384}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))

    def setrlimit(_, pair):
        limits["soft"], limits["hard"] = pair

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    # a burst of BACKLOG sockets is accepted before the gate counts them: they need descriptors too
    assert gate.check_fd_limit(2048 - gate.FD_HEADROOM - gate.BACKLOG) is None
    assert gate.check_fd_limit(2048 - gate.FD_HEADROOM) is not None
    short = gate.check_fd_limit(4096)
    assert short is not None and "max_connections=4096" in short and "2048" in short
    assert limits["soft"] == 2048  # only warned: an embedding process owns its limits
    assert gate.check_fd_limit(4096, raise_soft=True) is None
    assert limits == {"soft": 4096 + gate.BACKLOG + gate.FD_HEADROOM, "hard": 16384}
    assert gate.check_fd_limit(20_000, raise_soft=True) is not None  # the hard limit is as far as it goes
    assert limits["soft"] == 16384


def test_a_connection_is_uncounted_once_even_when_the_loop_never_calls_its_protocol():
    """Where asyncio fails to make a socket's transport after the factory ran (the protocol then hears
    nothing), the slot comes back when the wrapper is collected; a connection lost is uncounted once."""
    import asyncio
    import gc

    from kvlink.bootstrap.metrics import ServerCounters

    counters = ServerCounters()
    g = gate.ConnectionGate(2, asyncio.Protocol, counters)
    orphan = g()  # the loop failed right after: no connection_made, no connection_lost
    lost = g()
    assert counters.connections == 2
    refused = g()  # at the cap
    assert counters.connections_refused == 1
    lost.connection_lost(None)
    lost.connection_lost(None)
    assert counters.connections == 1
    del orphan, lost
    gc.collect()
    assert counters.connections == 0

    class Written:  # uvloop's transports write but are no asyncio.WriteTransport
        def __init__(self):
            self.data, self.closed = b"", False

        def write(self, data):
            self.data += data

        def close(self):
            self.closed = True

    t = Written()
    refused.connection_made(t)
    assert t.data.startswith(b"HTTP/1.1 503") and b"max_connections" in t.data and t.closed


def test_a_client_that_never_reads_a_large_answer_is_let_go_and_readers_get_theirs_whole(make_registration):
    """An answer past the socket's buffers (a lookup of many published requests) waits for the client to read
    it: a client that never does (a stopped decode process) loses the connection after body_timeout_s instead
    of holding it, its slot and the answer for as long as its TCP stays up. A client that reads gets it whole."""
    import json

    from kvlink.bootstrap import BootstrapServer

    cfg = BootstrapConfig(host="127.0.0.1", port=0, token=TOKEN, idle_timeout_s=0.5, body_timeout_s=0.5,
                          sweep_interval_s=0.05)
    with BootstrapServer(cfg) as srv, BootstrapClient(srv.url, token=TOKEN) as cli:
        cli.register_engine(make_registration("E", num_blocks=1 << 20), 600.0)
        ids = [f"r{i}" for i in range(1000)]
        for rid in ids:
            cli.publish("E", rid, [list(range(1, 2001))], 32000, lease_s=600.0)
        whole = cli.lookup("E", ids)  # ~10 MB, read whole
        assert all(whole[r].block_ids == [list(range(1, 2001))] for r in ids)
        body = json.dumps({"engine_id": "E", "request_ids": ids}).encode()
        socks = []
        for _ in range(4):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/request/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            socks.append(s)
        try:
            # (both at once: before the server has taken the new connections, they are not counted either)
            until(lambda: srv.app.counters.errors["answer_not_taken"] >= 1 and srv.app.counters.connections <= 1,
                  "the connections that read nothing closed, an answer not taken among them (one the kernel "
                  "buffered whole ends idle)")
            again = cli.lookup("E", ids)  # everyone else served
            assert all(again[r].block_ids == whole[r].block_ids for r in ids)
        finally:
            for s in socks:
                s.close()


def test_a_client_that_resets_mid_answer_is_let_go_quietly(make_registration, caplog):
    """The case the answer's deadline is for, ended by the client: a reset mid-answer is counted, not logged
    as an error with a traceback (aiohttp's own Response dropped it quietly too)."""
    import json
    import logging
    import struct

    from kvlink.bootstrap import BootstrapServer

    caplog.set_level(logging.INFO)
    cfg = BootstrapConfig(host="127.0.0.1", port=0, token=TOKEN, body_timeout_s=0.5)
    with BootstrapServer(cfg) as srv, BootstrapClient(srv.url, token=TOKEN) as cli:
        cli.register_engine(make_registration("E", num_blocks=1 << 20), 600.0)
        ids = [f"r{i}" for i in range(300)]
        blocks = list(range(100_000, 110_000))  # ~21 MB of answer: past what a host's socket buffers absorb
        for rid in ids:  # (a 3 MB answer fit in one host's: written whole, nothing to reset)
            cli.publish("E", rid, [blocks], 16 * len(blocks), lease_s=600.0)
        body = json.dumps({"engine_id": "E", "request_ids": ids}).encode()
        # (a reset can land before the answer's write begins, where nothing is left to count: resets go on
        # until one lands mid-answer, each checked for a second)
        for _ in range(10):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            s.connect(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/request/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                      + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            s.recv(1000)
            s.close()
            try:
                until(lambda: srv.app.counters.errors["answer_not_taken"] >= 1, "a reset answer counted", 1.0)
                break
            except AssertionError:
                continue
        until(lambda: srv.app.counters.errors["answer_not_taken"] >= 1, "a reset answer counted")
        assert len(cli.lookup("E", ids[:5])) == 5  # everyone else served
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

