"""The pull table (kvlink/vllm/pulls.py) driven event by event: every race is a sequence of calls, with an
injected clock, no threads, no sleeps, no transport."""

from __future__ import annotations

import pytest

from kvlink.vllm.plan import PairingError, pair_blocks
from kvlink.vllm.pulls import ALL_LAYERS, CancelBatch, Lease, Post, PullTable, Renew, Resolve, State

pytest.importorskip("vllm")  # PullSpec is vLLM metadata

URL, ENGINE = "http://boot", "pre"
GROUP = (URL, ENGINE)
REMOTE = "remote-A"  # the adapter's remote handle: opaque to the table


def spec(rid: str, blocks=(1, 2), first: int = 0):
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    src = RemoteSource(bootstrap_url=URL, engine_id=ENGINE, request_id="p-" + rid, block_ids=tuple(blocks))
    return PullSpec(rid, tuple(blocks), first, src)


def lease(rid: str, lease_s: float = 30.0) -> Lease:
    return Lease(URL, ENGINE, "p-" + rid, lease_s)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def start(t: PullTable, rid: str, now: float = 0.0, held_until: float = 0.0, blocks=(1, 2)):
    """Submit and resolve one pull; returns the Post that carries it (and checks the Resolve/Renew asked)."""
    assert [type(a) for a in t.submit(spec(rid, blocks), now)] == [Resolve]
    acts = t.resolved(rid, REMOTE, [(b, b + 10) for b in blocks], lease(rid), held_until, now, now)
    posts = of(acts, Post)
    assert len(posts) == 1 and [p.rid for p in posts[0].pulls] == [rid]
    assert t.state(rid) is State.READING
    return posts[0], of(acts, Renew)


def results(t: PullTable, now: float = 100.0):
    r = t.take_results(now)
    return r.done, r.failed


# ----- the happy paths --------------------------------------------------------------------------------------


def test_sequential_pull_waits_for_the_lease_proof_then_is_done():
    t = PullTable(60.0)
    post, renews = start(t, "a")
    assert renews == [Renew(GROUP, ("p-a",), ("a",), 30.0)]  # the first renewal goes out with the READ
    assert t.posted(post.batch, "h1", 4096, 4, 2, now=0.1) == []
    assert t.batch_ended(post.batch, None, now=0.2) == []  # READ done; renewal still out (one per group)
    assert t.state("a") is State.CONFIRMING and results(t) == (set(), {})
    t.lease_held(GROUP, ("a",), held_until=0.05 + 30.0, now=0.3)
    assert results(t) == ({"a"}, {})
    counts, samples = t.take_stats()
    assert counts["pulls_ok"] == 1 and counts["lease_proof_waits"] == 1 and counts["bytes_pulled"] == 4096
    assert samples["pull_s"] == [pytest.approx(0.3)] and samples["transfer_s"] == [pytest.approx(0.1)]


def test_read_ending_inside_a_proven_lease_is_done_at_once():
    t = PullTable(60.0)
    post, _ = start(t, "a", held_until=10.0)  # concurrent lookup proved the lease until t=10
    t.posted(post.batch, "h", 1, 1, 1, now=0.0)
    t.batch_ended(post.batch, None, now=1.0)
    assert t.state("a") is None and results(t) == ({"a"}, {})


def test_nothing_to_pull_is_done_without_resolving():
    t = PullTable(60.0)
    assert t.submit(spec("a", blocks=(0, 0)), 0.0) == []  # only null blocks: nothing to move
    assert results(t) == ({"a"}, {})


def test_ready_pulls_of_one_remote_share_a_batch():
    t = PullTable(60.0)
    t.submit(spec("a"), 0.0)
    t.submit(spec("b"), 0.0)
    t.resolved("a", REMOTE, [(1, 11)], lease("a"), 0.0, 0.0, 0.0)  # posts a alone
    t.resolved("b", "remote-B", [(2, 12)], lease("b"), 0.0, 0.0, 0.0)
    assert [b.remote for b in t.batches()] == [REMOTE, "remote-B"]


