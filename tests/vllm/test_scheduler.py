"""Prefill's scheduler side against a real bootstrap server: held blocks are freed even when the server
loses their outcomes (it dropped the engine after missed heartbeats, or restarted)."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest

from kvlink.bootstrap import Outcome
from tests.vllm.helpers import held_requests

pytest.importorskip("vllm")


@contextlib.contextmanager
def _prefill_scheduler(lease_s: float = 2.0, **server):
    """A prefill scheduler registered with a real bootstrap server (``server``: its BootstrapConfig limits)."""
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer, EngineRegistration
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0, **server)).start()
    reg = EngineRegistration(engine_id="pre", tp_rank=0, tp_size=1, transport_addr="127.0.0.1:9", layers=[],
                             protocol_version=1, compat_hash="x")
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_url=srv.url, lease_s=lease_s), "pre", "kv_producer", 32)
    try:
        with BootstrapClient(srv.url) as cli:
            cli.register_engine(reg, 60.0)
            yield sched, cli, reg
    finally:
        sched.shutdown()
        srv.stop()


@pytest.fixture
def prefill():
    with _prefill_scheduler() as it:
        yield it


def _hold(sched, cli, rid: str) -> None:
    """What _finished_producer does for a finished request, with a lease the test outlives: publish it,
    then hold its blocks (the server answers, so the local deadline never applies)."""
    cli.publish("pre", rid, [[1, 2]], num_tokens=64, lease_s=60.0)
    with sched._held_lock:
        sched._held.published(rid, 2)


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
    assert set(held_requests(sched)) == {"r4"}
    assert sched._reconcile(cli) == 0  # nothing else to free


def test_normal_outcomes_still_come_from_the_poll(prefill):
    sched, cli, reg = prefill
    _hold(sched, cli, "r5")
    cli.release("pre", "r5", Outcome.PULLED)
    assert _freed(sched, {"r5"}, wait_s=1.0) == {"r5"}  # well before the first lookup (half a lease)
    assert sched.get_kv_connector_stats().data["released_pulled"] == 1


def test_a_release_between_poll_and_lookup_is_not_counted_expired(prefill):
    """Decode's release can land after a poll and before the periodic lookup: the lookup then sees it
    released while its outcome is still queued for the next poll. That is not a lease expiry."""
    sched, cli, reg = prefill
    _hold(sched, cli, "r6")
    cli.release("pre", "r6", Outcome.PULLED)
    assert sched._reconcile(cli) == 0  # first sighting: the poll delivers the outcome
    assert _freed(sched, {"r6"}) == {"r6"}
    stats = sched.get_kv_connector_stats().data
    assert (stats["released_pulled"], stats["leases_expired"]) == (1, 0)


def test_a_release_whose_outcome_was_lost_is_freed_on_the_second_lookup(prefill):
    sched, cli, reg = prefill
    _hold(sched, cli, "r7")
    cli.release("pre", "r7", Outcome.ABANDONED)
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
    threading.Timer(0.05, cli.release, ("pre", "r8", Outcome.PULLED)).start()
    frees, took = _idle_step(sched)
    assert frees == ["r8"] and took < 0.9 and not held_requests(sched)  # the release ended the wait
    _hold(sched, cli, "r9")
    threading.Timer(0.3, cli.release, ("pre", "r9", Outcome.PULLED)).start()
    frees, took = _idle_step(sched, scheduled_tokens=64)  # a step with work never waits
    assert frees == [] and took < 0.3
    assert _freed(sched, {"r9"}) == {"r9"}


@pytest.mark.parametrize("key", ["idle_step_wait_ms", "pull_step_wait_ms"])
def test_step_waits_are_validated(key):
    from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError

    assert getattr(ConnectorConfig.from_extra({key: 0}), key) == 0
    for bad in (-1, 1001, "5", True):
        with pytest.raises(ConnectorConfigError, match=key):
            ConnectorConfig.from_extra({key: bad})


def test_decode_step_with_nothing_to_run_but_pulls_sleeps_first():
    """Decode: while requests only wait for their KV (concurrent pairing: for prefill to publish; or a pull
    of published blocks), each engine step sleeps pull_step_wait_ms (vLLM would otherwise step back to
    back beside prefill, and beside the worker's threads); a step with work, new pulls or cancels, or no
    pull under way, does not. (A worker's nudge ends the wait early: test_nudge.py.)"""
    import dataclasses

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import RemoteSource
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(pull_step_wait_ms=200.0), "dec", "kv_consumer", 32)
    try:
        assert _idle_step(sched)[1] < 0.15  # no pull under way: vLLM would not step for nothing
        sched._pulls["d1"] = RemoteSource(bootstrap_url="http://127.0.0.1:9", transfer_id="t1")
        assert _idle_step(sched)[1] >= 0.19
        assert _idle_step(sched, scheduled_tokens=1)[1] < 0.15  # other requests run: never wait
        sched._pulls["d2"] = RemoteSource(bootstrap_url="http://127.0.0.1:9", engine_id="pre", request_id="r2",
                                          block_ids=((1, 2),))
        del sched._pulls["d1"]
        assert _idle_step(sched)[1] >= 0.19  # a pull of published blocks (sequential) alone waits too
        sched._pulls["d1"] = RemoteSource(bootstrap_url="http://127.0.0.1:9", transfer_id="t1")
        del sched._pulls["d2"]
        sched._new_cancels.append("d1")
        assert _idle_step(sched)[1] < 0.15  # a cancel goes to the worker at once
        sched.cfg = dataclasses.replace(sched.cfg, pull_step_wait_ms=0)
        assert _idle_step(sched)[1] < 0.15
    finally:
        sched.shutdown()


def _finished(rid: str, params, status: str = "FINISHED_STOPPED"):
    """The parts of a vLLM Request that request_finished reads."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, status=getattr(RequestStatus, status),
                           num_computed_tokens=64, prompt_token_ids=list(range(64)))


def test_a_publish_with_no_answer_keeps_the_blocks_and_a_refused_one_frees_them():
    """A publish the server may apply late (no answer within bootstrap_timeout_s) could hand the blocks to a
    decode long-polling the transfer id: they stay held as if published. A refused connection says the
    server never had it: freed at once. Either way decode is told to compute (kvlink_error)."""
    import socket

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import PrefillRequest
    from kvlink.vllm.scheduler import KVLinkScheduler
    from tests.ports import free_port

    from types import SimpleNamespace

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_url=url, bootstrap_timeout_s=0.5, lease_s=2.0), "pre",
                            "kv_producer", 32)
    staged = KVLinkScheduler(ConnectorConfig(bootstrap_url=url, bootstrap_timeout_s=0.5, lease_s=2.0), "pre-s",
                             "kv_producer", 32, staging_slots=4)
    abandoned = []
    staged._abandon_transfer = lambda rid, tid: abandoned.append(tid)
    try:
        keep, answer = sched.request_finished(_finished("r1", PrefillRequest("t-1").to_params()), [3, 4])
        assert keep and "publish failed" in answer["kvlink_error"]
        assert "r1" in held_requests(sched)
        # host staging: the slots are published after the copy; no answer must not abandon the transfer
        assert staged.request_finished(_finished("s1", PrefillRequest("t-s1").to_params()), [3, 4])[0]
        staged.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1, finished_req_ids=()))
        staged.update_connector_output(SimpleNamespace(finished_sending={"s1"}, finished_recving=(),
                                                       failed_recving=()))
        assert staged.get_kv_connector_stats().data["publish_failures"] == 1
        assert abandoned == [] and "s1" in held_requests(staged)
    finally:
        sched.shutdown()
        staged.shutdown()
        silent.close()
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_url=f"http://127.0.0.1:{free_port()}", bootstrap_timeout_s=0.5,
                                            lease_s=2.0), "pre2", "kv_producer", 32)
    try:
        keep, answer = sched.request_finished(_finished("r2", PrefillRequest("t-2").to_params()), [3, 4])
        assert not keep and "publish failed" in answer["kvlink_error"]
        assert "r2" not in held_requests(sched)
    finally:
        sched.shutdown()


def test_a_finished_request_is_published_held_and_answered_with_params_decode_parses(prefill):
    from kvlink.vllm.params import PrefillRequest, RemoteSource, prompt_digest

    sched, cli, reg = prefill
    keep, answer = sched.request_finished(_finished("r10", PrefillRequest("t-10").to_params()), [0, 4, 5])
    sha = prompt_digest(range(64))  # of the 64 prompt tokens it computed
    assert keep and RemoteSource.from_params(answer) == RemoteSource(
        bootstrap_url=sched.bootstrap_url, engine_id="pre", request_id="r10", block_ids=(0, 4, 5), num_tokens=64,
        transfer_id="t-10", lease_s=2.0, prompt_sha=sha)
    rec = cli.lookup_transfer("t-10")
    assert rec.block_ids == [[0, 4, 5]] and rec.prompt_sha == sha  # the null block kept by position
    assert held_requests(sched) == {"r10": 2}  # the null block holds nothing
    cli.release("pre", "r10", Outcome.PULLED)
    assert _freed(sched, {"r10"}) == {"r10"}
    assert sched.get_kv_connector_stats().data["released_pulled"] == 1


def test_an_aborted_request_is_not_held(prefill):
    sched, cli, reg = prefill
    assert sched.request_finished(_finished("r13", {"do_remote_decode": True}, "FINISHED_ABORTED"), [1]) == (
        False, None)
    assert held_requests(sched) == {}


def test_malformed_prefill_params_are_refused_naming_the_field(prefill):
    sched, cli, reg = prefill
    for params, field in (({"do_remote_decode": True, "transfer_id": "t" * 513}, "transfer_id"),
                          ({"do_remote_decode": True, "transfer_id": 7}, "transfer_id"),
                          ({"do_remote_decode": "yes"}, "do_remote_decode")):
        keep, answer = sched.request_finished(_finished("r11", params), [1])
        assert not keep and answer["do_remote_prefill"] is False and repr(field) in answer["kvlink_error"]
    assert held_requests(sched) == {}
    assert sched.get_kv_connector_stats().data["bad_params"] == 3
    # 300 characters: prefill refused it before while decode accepted it; now both follow one rule.
    keep, answer = sched.request_finished(_finished("r12", {"do_remote_decode": True, "transfer_id": "t" * 300}), [1])
    assert keep and answer["transfer_id"] == "t" * 300


def test_decode_refuses_malformed_params_once_and_answers_with_the_field():
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    try:
        req = _finished("d1", {"do_remote_prefill": True, "remote_bootstrap_addr": 12})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # counted once
        keep, answer = sched.request_finished(req, [])
        assert not keep and "'remote_bootstrap_addr'" in answer["kvlink_error"]
        assert sched.get_kv_connector_stats().data["bad_params"] == 1
    finally:
        sched.shutdown()


@pytest.mark.parametrize("blocks,tokens,why", [([[1, 2], [3, 4]], 32, "2 KV cache group(s); this engine has 1"),
                                               ([1, 2], 1000, "too few for remote_num_tokens=1000")])
def test_decode_refuses_block_ids_that_cannot_be_its_own_at_admission(blocks, tokens, why):
    """More KV cache groups than decode has, or fewer positions than the tokens they claim: refused when the
    request is admitted, naming the field, instead of a pull that fails later without a word to the client."""
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    try:
        req = _decode_request("d1", 64, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://p:1",
                                         "remote_engine_id": "pre", "remote_request_id": "r1",
                                         "remote_block_ids": blocks, "remote_num_tokens": tokens})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        keep, answer = sched.request_finished(req, [])
        assert not keep and why in answer["kvlink_error"] and "'remote_block_ids'" in answer["kvlink_error"]
    finally:
        sched.shutdown()


def test_params_are_parsed_once_while_vllm_asks_every_step(monkeypatch):
    """vLLM asks again every step while a request waits (no room, a sibling pulling): params of up to 64
    groups of a million block ids took seconds to parse, every step, holding up every request."""
    from kvlink.vllm import scheduler as S
    from kvlink.vllm.config import ConnectorConfig

    parsed = []
    real = S.RemoteSource.from_params
    monkeypatch.setattr(S.RemoteSource, "from_params", staticmethod(lambda p: parsed.append(1) or real(p)))
    sched = S.KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    try:
        req = _decode_request("d1", 64, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://p:1",
                                         "remote_engine_id": "pre", "remote_request_id": "r1",
                                         "remote_block_ids": [1, 2, 3, 4], "remote_num_tokens": 64})
        for _ in range(3):
            assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
        assert len(parsed) == 1
        sched.request_finished(req, [])
        assert sched._parsed == {}
    finally:
        sched.shutdown()


def test_decode_refuses_a_bootstrap_server_not_in_bootstrap_allow(caplog):
    """A request that can name any bootstrap server makes decode call it with its token and connect where it
    says: with bootstrap_allow, one not listed is refused, naming it, and the prompt computed locally."""
    from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError
    from kvlink.vllm.scheduler import KVLinkScheduler

    with pytest.raises(ConnectorConfigError, match="bootstrap_allow"):
        ConnectorConfig(bootstrap_allow="http://a:1")
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_token="s3cret", bootstrap_allow=["prefill-0:8998/"]),
                            "dec", "kv_consumer", 16)
    try:
        evil = _finished("d1", {"do_remote_prefill": True, "remote_bootstrap_addr": "http://evil:80",
                                "transfer_id": "t1"})
        assert sched.get_num_new_matched_tokens(evil, 0) == (0, False)
        keep, answer = sched.request_finished(evil, [])
        assert not keep and "'http://evil:80' is not one of this engine's bootstrap_allow" in answer["kvlink_error"]
        ok = _decode_request("d2", 64, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://prefill-0:8998",
                                        "transfer_id": "t2"})
        assert sched.get_num_new_matched_tokens(ok, 0) == (64, True)
    finally:
        sched.shutdown()
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_token="s3cret"), "dec2", "kv_consumer", 16)
    sched.shutdown()
    assert "bootstrap_allow is not" in caplog.text
    # aborted before it was ever scheduled: the release to prefill is not sent to a server not allowed either
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_token="s3cret", bootstrap_allow=["prefill-0:8998"]),
                            "dec3", "kv_consumer", 16)
    calls = []
    sched._release_shared = lambda src, rid, pulled: calls.append(src.bootstrap_url)
    try:
        for rid, addr in (("a1", "http://evil:80"), ("a2", "http://prefill-0:8998")):
            sched.request_finished(_finished(rid, {"do_remote_prefill": True, "remote_bootstrap_addr": addr,
                                                   "transfer_id": "t-" + rid}, "FINISHED_ABORTED"), [])
        assert calls == ["http://prefill-0:8998"]
    finally:
        sched.shutdown()


def test_a_request_asking_to_be_pulled_and_published_is_refused_and_forgotten():
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(), "both", "kv_consumer", 16)
    try:
        req = _decode_request("b1", 64, {"do_remote_prefill": True, "do_remote_decode": True,
                                         "remote_bootstrap_addr": "http://p:1", "transfer_id": "t"})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        keep, answer = sched.request_finished(req, [])
        assert not keep and "both do_remote_prefill and do_remote_decode" in answer["kvlink_error"]
        assert "b1" not in sched._bad and "b1" not in sched._processed
    finally:
        sched.shutdown()


def test_a_staged_request_whose_id_decode_could_not_be_told_is_refused_not_raised():
    """Host staging: the answer names the request; an id the params refuse (over 512 characters) must be a
    refusal, not an exception in vLLM's scheduler loop, and no pool slot is taken."""
    import socket

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    silent = socket.create_server(("127.0.0.1", 0))
    pre = KVLinkScheduler(ConnectorConfig(bootstrap_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                                          bootstrap_timeout_s=0.5), "pre", "kv_producer", 32, staging_slots=4)
    pre._abandon_transfer = lambda rid, tid: None
    try:
        keep, answer = pre.request_finished(_finished("x" * 600, {"do_remote_decode": True}), [1, 2])
        assert not keep and "remote_request_id" in answer["kvlink_error"]
        assert pre._planner.pool.in_use == 0 and not pre._planner.is_staging("x" * 600)
    finally:
        pre.shutdown()
        silent.close()


# ----- decode: the pull handed to the worker is decode's block table by position ---------------------------


def _decode_request(rid: str, n_tokens: int, params: dict):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + n_tokens)),
                   sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                   pooling_params=None)


