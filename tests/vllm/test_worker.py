"""KVLinkWorker pulls against the in-process fake transport and a real (embedded) bootstrap server.

A producer worker and a consumer worker, each over a small CPU "KV cache" (two layers, views of one
allocation as vLLM lays them out). Covers what the real-server tests cannot pin down cheaply: a pull is
settled by the batch's own completion (no polling), and a dropped connection ends it at once rather
than at ``pull_timeout_s``.
"""

from __future__ import annotations

import contextlib
import time

import msgspec
import pytest

from kvlink.errors import PeerClosed
from tests import fakes_transport
from tests.fakes import Delegating, FakeBootstrapClient
from kvlink.vllm.pulls import State
from tests.vllm.helpers import pull_outcome, register_two_layers, submit_pull

torch = pytest.importorskip("torch")

BLOCKS, HEADS, BLOCK, HEAD2 = 6, 2, 32, 128


def _cache(fill: float) -> dict:
    buf = torch.full((2, BLOCKS, HEADS, BLOCK, HEAD2), fill, dtype=torch.bfloat16)
    for layer in range(2):
        for b in range(BLOCKS):
            buf[layer, b] = fill + layer * 10 + b
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(2)}


@contextlib.contextmanager
def _workers(dec_cache: dict):
    """A prefill and a decode worker over the fake transport, with a bootstrap server; decode's layers are
    ``dec_cache``."""
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    from kvlink.backends import register_backend, unregister_backend

    register_backend("fake", fakes_transport.Engine)
    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    cfg = ConnectorConfig(pull_timeout_s=60.0, lookup_wait_s=30.0, transport_backend="fake")
    pre = W.KVLinkWorker(cfg, W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = W.KVLinkWorker(cfg, W.RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        pre.register_kv_caches(_cache(1.0))
        dec.register_kv_caches(dec_cache)
        pre._ensure_registered(srv.url)
        yield pre, dec, srv.url
    finally:
        dec.shutdown()
        pre.shutdown()
        srv.stop()
        unregister_backend("fake")


@pytest.fixture
def pair(monkeypatch):
    with _workers(_cache(0.0)) as p:
        yield p


def _pull(dec, url: str, rid: str, pairs: list[tuple[int, int]], lease_s: float = 30.0):
    """Publish prefill's request (as its scheduler would), then hand decode the sequential params."""
    _publish(url, rid, pairs, lease_s)
    submit_pull(dec, url, rid, pairs)


def _publish(url: str, rid: str, pairs: list[tuple[int, int]], lease_s: float) -> None:
    from kvlink.bootstrap import BootstrapClient

    with BootstrapClient(url) as cli:
        cli.publish("pre", "p-" + rid, [[r for _, r in pairs]], num_tokens=BLOCK * len(pairs), lease_s=lease_s)


def _posted(dec):
    with dec._lock:
        return [b for b in dec._table.batches() if b.handle is not None]


def _state(dec, rid):
    with dec._lock:
        return dec._table.state(rid)


def _counted(dec, key: str) -> int:
    """A count the table holds for the next get_stats(), read without taking it (the test takes it later)."""
    with dec._lock:
        return dec._table.counts.get(key, 0)


def _cancel(dec, rid):
    from kvlink.vllm.metadata import KVLinkMetadata

    dec.start_load_kv(KVLinkMetadata(cancels=[rid]))


def _finished(dec, rid: str, within_s: float) -> tuple[str, float] | None:
    """("ok" or "failed", seconds) once decode's worker reports pull ``rid``; None if not within ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        _, recv, failed = dec.transfer_results()
        if rid in recv:
            return ("failed" if rid in failed else "ok"), time.monotonic() - t0
        time.sleep(0.02)
    return None


def test_pulls_waiting_for_prefill_neither_queue_a_published_one_nor_keep_their_thread_once_ended(monkeypatch):
    """Concurrent pairing: each pull waiting for prefill's record holds a resolver thread through its long
    polls. With every resolver taken by pulls whose prefill never publishes (slow, stalled, gone), a pull
    whose record is already there waited for one of them to give up (up to lookup_wait_s, 30 s); ending
    those pulls did not free their threads. Now a waiting pull polls in slices and frees its thread within
    one once it ended; a pull waiting across many slices still gets its record."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm import puller
    from kvlink.vllm import worker as W
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    monkeypatch.setattr(W, "RESOLVERS", 2)
    monkeypatch.setattr(puller, "POLL_SLICE_S", 0.3)
    with _workers(_cache(0.0)) as (pre, dec, url):
        def spec(rid: str) -> PullSpec:
            return PullSpec(request_id=rid, local_block_ids=(1,), first_block=0,
                            source=RemoteSource(bootstrap_url=url, transfer_id=f"T-{rid}"))

        for rid in ("slow0", "slow1"):  # every resolver waits for a prefill that never publishes
            dec._submit(spec(rid))
        time.sleep(0.5)
        for rid in ("slow0", "slow1"):
            _cancel(dec, rid)
        with BootstrapClient(url) as cli:
            cli.publish("pre", "p-fast", [[3]], num_tokens=BLOCK, lease_s=30.0, transfer_id="T-fast")
            dec._submit(spec("fast"))
            got = _finished(dec, "fast", 10.0)
            assert got is not None and got[0] == "ok", got  # not after lookup_wait_s (30 s)
            dec._submit(spec("late"))  # published after several slices: still waited for
            time.sleep(1.2)
            cli.publish("pre", "p-late", [[4]], num_tokens=BLOCK, lease_s=30.0, transfer_id="T-late")
            assert _finished(dec, "late", 10.0)[0] == "ok"


def test_two_decode_engines_reading_one_request_keep_it_held_until_both_released(pair):
    """Two decode engines pull one prefill request (its samples on two data-parallel engines, or a decode leg
    retried on another replica), each renewing under its own name (lease.reader_of). The first engine's
    release, as its scheduler sends it, does not free the blocks the second may still read; the second's
    does. Before, the first release freed them at once."""
    from kvlink.bootstrap import BootstrapClient, Outcome
    from kvlink.vllm import worker as W
    from kvlink.vllm.lease import reader_of

    pre, dec0, url = pair
    dec1 = W.KVLinkWorker(dec0.cfg, W.RankInfo("dec1", 0, 1, 0, 1, "m", launch="77"), "kv_consumer")
    try:
        dec1.register_kv_caches(_cache(0.0))
        _publish(url, "x", [(1, 2)], lease_s=30.0)
        for dec in (dec0, dec1):
            submit_pull(dec, url, "x", [(1, 2)])
            assert _finished(dec, "x", 10.0)[0] == "ok"
        with BootstrapClient(url) as cli:
            cli.poll_released("pre")
            assert cli.release("pre", "p-x", Outcome.PULLED, reader=reader_of("dec", None)) is False
            assert cli.poll_released("pre") == []  # dec1 may still be reading
            assert cli.release("pre", "p-x", Outcome.PULLED, reader=reader_of("dec1", "77")) is True
            assert cli.poll_released("pre") == [("p-x", Outcome.PULLED)]
    finally:
        dec1.shutdown()


def test_pull_copies_the_blocks_and_times_the_request(pair):
    pre, dec, url = pair
    _pull(dec, url, "r1", [(1, 3), (2, 4)])
    assert pull_outcome(dec, "r1") == "ok"
    for name, t in dec.kv_caches.items():
        src = pre.kv_caches[name]
        assert torch.equal(t[1], src[3]) and torch.equal(t[2], src[4])
        assert not torch.equal(t[3], src[3])  # only the requested blocks moved
    stats = dec.get_stats().data
    assert stats["pulls_ok"] == 1 and stats["bytes_pulled"] == 2 * 2 * dec.block_bytes
    assert len(stats["pull_s"]) == 1 and len(stats["transfer_s"]) == 1
    assert stats["pull_s"][0] >= stats["transfer_s"][0]  # the request's time includes its READ


def test_handoff_time_is_the_wait_for_vllm_to_collect_a_finished_pull(pair):
    """handoff_s runs from the pull settling (KV in place and trusted) to get_finished collecting it, so a
    vLLM step loop that comes late shows up there and not in pull_s."""
    pre, dec, url = pair
    t0 = time.monotonic()
    _pull(dec, url, "r9", [(1, 1), (2, 2)])
    deadline = time.monotonic() + 30
    while _counted(dec, "pulls_ok") < 1:  # settled, not yet collected
        assert time.monotonic() < deadline, "the pull never settled"
        time.sleep(0.005)
    settled_by = time.monotonic() - t0
    time.sleep(0.25)  # vLLM's next step comes late
    _, recving, failed = dec.transfer_results()
    assert recving == {"r9"} and not failed
    stats = dec.get_stats().data
    assert len(stats["handoff_s"]) == 1 and stats["handoff_s"][0] >= 0.25
    assert stats["pull_s"][0] <= settled_by  # the late step is not counted as pull time
    assert dec.get_stats() is None or not dec.get_stats().data.get("handoff_s")  # sampled once


def test_dropped_connection_fails_the_pull_at_once(pair, monkeypatch):
    """Prefill dies mid-READ: the transport fails the batch (peer gone) and the pull is reported failed
    then, not when pull_timeout_s (60 s here) runs out; its blocks are reported for recompute."""
    pre, dec, url = pair
    monkeypatch.setattr(fakes_transport.Engine, "delay_s", 0.3)
    monkeypatch.setattr(fakes_transport.Engine, "fail_with", PeerClosed("connection reset by peer"))
    _pull(dec, url, "r2", [(1, 1), (2, 2), (3, 3)])
    assert pull_outcome(dec, "r2") == "failed"
    assert dec.take_load_error_blocks() == {1, 2, 3}
    assert dec.get_stats().data["pulls_failed"] == 1
    monkeypatch.setattr(fakes_transport.Engine, "fail_with", None)
    _pull(dec, url, "r3", [(4, 4)])  # reconnects after the failure
    assert pull_outcome(dec, "r3") == "ok"


def test_cancel_mid_read_reports_once_and_reposts_nothing(pair, monkeypatch):
    pre, dec, url = pair
    monkeypatch.setattr(fakes_transport.Engine, "delay_s", 0.5)
    _pull(dec, url, "r4", [(1, 1)])
    deadline = time.monotonic() + 10
    while not _posted(dec) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _posted(dec), "the READ was never posted"
    _cancel(dec, "r4")
    assert pull_outcome(dec, "r4") == "ok"  # a cancelled request is released as finished, exactly once
    time.sleep(0.8)  # the cancelled batch's waiter returns; nothing may be reported again
    _, recving, failed = dec.transfer_results()
    assert "r4" not in recving and "r4" not in failed
    assert dec.get_stats().data["pulls_cancelled"] == 1
    assert (url, "pre") in dec._remotes  # our own cancel is no reason to drop the connection
    monkeypatch.setattr(fakes_transport.Engine, "delay_s", 0.5)
    _pull(dec, url, "r4b", [(2, 2)])
    assert [b.rids for b in _posted(dec)] == [["r4b"]]  # still the known-peer fast path


def test_known_peer_read_is_posted_before_submit_returns(pair, monkeypatch):
    """Sequential params naming a peer we are connected to need no network: the READ is posted on the
    calling (vLLM) thread, not handed to a resolver thread."""
    pre, dec, url = pair
    _pull(dec, url, "r5", [(1, 1)])  # first contact goes through a resolver thread
    assert pull_outcome(dec, "r5") == "ok"
    monkeypatch.setattr(fakes_transport.Engine, "delay_s", 0.5)
    _pull(dec, url, "r6", [(2, 2)])
    assert [b.rids for b in _posted(dec)] == [["r6"]]
    assert pull_outcome(dec, "r6") == "ok"


def test_a_kept_peer_of_another_launch_is_looked_up_on_a_resolver_not_on_vllms_thread(pair, monkeypatch):
    """Sequential params naming another launch than the kept remote's (a rolling restart: the old process
    still serves) need the bootstrap server: a resolver asks it, never vLLM's thread (a slow server would
    stall decode's step, for every such request)."""
    import threading

    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    pre, dec, url = pair
    _pull(dec, url, "r1", [(1, 1)])
    assert pull_outcome(dec, "r1") == "ok"  # the remote is kept now (launch None: unfenced)
    asked_on, real = [], dec._clients_for

    class Slow(Delegating):
        def engine_ranks(self, engine_id):
            asked_on.append(threading.current_thread() is threading.main_thread())
            time.sleep(1.0)  # a slow bootstrap server
            return self._inner.engine_ranks(engine_id)

    monkeypatch.setattr(dec, "_clients_for", lambda u: Slow(real(u)))
    _publish(url, "r2", [(2, 2)], 30.0)
    src = RemoteSource(bootstrap_url=url, engine_id="pre", request_id="p-r2", block_ids=(2,), lease_s=30.0,
                       launch="L2")
    t0 = time.monotonic()
    dec._submit(PullSpec(request_id="r2", local_block_ids=(2,), first_block=0, source=src))
    took = time.monotonic() - t0
    assert pull_outcome(dec, "r2", wait_s=10) == "failed"  # the engine's ranks name no launch L2
    assert asked_on == [False], "the bootstrap server was asked on vLLM's (the calling) thread"
    assert took < 0.9, f"_submit held vLLM's thread {took:.2f} s on a bootstrap call"


def test_a_client_chosen_lease_never_sets_what_the_shared_renewal_asks(pair, monkeypatch):
    """Sequential params carry prefill's lease as the client wrote it; decode renews every pull from one prefill
    engine in one call asking the largest lease among them. A lease beyond what a bootstrap server grants
    (600 s by default; params allow a day) made that call fail for every pull in it, so honest pulls never
    got their lease proof: the params' lease counts up to this engine's own."""
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    pre, dec, url = pair
    asked, real = [], dec._clients_for

    class Recording(Delegating):
        def renew(self, engine_id, request_ids, lease_s, reader=None):
            asked.append(lease_s)
            return self._inner.renew(engine_id, request_ids, lease_s, reader)

    monkeypatch.setattr(dec._leases, "_clients", lambda u: Recording(real(u)))
    _publish(url, "r1", [(1, 1)], 30.0)
    src = RemoteSource(bootstrap_url=url, engine_id="pre", request_id="p-r1", block_ids=(1,), lease_s=86400.0)
    dec._submit(PullSpec(request_id="r1", local_block_ids=(1,), first_block=0, source=src))
    assert pull_outcome(dec, "r1") == "ok"
    assert asked and max(asked) <= dec.cfg.lease_s  # (it asked 86400 s: refused by the server, 400)


def test_params_naming_other_blocks_than_prefill_published_are_never_trusted(pair):
    """Real worker, transport and bootstrap server: a client's sequential params name a live prefill request
    and other blocks of that engine (another request's KV). The READ may go through, but the first lease
    proof finds the record names other blocks, and the pull fails (decode computes the prompt)."""
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    pre, dec, url = pair
    _publish(url, "r9", [(1, 1), (2, 2)], lease_s=30.0)
    src = RemoteSource(bootstrap_url=url, engine_id="pre", request_id="p-r9", block_ids=(1, 5), lease_s=30.0)
    dec._submit(PullSpec(request_id="r9", local_block_ids=(1, 2), first_block=0, source=src))
    assert pull_outcome(dec, "r9") == "failed"
    assert dec.take_load_error_blocks() == {1, 2}
    _pull(dec, url, "r10", [(3, 3)])  # the same request named with its own blocks: read and trusted
    assert pull_outcome(dec, "r10") == "ok"


def test_pull_whose_lease_ran_out_is_recomputed(pair):
    """Decode got to the request after prefill's lease ran out (prefill may have reused the blocks): the
    first renewal says so and the pull fails (recompute) although the READ itself went through."""
    pre, dec, url = pair
    _publish(url, "r7", [(1, 1), (2, 2)], lease_s=0.2)
    time.sleep(0.5)
    submit_pull(dec, url, "r7", [(1, 1), (2, 2)])
    assert pull_outcome(dec, "r7") == "failed"
    assert dec.take_load_error_blocks() == {1, 2}


def test_read_faster_than_the_renewal_waits_for_its_proof(pair, monkeypatch):
    """A READ that beats the first renewal's round trip is not reported until the renewal proves the lease
    held; then it is reported done."""
    pre, dec, url = pair
    real = dec._leases._clients
    monkeypatch.setattr(dec._leases, "_clients", lambda u: FakeBootstrapClient(delay_s=2.0, then=real(u)))
    _pull(dec, url, "r8", [(3, 3)])
    deadline = time.monotonic() + 1.5
    while _state(dec, "r8") is not State.CONFIRMING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(dec, "r8") is State.CONFIRMING  # READ done, proof pending
    _, recving, failed = dec.transfer_results()
    assert "r8" not in recving and "r8" not in failed
    assert pull_outcome(dec, "r8") == "ok"
    stats = dec.get_stats().data
    assert stats["lease_proof_waits"] == 1
    assert stats["pull_s"][-1] >= 1.0  # the request's time includes the wait for the proof
    for name, t in dec.kv_caches.items():
        assert torch.equal(t[3], pre.kv_caches[name][3])


def test_cancel_that_cannot_settle_is_reported_only_once_the_batch_lets_go(pair, monkeypatch):
    """A backend whose cancel cannot stop a batch in flight (as Mooncake's): the aborted request is not
    handed back to vLLM, which would reuse its blocks, while the batch can still write into them."""
    pre, dec, url = pair
    _pull(dec, url, "w1", [(1, 1)])  # connect first: later pulls post on this thread
    assert pull_outcome(dec, "w1") == "ok"
    monkeypatch.setattr(fakes_transport.Engine, "cancel_cannot_stop", True)
    monkeypatch.setattr(fakes_transport.Engine, "delay_s", 0.8)
    _pull(dec, url, "w2", [(4, 5)])
    (batch,) = _posted(dec)
    handle = batch.handle
    _cancel(dec, "w2")
    t0 = time.monotonic()
    reported = None
    while time.monotonic() - t0 < 10 and reported is None:
        _, recving, failed = dec.transfer_results()
        if "w2" in recving:
            reported = time.monotonic()
            assert handle._done.is_set(), "reported to vLLM while the batch could still write its blocks"
        time.sleep(0.01)
    assert reported is not None and "w2" not in failed
    assert handle.cancels >= 2  # asked again until it settled
    for name, t in dec.kv_caches.items():  # the batch's bytes landed before the report, none after
        assert torch.equal(t[4], pre.kv_caches[name][5])
    assert dec.get_stats().data["pulls_cancelled"] == 1


@pytest.fixture
def mooncake_pair():
    """Prefill and decode workers over real Mooncake transfer engines (TCP on loopback) whose cancel gives
    up waiting at once: a batch in flight cannot be stopped, as with Mooncake on RDMA."""
    pytest.importorskip("mooncake")
    from kvlink.backends import register_backend, unregister_backend
    from kvlink.backends.mooncake import MooncakeBackend
    from kvlink.backends.mooncake_config import MooncakeConfig
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    register_backend("mooncake-stubborn", lambda config, options: MooncakeBackend(
        config, MooncakeConfig(max_queued=4, settle_s=0.001)))
    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    cfg = ConnectorConfig(pull_timeout_s=60.0, transport_backend="mooncake-stubborn")
    pre = W.KVLinkWorker(cfg, W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = W.KVLinkWorker(cfg, W.RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    n = 512
    try:
        register_two_layers(pre, dec, srv.url, n, HEADS, BLOCK, HEAD2)
        yield pre, dec, srv.url, n
    finally:
        dec.shutdown()
        pre.shutdown()
        srv.stop()
        unregister_backend("mooncake-stubborn")


def test_mooncake_cancel_mid_read_is_reported_only_once_the_batch_settled(mooncake_pair):
    pre, dec, url, n = mooncake_pair
    _pull(dec, url, "m1", [(1, 1)])  # first contact
    assert pull_outcome(dec, "m1") == "ok"
    # reversed remote ids: no two blocks coalesce, so the READ is many small chunks one after another
    pairs = [(i, n - i) for i in range(1, n)]
    _pull(dec, url, "m2", pairs)
    (batch,) = _posted(dec)
    handle = batch.handle
    _cancel(dec, "m2")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, recving, failed = dec.transfer_results()
        if "m2" in recving:
            assert handle.settled, "reported to vLLM while Mooncake could still write its blocks"
            break
        time.sleep(0.002)
    else:
        pytest.fail("the cancelled pull was never reported")
    snap = {name: t.clone() for name, t in dec.kv_caches.items()}
    time.sleep(0.3)
    for name, t in dec.kv_caches.items():
        assert torch.equal(t, snap[name]), "bytes landed in the blocks after they went back to vLLM"
    _pull(dec, url, "m3", [(3, 7)])  # the engine keeps serving
    assert pull_outcome(dec, "m3") == "ok"
    for name, t in dec.kv_caches.items():
        assert torch.equal(t[3], pre.kv_caches[name][7])


def test_a_read_that_cannot_be_posted_fails_the_pull_and_the_next_one_works(pair, monkeypatch):
    from kvlink.errors import OutOfRange

    pre, dec, url = pair
    real_read = fakes_transport.Engine.read

    def refuse(self, *a, **kw):
        raise OutOfRange("descriptor 0: remote offset beyond the region")

    monkeypatch.setattr(fakes_transport.Engine, "read", refuse)
    _pull(dec, url, "p1", [(1, 1), (2, 2)])
    assert pull_outcome(dec, "p1") == "failed" and dec.take_load_error_blocks() == {1, 2}
    monkeypatch.setattr(fakes_transport.Engine, "read", real_read)
    _pull(dec, url, "p2", [(3, 3)])
    assert pull_outcome(dec, "p2") == "ok"


def test_multi_part_batch_failing_in_one_part_stops_the_others_before_it_fails():
    """kv_both and non-contiguous caches READ each layer as its own transport batch: one part's error
    must not be reported (vLLM reusing the blocks) while another part still writes."""
    from kvlink.errors import NotSettled, PeerClosed
    from kvlink.vllm.puller import _Batches

    class Part:
        def __init__(self, error=None, cancel_error=None):
            self.error, self.cancel_error, self.cancelled = error, cancel_error, 0

        def poll(self):
            if self.error:
                raise self.error
            return False

        def wait(self, timeout_s):
            self.poll()

        def cancel(self):
            self.cancelled += 1
            if self.cancel_error:
                raise self.cancel_error
            return True

    ok, bad = Part(), Part(error=PeerClosed("reset"))
    batches = _Batches([bad, ok])
    # polled on vLLM's thread: not settled until the cancel thread has stopped the other parts
    with pytest.raises(NotSettled, match="PeerClosed: reset"):
        batches.poll()
    assert ok.cancelled == 0  # a backend's cancel may block: never on vLLM's thread
    assert batches.cancel() is True and ok.cancelled == 1
    stubborn = Part(cancel_error=NotSettled("chunk in flight"))
    with pytest.raises(NotSettled):  # not settled: the table keeps the pulls and asks again
        _Batches([Part(error=PeerClosed("reset")), stubborn]).wait(1.0)


def test_a_pull_that_ends_nudges_the_scheduler_once_per_handover(pair):
    """The decode worker nudges its engine's scheduler (nudge.py; here in this process) when a pull ends,
    so a step waiting for pulls goes on and hands it over; after the handover the next pull nudges again."""
    from kvlink.vllm.nudge import NudgeListener

    pre, dec, url = pair
    listener = NudgeListener(dec.rank.engine_id)
    try:
        assert listener.listening and not listener.wait(0.0)
        _pull(dec, url, "n1", [(1, 3)])
        assert listener.wait(30.0)
        assert pull_outcome(dec, "n1") == "ok"
        _pull(dec, url, "n2", [(2, 4)])
        assert listener.wait(30.0)
        assert pull_outcome(dec, "n2") == "ok"
        assert not listener.wait(0.05)
    finally:
        listener.close()


def test_a_batch_posted_only_in_part_is_never_trusted(monkeypatch):
    """Layers in regions of their own are READ one transport batch each. When the second cannot be posted
    (its peer died), the first may already have ended: vLLM's thread, checking batches between the
    worker's events, must not report the pull done with the second layer never written."""
    from kvlink.errors import PeerClosed

    # two allocations: no single region holds both layers, so each layer is a READ of its own
    with _workers({name: t.clone() for name, t in _cache(0.0).items()}) as (pre, dec, url):
        assert dec._local_region is None
        real_read, reads = fakes_transport.Engine.read, []

        def second_fails(self, *a, **kw):
            reads.append(1)
            if len(reads) == 2:
                raise PeerClosed("peer closed the connection")
            return real_read(self, *a, **kw)

        real_apply, inside = dec._apply, []

        def apply_then_check(event):  # vLLM's thread runs _settle_finished after each event of the worker
            real_apply(event)
            if not inside:
                inside.append(1)
                try:
                    dec._settle_finished()
                finally:
                    inside.clear()

        monkeypatch.setattr(fakes_transport.Engine, "read", second_fails)
        monkeypatch.setattr(dec, "_apply", apply_then_check)
        _pull(dec, url, "half", [(1, 1), (2, 2)])
        assert pull_outcome(dec, "half") == "failed"
        assert len(reads) == 2 and dec.take_load_error_blocks() == {1, 2}

def test_a_post_that_raises_before_any_read_fails_its_pull_instead_of_stranding_it(pair, monkeypatch):
    pre, dec, url = pair

    class Broken(dict):
        def get(self, *a):
            raise RuntimeError("layer map broken")

    good = dec._group_layers
    monkeypatch.setattr(dec, "_group_layers", Broken())
    _pull(dec, url, "x1", [(1, 1)])
    assert pull_outcome(dec, "x1") == "failed" and dec.take_load_error_blocks() == {1}
    monkeypatch.setattr(dec, "_group_layers", good)
    _pull(dec, url, "x2", [(2, 2)])
    assert pull_outcome(dec, "x2") == "ok"


class _TcpWorkers:
    """Workers over the real TCP transport, with one bootstrap server (``url``); every worker made, then the
    server, is shut down after the test, and ``closing`` callables run first."""

    def __init__(self):
        from kvlink.bootstrap import BootstrapConfig, BootstrapServer

        self.srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
        self.url = self.srv.url
        self.made: list = []
        self.closing: list = []

    def worker(self, cfg, engine_id: str, role: str, cache: dict, launch: str | None = None):
        from kvlink.vllm import worker as W

        w = W.KVLinkWorker(cfg, W.RankInfo(engine_id, 0, 1, 0, 1, "m", launch=launch), role)
        self.made.append(w)
        w.register_kv_caches(cache)
        return w

    def decode(self, cache: dict, **cfg):
        """A decode worker over ``cache`` (pull timeout 30 s, lookups 10 s)."""
        from kvlink.vllm.config import ConnectorConfig

        return self.worker(ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0, lookup_wait_s=10.0, **cfg),
                           "dec", "kv_consumer", cache)

    def close(self) -> None:
        for fn in self.closing:
            fn()
        for w in reversed(self.made):
            w.shutdown()
        self.srv.stop()


@pytest.fixture
def tcp():
    t = _TcpWorkers()
    try:
        yield t
    finally:
        t.close()


def test_a_registration_whose_address_another_process_took_is_never_read(tcp, monkeypatch):
    """Real TCP transport. Prefill dies without unregistering (its registration lives out its lease) and
    another engine's worker takes its transport port, with its own KV behind the same region ids. Decode's
    first contact with the dead engine connects only to the process its registration names: the pull
    fails ``engine_changed`` and no byte lands. Control: connecting to whatever answers at the address (as
    before) reads the other process's blocks and reports the pull ok."""
    from kvlink.vllm import puller as P
    from kvlink.vllm.config import ConnectorConfig
    from tests.ports import free_port

    pre_cfg = ConnectorConfig(transport_backend="tcp", transport_port=free_port(), engine_lease_s=120.0)
    pre = tcp.worker(pre_cfg, "pre", "kv_producer", _cache(1.0))
    pre._ensure_registered(tcp.url)
    pre.shutdown()  # died: no unregister, its registration stays for its lease
    other = tcp.worker(pre_cfg, "other", "kv_producer", _cache(50.0))  # the same port, another process's KV
    other._ensure_registered(tcp.url)
    dst = _cache(0.0)
    before = {n: t.clone() for n, t in dst.items()}
    dec = tcp.decode(dst)
    _pull(dec, tcp.url, "r", [(1, 2), (3, 4)])
    assert pull_outcome(dec, "r") == "failed"
    assert all(torch.equal(dst[n], before[n]) for n in dst), "a byte of the other process landed"
    assert dec.get_stats().data.get("compat_refused.engine_changed") == 1

    monkeypatch.setattr(P, "expected_name", lambda reg: None)  # control: any engine at the address
    _pull(dec, tcp.url, "r2", [(1, 2), (3, 4)])
    assert pull_outcome(dec, "r2") == "ok"
    layer = next(iter(dst.values()))
    assert torch.equal(layer[1], next(iter(other.kv_caches.values()))[2])  # the other process's block


@pytest.mark.parametrize("check", [True, False])
def test_a_prefill_restarted_under_the_same_engine_id_is_read_at_once(tcp, monkeypatch, check):
    """Real TCP transport. Decode keeps its connection to a prefill engine between pulls. The prefill
    restarts under the same engine id and transport port (a pod restarted with a fixed ``engine_id``): a
    new process, registered under a new instance. Decode's kept peer reads stale (the old process closed
    its connections), so it asks for the engine's ranks again and reads the new process's blocks: the first
    pull after the restart succeeds. Control (``check`` off: the kept peer trusted, as before): that pull
    fails (the reconnect hears the new name: PeerChanged), and no byte lands."""
    from kvlink.vllm.config import ConnectorConfig
    from tests.ports import free_port

    pre_cfg = ConnectorConfig(transport_backend="tcp", transport_port=free_port())
    pre = tcp.worker(pre_cfg, "pre", "kv_producer", _cache(1.0))
    pre._ensure_registered(tcp.url)
    dst = _cache(0.0)
    dec = tcp.decode(dst)
    _pull(dec, tcp.url, "r1", [(1, 2)])
    assert pull_outcome(dec, "r1") == "ok"
    pre.shutdown()
    new = tcp.worker(pre_cfg, "pre", "kv_producer", _cache(50.0))  # same engine id and port, another process
    new._ensure_registered(tcp.url)
    peer = next(iter(dec._remotes.values())).legs[0].peer
    deadline = time.monotonic() + 10
    while not dec.engine.peer_stale(peer):  # the old process's connections seen closed
        assert time.monotonic() < deadline
        time.sleep(0.02)
    if not check:
        monkeypatch.setattr(dec.engine, "peer_stale", lambda peer: False)
    before = {n: t.clone() for n, t in dst.items()}
    _pull(dec, tcp.url, "r2", [(3, 4)])
    layer, src = next(iter(dst.values())), next(iter(new.kv_caches.values()))
    if check:
        assert pull_outcome(dec, "r2") == "ok"
        assert torch.equal(layer[3], src[4])  # the new process's block
        assert dec.get_stats().data.get("remote_refreshed") == 1
    else:
        assert pull_outcome(dec, "r2") == "failed"
        assert all(torch.equal(dst[n], before[n]) for n in dst)
        assert dec.get_stats().data.get("remote_refreshed", 0) == 0


@pytest.mark.parametrize("renew", [True, False])
def test_a_record_older_than_the_ranks_decode_connects_to_is_renewed_before_any_read_is_trusted(tcp, 
        monkeypatch, renew):
    """Real TCP transport, concurrent pairing. Decode has prefill's published record in hand when the
    prefill process dies and a new one registers under the same engine id and port (its registration drops
    the old process's records); decode then looks up the engine's ranks and connects to the new process.
    The old record's block ids name the new process's memory: no read is trusted until a renewal proves the
    record still stands, and it does not, so the pull fails. Control (``renew`` off: the record's lease
    trusted, as before): the pull reports ok with the new process's bytes, the wrong KV."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm import puller as P
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource
    from tests.ports import free_port

    pre_cfg = ConnectorConfig(transport_backend="tcp", transport_port=free_port())
    old = tcp.worker(pre_cfg, "pre", "kv_producer", _cache(1.0))
    old._ensure_registered(tcp.url)
    dst = _cache(0.0)
    dec = tcp.decode(dst)
    with BootstrapClient(tcp.url) as cli:
        cli.publish("pre", "p-r", [[2]], num_tokens=BLOCK, lease_s=30.0, transfer_id="t-r")
    real, replaced = dec._remote, []

    def restart_then_remote(*a, **kw):  # between decode's record and its lookup of the ranks
        if not replaced:
            old.shutdown()
            new = tcp.worker(pre_cfg, "pre", "kv_producer", _cache(50.0))
            new._ensure_registered(tcp.url)
            replaced.append(new)
        return real(*a, **kw)

    monkeypatch.setattr(dec, "_remote", restart_then_remote)
    if not renew:
        monkeypatch.setattr(P._Remote, "looked_up", property(lambda self: 0.0, lambda self, v: None))
    dec._submit(PullSpec(request_id="r", local_block_ids=(1,), first_block=0,
                         source=RemoteSource(bootstrap_url=tcp.url, engine_id="pre", transfer_id="t-r")))
    outcome = pull_outcome(dec, "r")
    assert replaced, "the restart did not happen between the record and the connect"
    layer, new_block = next(iter(dst.values())), next(iter(replaced[0].kv_caches.values()))[2]
    if renew:
        assert outcome == "failed"
    else:
        assert outcome == "ok" and torch.equal(layer[1], new_block)  # the wrong KV, trusted


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
@pytest.mark.parametrize("fence", [True, False, "record"])
def test_a_rolling_restart_is_read_from_the_new_process_not_the_old_one_decode_kept(tcp, monkeypatch, mode, fence):
    """Real TCP transport. A rolling restart under one engine id: the new process (launch L2, another port)
    registers while the old one (L1) still serves, so decode's kept peers of L1 are not stale. The new
    process's request names its launch (the record's ``launch``, the params' ``remote_launch``): decode looks
    the ranks up again and reads L2's blocks. Control (``fence`` off: the launch not passed on, as before,
    and the sequential record check blind to launches): the kept remote reads the old process's memory at
    the new block ids and reports ok, the wrong KV. ``record``: params that name no launch (a router that
    drops the field) leave the kept remote in place, and the sequential pull's record check (the record was
    published by L2, the ranks read are L1's) fails it, nothing trusted."""
    from kvlink.vllm import lease
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    old = tcp.worker(ConnectorConfig(transport_backend="tcp"), "pre", "kv_producer", _cache(1.0), launch="L1")
    old._ensure_registered(tcp.url)
    dst = _cache(0.0)
    dec = tcp.decode(dst)
    with BootstrapClient(tcp.url) as cli:
        cli.publish("pre", "p-r1", [[2]], num_tokens=BLOCK, lease_s=30.0, launch="L1")
    dec._submit(PullSpec(request_id="r1", local_block_ids=(1,), first_block=0, source=RemoteSource(
        bootstrap_url=tcp.url, engine_id="pre", request_id="p-r1", block_ids=((2,),), launch="L1")))
    assert pull_outcome(dec, "r1") == "ok"
    # the old one keeps serving
    new = tcp.worker(ConnectorConfig(transport_backend="tcp"), "pre", "kv_producer", _cache(50.0), launch="L2")
    new._ensure_registered(tcp.url)
    with BootstrapClient(tcp.url) as cli:
        cli.publish("pre", "p-r2", [[4]], num_tokens=BLOCK, lease_s=30.0, launch="L2",
                    transfer_id="t-r2" if mode == "concurrent" else None)
    if fence is not True:
        real = dec._remote
        monkeypatch.setattr(dec, "_remote", lambda cli, url, engine_id, launch=None: real(cli, url, engine_id))
    if fence is False:
        check = lease.RecordCheck.wrong
        monkeypatch.setattr(lease.RecordCheck, "wrong", lambda self, rec, where: check(
            self, msgspec.structs.replace(rec, launch=self.launch), where))
    src = RemoteSource(bootstrap_url=tcp.url, engine_id="pre", request_id="p-r2", block_ids=((4,),),
                       launch="L2") if mode == "sequential" else \
        RemoteSource(bootstrap_url=tcp.url, engine_id="pre", transfer_id="t-r2")
    dec._submit(PullSpec(request_id="r2", local_block_ids=(3,), first_block=0, source=src))
    if fence == "record" and mode == "sequential":
        assert pull_outcome(dec, "r2") == "failed"  # (the READ ran beside the check: its bytes are not trusted)
        return
    assert pull_outcome(dec, "r2") == "ok"
    layer = next(iter(dst.values()))
    new_block, old_block = (next(iter(w.kv_caches.values()))[4] for w in (new, old))
    assert not torch.equal(new_block, old_block)
    assert torch.equal(layer[3], new_block if fence is True else old_block)
    if fence is True and mode == "sequential":  # params of a launch no rank is registered by: refused, nothing read
        before = layer[5].clone()
        dec._submit(PullSpec(request_id="r3", local_block_ids=(5,), first_block=0, source=RemoteSource(
            bootstrap_url=tcp.url, engine_id="pre", request_id="p-r2", block_ids=((4,),), launch="L9")))
        assert pull_outcome(dec, "r3") == "failed" and torch.equal(layer[5], before)
        assert dec.get_stats().data.get("compat_refused.engine_changed") == 1


def _stage(tcp, pp: int, fill: float, launch: str):
    """Stage ``pp`` of a two-stage prefill engine "pre" (one layer each) of ``launch``, registered."""
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    name = f"model.layers.{pp}.self_attn.attn"
    w = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp"),
                       W.RankInfo("pre", 0, 1, 0, 1, "m", pp_rank=pp, pp_size=2, num_layers=2, launch=launch),
                       "kv_producer")
    tcp.made.append(w)
    w.register_kv_caches({name: _cache(fill)[name]})
    w._ensure_registered(tcp.url)
    return w


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_a_rolling_restart_half_registered_is_not_read_nor_kept(tcp, mode):
    """Real TCP, a two-stage prefill rolled under one engine id: decode looks the engine up when the new
    process's first stage has registered and the old second stage has not yet been replaced. Those ranks
    are no one process set: refused (nothing read), and nothing kept, so once every stage is the new
    process's, its records are read from it, never the second stage's layers from the old process (a review:
    such a lookup was kept as if unfenced, and the new launch's records read through it)."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    old = [_stage(tcp, 0, 1.0, "L1"), _stage(tcp, 1, 1.0, "L1")]
    dst = _cache(0.0)
    dec = tcp.decode(dst)
    with BootstrapClient(tcp.url) as cli:
        cli.publish("pre", "p-r1", [[2]], num_tokens=BLOCK, lease_s=30.0, launch="L1")
    _stage(tcp, 0, 50.0, "L2")  # the new process's first stage: the launches are mixed now
    dec._submit(PullSpec(request_id="r1", local_block_ids=(1,), first_block=0, source=RemoteSource(
        bootstrap_url=tcp.url, engine_id="pre", request_id="p-r1", block_ids=((2,),), launch="L1")))
    assert pull_outcome(dec, "r1") == "failed"
    assert dec.get_stats().data.get("compat_refused.engine_changed") == 1 and not dec._remotes
    new1 = _stage(tcp, 1, 50.0, "L2")  # every stage is L2's; the old process still serves
    with BootstrapClient(tcp.url) as cli:
        cli.publish("pre", "p-r2", [[4]], num_tokens=BLOCK, lease_s=30.0, launch="L2",
                    transfer_id="t-r2" if mode == "concurrent" else None)
    src = RemoteSource(bootstrap_url=tcp.url, engine_id="pre", request_id="p-r2", block_ids=((4,),), launch="L2") \
        if mode == "sequential" else RemoteSource(bootstrap_url=tcp.url, engine_id="pre", transfer_id="t-r2")
    dec._submit(PullSpec(request_id="r2", local_block_ids=(3,), first_block=0, source=src))
    assert pull_outcome(dec, "r2") == "ok"
    got = dst["model.layers.1.self_attn.attn"][3]
    assert torch.equal(got, new1.kv_caches["model.layers.1.self_attn.attn"][4])
    assert not torch.equal(got, old[1].kv_caches["model.layers.1.self_attn.attn"][4])


def test_connections_a_middlebox_dropped_keep_the_remote_and_its_peers(tcp):
    """Real TCP through a relay (prefill advertises it). The relay drops every idle connection of a live
    prefill: decode's kept peers read stale, it asks for the ranks again, they name the same process, so
    the kept remote object stays (pulls streaming through it keep their pieces; nothing counted as a
    restart) and the next READs reopen the connections."""
    from kvlink.vllm.config import ConnectorConfig
    from tests.ports import free_port
    from tests.relay import Relay

    tport = free_port()
    relay = Relay(f"127.0.0.1:{tport}")
    tcp.closing.append(relay.close)

    pre = tcp.worker(ConnectorConfig(transport_backend="tcp", transport_port=tport,
                                 transport_advertise=relay.address), "pre", "kv_producer", _cache(1.0))
    pre._ensure_registered(tcp.url)
    dst = _cache(0.0)
    dec = tcp.decode(dst)
    _pull(dec, tcp.url, "r1", [(1, 2)])
    assert pull_outcome(dec, "r1") == "ok"
    remote = next(iter(dec._remotes.values()))
    relay.drop()
    peer = remote.legs[0].peer
    deadline = time.monotonic() + 10
    while not dec.engine.peer_stale(peer):
        assert time.monotonic() < deadline, "the dropped connections never read stale"
        time.sleep(0.02)
    for i, (lb, rb) in enumerate([(3, 4), (4, 5), (5, 1)]):
        _pull(dec, tcp.url, f"r{i + 2}", [(lb, rb)])
        assert pull_outcome(dec, f"r{i + 2}") == "ok"
    assert next(iter(dec._remotes.values())) is remote
    layer, src = next(iter(dst.values())), next(iter(pre.kv_caches.values()))
    assert all(torch.equal(layer[lb], src[rb]) for lb, rb in [(3, 4), (4, 5), (5, 1)])
    assert dec.get_stats().data.get("remote_refreshed", 0) == 0


def test_a_kept_peer_closed_to_make_room_is_connected_again_not_failed(tcp):
    """Real TCP transport, a decode rank whose peer table holds one peer (``transport_max_peers`` 1). A pull
    from engine B closes A's idle peer to make room while decode still keeps A's remote: the next pull from
    A sees that peer gone (``peer_stale``), asks for A's ranks again and connects anew instead of failing
    on the closed peer's id (before: that pull failed once, UnknownPeer)."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig

    def pull(rid, engine, pairs):
        with BootstrapClient(tcp.url) as cli:
            cli.publish(engine, "p-" + rid, [[r for _, r in pairs]], num_tokens=BLOCK * len(pairs), lease_s=30.0)
        submit_pull(dec, tcp.url, rid, pairs, engine_id=engine)
        return pull_outcome(dec, rid)

    a = tcp.worker(ConnectorConfig(transport_backend="tcp"), "a", "kv_producer", _cache(1.0))
    b = tcp.worker(ConnectorConfig(transport_backend="tcp"), "b", "kv_producer", _cache(50.0))
    a._ensure_registered(tcp.url)
    b._ensure_registered(tcp.url)
    dst = _cache(0.0)
    dec = tcp.decode(dst, transport_max_peers=1)
    assert pull("r1", "a", [(1, 2)]) == "ok"
    assert pull("r2", "b", [(2, 3)]) == "ok"  # A's peer closed to make room
    assert pull("r3", "a", [(3, 4)]) == "ok"
    layer = next(iter(dst.values()))
    assert torch.equal(layer[3], next(iter(a.kv_caches.values()))[4])
    stats = dec.get_stats().data
    assert stats.get("remote_refreshed") == 1 and stats.get("pulls_failed", 0) == 0

def test_the_transport_limits_reach_the_engine():
    """transport_max_conns / transport_max_peers configure each worker's transport engine (real TCP)."""
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    w = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp", transport_max_conns=3, transport_max_peers=2),
                       W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    try:
        w.register_kv_caches(_cache(1.0))
        assert (w.engine.config.max_conns, w.engine.config.max_peers) == (3, 2)
    finally:
        w.shutdown()


def test_a_state_page_of_many_parts_registers_and_is_still_told_apart():
    """A state page of four parts (a linear-attention state with its recovery records) registers, and another
    page still does not pair: refused at first contact, layer by layer. A layer's layout longer than the 128
    characters a registered layer may carry goes as its digest."""
    import math

    import torch

    from kvlink.backends import register_backend, unregister_backend
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.compat import MAX_LAYOUT_DESC, layer_layout
    from kvlink.vllm.contact import LocalKV, PullFailed, legs_for

    def cache(conv_transposed: bool) -> dict:
        nb, parts = 6, [((3, 1536) if conv_transposed else (1536, 3), torch.bfloat16), ((4, 32, 32), torch.float32),
                        ((4, 4, 32), torch.float32), ((4, 4, 64), torch.float32)]
        sizes = [math.prod(sh) * torch.empty(0, dtype=dt).element_size() for sh, dt in parts]
        page = torch.zeros(nb, sum(sizes), dtype=torch.uint8)
        states, off = [], 0
        for (sh, dt), size in zip(parts, sizes):
            states.append(page[:, off:off + size].view(dt).view(nb, *sh))
            off += size
        return {"model.layers.0.mixer": states,
                "model.layers.1.self_attn.attn": torch.zeros(nb, 2, 16, 128, dtype=torch.bfloat16)}

    register_backend("fake", fakes_transport.Engine)
    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    made = []
    try:
        for transposed in (False, True):
            w = W.KVLinkWorker(ConnectorConfig(transport_backend="fake"),
                               W.RankInfo(f"pre{int(transposed)}", 0, 1, 0, 1, "m", kv_heads=2,
                                          groups="MambaSpec:16|FullAttentionSpec:16"), "kv_producer",
                               layer_groups={"model.layers.0.mixer": 0, "model.layers.1.self_attn.attn": 1},
                               state_layers={"model.layers.0.mixer"}, num_groups=2)
            made.append(w)
            w.register_kv_caches(cache(transposed))
            w._ensure_registered(srv.url)
        with BootstrapClient(srv.url) as cli:
            regs = [cli.engine_ranks(w.rank.engine_id)[0] for w in made]
        assert [r.compat_hash for r in regs] == [w.compat_hash for w in made]
        # the state's layout is compared per layer (the compat hash has the attention layout, which every
        # pipeline stage has): the mixer's registered layouts differ, as digests of the long descriptions
        mixer = [next(x.layout for x in r.layers if x.name == "model.layers.0.mixer") for r in regs]
        assert all(len(m) <= MAX_LAYOUT_DESC for m in mixer) and mixer[0] != mixer[1]
        assert made[0].compat_hash == made[1].compat_hash
        local = made[1]
        with pytest.raises(PullFailed, match="lays layer model.layers.0.mixer out as state:31744:0:bfloat16:1536x3") as e:
            legs_for("pre0", [regs[0]], LocalKV(0, 1, 0, 1, tuple(local.layer_names), local.layout,
                                                local._local_geoms, local._total_heads, local.compat,
                                                local.compat_hash, groups=local._layer_group, layouts=local.layouts))
        assert e.value.reason == "layout"
        long = [f"state:1:{'x' * 150}", f"state:1:{'x' * 149}y"]
        assert [layer_layout(d)[:7] for d in long] == ["sha256:"] * 2 and len(layer_layout(long[0])) <= 128
        assert layer_layout(long[0]) != layer_layout(long[1]) and layer_layout("state:1:x") == "state:1:x"
    finally:
        for w in made:
            w.shutdown()
        srv.stop()
        unregister_backend("fake")


def test_a_rank_of_state_layers_only_is_refused_at_start_naming_why():
    """A pipeline stage holding Mamba layers only has no attention block to lay blocks out by: start-up stops
    and says so (a stage with both kinds, or attention only, registers: tests/vllm/test_pp_mamba.py)."""
    import torch

    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    w = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp"), W.RankInfo("pre", 0, 1, 1, 2, "m", kv_heads=2),
                       "kv_producer", layer_groups={"model.layers.2.mixer": 0}, state_layers={"model.layers.2.mixer"},
                       num_groups=2)
    try:
        with pytest.raises(RuntimeError, match=r"model.layers.2.mixer.*at least one attention layer on every rank"):
            w.register_kv_caches({"model.layers.2.mixer": [torch.zeros(4, 64, dtype=torch.bfloat16)]})
    finally:
        w.shutdown()