# ----- cancel ------------------------------------------------------------------------------------------------


def test_cancel_while_resolving_reports_once_and_ignores_the_late_resolution():
    t = PullTable(60.0)
    t.submit(spec("a"), 0.0)
    assert t.cancel("a", 0.1) == []
    assert results(t) == ({"a"}, {})
    assert t.resolved("a", REMOTE, [(1, 11)], lease("a"), 0.0, 0.0, 0.2) == []
    assert t.batches() == [] and results(t) == (set(), {})
    assert t.take_stats()[0]["pulls_cancelled"] == 1


def test_cancel_while_confirming_reports_cancelled_and_the_late_proof_is_ignored():
    t = PullTable(60.0)
    post, _ = start(t, "a")
    t.posted(post.batch, "h", 1, 1, 1, 0.0)
    t.batch_ended(post.batch, None, 0.1)
    assert t.state("a") is State.CONFIRMING
    assert t.cancel("a", 0.2) == []  # nothing writes its blocks any more: reported now
    assert results(t) == ({"a"}, {})
    t.lease_held(GROUP, ("a",), 99.0, 0.3)
    assert results(t) == (set(), {})


def test_cancel_mid_read_waits_for_the_batch_to_settle_and_reposts_its_siblings():
    t = PullTable(60.0)
    t.submit(spec("a"), 0.0)
    t.submit(spec("b"), 0.0)
    t.resolved("a", REMOTE, [(1, 11)], lease("a"), 0.0, 0.0, 0.0)  # "a" posted alone: cancel it later
    first = t.batches()[0]
    t.posted(first.id, "h1", 1, 1, 1, 0.0)
    # "b" resolves later: a second batch from the same remote
    t.resolved("b", REMOTE, [(2, 12)], lease("b"), 0.0, 0.0, 0.0)
    second = t.batches()[1]
    t.posted(second.id, "h2", 1, 1, 1, 0.0)
    assert t.cancel("b", 0.1) == [CancelBatch(second.id, "h2")]
    assert t.state("b") is State.SETTLING and results(t) == (set(), {})  # vLLM must not reuse its blocks yet
    assert t.batch_ended(second.id, "Canceled: batch canceled", 0.11) == []  # a cancel's error is no proof
    assert results(t) == (set(), {})
    t.cancel_settled(second.id, 0.12)
    assert results(t) == ({"b"}, {})
    assert t.state("a") is State.READING  # the other batch is untouched


def ready_together(t: PullTable, rids, held_until: float = 0.0) -> Post:
    """Several pulls READY at once (a burst of resolutions): one Post carries them all."""
    for rid in rids:
        t.submit(spec(rid), 0.0)
        p = t.get(rid)
        p.remote, p.queued, p.lease, p.state, p.held_until = REMOTE, {(0, 1): (11, 0, ALL_LAYERS)}, lease(rid), State.READY, held_until
        p.final = True  # the published record arrived (no stream of pieces)
    (post,) = t.take_posts(0.0)
    return post


def test_siblings_of_a_cancelled_request_are_posted_again():
    t2 = PullTable(60.0)
    post = ready_together(t2, ("a", "b"))
    assert sorted(p.rid for p in post.pulls) == ["a", "b"]
    t2.posted(post.batch, "h", 2, 2, 2, 0.0)
    assert t2.cancel("a", 0.1) == [CancelBatch(post.batch, "h")]
    reposts = t2.cancel_settled(post.batch, 0.2)
    assert [[p.rid for p in r.pulls] for r in reposts] == [["b"]] and t2.state("b") is State.READING
    assert results(t2) == ({"a"}, {})