def _blocks(ids):
    """vLLM's own block objects for a block table; id 0 is its null block."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    blocks = []
    for b in ids:
        blk = KVCacheBlock(b)
        blk.is_null = b == 0
        blocks.append(blk)
    return KVCacheBlocks((blocks,))


@pytest.mark.parametrize("table, hit_tokens, ext_tokens, want_table, want_first, want_fill", [
    # a sliding window: positions 0-2 are null (outside the window), the rest are decode's new blocks
    ((0, 0, 0, 7, 8), 0, 150, (0, 0, 0, 7, 8), 0, (7, 8)),
    # a prefix-cache hit of two blocks, then two blocks to pull
    ((3, 4, 7, 8), 64, 60, (3, 4, 7, 8), 2, (7, 8)),
    # blocks vLLM allocated past the loaded tokens are not part of the pull
    ((5, 6, 9), 0, 40, (5, 6), 0, (5, 6)),
])
def test_decode_pull_is_the_block_table_by_position(table, hit_tokens, ext_tokens, want_table, want_first,
                                                    want_fill):
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 32)
    try:
        n = hit_tokens + ext_tokens
        req = _decode_request("d1", n, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1",
                                        "remote_engine_id": "pre", "remote_request_id": "p1",
                                        "remote_block_ids": list(range(20, 20 + len(table))),
                                        "remote_num_tokens": n})
        assert sched.get_num_new_matched_tokens(req, hit_tokens) == (ext_tokens, True)
        sched.update_state_after_alloc(req, _blocks(table), ext_tokens)
        (spec,) = sched.build_connector_meta(None).pulls
        assert (spec.local_block_ids, spec.first_block, spec.blocks_to_fill) == (want_table, want_first, want_fill)
    finally:
        sched.shutdown()


def test_offered_tokens_then_handed_none_to_load_pulls_nothing_and_frees_prefills_copy(monkeypatch):
    """Inside vLLM's MultiConnector a child before kvlink with a hit loads the request, and kvlink hears
    ``update_state_after_alloc(..., 0)`` after offering the prompt (as after a local prefix-cache hit):
    nothing is pulled into blocks another child fills, and prefill hears "abandoned" at once instead of
    holding its copy for a lease."""
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 32)
    told = []
    monkeypatch.setattr(sched, "_release_async", lambda src, outcome: told.append((src.request_id, outcome)))
    try:
        req = _decode_request("d-other", 96, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1",
                                              "remote_engine_id": "pre", "remote_request_id": "p-other",
                                              "remote_block_ids": [20, 21, 22], "remote_num_tokens": 96})
        offered, load_async = sched.get_num_new_matched_tokens(req, 0)
        assert offered > 0 and load_async
        sched.update_state_after_alloc(req, _blocks([5, 6, 7]), 0)
        assert not sched.build_connector_meta(None).pulls
        assert told == [("p-other", Outcome.ABANDONED)]
        sched.request_finished(req, [5, 6, 7])
        assert told == [("p-other", Outcome.ABANDONED)]  # once
    finally:
        sched.shutdown()


def test_a_server_that_takes_fewer_ids_per_lookup_is_asked_in_smaller_chunks_and_never_counts_as_silent():
    """A bootstrap server run with a small max_lookup_ids answers a larger reconcile lookup 400, every time.
    That answer is not silence: counted as silence, prefill freed every held request a lease later, under
    decode's renewals (which that server kept granting)."""
    with _prefill_scheduler(lease_s=30.0, max_lookup_ids=2) as (sched, cli, _):
        for rid in ("a", "b", "c"):
            assert sched.request_finished(_finished(rid, {"do_remote_decode": True}), [3, 4])[0]
        assert sched._reconcile(sched.clients.get(sched.bootstrap_url)) == 0
        assert sched._lookup_chunk == 2 and set(held_requests(sched)) == {"a", "b", "c"}


