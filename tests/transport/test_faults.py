"""Dead, stalled and slow peers; cancel, timeout and close with batches in
flight; unregistering while peers access a region."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvlink.errors import Canceled, Closed, KVLinkError, PeerClosed, TimeoutError_, UnknownRegion
from kvlink.transport import Access
from tests.fakes import SlowTarget

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `-m tests.fakes` runs here


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def started_receiving(dst: np.ndarray, fill: int = 0xAB, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not (dst == fill).any():
        assert time.monotonic() < deadline, "the slow peer never started sending"
        time.sleep(0.01)


def test_peer_killed_mid_batch_fails_within_timeout(make_engine):
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakes", "kvlink-test-token"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        init = make_engine(name="i", listen=None, op_timeout_s=20)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        rdst = init.register(dst)
        peer = init.connect(address)
        b = init.read(peer, rdst, [0], 1, [0], dst.nbytes)
        started_receiving(dst)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerClosed, match="receiving"):
            b.wait()
        assert time.monotonic() - t0 < 20  # well within the batch's timeout, not at it
    finally:
        proc.kill()
        proc.wait()


def test_stalled_peer_times_out_and_others_are_still_served(make_engine, pair):
    p = pair()
    stalled = SlowTarget(token=b"kvlink-test-token", stall=True)
    try:
        dst = np.zeros(4096, dtype=np.uint8)
        r = p.init.register(dst)
        sp = p.init.connect(stalled.address)
        b = p.init.read(sp, r, [0], 1, [0], 4096, timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError_):
            b.wait()
        assert time.monotonic() - t0 < 5
        # the healthy peer is unaffected
        p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096).wait()
        assert np.array_equal(p.dst[:4096], p.src[:4096])
    finally:
        stalled.close()


@pytest.mark.parametrize("how", ["cancel", "wait-timeout"])
def test_no_late_write_after_cancel_or_timeout(make_engine, how):
    """Fill the destination after cancel/timeout returns and check that it stays
    intact while the peer keeps sending."""
    slow = SlowTarget(token=b"kvlink-test-token", chunk=2048, interval=0.002)
    try:
        init = make_engine(name="i", listen=None, streams=1)
        dst = np.zeros(4 << 20, dtype=np.uint8)
        rdst = init.register(dst)
        peer = init.connect(slow.address)
        b = init.read(peer, rdst, [0], 1, [0], dst.nbytes)
        started_receiving(dst)
        if how == "cancel":
            b.cancel()
            with pytest.raises(Canceled):
                b.wait()
        else:
            with pytest.raises(TimeoutError_, match="canceled"):
                b.wait(timeout_s=0.2)
        dst[:] = 0x11  # the decode side reuses the blocks at once
        sent = slow.sent_after_request
        time.sleep(0.5)
        assert (dst == 0x11).all()
        assert slow.sent_after_request >= sent  # the peer was still trying
        # and the stream is usable again (a fresh connection)
        b2 = init.read(peer, rdst, [0], 1, [0], 4096)
        b2.wait(timeout_s=10)
        assert (dst[:4096] == 0xAB).all()
    finally:
        slow.close()


def test_close_with_batches_in_flight_neither_hangs_nor_leaks(make_engine):
    base = threads()
    slow = SlowTarget(token=b"kvlink-test-token", stall=True)
    try:
        from kvlink.transport import Engine, EngineConfig

        init = Engine(EngineConfig(name="i", listen=None, token=b"kvlink-test-token", streams=4))
        dst = np.zeros(1 << 20, dtype=np.uint8)
        rdst = init.register(dst)
        peer = init.connect(slow.address)
        batches = [init.read(peer, rdst, [i * 4096], 1, [0], 4096) for i in range(16)]
        assert threads() >= base + 4
        t0 = time.monotonic()
        init.close()
        assert time.monotonic() - t0 < 5
        for b in batches:
            with pytest.raises((Closed, PeerClosed, Canceled)):
                b.wait()
        slow.close()  # and the fake's own threads end
        deadline = time.monotonic() + 5
        while threads() > base and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threads() <= base  # every engine thread was joined (earlier tests' threads may end meanwhile)
        with pytest.raises(Closed):
            init.read(peer, rdst, [0], 1, [0], 16)
    finally:
        slow.close()


def test_unregister_during_remote_writes(pair):
    """Once unregister returns, no peer touches that memory again."""
    p = pair()
    sink = np.zeros(8 << 20, dtype=np.uint8)
    region = p.target.register(sink, Access.WRITE)
    src = np.full(8 << 20, 0x5A, dtype=np.uint8)
    rsrc = p.init.register(src)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            try:
                p.init.write(p.peer, rsrc, [0], region.id, [0], src.nbytes).wait()
            except KVLinkError as e:
                errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.2)
    region.unregister(timeout_s=10)
    sink[:] = 0x22
    time.sleep(0.3)
    stop.set()
    t.join(timeout=30)
    assert not t.is_alive()
    assert (sink == 0x22).all()
    assert any(isinstance(e, UnknownRegion) for e in errors)


def test_unregister_waits_for_reads_in_flight(pair):
    p = pair(size=32 << 20)
    done = []
    b = p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 32 << 20)
    p.rsrc.unregister(timeout_s=10)  # returns after the peer's read finished (or failed)
    try:
        b.wait()
        done.append("ok")
    except UnknownRegion:
        done.append("refused")
    assert done
    with pytest.raises(UnknownRegion):
        p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 16).wait()


def test_close_while_a_waiter_runs_its_own_small_read_returns(make_engine):
    """A waiter that runs its one-part batch itself marks the stream busy; close waits for it, and must be
    woken when that part ends (the queue is empty then), not hang in the stream's join."""
    from tests.relay import Relay

    target = make_engine(name="target")
    src = np.full(64 * 1024, 3, dtype=np.uint8)
    rsrc = target.register(src, Access.READ)
    relay = Relay(target.address, rate=32_000)  # 64 KiB: 2 s
    try:
        init = make_engine(name="init", listen=None, streams=1)
        dst = np.zeros_like(src)
        rdst = init.register(dst)
        peer = init.connect(relay.address)
        closed, inline = threading.Event(), []

        def close_soon():
            time.sleep(0.5)
            inline.append(init.stats()["parts_inline"])
            init.close()
            closed.set()

        closer = threading.Thread(target=close_soon, daemon=True)
        closer.start()
        b = init.read(peer, rdst, [0], rsrc.id, [0], src.nbytes)
        with pytest.raises(KVLinkError):
            b.wait()  # runs the part on this thread: the stream worker sees it busy
        assert inline == [1], "the waiter did not run its part itself: nothing was tested"
        assert closed.wait(15), "engine close hung after the waiter's part ended"
    finally:
        relay.close()