def test_per_head_scales_travel_in_the_registration_and_other_ones_are_refused():
    """An fp8 cache with per-head scales (compressed-tensors' attention-head strategy): prefill registers its
    heads' scales, and a decode whose heads carry other scales under the same maximum (what vLLM's scalar
    scale is) refuses prefill at first contact instead of reading bytes it would decode otherwise; one with
    the same scales pulls."""
    from types import SimpleNamespace

    from kvlink.backends import register_backend, unregister_backend
    from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer
    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    def modules(k_heads):
        return {f"model.layers.{i}.self_attn.attn": SimpleNamespace(
            _k_scale_float=max(k_heads), _v_scale_float=1.0, _k_scale=torch.tensor(k_heads),
            _v_scale=torch.tensor(1.0)) for i in range(2)}

    def caches(fill):
        buf = torch.full((2, BLOCKS, HEADS, BLOCK, HEAD2), fill, dtype=torch.uint8)
        return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(2)}

    register_backend("fake", fakes_transport.Engine)
    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    cfg = ConnectorConfig(pull_timeout_s=60.0, lookup_wait_s=30.0, transport_backend="fake")
    workers = [W.KVLinkWorker(cfg, W.RankInfo(name, 0, 1, 0, 1, "m", kv_format="fp8_e4m3"), role)
               for name, role in (("pre", "kv_producer"), ("dec", "kv_consumer"), ("other", "kv_consumer"))]
    pre, dec, other = workers
    try:
        pre.register_kv_caches(caches(7), modules([0.5, 0.25]))
        dec.register_kv_caches(caches(0), modules([0.5, 0.25]))
        other.register_kv_caches(caches(0), modules([0.25, 0.5]))
        pre._ensure_registered(srv.url)
        with BootstrapClient(srv.url) as cli:
            (layer, _) = cli.engine_ranks("pre")[0].layers
        assert (layer.k_scale, layer.k_head_scales, layer.v_head_scales) == (0.5, [0.5, 0.25], None)
        _pull(dec, srv.url, "r1", [(1, 1)])
        assert pull_outcome(dec, "r1") == "ok"
        assert int(dec.kv_caches["model.layers.0.self_attn.attn"][1].min()) == 7
        _publish(srv.url, "r2", [(2, 2)], 30.0)
        submit_pull(other, srv.url, "r2", [(2, 2)])
        assert pull_outcome(other, "r2") == "failed"
        assert other.get_stats().data.get("compat_refused.kv_scales") == 1
        assert int(other.kv_caches["model.layers.0.self_attn.attn"][2].max()) == 0  # nothing read
    finally:
        for w in workers:
            w.shutdown()
        srv.stop()
        unregister_backend("fake")