@pytest.mark.parametrize("error", ["unauthorized", "down"])
def test_a_poll_that_fails_even_with_an_answer_is_silence_so_the_deadline_still_frees(error):
    """A poll refused outright (a token rotated on the server, say) tells prefill nothing of its held
    requests: it must count as silence, so the lease deadline frees them (counting it as an answer leaked
    them for good)."""
    from kvlink.bootstrap import Unauthorized
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    polls = []

    class Failing:
        def poll_released(self, engine_id, launch=None):
            polls.append((engine_id, launch))
            raise Unauthorized("bearer token missing or wrong") if error == "unauthorized" else ConnectionError("down")

    sched = KVLinkScheduler(ConnectorConfig(bootstrap_url="http://127.0.0.1:9", lease_s=30.0, release_poll_s=0.01),
                            "pre", "kv_producer", 32, launch="L1")
    try:
        sched.clients.get = lambda url: Failing()
        with sched._held_lock:
            sched._held.published("r1", 2)
        deadline = time.monotonic() + 10
        while len(polls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with sched._held_lock:
            assert polls and sched._held._silent_since is not None
        assert polls[0] == ("pre", "L1")  # the poll names this process's start (PairingTable.poll_released)
    finally:
        sched.shutdown()


def test_decode_params_refused_at_admission_give_prefills_copy_back_at_once():
    """Params decode refuses when it admits the request (here: another KV cache group count) name a live
    prefill request nobody will pull: prefill is told now, not after its lease."""
    from kvlink.bootstrap import RequestStatus
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    with _prefill_scheduler(lease_s=30.0) as (pre, cli, _):
        keep, params = pre.request_finished(_finished("r1", {"do_remote_decode": True}), [3, 4])
        assert keep
        params = dict(params, remote_block_ids=[[3, 4], [5, 6]])
        dec = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 32)
        try:
            req = _decode_request("d1", 64, params)
            assert dec.get_num_new_matched_tokens(req, 0) == (0, False)
            deadline = time.monotonic() + 10
            while cli.lookup("pre", ["r1"])["r1"] is not RequestStatus.RELEASED and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cli.lookup("pre", ["r1"])["r1"] is RequestStatus.RELEASED
        finally:
            dec.shutdown()