def test_a_cancel_that_cannot_settle_is_asked_again_until_it_does():
    """Mooncake: cancel raises NotSettled, the adapter reports nothing; every tick asks again. The
    request is reported only when the backend finally says the batch settled."""
    t = PullTable(60.0)
    post, _ = start(t, "a")
    t.posted(post.batch, "h", 1, 1, 1, 0.0)
    assert of(t.cancel("a", 0.1), CancelBatch)
    assert t.cancel("a", 0.15) == []  # asked already
    assert of(t.tick(0.21), CancelBatch) == [CancelBatch(post.batch, "h")]  # first retry after 0.1 s
    assert of(t.tick(0.25), CancelBatch) == []  # not on every tick
    assert of(t.tick(0.32), CancelBatch) == [CancelBatch(post.batch, "h")]
    assert of(t.tick(0.45), CancelBatch) == []  # the interval doubles
    assert t.next_wakeup(0.45) == pytest.approx(0.52)  # the retry wakes the ticker, not a spent deadline
    assert of(t.tick(61.0), CancelBatch)  # long past its deadline: still only asked again, never reported
    assert any("has still not settled" in m and "'a'" in m for m in t.take_messages())  # said once, loudly
    assert not any("has still not settled" in m for m in (of(t.tick(70.0), CancelBatch), t.take_messages())[1])
    assert results(t) == (set(), {})
    t.cancel_settled(post.batch, 0.4)
    assert results(t) == ({"a"}, {}) and of(t.tick(0.5), CancelBatch) == []


def test_completion_after_cancel_reports_the_cancel_and_lets_siblings_go_on():
    t = PullTable(60.0)
    post = ready_together(t, ("a", "b"), held_until=50.0)
    t.posted(post.batch, "h", 2, 2, 2, 0.0)
    t.cancel("a", 0.1)
    assert t.batch_ended(post.batch, None, 0.2) == []  # it finished before the cancel took: all bytes in
    assert results(t) == ({"a", "b"}, {})
    assert t.cancel_settled(post.batch, 0.3) == [] and results(t) == (set(), {})
    counts, _ = t.take_stats()
    assert counts["pulls_cancelled"] == 1 and counts["pulls_ok"] == 1


def test_duplicate_completion_is_reported_once():
    t = PullTable(60.0)
    post, _ = start(t, "a", held_until=50.0)
    t.posted(post.batch, "h", 1, 1, 1, 0.0)
    t.batch_ended(post.batch, None, 0.1)  # vLLM's thread polled it
    t.batch_ended(post.batch, None, 0.2)  # the waiter thread too
    t.batch_ended(post.batch, "PeerClosed: late", 0.3)
    assert results(t) == ({"a"}, {})
    assert t.take_stats()[0]["batches"] == 1


# ----- failures ----------------------------------------------------------------------------------------------


def test_lease_lost_mid_read_fails_after_the_batch_settles():
    t = PullTable(60.0)
    post, _ = start(t, "a", blocks=(3, 4))
    t.posted(post.batch, "h", 1, 1, 1, 0.0)
    acts = t.lease_lost(GROUP, "a", "prefill lease of pre/p-a is expired", 0.1)
    assert acts == [CancelBatch(post.batch, "h")] and results(t) == (set(), {})
    t.cancel_settled(post.batch, 0.2)
    done, failed = results(t)
    assert done == set() and failed == {"a": (3, 4)}
    assert t.take_error_blocks() == {3, 4} and t.take_error_blocks() == set()


def test_batch_failure_fails_its_pulls_with_their_blocks():
    t = PullTable(60.0)
    post, _ = start(t, "a", blocks=(5,))
    t.posted(post.batch, "h", 1, 1, 1, 0.0)
    t.batch_ended(post.batch, "PeerClosed: connection reset", 0.1)
    assert results(t) == (set(), {"a": (5,)})


def test_post_that_fails_fails_its_pulls():
    t = PullTable(60.0)
    post, _ = start(t, "a")
    t.post_failed(post.batch, "OutOfRange: descriptor 3", 0.0)
    assert results(t)[1] == {"a": (1, 2)} and t.batches() == []


