"""Prefill's scheduler side against a real bootstrap server: held blocks are freed even when the server
loses their outcomes (it dropped the engine after missed heartbeats, or restarted)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")


@pytest.fixture
def prefill():
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer, EngineRegistration
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    reg = EngineRegistration(engine_id="pre", tp_rank=0, tp_size=1, transport_addr="127.0.0.1:9", layers=[],
                             protocol_version=1, compat_hash="x")
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_url=srv.url, lease_s=2.0), "pre", "kv_producer", 32)
    try:
        with BootstrapClient(srv.url) as cli:
            cli.register_engine(reg, 60.0)
            yield sched, cli, reg
    finally:
        sched.shutdown()
        srv.stop()


def _hold(sched, cli, rid: str) -> None:
    """What _finished_producer does for a finished request: publish it, then hold its blocks."""
    cli.publish("pre", rid, [[1, 2]], num_tokens=64, lease_s=60.0)
    sched._held[rid] = (time.monotonic() + 600.0, 2)  # local deadline far away: only the server can free


def _freed(sched, want: set[str], wait_s: float = 10.0) -> set[str]:
    got: set[str] = set()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not want <= got:
        got |= set(sched._take_frees())
        time.sleep(0.05)
    return got


def test_requests_lost_with_a_dropped_engine_are_freed(prefill):
    sched, cli, reg = prefill
    for rid in ("r1", "r2", "r3"):
        _hold(sched, cli, rid)
    cli.unregister_engine("pre")  # as when its lease ran out: its requests go, with no outcome queued
    cli.register_engine(reg, 60.0)  # the heartbeater registers it again
    _hold(sched, cli, "r4")  # published after: still held by the server
    assert _freed(sched, {"r1", "r2", "r3"}) == {"r1", "r2", "r3"}  # found by the periodic lookup
    assert set(sched._held) == {"r4"}
    assert sched._reconcile(cli) == 0  # nothing else to free


def test_normal_outcomes_still_come_from_the_poll(prefill):
    sched, cli, reg = prefill
    _hold(sched, cli, "r5")
    cli.release("pre", "r5", "pulled")
    assert _freed(sched, {"r5"}, wait_s=1.0) == {"r5"}  # well before the first lookup (half a lease)
    assert sched.get_kv_connector_stats().data["released_pulled"] == 1


def test_a_release_between_poll_and_lookup_is_not_counted_expired(prefill):
    """Decode's release can land after a poll and before the periodic lookup: the lookup then sees it
    released while its outcome is still queued for the next poll. That is not a lease expiry."""
    sched, cli, reg = prefill
    _hold(sched, cli, "r6")
    cli.release("pre", "r6", "pulled")
    assert sched._reconcile(cli) == 0  # first sighting: the poll delivers the outcome
    assert _freed(sched, {"r6"}) == {"r6"}
    stats = sched.get_kv_connector_stats().data
    assert (stats["released_pulled"], stats["leases_expired"]) == (1, 0)


def test_a_release_whose_outcome_was_lost_is_freed_on_the_second_lookup(prefill):
    sched, cli, reg = prefill
    _hold(sched, cli, "r7")
    cli.release("pre", "r7", "abandoned")
    assert sched._reconcile(cli) == 0
    assert sched._reconcile(cli) == 1  # still released a lookup later: freed even if no poll ever says so
    assert "r7" in _freed(sched, {"r7"})
    assert sched._reconcile(cli) == 0


def _idle_step(sched, scheduled_tokens: int = 0):
    from types import SimpleNamespace
    out = SimpleNamespace(total_num_scheduled_tokens=scheduled_tokens, finished_req_ids=set())
    t0 = time.monotonic()
    frees = sched.build_connector_meta(out).frees
    return frees, time.monotonic() - t0


def test_an_idle_step_waits_for_a_release_and_ends_with_it(prefill):
    """With nothing to run but held blocks, a step waits (up to idle_step_wait_ms) for a release instead
    of returning at once, and the release it waited for is freed in that same step."""
    import dataclasses
    import threading

    sched, cli, reg = prefill
    sched.cfg = dataclasses.replace(sched.cfg, idle_step_wait_ms=1000.0)
    _hold(sched, cli, "r8")
    frees, took = _idle_step(sched)
    assert frees == [] and took >= 0.99  # nobody released: the whole wait, no free
    threading.Timer(0.05, cli.release, ("pre", "r8", "pulled")).start()
    frees, took = _idle_step(sched)
    assert frees == ["r8"] and took < 0.9 and not sched._held  # the release ended the wait
    _hold(sched, cli, "r9")
    threading.Timer(0.3, cli.release, ("pre", "r9", "pulled")).start()
    frees, took = _idle_step(sched, scheduled_tokens=64)  # a step with work never waits
    assert frees == [] and took < 0.3
    assert _freed(sched, {"r9"}) == {"r9"}


def test_idle_step_wait_is_validated():
    from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError

    assert ConnectorConfig.from_extra({"idle_step_wait_ms": 0}).idle_step_wait_ms == 0
    for bad in (-1, 1001, "5", True):
        with pytest.raises(ConnectorConfigError, match="idle_step_wait_ms"):
            ConnectorConfig.from_extra({"idle_step_wait_ms": bad})