def test_every_publish_names_the_launch_and_a_replaced_one_keeps_nothing():
    """Directly and after a host-staging copy: the engine's ranks are registered by launch "new"; the old
    launch's publishes are refused (their block ids or slots would be read in the new process's memory),
    and the old scheduler frees what it held for them."""
    from types import SimpleNamespace

    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer, EngineRegistration, RequestStatus
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import PrefillRequest
    from kvlink.vllm.scheduler import KVLinkScheduler

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    cfg = ConnectorConfig(bootstrap_url=srv.url, lease_s=30.0)
    old = KVLinkScheduler(cfg, "pre", "kv_producer", 32, launch="old")
    staged = KVLinkScheduler(cfg, "pre", "kv_producer", 32, staging_slots=8, launch="old")
    try:
        with BootstrapClient(srv.url) as cli:
            cli.register_engine(EngineRegistration(engine_id="pre", transport_addr="127.0.0.1:9", layers=[],
                                                   protocol_version=2, compat_hash="x", launch="new"), 60.0)
            keep, answer = old.request_finished(_finished("r1", PrefillRequest("t-1").to_params()), [3, 4])
            assert not keep and "launch" in answer["kvlink_error"] and held_requests(old) == {}
            keep, _ = staged.request_finished(_finished("r2", PrefillRequest("t-2").to_params()), [5, 6])
            assert keep  # answered at once; published after the copy
            staged.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1, finished_req_ids=()))
            staged.update_connector_output(SimpleNamespace(finished_sending={"r2"}, finished_recving=(),
                                                           failed_recving=()))
            deadline = time.monotonic() + 10
            while staged._planner.pool.in_use and time.monotonic() < deadline:
                time.sleep(0.05)
            assert staged._planner.pool.in_use == 0 and held_requests(staged) == {}
            assert set(cli.lookup("pre", ["r1", "r2"]).values()) == {RequestStatus.UNKNOWN}
            new = KVLinkScheduler(cfg, "pre", "kv_producer", 32, launch="new")
            try:
                keep, _ = new.request_finished(_finished("r3", PrefillRequest("t-3").to_params()), [7])
                assert keep and cli.lookup_transfer("t-3").request_id == "r3"
            finally:
                new.shutdown()
    finally:
        staged.shutdown()
        old.shutdown()
        srv.stop()


def test_a_staged_request_is_published_after_its_copy_and_an_early_abandon_still_frees_it():
    """Host staging, scheduler sides only, real bootstrap server: prefill answers at once with a transfer id
    and no block ids, publishes the slots only when the worker reports the copy, and a decode that gives
    the request up before that publish (a client abort) still reaches prefill, whose slots are freed long
    before the 30 s lease and without an engine step."""
    from types import SimpleNamespace

    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer, EngineRegistration, UnknownRequest
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import RemoteSource
    from kvlink.vllm.scheduler import KVLinkScheduler

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    pre = KVLinkScheduler(ConnectorConfig(bootstrap_url=srv.url, lease_s=30.0), "pre", "kv_producer", 32,
                          staging_slots=8)
    dec = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 32)
    try:
        keep, params = pre.request_finished(_finished("r1", {"do_remote_decode": True}), [0, 4, 5])
        src = RemoteSource.from_params(params)
        assert keep and src.block_ids is None and src.transfer_id and src.request_id == "r1"
        with BootstrapClient(srv.url) as cli:
            cli.register_engine(EngineRegistration(engine_id="pre", transport_addr="127.0.0.1:9", layers=[],
                                                   protocol_version=2, compat_hash="x"), 60.0)
            with pytest.raises(UnknownRequest):
                cli.lookup_transfer(src.transfer_id)  # nothing is readable before the copy
            dec._release_async(src, Outcome.ABANDONED)  # decode gives up first: its report waits
            time.sleep(1.0)  # ... and reaches the server well before the publish
            meta = pre.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1, finished_req_ids=()))
            assert meta.stages == [("r1", (4, 5), (1, 2))]
            assert pre._planner.device_blocks() == 2 and pre.has_pending_work()
            pre.update_connector_output(SimpleNamespace(finished_sending={"r1"}, finished_recving=(),
                                                        failed_recving=()))
            deadline = time.monotonic() + 10
            while pre._planner.pool.in_use and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pre._planner.pool.in_use == 0 and held_requests(pre) == {}
            stats = pre.get_kv_connector_stats().data
            assert stats["staged"] == 1 and stats["released_abandoned"] == 1 and stats["staging_used_blocks"] == 0
    finally:
        dec.shutdown()
        pre.shutdown()
        srv.stop()


def test_a_streamed_request_restaged_from_scratch_is_published_at_the_next_epoch():
    """Its pieces named pool slots it could not keep: decode must read all of it again, not trust a piece
    whose slot another request's copy may have reused before decode's READ ended."""
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer, EngineRegistration
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    pre = KVLinkScheduler(ConnectorConfig(bootstrap_url=srv.url, lease_s=30.0), "pre", "kv_producer", 32,
                          staging_slots=2)
    try:
        with BootstrapClient(srv.url) as cli:
            cli.register_engine(EngineRegistration(engine_id="pre", transport_addr="127.0.0.1:9", layers=[],
                                                   protocol_version=2, compat_hash="x"), 60.0)
            pl = pre._planner
            with pre._held_lock:
                assert pl.reserve("d", 1) is not None  # streamed into one slot
                assert pl.admit("e", (9,), 0.0, ("t-e", 32, 0, None)) is None
                pl.take_jobs(0.0)  # e takes the other slot: the pool is full
                assert pl.admit("d", (31, 32), 0.0, ("t-d", 64, 0, None)) is None  # cannot grow in place
                pl.staged("e")
                pl.release("e")
                (job,), _ = pl.take_jobs(0.0)
            assert job.request_id == "d" and job.restaged
            pre._staged("d")
            assert cli.lookup_transfer("t-d").epoch == 1
    finally:
        pre.shutdown()
        srv.stop()


