"""The client's transport against a scripted server: retries on 5xx and connection errors only, reuse."""

from __future__ import annotations

import socket

import pytest

from kvlink.bootstrap import (
    BootstrapClient,
    BootstrapError,
    BootstrapUnavailable,
    InvalidField,
    UnknownEngine,
)
from tests.fakes import ScriptedHTTPServer

OK = (200, {"lease_s": 3.0})


def scripted(*replies):
    """A script answering ``replies`` in order, then the last one forever."""
    queue = list(replies)

    def script(path: str):
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return script


def test_5xx_is_retried_with_backoff():
    with ScriptedHTTPServer(scripted((503, {"error": "busy"}), (502, {}), OK)) as fake:
        cli = BootstrapClient(fake.url, timeout_s=5.0, retries=3, backoff_s=0.01)
        cli.heartbeat("P")
        assert len(fake.requests) == 3


def test_4xx_is_not_retried():
    bad = (400, {"error": "Expected `int`", "code": "invalid", "field": "tp_rank"})
    with ScriptedHTTPServer(scripted(bad)) as fake:
        cli = BootstrapClient(fake.url, timeout_s=5.0, retries=3, backoff_s=0.01)
        with pytest.raises(InvalidField) as err:
            cli.heartbeat("P")
        assert err.value.field == "tp_rank" and len(fake.requests) == 1
    gone = (404, {"error": "engine 'P' is not registered", "code": "unknown_engine", "field": "engine_id"})
    with ScriptedHTTPServer(scripted(gone)) as fake:
        with pytest.raises(UnknownEngine):
            BootstrapClient(fake.url, retries=3).heartbeat("P")
        assert len(fake.requests) == 1


def test_persistent_5xx_ends_in_unavailable():
    with ScriptedHTTPServer(scripted((500, {"error": "boom", "code": "internal", "field": None}))) as fake:
        cli = BootstrapClient(fake.url, timeout_s=5.0, retries=2, backoff_s=0.01)
        with pytest.raises(BootstrapUnavailable) as err:
            cli.heartbeat("P")
        assert len(fake.requests) == 3
        assert isinstance(err.value.__cause__, BootstrapError)


def test_non_json_error_bodies_are_handled():
    with ScriptedHTTPServer(lambda path: (418, "teapot")) as fake:  # type: ignore[arg-type,return-value]
        with pytest.raises(BootstrapError) as err:
            BootstrapClient(fake.url).heartbeat("P")
        assert err.value.status == 418


def test_connection_is_reused():
    with ScriptedHTTPServer(scripted(OK)) as fake:
        cli = BootstrapClient(fake.url)
        for _ in range(10):
            cli.heartbeat("P")
        assert len({port for _, port in fake.requests}) == 1


def test_server_closing_idle_connections_is_not_an_outage():
    with ScriptedHTTPServer(scripted(OK), close_after_each=True) as fake:
        cli = BootstrapClient(fake.url, retries=0)
        for _ in range(5):
            cli.heartbeat("P")
        assert len(fake.requests) == 5


def test_unreachable_server_fails_within_the_timeout():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connection refused
        cli = BootstrapClient(f"http://127.0.0.1:{port}", timeout_s=0.5, retries=5, backoff_s=0.05)
        with pytest.raises(BootstrapUnavailable) as err:
            cli.lookup("P", ["r"])
        assert isinstance(err.value, ConnectionError)
        assert "unavailable" in str(err.value)


def test_a_server_that_never_answers_is_bounded_by_the_timeout():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # accepts connections (kernel backlog) but never answers
        cli = BootstrapClient(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout_s=0.3, retries=3)
        with pytest.raises(BootstrapUnavailable):
            cli.heartbeat("P")


def test_closed_client_refuses_calls():
    cli = BootstrapClient("http://127.0.0.1:9")
    cli.close()
    with pytest.raises(BootstrapError):
        cli.heartbeat("P")