def test_unsettled_wait_fails_only_once_the_backend_lets_go():
    t = PullTable(60.0)
    post, _ = start(t, "a")
    t.posted(post.batch, "h", 1, 1, 1, 0.0)
    assert t.batch_unsettled(post.batch, "NotSettled: chunk in flight", 31.0) == [CancelBatch(post.batch, "h")]
    assert t.state("a") is State.SETTLING and results(t) == (set(), {})
    assert of(t.tick(31.5), CancelBatch)
    t.cancel_settled(post.batch, 32.0)
    assert results(t)[1] == {"a": (1, 2)}


def test_cancel_before_the_batch_handle_exists_is_sent_once_posted():
    t = PullTable(60.0)
    post, _ = start(t, "a")
    assert t.cancel("a", 0.0) == []  # the READ is being posted: nothing to cancel yet
    assert t.posted(post.batch, "h", 1, 1, 1, 0.1) == [CancelBatch(post.batch, "h")]


@pytest.mark.parametrize("state", ["resolving", "reading", "confirming"])
def test_deadline_in_every_state(state):
    t = PullTable(5.0)
    t.submit(spec("a"), 0.0)
    post = None
    if state != "resolving":
        post = of(t.resolved("a", REMOTE, [(1, 11)], lease("a"), 0.0, 99.0, 0.0), Post)[0]
        t.posted(post.batch, "h", 1, 1, 1, 0.0)
    if state == "confirming":
        t.batch_ended(post.batch, None, 1.0)
        assert t.state("a") is State.CONFIRMING
    assert of(t.tick(4.9), CancelBatch) == [] and results(t) == (set(), {})
    acts = t.tick(5.0)
    if state == "reading":  # its READ may still write: failed only once the batch settled
        assert of(acts, CancelBatch) and t.state("a") is State.SETTLING
        assert t.next_wakeup(5.0) > 5.0  # a spent deadline must not make the ticker spin
        assert of(t.tick(6.0), CancelBatch)  # still asking; the deadline does not fail it twice
        t.cancel_settled(post.batch, 6.1)
    done, failed = results(t)
    assert done == set() and list(failed) == ["a"]
    assert t.running() == 0


def test_resolve_failure_is_reported_with_the_blocks():
    t = PullTable(60.0)
    t.submit(spec("a", blocks=(7, 8)), 0.0)
    t.resolve_failed("a", "PairingError: request a group 0: ...", 0.1)
    t.resolve_failed("a", "twice", 0.2)
    assert results(t) == (set(), {"a": (7, 8)})


# ----- lease renewals ----------------------------------------------------------------------------------------


def test_renewals_one_call_per_group_retried_when_unreachable():
    t = PullTable(60.0)
    _, renews = start(t, "a")
    assert renews == [Renew(GROUP, ("p-a",), ("a",), 30.0)]
    t.submit(spec("b"), 0.0)
    acts = t.resolved("b", REMOTE, [(2, 12)], lease("b"), 0.0, 0.0, 0.0)
    assert of(acts, Renew) == []  # the group's call is out; b waits for it
    t.renew_failed(GROUP, ("a",), 1.0)
    assert of(t.tick(1.0), Renew) == [Renew(GROUP, ("p-b",), ("b",), 30.0)]  # b was due; a retries later
    t.lease_held(GROUP, ("b",), 31.0, 1.1)
    (r,) = of(t.tick(1.5), Renew)
    assert r.rids == ("a",)  # retried within half a second
    t.lease_held(GROUP, ("a",), 31.5, 1.6)
    assert of(t.tick(5.0), Renew) == []
    assert [r.rids for r in of(t.tick(11.7), Renew)] == [("a", "b")]  # every third of the lease


def test_a_renewal_names_at_most_max_renew_ids_and_the_rest_follow_at_once():
    """A bootstrap server refuses a call naming more ids than its max_lookup_ids, every time: one renewal of
    every due pull of a busy engine would have failed until the pulls timed out."""
    from kvlink.vllm.pulls import MAX_RENEW_IDS

    t = PullTable(60.0)
    n = MAX_RENEW_IDS + 100
    for i in range(n):
        t.submit(spec(f"r{i}"), 0.0)
        t.resolved(f"r{i}", REMOTE, [(2, 12)], lease(f"r{i}"), 0.0, 5.0, 0.0)  # first renewal due at 5
    (first,) = of(t.tick(6.0), Renew)
    assert len(first.rids) == MAX_RENEW_IDS
    rest = of(t.lease_held(GROUP, first.rids, 36.0, 6.1), Renew)  # the rest are due: asked for at once
    assert [len(r.rids) for r in rest] == [n - MAX_RENEW_IDS]
    assert not set(rest[0].rids) & set(first.rids)