@pytest.mark.parametrize("same_name", [True, False])
def test_a_restarted_peer_at_the_same_address_is_refused_unless_it_is_the_same_engine(make_engine, same_name):
    """The target's process restarts at the same address and registers its memory again: the same region
    id now names other bytes. A peer that reconnects and hears another engine name (kvlink's workers put
    their process instance in it) refuses it (PeerChanged) and reads nothing; the same name reconnects, as
    a connection dropped by the network does."""
    from kvlink.errors import PeerChanged

    old = make_engine(name="prefill/tp0/aaaa")
    host, port = old.address.rsplit(":", 1)
    src_old = np.full(4096, 1, dtype=np.uint8)
    region = old.register(src_old, Access.READ).id
    init = make_engine(name="decode", listen=None)
    dst = np.zeros(4096, dtype=np.uint8)
    rdst = init.register(dst)
    peer = init.connect(old.address)
    init.read(peer, rdst, [0], region, [0], 4096).wait()
    assert (dst == 1).all()
    old.close()
    new = make_engine(name="prefill/tp0/aaaa" if same_name else "prefill/tp0/bbbb", listen=f"{host}:{port}")
    src_new = np.full(4096, 2, dtype=np.uint8)
    assert new.register(src_new, Access.READ).id == region  # the same id, another process's memory
    dst[:] = 0
    deadline = time.monotonic() + 10
    while True:  # the first batch may meet the old, closed connection
        try:
            init.read(peer, rdst, [0], region, [0], 4096).wait()
            break
        except PeerChanged as e:
            assert not same_name
            assert "prefill/tp0/bbbb" in str(e) and "prefill/tp0/aaaa" in str(e)
            assert not dst.any()  # nothing read
            with pytest.raises(PeerChanged):  # the old peer stays retired: no batch on it reads the new engine
                init.read(peer, rdst, [0], region, [0], 4096).wait()
            fresh = init.connect(f"{host}:{port}")  # a new connect is a new peer, named for the new engine
            assert fresh.id != peer.id and fresh.name == "prefill/tp0/bbbb"
            init.read(fresh, rdst, [0], region, [0], 4096).wait()
            assert (dst == 2).all()
            return
        except PeerClosed:
            assert time.monotonic() < deadline
    assert same_name and (dst == 2).all()


