"""The server restarts (state lost): lookups in the gap fail fast, heartbeats register the engines again."""

from __future__ import annotations

import time

import pytest

from kvlink.bootstrap import (
    BootstrapClient,
    BootstrapConfig,
    BootstrapServer,
    BootstrapUnavailable,
    Heartbeater,
    Outcome,
    UnknownEngine,
)


def wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_restart_engines_reregister_via_heartbeat(make_registration, token):
    config = BootstrapConfig(token=token)
    first = BootstrapServer(config).start()
    port = first.port
    url = first.url
    prefill = BootstrapClient(url, token=token, timeout_s=1.0)
    decode = BootstrapClient(url, token=token, timeout_s=1.0, retries=2)
    regs = [make_registration("P", tp_rank=r, tp_size=3, port=7000 + r) for r in range(3)]
    reregistered: list[int] = []
    beaters = [Heartbeater(prefill, reg, lease_s=3.0, interval_s=0.05,
                           on_reregistered=lambda r=reg.tp_rank: reregistered.append(r)).start() for reg in regs]
    try:
        wait_for(lambda: all(b.registered.is_set() for b in beaters))
        prefill.publish("P", "r1", [[1]], 16, lease_s=30.0, transfer_id="t1")
        assert decode.lookup_transfer("t1").request_id == "r1"

        first.stop()
        # The gap: nothing listens. Lookups fail with a clear error, bounded by the client's timeout.
        with pytest.raises(BootstrapUnavailable):
            decode.lookup("P", ["r1"])
        with pytest.raises(BootstrapUnavailable):
            decode.lookup_transfer("t1", wait_s=1.0)

        second = BootstrapServer(BootstrapConfig(token=token, port=port)).start()
        try:
            assert second.table.server_id != first.table.server_id
            wait_for(lambda: sorted(reregistered) == [0, 1, 2])
            assert [r.tp_rank for r in decode.engine_ranks("P")] == [0, 1, 2]
            assert all(b.registrations == 2 for b in beaters)
            # The published request died with the old server: unknown, not hanging.
            assert decode.lookup("P", ["r1"])["r1"].value == "unknown"
            # The outcome cursor starts again with the new server.
            prefill.publish("P", "r2", [[2]], 16, lease_s=30.0)
            decode.release("P", "r2", Outcome.PULLED)
            assert prefill.poll_released("P") == [("r2", Outcome.PULLED)]
        finally:
            for b in beaters:
                b.stop()
            second.stop()
    finally:
        for b in beaters:
            b.stop()
        first.stop()


def test_lookup_for_a_forgotten_engine_fails_fast(server, token):
    with BootstrapClient(server.url, token=token, timeout_s=5.0) as cli:
        with pytest.raises(UnknownEngine):
            cli.lookup("never-registered", ["r"], wait_s=30.0)


def test_heartbeater_registers_again_when_forgotten(client, make_registration):
    reg = make_registration("P")
    with Heartbeater(client, reg, lease_s=5.0, interval_s=0.05, unregister_on_stop=True) as beater:
        wait_for(beater.registered.is_set)
        client.unregister_engine("P")  # as if the server had forgotten it
        wait_for(lambda: beater.registrations >= 2)
        assert client.get_engine("P") == reg
    with pytest.raises(UnknownEngine):
        client.get_engine("P")  # unregistered on stop


def test_heartbeater_waits_for_a_server_that_is_not_up_yet(make_registration, token):
    srv = BootstrapServer(BootstrapConfig(token=token))
    srv.start()
    port = srv.port
    srv.stop()
    cli = BootstrapClient(f"http://127.0.0.1:{port}", token=token, timeout_s=0.5, retries=0)
    with Heartbeater(cli, make_registration("P"), lease_s=3.0, interval_s=0.05) as beater:
        time.sleep(0.2)
        assert not beater.registered.is_set()
        with BootstrapServer(BootstrapConfig(token=token, port=port)) as late:
            wait_for(beater.registered.is_set)
            assert late.table.num_engine_ranks == 1


def test_a_server_not_up_at_start_is_waited_for_quietly_then_warned_about(make_registration, token, caplog):
    """Every PP/TP rank but an engine's first registers with the bootstrap server the first rank embeds, and
    may try before it listens: within the start-up grace that is logged at INFO (an operator saw a warning
    at every PP start); past the grace, or once registered, an unreachable server is a warning."""
    import logging

    srv = BootstrapServer(BootstrapConfig(token=token))
    srv.start()
    port = srv.port
    srv.stop()
    cli = BootstrapClient(f"http://127.0.0.1:{port}", token=token, timeout_s=0.5, retries=0)
    caplog.set_level(logging.INFO, logger="kvlink.bootstrap.heartbeat")
    with Heartbeater(cli, make_registration("P"), lease_s=3.0, interval_s=0.05) as beater:
        time.sleep(0.3)
        with BootstrapServer(BootstrapConfig(token=token, port=port)):
            wait_for(beater.registered.is_set)
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert any(lv == "INFO" and "waiting for the server" in m for lv, m in levels), levels
    assert not any(lv == "WARNING" for lv, _ in levels), levels
    caplog.clear()
    with Heartbeater(cli, make_registration("Q"), lease_s=3.0, interval_s=0.05, startup_grace_s=0.1):
        wait_for(lambda: any(r.levelname == "WARNING" for r in caplog.records), 5.0)
    assert "heartbeat failed, will retry" in caplog.records[-1].getMessage()


def test_reregistered_callback_survives_a_failed_first_attempt(make_registration, token):
    srv = BootstrapServer(BootstrapConfig(token=token)).start()
    port = srv.port
    calls: list[int] = []
    cli = BootstrapClient(srv.url, token=token, timeout_s=0.5, retries=0)
    with Heartbeater(cli, make_registration("P"), lease_s=3.0, interval_s=0.05,
                     on_reregistered=lambda: calls.append(1)) as beater:
        wait_for(beater.registered.is_set)
        srv.stop()
        time.sleep(0.2)  # heartbeats fail meanwhile
        srv2 = BootstrapServer(BootstrapConfig(token=token, port=port)).start()
        try:
            wait_for(lambda: calls == [1])
        finally:
            beater.stop()
            srv2.stop()


def test_start_fails_loudly_when_the_port_is_taken(server, token):
    with pytest.raises(OSError):
        BootstrapServer(BootstrapConfig(token=token, port=server.port)).start()