def test_groups_renew_independently():
    t = PullTable(60.0)
    start(t, "a")
    t.submit(spec("b"), 0.0)
    acts = t.resolved("b", REMOTE, [(2, 12)], Lease("http://other", ENGINE, "p-b", 30.0), 0.0, 0.0, 0.0)
    assert [r.group for r in of(acts, Renew)] == [("http://other", ENGINE)]


# ----- pairing by position (the sliding-window fix) ------------------------------------------------------------


def test_pairing_is_by_position_and_skips_null_and_cached_blocks():
    # decode: positions 0-1 outside the window (null), 2 in its prefix cache, 3-4 to pull
    local = (0, 0, 7, 8, 9)
    remote = (0, 21, 22, 23, 24)  # prefill kept one more block of its window than decode needs
    assert pair_blocks("r", 0, local, 3, remote) == [(8, 23), (9, 24)]
    assert pair_blocks("r", 0, local, 0, remote) == [(7, 22), (8, 23), (9, 24)]


def test_pairing_refuses_what_it_cannot_pair_exactly_naming_request_and_group():
    with pytest.raises(PairingError, match=r"request r1 group 0: decode needs block position 1 but prefill "
                                           r"no longer holds it"):
        pair_blocks("r1", 0, (0, 5, 6), 0, (0, 0, 16))
    with pytest.raises(PairingError, match=r"request r2 group 3: prefill published 2 blocks, decode's table"):
        pair_blocks("r2", 3, (4, 5, 6), 0, (14, 15))
    with pytest.raises(PairingError, match="first position to pull 4"):
        pair_blocks("r3", 0, (4, 5, 6), 4, (14, 15, 16))
    with pytest.raises(PairingError, match=r"request r4 group 0: decode's table has 2 blocks for tokens that "
                                           r"cover 3"):
        pair_blocks("r4", 0, (4, 5), 0, (14, 15, 16), num_blocks=3)


@pytest.mark.parametrize("n, lost", [(95, True), (127, True), (159, True), (96, False), (94, False), (64, False),
                                     (63, False), (700, False), (31, False)])
def test_window_start_lost_exactly_when_the_recomputed_token_reads_a_freed_block(n, lost):
    from kvlink.vllm.plan import window_start_lost

    assert window_start_lost(n, 32, 64) is lost
    # against vLLM's own accounting: the blocks it frees for n computed tokens, and the block holding the
    # first key of the recomputed last token (position n - 1, window of 64)
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    mgr = SimpleNamespace(sliding_window=64, extra_retained_tokens=0)
    freed_blocks = SlidingWindowManager.get_num_skipped_tokens(mgr, n) // 32
    assert (max(0, n - 1 - 64 + 1) // 32 < freed_blocks) is lost


def test_post_split_defers_refuses_and_keeps_cancel_outcomes():
    """Host staging's landing pool: before posting, the adapter sends some pulls back to wait for room and
    fails one that can never fit; one cancelled meanwhile gets its outcome."""
    t = PullTable(60.0)
    post = ready_together(t, ["a", "b", "c"])
    t.cancel("c", 0.5)  # no handle yet: nothing to stop
    t.post_split(post.batch, ["a", "c"], {"b": "too big for the staging pool"}, 1.0)
    assert t.state("a") is State.READY and t.batch(post.batch) is None
    done, failed = results(t)
    assert done == {"c"} and set(failed) == {"b"}
    assert t.take_stats()[0]["staging_pool_full"] == 1
    assert [p.rid for p in t.take_posts(2.0)[0].pulls] == ["a"]