def _connect_aside(init, silent) -> tuple:
    """A thread connecting ``init`` to a listener that never answers; (the thread, its errors), 0.3 s in."""
    import threading
    import time

    from kvlink.errors import KVLinkError

    errors = []

    def connect():
        try:
            init.connect(f"127.0.0.1:{silent.getsockname()[1]}")
        except KVLinkError as e:
            errors.append(e)

    t = threading.Thread(target=connect)
    t.start()
    time.sleep(0.3)
    return t, errors


def test_a_silent_peer_delays_only_its_own_connect(make_engine):
    """A peer that accepts and never says a word holds its connect up to the handshake timeout (per stream);
    a connect to a healthy peer meanwhile goes through at once, and two concurrent connects to one address
    end with one peer."""
    import socket
    import threading
    import time

    silent = socket.create_server(("127.0.0.1", 0), backlog=16)
    good = make_engine(name="good")
    init = make_engine(name="i", listen=None, streams=4, handshake_timeout_s=3.0)
    t, failed = _connect_aside(init, silent)  # waiting for its handshake
    t0 = time.monotonic()
    peers = []
    both = [threading.Thread(target=lambda: peers.append(init.connect(good.address))) for _ in range(2)]
    for th in both:
        th.start()
    for th in both:
        th.join(10)
    assert time.monotonic() - t0 < 2.0
    assert len(peers) == 2 and peers[0].id == peers[1].id
    t.join(30)
    assert failed  # the silent one timed out
    silent.close()


@pytest.mark.parametrize("stage", ["handshake", "tcp-connect"])
def test_close_while_another_thread_connects_waits_for_it_and_frees_nothing_under_it(make_engine, stage):
    """close() from one thread while another is inside a connect (a silent peer holds its handshake): the
    connect is told to give up, close waits for it, then frees the engine; no call runs on freed memory
    (it used to: a crash at shutdown). Calls after close raise Closed."""
    import socket
    import time

    from kvlink.errors import Closed

    silent = socket.create_server(("127.0.0.1", 0), backlog=16 if stage == "handshake" else 0)
    fill = []
    if stage == "tcp-connect":  # a full backlog: the TCP connect itself waits (connect_timeout)
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(silent.getsockname())
            except BlockingIOError:
                pass
            fill.append(c)
        time.sleep(0.2)
    init = make_engine(name="i", listen=None, streams=2, handshake_timeout_s=5.0, connect_timeout_s=5.0)
    t, errors = _connect_aside(init, silent)
    t0 = time.monotonic()
    init.close()
    assert time.monotonic() - t0 < 3.0  # told to give up, not waited out (5 s)
    t.join(10)
    assert not t.is_alive() and errors
    with pytest.raises(Closed):
        init.stats()
    for c in fill:
        c.close()
    silent.close()