def test_staging_never_frees_a_request_mid_publish_nor_spins_nor_stops_preemption():
    """Host staging, prefill's scheduler side against a real bootstrap server:
    - a held request whose publish is in flight is left out of reconcile lookups (the server does not know it
      yet: "unknown" would free slots decode is about to read); once published-or-failed it is looked up again,
      and freed a lease after the first lookup that misses it (a renewal just before may have promised that);
    - staged requests hold no vLLM block (vLLM must go on preempting), requests queued or being copied do;
    - a request waiting for room takes the normal idle wait (no spinning); a copy under way a short one."""
    from types import SimpleNamespace

    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer, EngineRegistration
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    pre = KVLinkScheduler(ConnectorConfig(bootstrap_url=srv.url, lease_s=1.0), "pre", "kv_producer", 32,
                          staging_slots=2)
    idle = SimpleNamespace(total_num_scheduled_tokens=0, finished_req_ids=())
    try:
        with BootstrapClient(srv.url) as cli:
            cli.register_engine(EngineRegistration(engine_id="pre", transport_addr="127.0.0.1:9", layers=[],
                                                   protocol_version=2, compat_hash="x"), 60.0)
            with pre._held_lock:
                pre._held.published("mid", 0)
                pre._publishing.add("mid")
            assert pre._reconcile(cli) == 0 and "mid" in held_requests(pre)
            assert not pre.has_pending_block_frees()  # held, but no vLLM block
            with pre._held_lock:
                pre._publishing.discard("mid")  # its publish failed: the server never knew it
            assert pre._reconcile(cli) == 0 and "mid" in held_requests(pre)  # missing from now on
            deadline = time.monotonic() + 10
            while "mid" in held_requests(pre) and time.monotonic() < deadline:
                pre._reconcile(cli)  # (the release watcher's periodic lookups may free it first)
                time.sleep(0.1)
            assert "mid" not in held_requests(pre)
            pre._take_frees()
            pre.request_finished(_finished("a", {"do_remote_decode": True}), [4, 5])
            pre.request_finished(_finished("b", {"do_remote_decode": True}), [6])  # no room: waits
            assert pre.has_pending_block_frees()  # their vLLM blocks come back once staged
            meta = pre.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1, finished_req_ids=()))
            assert [j[0] for j in meta.stages] == ["a"]
            assert pre._idle_wait(idle) == 0.001  # a copy under way: step soon
            pre.update_connector_output(SimpleNamespace(finished_sending={"a"}, finished_recving=(),
                                                        failed_recving=()))
            assert pre._idle_wait(idle) == pre.cfg.idle_step_wait_ms / 1e3  # only "b", waiting for room
    finally:
        pre.shutdown()
        srv.stop()


def test_stream_granularity_is_layer_or_step():
    from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError

    assert ConnectorConfig.from_extra({}).stream_granularity == "layer"
    assert ConnectorConfig.from_extra({"stream_granularity": "step"}).stream_granularity == "step"
    for bad in ("layers", "", None, 1):
        with pytest.raises(ConnectorConfigError, match="stream_granularity"):
            ConnectorConfig.from_extra({"stream_granularity": bad})


def test_prefill_publishes_into_its_embedded_server_without_http():
    """With the embedded bootstrap server (no bootstrap_url), request_finished puts the record into the
    server's table on its loop thread: a decode long-polling the transfer id over HTTP gets it, and the
    scheduler's HTTP clients are not used for it."""
    import threading

    from kvlink.bootstrap import BootstrapClient, EngineRegistration
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import PrefillRequest
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(bootstrap_host="127.0.0.1", bootstrap_port=0, lease_s=30.0), "pre",
                            "kv_producer", 32)
    try:
        assert sched._server is not None
        reg = EngineRegistration(engine_id="pre", tp_rank=0, tp_size=1, transport_addr="127.0.0.1:9", layers=[],
                                 protocol_version=1, compat_hash="x")
        with BootstrapClient(sched.bootstrap_url) as cli:
            cli.register_engine(reg, 60.0)
            got: list = []
            poll = threading.Thread(target=lambda: got.append(cli.lookup_transfer("t-9", wait_s=20.0)))
            poll.start()
            used: list = []
            real_get = sched.clients.get
            sched.clients.get = lambda url: used.append(url) or real_get(url)
            keep, answer = sched.request_finished(_finished("r9", PrefillRequest("t-9").to_params()), [3, 4])
            poll.join(10.0)
            assert keep and answer["remote_request_id"] == "r9"
            assert [(r.request_id, r.block_ids, r.num_tokens) for r in got] == [("r9", [[3, 4]], 64)]
            assert used == []
            assert "r9" in held_requests(sched)
    finally:
        sched.shutdown()


def test_a_publish_the_bootstrap_server_refuses_as_full_frees_the_blocks_and_tells_decode_at_once():
    """A server that keeps no more of this engine's requests answers 429: it stored nothing, so prefill frees
    the blocks now, answers decode with a refusal and abandons the transfer id (a decode long-polling it
    stops waiting); the live request stays held."""
    from kvlink.bootstrap import RequestReleased
    from kvlink.vllm.params import PrefillRequest

    with _prefill_scheduler(lease_s=30.0, max_requests_per_engine=1) as (sched, cli, _):
        keep, answer = sched.request_finished(_finished("r1", PrefillRequest("t-1").to_params()), [3, 4])
        assert keep and answer["remote_request_id"] == "r1"
        keep, answer = sched.request_finished(_finished("r2", PrefillRequest("t-2").to_params()), [5, 6])
        assert not keep and "max_requests_per_engine" in answer["kvlink_error"]
        assert set(held_requests(sched)) == {"r1"}
        assert cli.lookup_transfer("t-1").request_id == "r1"
        with pytest.raises(RequestReleased):  # abandoned: a decode long-polling t-2 is answered now
            cli.lookup_transfer("t-2", wait_s=10.0)


@pytest.mark.parametrize("rid", ["r" * 600, "cmpl-\udcff"])
def test_a_request_id_the_server_cannot_take_frees_its_blocks_and_tells_decode_at_once(rid):
    """vLLM builds request ids from the client's: one too long for the server, or not valid Unicode. Its
    publish is refused before it is sent; its abandon cannot name it, so it names no one (abandoned only
    because nothing holds the id), and a decode long-polling the transfer id is answered now instead of
    after lookup_wait_s."""
    from kvlink.bootstrap import RequestReleased
    from kvlink.vllm.params import PrefillRequest, wire_id

    assert not wire_id(rid) and wire_id("r1")
    with _prefill_scheduler(lease_s=30.0) as (sched, cli, _):
        keep, answer = sched.request_finished(_finished(rid, PrefillRequest("t-1").to_params()), [3, 4])
        assert not keep and "publish failed" in answer["kvlink_error"]
        with pytest.raises(RequestReleased):
            cli.lookup_transfer("t-1", wait_s=10.0)
        assert held_requests(sched) == {}


def test_a_sequential_prompt_mismatch_is_decided_once_and_the_prompt_computed():
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import prompt_digest
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1", "remote_engine_id": "pre",
              "remote_request_id": "p1", "remote_block_ids": [1, 2, 3, 4], "remote_num_tokens": 64}
    try:
        same = _decode_request("d1", 64, params | {"remote_prompt_sha": prompt_digest(range(10, 74))})
        assert sched.get_num_new_matched_tokens(same, 0) == (64, True)
        other = _decode_request("d2", 64, params | {"remote_prompt_sha": prompt_digest(range(11, 75))})
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)  # asked again while it waits: once
        assert sched.get_kv_connector_stats().data["prompt_mismatch"] == 1
        longer = _decode_request("d3", 80, params | {"remote_prompt_sha": prompt_digest(range(10, 74))})
        assert sched.get_num_new_matched_tokens(longer, 0) == (64, True)  # prefill's 64 tokens begin its prompt
        shorter = _decode_request("d4", 40, params | {"remote_prompt_sha": prompt_digest(range(10, 74))})
        assert sched.get_num_new_matched_tokens(shorter, 0) == (0, False)
    finally:
        sched.shutdown()


