"""The initiator's peer table over a long life: peers of restarted processes (retired) and of engines that
went away (idle for good) are freed, so a decode that outlives hundreds of prefill restarts still
connects; ids of freed peers never name another peer; a peer in use is never the one closed."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvlink.transport import Access

MAX_PEERS = 64  # the tables of these tests (max_peers; the default is 1,024)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_retired_peers_are_freed_so_restarts_never_fill_the_table(make_engine):
    """A prefill restarting more times than the table holds, at one address under a new name each time: every restart retires the
    peer (PeerChanged) and a connect opens a new one. Before, retired peers kept their slots and threads and
    the connect past max_peers failed "too many peers"."""
    from kvlink.errors import PeerChanged, PeerClosed, UnknownPeer

    init = make_engine(name="decode", listen=None, streams=1, max_peers=MAX_PEERS)
    dst = np.zeros(4096, dtype=np.uint8)
    rdst = init.register(dst)
    first = make_engine(name="prefill/0", streams=1)
    address = first.address
    region = first.register(np.full(4096, 0, dtype=np.uint8), Access.READ).id
    peer = init.connect(address)
    init.read(peer, rdst, [0], region, [0], 4096).wait()
    old_ids, threads0 = [], _threads()
    target = first
    for n in range(1, MAX_PEERS + 45):
        target.close()
        target = make_engine(name=f"prefill/{n}", streams=1, listen=address)
        src = np.full(4096, n % 251, dtype=np.uint8)
        assert target.register(src, Access.READ).id == region
        deadline = time.monotonic() + 10
        while True:  # the old connection is closed: the reconnect hears the new name
            try:
                init.read(peer, rdst, [0], region, [0], 4096).wait()
                raise AssertionError(f"restart {n}: the retired peer read the new process's memory")
            except PeerChanged:
                break
            except PeerClosed:
                assert time.monotonic() < deadline
        old_ids.append(peer.id)
        peer = init.connect(address)  # fails "too many peers" without the fix, past max_peers
        assert peer.name == f"prefill/{n}" and peer.id not in old_ids
        init.read(peer, rdst, [0], region, [0], 4096).wait()
        assert (dst == n % 251).all()
    stats = init.stats()
    assert stats["peers"] <= 3, stats  # the live one, and retired ones whose threads were still exiting
    assert stats["peers_freed"] >= MAX_PEERS + 40, stats
    assert _threads() <= threads0 + 8, "stream threads of retired peers were not joined"
    stale = [type(peer)(i, address, "x", False) for i in (old_ids[0], old_ids[-1])]
    with pytest.raises(PeerChanged, match="retired"):  # the last one: its fate is known
        init.read(stale[1], rdst, [0], region, [0], 4096).wait()
    with pytest.raises(UnknownPeer, match="closed"):  # one whose slot has had other peers since
        init.read(stale[0], rdst, [0], region, [0], 4096).wait()
    assert (dst == (MAX_PEERS + 44) % 251).all()  # neither read a byte


def _spread(i: int) -> str:
    """Distinct loopback addresses (127.0.0.0/8 all reach this host): one peer each."""
    return f"127.0.{i // 250}.{i % 250 + 1}"


def test_with_the_table_full_the_least_recently_used_idle_peer_is_closed_and_a_busy_one_never(make_engine):
    """Engines that went away leave idle peers behind. With the table full, a connect closes the least
    recently used idle peer; a peer with a READ in flight is never chosen, however old; the closed peer's id
    says so (UnknownPeer, "connect again"), and nothing else changes."""
    from kvlink.errors import UnknownPeer
    from tests.conftest import TOKEN
    from tests.fakes import SlowTarget

    target = make_engine(name="prefill", listen="0.0.0.0:0", max_conns=4 * MAX_PEERS)
    port = target.address.rsplit(":", 1)[1]
    src = np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8)
    region = target.register(src, Access.READ).id
    init = make_engine(name="decode", listen=None, streams=1, op_timeout_s=60.0, max_peers=MAX_PEERS)
    dst = np.zeros(8192, dtype=np.uint8)
    rdst = init.register(dst)
    stalled = SlowTarget(token=TOKEN, stall=True)  # answers a READ and never sends its bytes: the busy peer
    try:
        busy = init.connect(stalled.address)
        slow = init.read(busy, init.register(np.zeros(64, dtype=np.uint8)), [0], 1, [0], 64)
        peers = [init.connect(f"{_spread(i)}:{port}") for i in range(MAX_PEERS - 1)]
        assert init.stats()["peers"] == MAX_PEERS
        init.read(peers[0], rdst, [0], region, [0], 16).wait()  # peers[0] used last: peers[1] is the oldest idle
        assert init.connect(f"{_spread(2)}:{port}") == peers[2]  # found by a connect: counts as used now
        extra = init.connect(f"{_spread(MAX_PEERS)}:{port}")
        assert init.stats()["peers"] == MAX_PEERS and init.stats()["peers_freed"] == 1
        with pytest.raises(UnknownPeer, match="closed .*connect again"):
            init.read(peers[1], rdst, [0], region, [0], 16).wait()
        extra2 = init.connect(f"{_spread(MAX_PEERS + 1)}:{port}")  # next oldest: peers[3], not the found peers[2]
        with pytest.raises(UnknownPeer, match="closed .*connect again"):
            init.read(peers[3], rdst, [0], region, [0], 16).wait()
        for p in (peers[0], peers[2], extra, extra2):
            init.read(p, rdst, [0], region, [0], 16).wait()
        assert init.connect(stalled.address) == busy  # the busy peer (the oldest by far) was not closed
        assert slow.cancel()  # still running until now
        again = init.connect(f"{_spread(1)}:{port}")  # the closed address connects anew, under a new id
        assert again.id != peers[1].id
        init.read(again, rdst, [0], region, [0], 8192).wait()
        assert (dst == src).all()
    finally:
        stalled.close()


def test_with_the_table_full_a_retired_peer_makes_room_before_any_live_one(make_engine):
    """A full table of live idle peers and one retired (its address restarted under another name): the
    connect to the restarted engine takes the retired peer's slot, however recently it was used; no live peer is closed."""
    from kvlink.errors import PeerChanged, PeerClosed

    target = make_engine(name="prefill", listen="0.0.0.0:0", max_conns=4 * MAX_PEERS)
    port = target.address.rsplit(":", 1)[1]
    region = target.register(np.full(64, 9, dtype=np.uint8), Access.READ).id
    init = make_engine(name="decode", listen=None, streams=1, max_peers=MAX_PEERS)
    dst = np.zeros(64, dtype=np.uint8)
    rdst = init.register(dst)
    live = [init.connect(f"{_spread(i)}:{port}") for i in range(MAX_PEERS - 1)]
    old = make_engine(name="other/0", streams=1)
    address = old.address
    old.register(np.zeros(64, dtype=np.uint8), Access.READ)
    peer = init.connect(address)
    assert init.stats()["peers"] == MAX_PEERS
    old.close()
    new = make_engine(name="other/1", streams=1, listen=address)
    new.register(np.full(64, 7, dtype=np.uint8), Access.READ)
    deadline = time.monotonic() + 10
    while True:
        try:
            init.read(peer, rdst, [0], region, [0], 64).wait()
            raise AssertionError("the retired peer read the new process")
        except PeerChanged:
            break
        except PeerClosed:
            assert time.monotonic() < deadline
    fresh = init.connect(address)
    init.read(fresh, rdst, [0], region, [0], 64).wait()
    assert (dst == 7).all()
    assert init.stats()["peers_freed"] == 1, "a live peer was closed while a retired one held its slot"
    for p in live:
        init.read(p, rdst, [0], region, [0], 64).wait()
    assert (dst == 9).all()