def test_a_read_submitted_while_the_engine_closes_fails_instead_of_stranding(make_engine):
    """A READ whose submit passed the engine's closing check as the close began (its descriptors still being
    built, in C): the stream thread, idle, had already exited on the close, and the part was queued where no
    thread would run or fail it; after the engine was freed its wait timed out, or read the freed peer. Such
    a READ now fails Closed as it is queued. Driven through the binding, as Engine.close does (stop, then
    destroy), so that the window is the C build of 2M descriptors and close lands in it."""
    from kvlink import _binding as B
    from tests.conftest import TOKEN

    n = 2_000_000
    target = make_engine(name="target")
    region = target.register(np.full(n, 7, dtype=np.uint8), Access.READ).id
    host, port = target.address.rsplit(":", 1)
    dst = np.zeros(n, dtype=np.uint8)
    offsets = np.arange(n, dtype=np.uint64)
    local = offsets + np.uint64(dst.ctypes.data)
    regions, lengths = np.array([region], dtype=np.uint32), np.array([1], dtype=np.uint64)
    overlapped = 0
    for attempt in range(80):
        if overlapped >= 3:
            break
        h = B.engine_create(listen_host=None, listen_port=0, token=TOKEN, name="init", streams=1, crc=False,
                            allow_insecure=False, op_timeout_ms=10_000, connect_timeout_ms=5_000,
                            handshake_timeout_ms=5_000, max_conns=64, same_host=0, max_peers=8)
        reg = B.region_register(h, dst.ctypes.data, dst.nbytes, int(Access.READ | Access.WRITE))
        peer = B.peer_connect(h, host, int(port))
        B.batch_wait(B.submit(h, peer, B.OP_READ, local[:16], regions, offsets[:16], lengths, 5_000), 5_000)
        box: dict = {}  # (the stream ran a part just now: it lingers, and sees the close at once)

        def submit():
            try:
                box["batch"] = B.submit(h, peer, B.OP_READ, local, regions, offsets, lengths, 60_000)
            except Closed:
                pass  # refused at its start: no overlap this time

        t = threading.Thread(target=submit)
        t.start()
        time.sleep(0.0005 * (1 + attempt % 16))
        B.engine_stop(h)
        t.join(60)
        B.engine_destroy(h)  # joins the stream threads: they fail whatever is queued
        del reg
        batch = box.get("batch")
        if batch is None:
            continue
        try:
            done = B.batch_poll(batch)
        except KVLinkError:
            done = True
        assert done, "a READ submitted as the engine closed was queued where nothing runs or fails it"
        try:
            B.batch_wait(batch, 1_000)
        except Closed:
            overlapped += 1  # the close reached it before it ran: failed, not stranded
        finally:
            B.batch_release(batch)
    assert overlapped, "no submit overlapped the close: nothing was tested"


def test_a_connection_closed_while_idle_is_reopened_for_the_next_read(make_engine):
    """A peer's connection closed between requests (the other side restarted its listener's connections, a
    middlebox or keepalive dropped it): the next READ opens a new connection to the same engine instead of
    failing on the dead one. A connection dropped while a READ is on it still fails that READ (above)."""
    from tests.relay import Relay

    target = make_engine(name="target")
    src = np.random.default_rng(9).integers(0, 256, 4 << 20, dtype=np.uint8)
    region = target.register(src, Access.READ).id
    relay = Relay(target.address)
    try:
        init = make_engine(name="init", listen=None, streams=2)
        dst = np.zeros_like(src)
        rdst = init.register(dst)
        peer = init.connect(relay.address)
        init.read(peer, rdst, [0], region, [0], src.nbytes).wait()
        for _ in range(3):
            relay.drop()
            time.sleep(0.2)  # the close reaches the engine's end of each stream
            dst[:] = 0
            # 4 MiB: striped over both streams, by their threads; then a small READ the waiter runs itself
            init.read(peer, rdst, [0], region, [0], src.nbytes).wait()
            init.read(peer, rdst, [0], region, [0], 4096).wait()
            assert (dst == src).all()
        assert init.stats()["batches_failed"] == 0
    finally:
        relay.close()