def test_a_sequential_pull_hashes_each_token_count_of_its_prompt_once(monkeypatch):
    """The digest compared before admitting (_same_prompt) is the one the pull's record check uses: decode's
    scheduler thread hashes a long prompt once, not again at allocation."""
    from kvlink.vllm import scheduler as sched_mod
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import prompt_digest, request_digest

    hashed = []
    monkeypatch.setattr(sched_mod, "request_digest", lambda r, n: hashed.append(n) or request_digest(r, n))
    sched = sched_mod.KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1", "remote_engine_id": "pre",
              "remote_request_id": "p1", "remote_block_ids": [1, 2, 3, 4], "remote_num_tokens": 64,
              "remote_prompt_sha": prompt_digest(range(10, 74))}
    try:
        for rid, n, want in (("d1", 64, [64]), ("d2", 80, [64, 80])):
            hashed.clear()
            req = _decode_request(rid, n, params | {"remote_request_id": f"p-{rid}"})
            assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
            sched.update_state_after_alloc(req, _blocks(range(5, 5 + -(-n // 16))), 64)
            spec = sched._new_pulls.pop()
            assert hashed == want
            assert (spec.prompt_tokens, spec.prompt_sha) == (64, prompt_digest(range(10, 74)))
            assert (spec.whole_tokens, spec.whole_sha) == (n, prompt_digest(range(10, 10 + n)))
    finally:
        sched.shutdown()


def test_the_request_digest_covers_the_lora_adapter_and_the_images_among_its_tokens():
    from types import SimpleNamespace

    from kvlink.vllm.params import prompt_digest
    from kvlink.vllm.params import request_digest

    def req(lora=None, mm=(), embeds=None, ids=tuple(range(32))):
        return SimpleNamespace(prompt_token_ids=list(ids), prompt_embeds=embeds, mm_features=[
            SimpleNamespace(modality="image", identifier=i, mm_position=SimpleNamespace(offset=o, length=4))
            for i, o in mm], lora_request=None if lora is None else SimpleNamespace(lora_name=lora))

    plain = request_digest(req(), 32)
    assert plain == prompt_digest(range(32))
    assert len({plain, request_digest(req(lora="a"), 32), request_digest(req(lora="b"), 32),
                request_digest(req(mm=[("img1", 4)]), 32), request_digest(req(mm=[("img2", 4)]), 32),
                request_digest(req(mm=[("img1", 8)]), 32)}) == 6
    assert request_digest(req(mm=[("img1", 40)]), 32) == plain  # an image after the tokens covered
    assert request_digest(req(embeds=object()), 32) is None  # embeddings: nothing to compare
    assert request_digest(req(ids=range(20)), 32) != prompt_digest(range(32))  # fewer tokens: another prompt


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_request_asking_both_to_pull_and_to_publish_is_never_streamed(role):
    """Refused as a pull (both flags) and ended as one by request_finished: were it streamed, its stream,
    its pool slots and the transfer at the server would stay taken for good."""
    from vllm.v1.request import RequestStatus

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(stream_kv=True), "pre", role, 32, staging_slots=4)
    try:
        params = {"do_remote_decode": True, "do_remote_prefill": True, "remote_bootstrap_addr": "http://p:1",
                  "transfer_id": "t-both"}
        req = _decode_request("both-1", 100, params)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 0)
        req.status = RequestStatus.FINISHED_ABORTED
        sched.request_finished(req, [1, 2, 3, 4])
        assert "both-1" not in sched._stream and "both-1" not in sched._stream_slots
        assert sched._planner.pool.in_use == 0
    finally:
        sched.shutdown()


def test_decode_releasing_before_prefills_publish_call_returns_frees_the_request_at_once():
    """Decode may read and release a request between the server storing prefill's publish and the call
    returning on prefill's side (long poll answered at once, a slow step); the watcher polls meanwhile.
    The request is held before the call, so that outcome frees it, instead of being dropped and leaving the
    blocks until two lookups (a real bootstrap server, prefill's real scheduler)."""
    import time
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from kvlink.bootstrap import Outcome
    from kvlink.vllm.params import PrefillRequest

    with _prefill_at_server(lease_s=4.0) as (sched, cli):
        cli.publish("pre", "other", [[9]], num_tokens=32, lease_s=60.0)  # held already: the watcher polls
        with sched._held_lock:
            sched._held.published("other", 1)
        publish = sched._publish

        def publish_then_decode_releases(*args, **kwargs):
            publish(*args, **kwargs)
            cli.release("pre", "r1", Outcome.PULLED)
            time.sleep(0.3)  # the watcher polls (every 20 ms) before the call returns

        sched._publish = publish_then_decode_releases
        req = SimpleNamespace(request_id="r1", kv_transfer_params=PrefillRequest("t-1").to_params(),
                              status=RequestStatus.FINISHED_STOPPED, num_computed_tokens=64,
                              prompt_token_ids=list(range(64)))
        assert sched.request_finished(req, [3, 4])[0]
        deadline, freed = time.monotonic() + 2.0, []
        while "r1" not in freed and time.monotonic() < deadline:
            freed += sched._take_frees()
            time.sleep(0.02)
        assert "r1" in freed
        assert sched.get_kv_connector_stats().data.get("released_pulled") == 1


@pytest.mark.parametrize("answer", ["expired", "launch", "released"])
def test_a_publish_retried_after_no_answer_keeps_its_blocks_unless_decode_released_it(answer):
    """The first try of a publish went out unanswered (the server may have applied it and handed the record
    to a decode), then the retry was refused because the engine's requests were dropped since (410 expired)
    or another launch registered it (409 launch): a decode may still read the first try's record on its
    lease, so the blocks stay held until the server's word (they were freed at once). 410 released: decode
    is done with it, freed now."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from kvlink.bootstrap import Conflict, RequestExpired, RequestReleased
    from kvlink.vllm.params import PrefillRequest

    with _prefill_at_server(lease_s=4.0) as (sched, cli):
        def refused(*args, **kwargs):
            err = {"expired": RequestExpired("ended", field="request_id"),
                   "launch": Conflict("replaced", field="launch"),
                   "released": RequestReleased("ended", field="request_id")}[answer]
            err.maybe_applied = answer != "released"  # (client.py: an earlier attempt went out unanswered)
            raise err

        sched._publish = refused
        req = SimpleNamespace(request_id="r1", kv_transfer_params=PrefillRequest("t-1").to_params(),
                              status=RequestStatus.FINISHED_STOPPED, num_computed_tokens=64,
                              prompt_token_ids=list(range(64)))
        keep, _ = sched.request_finished(req, [3, 4])
        if answer == "released":
            assert not keep and "r1" not in sched._held
        else:
            assert keep and "r1" in sched._held


def test_the_samples_grace_periods_do_not_hold_up_other_releases(monkeypatch):
    """Eight n > 1 prompts end at once, each keeping prefill's copy a grace period longer for late samples;
    a plain request's release right after goes out at once, not after the graces (which once slept on the
    four threads that also send releases)."""
    import threading
    import time

    from kvlink.bootstrap import Outcome
    from kvlink.vllm import scheduler as S
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import RemoteSource

    monkeypatch.setattr(S, "SIBLING_GRACE_S", 5.0)
    sent: dict[str, float] = {}
    done = threading.Event()

    class Client:
        def release(self, engine_id, request_id, outcome, reader=None):
            sent[request_id] = time.monotonic()
            if request_id == "plain":
                done.set()
            return False

    sched = S.KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    try:
        sched.clients = type("Pool", (), {"get": lambda self, url: Client(), "close": lambda self: None})()
        for i in range(8):
            src = RemoteSource(bootstrap_url="http://b:1", engine_id="pre", request_id=f"p{i}", block_ids=((1,),))
            sched._release_shared(src, f"0_r{i}", pulled=True)  # the sample's release waits out its grace
        t0 = time.monotonic()
        sched._release_async(RemoteSource(bootstrap_url="http://b:1", engine_id="pre", request_id="plain",
                                          block_ids=((1,),)), Outcome.PULLED)
        assert done.wait(4.0), "a plain release waited behind the samples' grace periods"
        assert sent["plain"] - t0 < 4.0 and not any(k.startswith("p") and k != "plain" for k in sent)
    finally:
        sched.shutdown()


def test_a_request_too_big_for_the_staging_pool_gives_its_transfer_id_up():
    """Concurrent pairing with host staging: a request larger than the pool is refused (decode computes
    it); a decode long-polling its transfer id hears "released" at once instead of after lookup_wait_s."""
    import time

    from kvlink.bootstrap.errors import RequestReleased

    with _prefill_at_server(staging_slots=2) as (pre, cli):
        keep, answer = pre.request_finished(
            _finished("big", {"do_remote_decode": True, "transfer_id": "t-big"}), [4, 5, 6])
        assert not keep and "staging blocks" in answer["kvlink_error"]
        t0 = time.monotonic()
        with pytest.raises(RequestReleased):
            cli.lookup_transfer("t-big", wait_s=10.0)  # decode's long poll
        assert time.monotonic() - t0 < 5.0


def test_a_staged_publish_the_server_refuses_gives_its_slots_back_at_once():
    """Host staging: the transfer id ended while prefill still copied (the proxy gave it up when prefill's
    HTTP leg failed), so the staged publish is refused 410. Nobody can find those slots: they go back to
    the pool now, not after a lease of lookups."""
    from types import SimpleNamespace

    with _prefill_at_server(staging_slots=8) as (pre, cli):
        keep, _ = pre.request_finished(_finished("r1", {"do_remote_decode": True, "transfer_id": "t-1"}),
                                       [4, 5, 6])
        assert keep and pre._stage_jobs([]) and pre._planner.pool.in_use == 3
        cli.abandon_transfer(None, "t-1")
        pre.update_connector_output(SimpleNamespace(finished_sending={"r1"}, finished_recving=set(),
                                                    failed_recving=set(), kv_connector_worker_meta=None))
        assert pre._planner.pool.in_use == 0 and pre._held.request_ids() == []


def test_a_late_sample_told_gone_computes_the_prompt_and_releases_nothing_again(monkeypatch):
    """n > 1: sample 0 pulled and, after the grace, prefill heard "pulled"; sample 1 asks later and is told
    the copy is gone (it computes the prompt). It must not report prefill's request a second time."""
    import time
    from types import SimpleNamespace

    from kvlink.vllm import scheduler as S
    from kvlink.vllm.config import ConnectorConfig

    monkeypatch.setattr(S, "SIBLING_GRACE_S", 0.1)
    calls = []

    class Client:
        def release(self, engine_id, request_id, outcome, reader=None):
            calls.append((request_id, outcome.value))
            readers.append(reader)
            return False

    readers = []
    sched = S.KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16, launch="1234")
    try:
        sched.clients = type("Pool", (), {"get": lambda self, url: Client(), "close": lambda self: None})()
        params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://b:1", "remote_engine_id": "pre",
                  "remote_request_id": "p1", "remote_block_ids": [1, 2], "remote_num_tokens": 32}
        first = _decode_request("0_r", 40, dict(params))
        n, _ = sched.get_num_new_matched_tokens(first, 0)
        sched.update_state_after_alloc(first, _blocks([5, 6]), n)
        sched.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"0_r"},
                                                      failed_recving=set(), kv_connector_worker_meta=None))
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == [("p1", "pulled")]
        assert readers == ["dec@1234"]  # the engine and start its workers name in their renewals (lease.reader_of)
        late = _decode_request("1_r", 40, dict(params))
        assert sched.get_num_new_matched_tokens(late, 0) == (0, False)
        sched.update_state_after_alloc(late, _blocks([7, 8]), 0)
        time.sleep(0.5)  # past a grace
        assert calls == [("p1", "pulled")]
        assert sched.get_kv_connector_stats().data["pull_after_release"] == 1
    finally:
        sched.shutdown()