def test_a_peer_closed_between_connect_and_its_first_question_is_connected_again(make_engine, monkeypatch):
    """Under churn with the table full, another thread's connect may close the peer a connect just got (the
    only idle one) before it asks the peer's name or same-host state: the connect tries again instead of
    failing UnknownPeer. (Driven here by making the first question fail; a stress run reproduced the race.)"""
    from kvlink import _binding as B
    from kvlink.errors import UnknownPeer
    from tests.fakes import failing_once

    target = make_engine(name="target")
    init = make_engine(name="decode", listen=None)
    flaky, calls = failing_once(B.peer_local, UnknownPeer("peer same-host state: peer 0 was closed (idle)"))
    monkeypatch.setattr(B, "peer_local", flaky)
    peer = init.connect(target.address)
    assert len(calls) == 2 and peer.name == "target"


def test_a_connect_for_a_named_engine_takes_no_other(make_engine):
    """``connect(address, expect=name)``: the engine answering there must be that one. Another name fails
    PeerChanged naming both and keeps nothing (decode's first contact with a registration whose address
    another process took: its region ids name other memory there)."""
    from kvlink.errors import PeerChanged

    target = make_engine(name="prefill/a")
    init = make_engine(name="decode", listen=None)
    with pytest.raises(PeerChanged, match='answers as engine "prefill/a", not "prefill/b"'):
        init.connect(target.address, expect="prefill/b")
    assert init.stats()["peers"] == 0  # nothing kept of the refused connect
    peer = init.connect(target.address, expect="prefill/a")
    assert peer.name == "prefill/a" and init.connect(target.address).id == peer.id
    with pytest.raises(PeerChanged, match="not \"prefill/b\""):  # a live peer under another name is not returned
        init.connect(target.address, expect="prefill/b")
    assert init.connect(target.address, expect="prefill/a").id == peer.id  # and was not retired for it
    for bad in ("", "x" * 65, "caf\u00e9", 7):
        with pytest.raises(ValueError, match="expect"):
            init.connect(target.address, expect=bad)


