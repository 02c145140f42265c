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

    limits = {"soft": 1024, "hard": 8192}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))

    def setrlimit(_, pair):
        limits["soft"], limits["hard"] = pair

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert gate.check_fd_limit(1024 - gate.FD_HEADROOM) is None
    short = gate.check_fd_limit(4096)
    assert short is not None and "max_connections=4096" in short and "1024" in short
    assert limits["soft"] == 1024  # only warned: an embedding process owns its limits
    assert gate.check_fd_limit(4096, raise_soft=True) is None
    assert limits == {"soft": 4096 + gate.FD_HEADROOM, "hard": 8192}
    assert gate.check_fd_limit(10_000, raise_soft=True) is not None  # the hard limit is as far as it goes
    assert limits["soft"] == 8192