@contextlib.contextmanager
def _prefill_at_server(lease_s: float = 30.0, staging_slots: int | None = None):
    """A prefill scheduler with a real bootstrap server, its engine registered: (scheduler, client)."""
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer, EngineRegistration
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    pre = KVLinkScheduler(ConnectorConfig(bootstrap_url=srv.url, lease_s=lease_s), "pre", "kv_producer", 32,
                          staging_slots=staging_slots)
    try:
        with BootstrapClient(srv.url) as cli:
            cli.register_engine(EngineRegistration(engine_id="pre", transport_addr="127.0.0.1:9", layers=[],
                                                   protocol_version=5, compat_hash="x"), 60.0)
            yield pre, cli
    finally:
        pre.shutdown()
        srv.stop()


def test_data_parallel_ranks_share_dp_rank_0s_embedded_bootstrap_server_on_a_fixed_port():
    """Every DP rank reads the same bootstrap_port: rank 0 serves it, the others publish to it (they used
    to try to listen on it too, and the second engine died with EADDRINUSE). A port taken by anything else
    is refused with a reason that names it. Port 0: each rank serves its own."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError
    from kvlink.vllm.scheduler import KVLinkScheduler
    from tests.ports import free_port

    port = free_port()
    cfg = ConnectorConfig(bootstrap_host="127.0.0.1", bootstrap_port=port)
    ranks = []
    try:
        ranks.append(KVLinkScheduler(cfg, "pre_dp0", "kv_producer", 32, dp_local=0))
        ranks.append(KVLinkScheduler(cfg, "pre_dp1", "kv_producer", 32, dp_local=1))
        assert ranks[0]._server is not None and ranks[1]._server is None
        assert ranks[0].bootstrap_url == ranks[1].bootstrap_url == f"http://127.0.0.1:{port}"
        with BootstrapClient(ranks[1].bootstrap_url) as cli:
            assert cli.health()
        with pytest.raises(ConnectorConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            KVLinkScheduler(cfg, "other", "kv_producer", 32, dp_local=0)
        own = [KVLinkScheduler(ConnectorConfig(bootstrap_host="127.0.0.1"), f"e_dp{i}", "kv_producer", 32,
                               dp_local=i) for i in (0, 1)]
        ranks += own
        assert all(r._server is not None for r in own) and own[0].bootstrap_url != own[1].bootstrap_url
    finally:
        for r in ranks:
            r.shutdown()


def test_allow_insecure_reaches_the_embedded_bootstrap_server():
    """Without a bootstrap token a non-loopback bootstrap_host stops start-up, and the message's advice,
    allow_insecure, is the connector's own key: it reaches the embedded server."""
    from kvlink.bootstrap import BootstrapConfigError
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    with pytest.raises(BootstrapConfigError, match="allow_insecure"):
        KVLinkScheduler(ConnectorConfig(bootstrap_host="0.0.0.0"), "pub", "kv_producer", 32)
    sched = KVLinkScheduler(ConnectorConfig(bootstrap_host="0.0.0.0", allow_insecure=True), "pub", "kv_producer", 32)
    try:
        assert sched._server is not None and sched._server.config.allow_insecure
    finally:
        sched.shutdown()