def test_a_named_connect_retires_the_peer_of_a_process_gone_from_the_address(make_engine):
    """A peer's process died and another took its address: the table still holds the old peer (nothing told
    it). A connect for the new engine's name asks the address, retires the old peer (its id fails
    PeerChanged) and reads the new process; one for the old name is refused from then on (before, it got the
    table's peer, whose first READ hears the new name and fails: no byte of the new process is read)."""
    from kvlink.errors import PeerChanged

    init = make_engine(name="decode", listen=None, streams=2)
    dst = np.zeros(4096, dtype=np.uint8)
    rdst = init.register(dst)
    first = make_engine(name="prefill/1")
    address = first.address
    region = first.register(np.full(4096, 1, dtype=np.uint8), Access.READ).id
    old = init.connect(address)
    init.read(old, rdst, [0], region, [0], 4096).wait()
    first.close()
    second = make_engine(name="prefill/2", listen=address)
    assert second.register(np.full(4096, 2, dtype=np.uint8), Access.READ).id == region
    assert init.connect(address).id == old.id  # unnamed: the table's peer, as before
    assert init.connect(address, expect="prefill/1").id == old.id  # its name: the same
    new = init.connect(address, expect="prefill/2")
    assert new.id != old.id and new.name == "prefill/2"
    with pytest.raises(PeerChanged, match='answers as engine "prefill/2", not "prefill/1"'):
        init.connect(address, expect="prefill/1")
    init.read(new, rdst, [0], region, [0], 4096).wait()
    assert (dst == 2).all()
    dst[:] = 0
    with pytest.raises(PeerChanged):
        init.read(old, rdst, [0], region, [0], 4096).wait()
    assert not dst.any()
    assert init.connect(address).id == new.id  # the retired peer is never handed out again


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_a_connect_that_heard_an_engine_before_the_one_in_the_table_retires_nothing(make_engine, named):
    """Two connects to one address while its engine changes: the slow one heard engine A on its first
    stream, then waited for its second; meanwhile the address went to engine B and a second connect put B's
    peer in the table. When the slow one finishes, B is the newer answer: B's peer stays and works, and the
    slow connect fails PeerChanged if it wanted A, or (any engine will do) connects again and gets B's peer.
    Before, the slow connect retired B's live peer."""
    import threading

    from kvlink.errors import PeerChanged
    from tests.relay import Relay

    a, b = make_engine(name="prefill/A"), make_engine(name="prefill/B")
    src = np.full(4096, 7, dtype=np.uint8)
    region = b.register(src, Access.READ).id
    init = make_engine(name="decode", listen=None, streams=2, same_host="off", handshake_timeout_s=30.0)
    dst = np.zeros(4096, dtype=np.uint8)
    rdst = init.register(dst)
    relay = Relay(a.address)
    try:
        release = relay.hold_next(skip=1)  # the slow connect's second stream
        slow: dict = {}

        def connect_slowly():
            try:
                slow["peer"] = init.connect(relay.address, expect="prefill/A" if named else None)
            except Exception as e:  # noqa: BLE001 - the test checks what it was
                slow["error"] = e

        t = threading.Thread(target=connect_slowly)
        t.start()
        deadline = time.monotonic() + 10
        while relay._accepted < 2:  # its first stream heard A, its second waits for A's answer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        relay.retarget(b.address)
        peer_b = init.connect(relay.address, expect="prefill/B")
        release.set()
        t.join(30)
        assert not t.is_alive()
        if named:
            assert isinstance(slow.get("error"), PeerChanged), slow
            assert 'answered as engine "prefill/A", then "prefill/B"' in str(slow["error"])
        else:
            assert slow.get("peer") is not None and slow["peer"].id == peer_b.id, slow
        init.read(peer_b, rdst, [0], region, [0], 4096).wait()  # B's peer was not retired
        assert (dst == 7).all()
        assert init.stats()["peers"] == 1
    finally:
        relay.close()


def test_a_named_connect_answered_by_a_third_engine_still_retires_the_stale_peer(make_engine):
    """The table's peer is of a process gone from the address, the address answers as another engine, and
    the connect wanted a third: refused, and the stale peer is retired all the same (an unnamed connect
    then gets the engine that answers, not the stale peer)."""
    from kvlink.errors import PeerChanged

    init = make_engine(name="decode", listen=None, streams=1)
    first = make_engine(name="prefill/Y", streams=1)
    address = first.address
    stale = init.connect(address)
    first.close()
    make_engine(name="prefill/X", streams=1, listen=address)
    with pytest.raises(PeerChanged, match='answers as engine "prefill/X", not "prefill/Z"'):
        init.connect(address, expect="prefill/Z")
    now = init.connect(address)
    assert now.id != stale.id and now.name == "prefill/X"


def test_the_c_connect_refuses_an_expected_name_it_cannot_carry(make_engine):
    from kvlink import _binding as B
    from kvlink.errors import InvalidArgument

    target = make_engine(name="t")
    init = make_engine(name="decode", listen=None)
    host, port = target.address.rsplit(":", 1)
    with init._using() as h:
        for bad in ("", "x" * 65):
            with pytest.raises(InvalidArgument):
                B.peer_connect(h, host, int(port), bad)
        assert B.peer_name(h, B.peer_connect(h, host, int(port), "t")) == "t"


def test_by_default_a_decode_rank_holds_over_a_thousand_peers_and_a_prefill_rank_serves_them(make_engine):
    """The defaults: a requester's table holds 1,024 peers and a responder serves 4,096 connections. Before,
    256 each: the 257th prefill rank one decode rank read closed a peer, and the 257th connection to one
    prefill rank (128 decode ranks of two streams) was refused. 260 peers at once here (one stream each: 520
    descriptors, within a 1,024 ulimit), none closed, all served."""
    from kvlink.transport import EngineConfig

    assert (EngineConfig().max_peers, EngineConfig().max_conns) == (1024, 4096)
    target = make_engine(name="prefill", listen="0.0.0.0:0")
    port = target.address.rsplit(":", 1)[1]
    region = target.register(np.full(64, 5, dtype=np.uint8), Access.READ).id
    init = make_engine(name="decode", listen=None, streams=1)
    dst = np.zeros(64, dtype=np.uint8)
    rdst = init.register(dst)
    peers = [init.connect(f"{_spread(i)}:{port}") for i in range(260)]
    for p in (peers[0], peers[-1]):
        init.read(p, rdst, [0], region, [0], 64).wait()
    assert (dst == 5).all()
    assert init.stats()["peers"] == 260 and init.stats()["peers_freed"] == 0
    assert target.stats()["server_conns"] == 260 and target.stats()["conns_rejected"] == 0