def test_the_embedded_bootstrap_server_takes_its_connection_cap_from_the_connector_config():
    """bootstrap_max_connections reaches the server prefill embeds: beyond it, a connection is refused."""
    import socket as socketlib

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(bootstrap_max_connections=2), "pre", "kv_producer", 32)
    socks = []
    try:
        host, port = sched.bootstrap_url.split("://", 1)[1].rsplit(":", 1)
        socks = [socketlib.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        socks[2].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert socks[2].recv(200).startswith(b"HTTP/1.1 503"), "the third connection was not refused"
    finally:
        for s in socks:
            s.close()
        sched.shutdown()


# ----- prompts without a digest (embeddings): the token count is still compared --------------------------------

def _mixed_request(rid: str, n_tokens: int, params: dict):
    """A decode request whose prompt mixes token ids and embeddings (vLLM's mixed mode): no digest."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + n_tokens)),
                   sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                   pooling_params=None, prompt_embeds=torch.zeros(n_tokens, 8),
                   prompt_is_token_ids=[i % 2 == 0 for i in range(n_tokens)])


class _Answers:
    def __init__(self, answers):
        self.answers = list(answers)

    def lookup_transfer(self, *args, **kwargs):
        return self.answers.pop(0)


def test_a_record_of_another_token_count_is_not_read_when_no_digest_can_be_compared():
    """Decode's prompt is 48 tokens (3 blocks of 16), prefill published a 40-token prompt in 3 blocks, and
    neither side has a digest (prompt embeddings). Positions 40..47 of prefill's last block were never
    computed, yet vLLM would count 47 tokens computed: the counts alone say it is another prompt."""
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    try:
        params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1", "transfer_id": "tx"}
        req = _mixed_request("d1", 48, params)
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        assert n == 48  # vLLM is told all 48 prompt tokens come from prefill
        sched.update_state_after_alloc(req, _blocks([1, 2, 3]), n)
        (spec,) = sched._new_pulls
    finally:
        sched.shutdown()
    assert spec.prompt_sha is None and spec.whole_sha is None
    record = SimpleNamespace(partial=False, block_ids=[[11, 12, 13]], num_tokens=40, lease_remaining_s=30.0,
                             version=1, prompt_sha=None, prompt_tokens=40, engine_id="pre", request_id="p1",
                             epoch=0, layers=0, launch=None)
    w = KVLinkWorker(ConnectorConfig(), RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        w._layer_ids, w._layer_rank = None, {}
        w._clients_for = lambda url: _Answers([record])
        w._remote = lambda cli, url, engine_id, launch=None: type("Remote", (), {"looked_up": 0.0})()
        carried = []
        w._carry_out = carried.extend
        w._table.submit(spec, 0.0)
        w._resolve(spec)
        posts = [a for a in carried if type(a).__name__ == "Post"]
        assert not posts, f"read a {record.num_tokens}-token record into a {spec.whole_tokens}-token prompt: {posts}"
        assert "d1" in w._table.take_results(time.monotonic()).failed
    finally:
        w.shutdown()


def test_a_sequential_pull_without_digests_is_checked_for_its_token_count_at_the_first_lease_proof():
    """Sequential pairing, the client dropped remote_num_tokens (the params are its word) and the prompts are
    mixed embeddings (no digest on either side): decode loads its whole 48-token prompt from a record of
    40 tokens whose block ids the params name. The check beside the first renewal must refuse it."""
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    try:
        params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1",
                  "remote_engine_id": "pre", "remote_request_id": "p1", "remote_block_ids": [11, 12, 13]}
        req = _mixed_request("d1", 48, params)
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        assert n == 48
        sched.update_state_after_alloc(req, _blocks([1, 2, 3]), n)
        (spec,) = sched._new_pulls
    finally:
        sched.shutdown()
    w = KVLinkWorker(ConnectorConfig(), RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        w._clients_for = lambda url: None
        w._remote = lambda cli, url, engine_id, launch=None: type("Remote", (), {"looked_up": 0.0, "launch": None})()
        carried = []
        w._carry_out = carried.extend
        w._table.submit(spec, 0.0)
        w._resolve(spec)
        (renew,) = [a for a in carried if type(a).__name__ == "Renew"]
        ((_, check),) = renew.verify
    finally:
        w.shutdown()
    rec = SimpleNamespace(block_ids=[[11, 12, 13]], num_tokens=40, prompt_sha=None, launch=None)
    assert check.wrong(rec, "pre/p1") is not None, "a 40-token record backs a 48-token load"


def test_a_prefill_only_engine_refuses_do_remote_prefill_instead_of_pulling():
    """A kv_producer has nowhere to pull into: decode-style params sent to it are refused at admission (the
    request is computed there), not handed to a worker with no destination (it failed the request)."""
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(bootstrap_url="http://127.0.0.1:9"), "pre", "kv_producer", 32)
    try:
        req = _decode_request("x1", 32, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:9",
                                         "remote_engine_id": "pre", "remote_request_id": "p1",
                                         "remote_block_ids": [1], "remote_num_tokens": 32})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert "not a kv_consumer" in sched._bad["x1"]
    finally:
        sched.shutdown()


def test_block_ids_of_another_group_count_are_refused_before_they_are_converted():
    """Params may carry 64 groups of 2^20 block ids; converting them all took seconds of vLLM's scheduler
    thread before the group count was refused. Past MAX_PARSED_IDS they are refused unparsed."""
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import RemoteSource
    from kvlink.vllm.scheduler import KVLinkScheduler

    sched = KVLinkScheduler(ConnectorConfig(), "dec", "kv_consumer", 16)
    converted = []
    real = RemoteSource.from_params
    try:
        RemoteSource.from_params = classmethod(lambda cls, p: converted.append(1) or real(p))
        ids = list(range(1 << 20))
        req = _decode_request("d1", 64, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:9",
                                         "remote_engine_id": "pre", "remote_request_id": "p1",
                                         "remote_block_ids": [ids] * 64, "remote_num_tokens": 64})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert converted == [] and "64 KV cache group(s)" in sched._bad["d1"]
    finally:
        RemoteSource.from_params = real
        sched.shutdown()