def test_the_table_size_is_validated():
    from kvlink.transport import EngineConfig

    for bad in (0, 4097, True, 2.0):
        with pytest.raises(ValueError, match="max_peers must be 1..4096"):
            EngineConfig(max_peers=bad)
    assert EngineConfig(max_peers=4096).max_peers == 4096


def test_an_engine_whose_limits_outgrow_the_descriptor_limit_says_so(make_engine, monkeypatch, caplog):
    """Serving 4,096 connections and keeping 1,024 peers needs more descriptors than a default ``ulimit -n``
    of 1,024: the engine warns at creation, naming both numbers (it leaves the process's limit alone: an
    embedding program owns it), and says nothing when its limits fit."""
    import logging
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 1024))
    with caplog.at_level(logging.WARNING, logger="kvlink.transport.engine"):
        make_engine(name="big")
        make_engine(name="small", max_conns=256, max_peers=128, streams=2)
    said = [r.getMessage() for r in caplog.records if "RLIMIT_NOFILE" in r.getMessage()]
    assert len(said) == 1 and "'big'" in said[0] and "6400" in said[0] and "1024" in said[0], said


def _until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_peer_whose_process_ended_is_stale_before_any_batch_is_sent(make_engine):
    """``peer_stale``: a kept peer whose process ended (it closed the connections) says so without a batch,
    so a caller that keeps peers connects anew, naming the engine it expects now, instead of failing a
    batch on the old name. A live idle peer is not stale; a retired one stays stale."""
    old = make_engine(name="prefill/tp0/aaaa")
    address = old.address
    region = old.register(np.full(4096, 1, dtype=np.uint8), Access.READ).id
    init = make_engine(name="decode", listen=None)
    dst = np.zeros(4096, dtype=np.uint8)
    rdst = init.register(dst)
    peer = init.connect(address)
    init.read(peer, rdst, [0], region, [0], 4096).wait()
    time.sleep(0.3)
    assert not init.peer_stale(peer)  # idle, its process alive: kept
    s = init.stats()
    batches = s["batches_ok"] + s["batches_failed"]
    old.close()
    assert _until(lambda: init.peer_stale(peer)), "the ended process's peer never read stale"
    s = init.stats()
    assert s["batches_ok"] + s["batches_failed"] == batches  # told without a batch
    new = make_engine(name="prefill/tp0/bbbb", listen=address)
    assert new.register(np.full(4096, 2, dtype=np.uint8), Access.READ).id == region
    fresh = init.connect(address, expect="prefill/tp0/bbbb")
    assert fresh.id != peer.id and not init.peer_stale(fresh)
    init.read(fresh, rdst, [0], region, [0], 4096).wait()
    assert (dst == 2).all()
    assert init.peer_stale(peer)  # retired for good


def test_a_connection_the_path_dropped_makes_the_peer_stale_and_the_same_engine_connects_again(make_engine):
    """A middlebox drops the idle connections of a live engine: the peer reads stale, a connect naming the
    same engine answers, and reads go on."""
    from tests.relay import Relay

    target = make_engine(name="prefill/tp0/aaaa")
    region = target.register(np.full(4096, 3, dtype=np.uint8), Access.READ).id
    relay = Relay(target.address)
    try:
        init = make_engine(name="decode", listen=None)
        dst = np.zeros(4096, dtype=np.uint8)
        rdst = init.register(dst)
        peer = init.connect(relay.address)
        assert not init.peer_stale(peer)
        relay.drop()
        assert _until(lambda: init.peer_stale(peer)), "the dropped connections never read stale"
        again = init.connect(relay.address, expect="prefill/tp0/aaaa")
        assert again.id == peer.id  # the same engine: its peer, not a new one
        for _ in range(init.config.streams):  # one-part batches take the streams in turn: each reopens
            dst[:] = 0
            init.read(again, rdst, [0], region, [0], 4096).wait()
            assert (dst == 3).all()
        assert not init.peer_stale(peer)
    finally:
        relay.close()
