"""The backend contract against Mooncake's transfer engine, side by side with
the native engine where the behaviour must be the same: READ/WRITE on random
shapes, bounds and access refused, unknown regions, notifications, timeouts,
cancel (no late writes), close, and the side channel's authentication."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from kvlink.backends import MooncakeConfig, open_backend
from kvlink.errors import (AccessDenied, AuthError, Canceled, Closed, KVLinkError, OutOfRange, ProtocolError,
                           TimeoutError_, UnknownRegion)
from kvlink.transport import Access, Backend, EngineConfig, Unsupported


def submit_and_wait(fn, *a, **kw):
    """Errors may come at submit (Mooncake checks locally) or at wait (native remote checks)."""
    fn(*a, **kw).wait()


def random_descs(rng, size: int, count: int, max_len: int):
    """Non-overlapping destination ranges, any source ranges, inside both buffers."""
    out, used = [], np.zeros(size, dtype=bool)
    while len(out) < count:
        n = int(rng.integers(1, max_len))
        r, l = int(rng.integers(0, size - n)), int(rng.integers(0, size - n))
        if not used[l:l + n].any():
            used[l:l + n] = True
            out.append((r, l, n))
    return (np.array([d[0] for d in out], dtype=np.uint64), np.array([d[1] for d in out], dtype=np.uint64),
            np.array([d[2] for d in out], dtype=np.uint64))


def check_copied(dst, src, dst_offs, src_offs, lens):
    for a, b, n in zip(dst_offs.tolist(), src_offs.tolist(), lens.tolist()):
        assert np.array_equal(dst[a:a + n], src[b:b + n]), f"block at {a} (from {b}, {n} B) differs"


# -- the contract -------------------------------------------------------------------------------
def test_kind_capabilities_and_protocol(make_backend):
    b = make_backend("mooncake")
    assert isinstance(b, Backend)
    assert b.kind == "mooncake"
    caps = b.capabilities
    assert caps.read and caps.write and caps.notify and caps.network
    assert not caps.cancel and not caps.crc and not caps.same_host  # stated, not faked
    assert b.address.startswith("127.0.0.1:")


def test_what_mooncake_cannot_do_is_refused():
    with pytest.raises(Unsupported):
        open_backend("mooncake", EngineConfig(crc=True), MooncakeConfig())
    with pytest.raises(Unsupported):
        open_backend("mooncake", EngineConfig(same_host="require"), MooncakeConfig())


# -- configuration -----------------------------------------------------------------------------
def test_config_validated_naming_the_field():
    assert MooncakeConfig().protocol == "tcp"
    assert MooncakeConfig(protocol="rdma").protocol == "rdma"  # passed through to Mooncake
    for field, bad in (("protocol", "tcp; rm"), ("max_queued", 1), ("max_queued", True), ("settle_s", 0),
                       ("transfer_timeout_s", 4), ("transfer_timeout_s", 30.5), ("host", ""), ("host", "a b"),
                       ("device", "mlx\n")):
        with pytest.raises(ValueError, match=field):
            MooncakeConfig(**{field: bad})


def test_config_from_the_environment():
    env = {"KVLINK_MOONCAKE_PROTOCOL": "rdma", "KVLINK_MOONCAKE_DEVICE": "mlx5_0", "KVLINK_MOONCAKE_HOST": "10.0.0.2",
           "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "64", "MC_TRANSFER_TIMEOUT": "60"}
    assert MooncakeConfig.from_env(env) == MooncakeConfig(protocol="rdma", device="mlx5_0", host="10.0.0.2",
                                                          max_queued=64, transfer_timeout_s=60)
    assert MooncakeConfig.from_env({}) == MooncakeConfig()
    with pytest.raises(ValueError, match="MC_TRANSFER_TIMEOUT='soon' is not a whole number"):
        MooncakeConfig.from_env({"MC_TRANSFER_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="environment: transfer_timeout_s"):
        MooncakeConfig.from_env({"MC_TRANSFER_TIMEOUT": "2"})


def test_opened_by_name_the_environment_is_read_once(monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "45")
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "512")
    b = open_backend("mooncake", EngineConfig(token=b"t" * 16, name="by-name"))
    try:
        assert b.mooncake == MooncakeConfig(max_queued=512, transfer_timeout_s=45)
    finally:
        b.close()


def test_config_reaches_mooncake(make_pair, monkeypatch):
    """max_queued and transfer_timeout_s are exported to Mooncake at construction: batches are cut in chunks
    of max_queued / 2, and Mooncake (which reads its environment then) accepts them."""
    for var in ("MC_TRANSFER_TIMEOUT", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"):
        monkeypatch.delenv(var, raising=False)  # restored after the test
    p = make_pair("mooncake", options=MooncakeConfig(max_queued=64, transfer_timeout_s=7))
    assert os.environ["MC_TRANSFER_TIMEOUT"] == "7" and os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "64"
    offs = np.arange(100, dtype=np.uint64) * 4096
    p.init.read(p.peer, p.rdst, offs, p.rsrc.id, offs, 4096).wait()
    check_copied(p.dst, p.src, offs, offs, np.full(100, 4096, dtype=np.uint64))
    assert p.init.stats()["chunks"] == 4  # 32 + 32 + 32 + 4


# -- data paths, same checks on both backends --------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_read_random_shapes(make_pair, kind, seed):
    p = make_pair(kind)
    rng = np.random.default_rng(seed)
    count = [1, 700, 1500][seed - 1]  # 1500 crosses Mooncake's chunk boundary (512) twice
    r, lo, n = random_descs(rng, p.src.nbytes, count, 9000)
    b = p.init.read(p.peer, p.rdst, lo, p.rsrc.id, r, n)
    b.wait()
    assert b.poll() and b.nbytes == int(n.sum())
    check_copied(p.dst, p.src, lo, r, n)
    untouched = np.ones(p.dst.nbytes, dtype=bool)
    for a, k in zip(lo.tolist(), n.tolist()):
        untouched[a:a + k] = False
    assert not p.dst[untouched].any(), "bytes outside the descriptors were written"


@pytest.mark.parametrize("seed", [4, 5])
def test_write_random_shapes(make_pair, kind, seed):
    p = make_pair(kind)
    rng = np.random.default_rng(seed)
    p.dst[:] = rng.integers(0, 256, p.dst.nbytes, dtype=np.uint8)  # the initiator's data to push
    before = p.src.copy()
    r, lo, n = random_descs(rng, p.src.nbytes, 600, 20000)  # r: non-overlapping targets
    p.init.write(p.peer, p.rdst, r, p.rsrc.id, lo, n).wait()
    check_copied(p.src, p.dst, lo, r, n)
    untouched = np.ones(p.src.nbytes, dtype=bool)
    for a, k in zip(lo.tolist(), n.tolist()):
        untouched[a:a + k] = False
    assert np.array_equal(p.src[untouched], before[untouched])


def test_several_remote_regions_in_one_batch(make_pair, kind):
    p = make_pair(kind)
    other = np.arange(1 << 16, dtype=np.uint8)
    r2 = p.target.register(other, Access.READ)  # registered after connect: found through a table refresh
    regs = np.array([p.rsrc.id, r2.id] * 4, dtype=np.uint32)
    offs = np.arange(8, dtype=np.uint64) * 4096
    p.init.read(p.peer, p.rdst, offs, regs, offs, 4096).wait()
    for k in range(8):
        src = p.src if k % 2 == 0 else other
        assert np.array_equal(p.dst[k * 4096:(k + 1) * 4096], src[k * 4096:(k + 1) * 4096])


def test_one_large_descriptor(make_pair, kind):
    p = make_pair(kind, size=32 << 20)
    p.init.read(p.peer, p.rdst, 0, p.rsrc.id, 0, p.src.nbytes).wait()
    assert np.array_equal(p.dst, p.src)


# -- refused before anything moves --------------------------------------------------------------
def test_bounds_refused(make_pair, kind):
    p = make_pair(kind)
    size = p.src.nbytes
    for lo, ro, n in ([0], [size - 10], 4096), ([0], [size], 1):
        with pytest.raises(OutOfRange):
            submit_and_wait(p.init.read, p.peer, p.rdst, lo, p.rsrc.id, ro, n)
    for lo, ro, n in ([0], [2**64 - 1], 2), ([0], [0], size + 1):  # overflow: the native engine says EINVAL
        with pytest.raises(ValueError):
            submit_and_wait(p.init.read, p.peer, p.rdst, lo, p.rsrc.id, ro, n)
    with pytest.raises(ValueError):  # local bounds (OutOfRange on Mooncake, a ValueError too)
        submit_and_wait(p.init.read, p.peer, p.rdst, [size - 10], p.rsrc.id, [0], 4096)
    assert not p.dst.any()


def test_access_flags_refused(make_pair, make_backend, kind):
    p = make_pair(kind)
    ro = p.target.register(np.ones(1 << 16, dtype=np.uint8), Access.READ)
    hidden = p.target.register(np.ones(1 << 16, dtype=np.uint8), Access.NONE)
    with pytest.raises(AccessDenied):
        submit_and_wait(p.init.write, p.peer, p.rdst, [0], ro.id, [0], 4096)
    with pytest.raises(AccessDenied):
        submit_and_wait(p.init.read, p.peer, p.rdst, [0], hidden.id, [0], 4096)
    assert not p.dst.any()


def test_unknown_region_refused(make_pair, kind):
    p = make_pair(kind)
    with pytest.raises(UnknownRegion):
        submit_and_wait(p.init.read, p.peer, p.rdst, [0], p.rsrc.id ^ 0x5A5A, [0], 4096)


def test_no_remote_address_leaks_above_the_backend(make_pair):
    p = make_pair("mooncake")
    text = repr(p.peer) + repr(p.rsrc) + repr(p.init.stats())
    assert hex(p.rsrc.addr)[2:] not in text and str(p.rsrc.addr) not in text


# -- notifications -----------------------------------------------------------------------------
def test_notifications(make_pair, kind):
    p = make_pair(kind)
    for k in range(5):
        p.init.notify(p.peer, b"req-%d done" % k)
    deadline = time.monotonic() + 5
    got = []
    while len(got) < 5 and time.monotonic() < deadline:
        got += p.target.drain_notifications()
        time.sleep(0.01)
    assert got == [("initiator", b"req-%d done" % k) for k in range(5)]
    for bad in (b"", b"x" * 4097):
        with pytest.raises(ValueError):
            p.init.notify(p.peer, bad)


def test_notify_after_write_sees_the_data(make_pair):
    p = make_pair("mooncake")
    p.dst[:4096] = 0xAB
    p.init.write(p.peer, p.rdst, [0], p.rsrc.id, [8192], 4096).wait()
    p.init.notify(p.peer, b"written")
    assert p.target.drain_notifications() == [("initiator", b"written")]
    assert (p.src[8192:12288] == 0xAB).all()


# -- authentication of the side channel --------------------------------------------------------
def test_wrong_token_refused(make_pair, make_backend):
    p = make_pair("mooncake")
    intruder = make_backend("mooncake", name="intruder", listen=None, token=b"not-the-token")
    with pytest.raises(AuthError):
        intruder.connect(p.target.address)


def test_not_a_kvlink_peer_refused(make_backend):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve():
        c, _ = srv.accept()
        c.sendall(b"\x00\x00\x00\x05HELLO")
        time.sleep(0.5)
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    init = make_backend("mooncake", name="i", listen=None)
    with pytest.raises(ProtocolError):
        init.connect(f"127.0.0.1:{port}")
    t.join()
    srv.close()


def test_side_channel_frames_are_tagged():
    from kvlink.backends.sidechannel import Tagger, decode_table, encode_table

    a, b = Tagger(b"k" * 32), Tagger(b"k" * 32)
    f1, f2 = a.seal(b"T"), a.seal(b"Nhello")
    with pytest.raises(AuthError):  # replay of frame 1 where frame 2... is expected after it
        b.open(f1), b.open(f1)
    c = Tagger(b"k" * 32)
    with pytest.raises(AuthError):  # tampered
        c.open(f1[:-1] + b"X")
    assert Tagger(b"k" * 32).open(f1) == b"T"
    assert f2 != f1
    session, table = decode_table(encode_table("127.0.0.1:1234", [(7, 4096, 100, 1)]))
    assert session == "127.0.0.1:1234" and table == {7: (4096, 100, 1)}
    for bad in (b"{", b'{"session": "x", "regions": []}', b'{"session": "h:1", "regions": [[1, 2, 0, 1]]}',
                b'{"session": "h:1", "regions": [[1, -2, 5, 1]]}', b'{"session": "h:1", "regions": [[1, 2, 3]]}',
                b"[" * 100000):  # (nested beyond the parser's recursion: a ProtocolError too)
        with pytest.raises(ProtocolError):
            decode_table(bad)


def test_peer_names_on_the_side_channel_are_engine_names():
    from kvlink.backends.sidechannel import peer_name_of

    assert peer_name_of(b"decode-0") == "decode-0"
    for bad in (b"caf\xc3\xa9", b"a\nb", b"x" * 65, b"\xff\xfe"):
        with pytest.raises(ProtocolError, match="peer name"):
            peer_name_of(bad)


def test_sockets_trickling_their_handshake_do_not_keep_peers_out(make_backend):
    """Four unauthenticated sockets (max_conns 4) announce a 1 MiB AUTH frame and send it a byte every 0.5 s,
    under handshake_timeout_s (1 s) per byte: they held every slot for good and a peer holding the token was
    refused. Now a handshake ends at its deadline, at most a quarter of the slots wait in one, and the
    oldest is closed for a new connection."""
    import struct

    target = make_backend("mooncake", name="target", max_conns=4, handshake_timeout_s=1.0)
    host, port = target.address.rsplit(":", 1)
    socks, stop = [], threading.Event()
    for _ in range(4):
        c = socket.create_connection((host, int(port)))
        c.recv(4096)  # HELLO
        c.sendall(struct.pack(">I", 1 << 20))
        socks.append(c)

    def trickle():
        while not stop.is_set():
            for c in socks:
                try:
                    c.send(b"x")
                except OSError:
                    pass
            time.sleep(0.5)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        time.sleep(1.5)
        peer = make_backend("mooncake", name="init", listen=None).connect(target.address)
        assert peer.name == "target"
    finally:
        stop.set()
        t.join()
        for c in socks:
            c.close()


def test_a_listener_trickling_its_hello_is_cut_off_at_the_handshake_timeout(make_backend):
    import struct

    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        c, _ = srv.accept()
        c.sendall(struct.pack(">I", 39))
        while not stop.is_set():
            try:
                c.send(b"H")
            except OSError:
                return
            time.sleep(0.3)

    threading.Thread(target=serve, daemon=True).start()
    init = make_backend("mooncake", name="i", listen=None, handshake_timeout_s=1.0, connect_timeout_s=1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError_):
            init.connect(f"127.0.0.1:{srv.getsockname()[1]}")
        assert time.monotonic() - t0 < 5.0
    finally:
        stop.set()
        srv.close()


# -- timeouts and cancel -----------------------------------------------------------------------
def test_cancel_stops_and_nothing_lands_afterwards(make_pair):
    p = make_pair("mooncake", size=64 << 20)
    n = 16384
    offs = np.arange(n, dtype=np.uint64) * 4096
    b = p.init.read(p.peer, p.rdst, offs, p.rsrc.id, offs, 4096)
    assert b.cancel() is True  # this call stopped it
    assert b.settled
    assert b.cancel() is False  # already ended, by the first cancel
    snap = p.dst.copy()
    time.sleep(0.3)
    assert np.array_equal(snap, p.dst), "bytes landed after cancel returned"
    with pytest.raises(Canceled):
        b.poll()
    copied = sum(np.array_equal(p.dst[o:o + 4096], p.src[o:o + 4096]) for o in range(0, 64 << 20, 4096 * 64))
    assert copied < (64 << 20) // (4096 * 64), "cancel did not stop the batch early"
    assert p.init.stats()["canceled"] == 1


def test_cancel_of_a_finished_batch_leaves_its_outcome(make_pair, kind):
    p = make_pair(kind)
    b = p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096)
    b.wait()
    assert b.cancel() is False  # it had already ended: nothing stopped
    assert b.poll() and np.array_equal(p.dst[:4096], p.src[:4096])


def test_wait_timeout_cancels_and_settles(make_pair):
    p = make_pair("mooncake", size=64 << 20)
    offs = np.arange(16384, dtype=np.uint64) * 4096
    b = p.init.read(p.peer, p.rdst, offs, p.rsrc.id, offs, 4096)
    with pytest.raises(TimeoutError_):
        b.wait(0.001)
    snap = p.dst.copy()
    time.sleep(0.3)
    assert np.array_equal(snap, p.dst)
    # the backend stays usable
    p.dst[:] = 0
    p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096).wait()
    assert np.array_equal(p.dst[:4096], p.src[:4096])


def test_stopped_peer_reports_not_settled_then_settles(make_backend, mc_target):
    from kvlink.backends.mooncake import NotSettled
    from kvlink.bench.workloads import expected, gather

    t = mc_target()
    init = make_backend("mooncake", options=MooncakeConfig(settle_s=0.3), name="i", listen=None)
    dst = np.zeros(64 << 20, dtype=np.uint8)
    rdst = init.register(dst)
    peer = init.connect(t.address)
    offs = np.arange(2048, dtype=np.uint64) * 32768
    t.stop()
    try:
        b = init.read(peer, rdst, offs, t.region, offs, 32768)
        with pytest.raises(NotSettled):  # Mooncake cannot abort: the caller is told its memory is still in use
            b.wait(0.3)
        assert not b.settled
    finally:
        t.cont()
    assert b.cancel(timeout_s=20) is True  # now the chunk in flight settles: the first cancel to return
    assert b.settled and b.cancel() is False
    snap = dst.copy()
    time.sleep(0.3)
    assert np.array_equal(snap, dst)
    init.read(peer, rdst, offs[:8], t.region, offs[:8], 32768).wait()
    assert np.array_equal(gather(dst, offs[:8], 32768), expected(offs[:8], 32768, t.seed))


def test_killed_peer_fails_within_bounded_time(make_backend, mc_target):
    t = mc_target()
    init = make_backend("mooncake", name="i", listen=None)
    dst = np.zeros(64 << 20, dtype=np.uint8)
    rdst = init.register(dst)
    peer = init.connect(t.address)
    offs = np.arange(2048, dtype=np.uint64) * 32768
    init.read(peer, rdst, offs, t.region, offs, 32768).wait()
    t.kill()
    t0 = time.monotonic()
    with pytest.raises(KVLinkError):
        init.read(peer, rdst, offs, t.region, offs, 32768).wait(25)
    assert time.monotonic() - t0 < 60
    with pytest.raises(KVLinkError):
        init.notify(peer, b"anyone?", timeout_s=2)


# -- regions and close -------------------------------------------------------------------------
def test_unregister_refuses_new_batches(make_pair):
    p = make_pair("mooncake")
    p.rdst.unregister()
    assert not p.rdst.registered
    with pytest.raises(ValueError):
        p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096)


def test_close(make_pair, kind):
    p = make_pair(kind)
    p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096).wait()
    p.init.close()
    p.init.close()  # idempotent
    with pytest.raises(Closed):
        p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096)


def test_close_with_batches_queued_does_not_hang(make_pair):
    p = make_pair("mooncake", size=64 << 20)
    offs = np.arange(16384, dtype=np.uint64) * 4096
    batches = [p.init.read(p.peer, p.rdst, offs, p.rsrc.id, offs, 4096) for _ in range(3)]
    t0 = time.monotonic()
    p.init.close()
    assert time.monotonic() - t0 < 30
    for b in batches:
        assert b.settled
        with pytest.raises(KVLinkError):
            b.wait(1)


# -- what Mooncake does not report, made safe ----------------------------------------------------
def test_a_chunk_failing_at_one_descriptor_is_reported_only_once_its_other_descriptors_are_done(make_backend):
    """Mooncake answers a batch's status at its first failed slice (here: a region the target unregistered
    after the table was fetched) while the chunk's other slices still land. The batch is reported failed only
    settle_s later: once wait() raises, nothing more lands in the destination. Batches queued behind it to
    the same peer go on meanwhile."""
    options = MooncakeConfig(settle_s=5.0)
    target = make_backend("mooncake", options=options, name="target")
    init = make_backend("mooncake", options=options, name="initiator", listen=None)
    a = np.random.default_rng(1).integers(1, 256, 16 << 20, dtype=np.uint8)
    ra, rb = target.register(a), target.register(np.full(1 << 20, 7, np.uint8))
    dst = np.zeros(16 << 20, dtype=np.uint8)
    rd = init.register(dst)
    peer = init.connect(target.address)
    rb.unregister()  # the initiator's cached table still names it
    n, size = 127, 64 << 10
    offs = np.arange(1, n + 1, dtype=np.uint64) * size
    b = init.read(peer, rd, np.concatenate(([0], offs)).astype(np.uint64),
                  np.array([rb.id] + [ra.id] * n, np.uint32), np.concatenate(([0], offs)).astype(np.uint64),
                  np.array([4096] + [size] * n, np.uint64))
    t0 = time.monotonic()
    ok = init.read(peer, rd, [0], ra.id, [0], 4096)  # queued behind it: not held up for settle_s
    ok.wait(30)
    assert time.monotonic() - t0 < 3.0 and not b.settled
    with pytest.raises(KVLinkError):
        b.wait(30)
    assert b.settled
    snap = dst.copy()
    time.sleep(0.5)
    assert np.array_equal(snap, dst)


def test_a_failed_chunk_with_many_bytes_still_moving_is_settled_only_once_they_may_have_landed(make_backend):
    """As above with a short settle_s (50 ms) and 255 MiB behind the failed descriptor: settle_s alone passed
    while most of them still moved, and wait() reported the batch failed (its memory free to reuse) with
    ~180 MB landing afterwards. The wait now counts the chunk's bytes too (at SETTLE_FLOOR_BPS)."""
    from kvlink.backends.mooncake import MAX_CHUNK_BYTES, chunk_bounds

    assert chunk_bounds([60, 60, 60, 200, 10], 10, 100) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert chunk_bounds([1] * 10, 4, 100) == [(0, 4), (4, 8), (8, 10)]
    options = MooncakeConfig(settle_s=0.05)
    target = make_backend("mooncake", options=options, name="target")
    init = make_backend("mooncake", options=options, name="initiator", listen=None)
    n, size = 255, 1 << 20
    assert (n + 1) * size <= MAX_CHUNK_BYTES  # one chunk
    a = np.random.default_rng(1).integers(1, 256, (n + 1) * size, dtype=np.uint8)
    ra, rb = target.register(a), target.register(np.full(1 << 20, 7, np.uint8))
    dst = np.zeros((n + 1) * size, dtype=np.uint8)
    rd = init.register(dst)
    peer = init.connect(target.address)
    init.read(peer, rd, [0], ra.id, [0], 4096).wait()
    dst[:] = 0
    rb.unregister()  # the initiator's cached table still names it
    offs = np.arange(1, n + 1, dtype=np.uint64) * size
    b = init.read(peer, rd, np.concatenate(([0], offs)).astype(np.uint64),
                  np.array([rb.id] + [ra.id] * n, np.uint32), np.concatenate(([0], offs)).astype(np.uint64),
                  np.array([4096] + [size] * n, np.uint64))
    with pytest.raises(KVLinkError):
        b.wait(60)
    assert b.settled
    landed = int(np.count_nonzero(dst))
    time.sleep(1.0)
    assert int(np.count_nonzero(dst)) == landed


def test_a_batch_mooncake_gave_up_on_keeps_its_region_from_being_unregistered(make_backend, mc_target):
    """Mooncake gives up on a batch to a stalled peer after transfer_timeout_s while its slices stay queued
    (NotSettled). unregister() returned at once all the same, and the slices landed in the memory after
    the peer went on. The region now stays counted: unregister raises TimeoutError_ and it stays
    registered (the caller keeps the memory; close() destroys the engine, which stops them)."""
    from kvlink.backends.mooncake import NotSettled

    t = mc_target()
    init = make_backend("mooncake", options=MooncakeConfig(transfer_timeout_s=5, settle_s=1.0), name="i",
                        listen=None, op_timeout_s=120.0)
    dst = np.zeros(64 << 20, dtype=np.uint8)
    rdst = init.register(dst)
    peer = init.connect(t.address)
    init.read(peer, rdst, [0], t.region, [0], 4096).wait()
    offs = np.arange(512, dtype=np.uint64) * 65536
    t.stop()
    try:
        b = init.read(peer, rdst, offs, t.region, offs, 65536)
        with pytest.raises(NotSettled, match="gave up"):
            b.wait(45)
        with pytest.raises(TimeoutError_):
            rdst.unregister(timeout_s=1.0)
        assert rdst.registered and not b.settled
    finally:
        t.cont()


def test_unregister_between_a_submits_checks_and_its_count_refuses_the_batch(make_pair, monkeypatch):
    """A batch checked against a live region that is unregistered before it is counted on it: refused, and
    nothing lands in the unregistered memory (Mooncake's own path does not check that local memory is
    registered)."""
    import kvlink.backends.mooncake as M

    p = make_pair("mooncake")
    real = M.check_descriptors

    def unregister_meanwhile(*a, **kw):
        d = real(*a, **kw)
        p.rdst.unregister()
        return d

    monkeypatch.setattr(M, "check_descriptors", unregister_meanwhile)
    with pytest.raises(ValueError, match="not registered"):
        p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 1 << 20)
    time.sleep(0.3)
    assert not p.dst.any()


def test_connecting_again_reuses_the_live_peer_and_holds_no_more_connections(make_backend):
    """Each connect (the connector reconnects after an error) used to add a thread and a side-channel
    connection for good: past the target's max_conns every connect failed. As with the native engine, a
    connect to an address with a live peer returns that peer."""
    target = make_backend("mooncake", name="target", max_conns=2)
    region = target.register(np.arange(1 << 20, dtype=np.uint64).astype(np.uint8))
    init = make_backend("mooncake", name="initiator", listen=None)
    dst = np.zeros(4096, dtype=np.uint8)
    rd = init.register(dst)
    peers = [init.connect(target.address) for _ in range(6)]
    assert {p.id for p in peers} == {peers[0].id} and init.stats()["peers"] == 1
    init.read(peers[0], rd, [0], region.id, [4096], 4096).wait()
    assert np.array_equal(dst, (np.arange(4096, 8192, dtype=np.uint64)).astype(np.uint8))


def test_a_batch_racing_the_replacement_of_its_gone_peer_is_refused_not_stranded(make_pair, monkeypatch):
    """A submit checked its peer, then the peer's side channel closed and a connect replaced it (its thread
    ends after what was queued) before the batch was queued: the batch would sit on a queue nobody reads,
    never settled, its region counted busy for good. The check and the queueing are one step: refused."""
    import kvlink.backends.mooncake as M
    from kvlink.errors import PeerClosed

    p = make_pair("mooncake")
    real = M.check_descriptors
    fresh = []

    def replaced_meanwhile(*a, **kw):
        d = real(*a, **kw)
        if not fresh:
            p.peer._client.gone = lambda: True  # as if its process had ended
            fresh.append(p.init.connect(p.target.address))
        return d

    monkeypatch.setattr(M, "check_descriptors", replaced_meanwhile)
    with pytest.raises(PeerClosed, match="connect again"):
        p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096)
    assert fresh[0] is not p.peer and p.rdst.inflight == 0
    monkeypatch.setattr(M, "check_descriptors", real)
    p.init.read(fresh[0], p.rdst, [0], p.rsrc.id, [0], 4096).wait()
    assert np.array_equal(p.dst[:4096], p.src[:4096])
    p.rdst.unregister(timeout_s=2)


def test_notifications_nobody_drains_are_bounded(make_pair, kind):
    """16 MiB of notifications at most wait to be drained (4,096 of the largest); the next is refused
    (QueueFull at the sender, counted at the receiver) and a drain makes room again."""
    from kvlink.errors import QueueFull

    p = make_pair(kind)
    big = b"n" * 4096
    for _ in range(4096):
        p.init.notify(p.peer, big)
    with pytest.raises(QueueFull):
        p.init.notify(p.peer, big)
    assert p.target.stats()["notifs_dropped"] == 1
    assert len(p.target.drain_notifications()) == 4096
    p.init.notify(p.peer, big)
    assert p.target.drain_notifications() == [("initiator", big)]


def test_a_peer_whose_process_ended_takes_no_batch_until_connected_again(make_backend, mc_target):
    """Mooncake cannot tell a restarted process from the old one (a process at the same address may hold
    other memory at the addresses the cached table names). The side channel's end says the process ended:
    batches to that peer are refused with PeerClosed, and the connector connects again (a fresh table)."""
    from kvlink.errors import PeerClosed

    t = mc_target()
    init = make_backend("mooncake", name="i", listen=None)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    rdst = init.register(dst)
    peer = init.connect(t.address)
    init.read(peer, rdst, [0], t.region, [0], 4096).wait()
    assert not init.peer_stale(peer)
    t.kill()
    deadline = time.monotonic() + 10
    while not init.peer_stale(peer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert peer._client.gone()
    with pytest.raises(PeerClosed, match="connect again"):
        init.read(peer, rdst, [0], t.region, [0], 4096)
    again = mc_target()
    p2 = init.connect(again.address)
    init.read(p2, rdst, [0], again.region, [0], 4096).wait()


def test_a_kept_peer_reads_stale_once_its_engine_closed(make_backend, kind):
    """Both backends: ``peer_stale`` is false for a live peer and turns true, without a batch, once the
    engine behind it closed (the connector then asks for the prefill's ranks again)."""
    from kvlink.transport import Access

    target = make_backend(kind, name="prefill/a")
    target.register(np.zeros(4096, dtype=np.uint8), Access.READ)
    init = make_backend(kind, name="decode", listen=None)
    peer = init.connect(target.address)
    time.sleep(0.2)
    assert not init.peer_stale(peer)
    target.close()
    deadline = time.monotonic() + 10
    while not init.peer_stale(peer):
        assert time.monotonic() < deadline, "the closed engine's peer never read stale"
        time.sleep(0.05)


def test_a_connect_for_a_named_engine_takes_no_other(make_backend, kind):
    """Both backends: ``connect(address, expect=name)`` refuses an engine answering under another name
    (PeerChanged, naming both) and keeps no peer for it; the right name connects and reads."""
    from kvlink.errors import PeerChanged
    from kvlink.transport import Access

    target = make_backend(kind, name="prefill/a")
    init = make_backend(kind, name="decode", listen=None)
    src = np.arange(4096, dtype=np.uint32).view(np.uint8)
    region = target.register(src, Access.READ)
    dst = np.zeros_like(src)
    rdst = init.register(dst)
    with pytest.raises(PeerChanged, match="prefill/a.*not .prefill/b"):
        init.connect(target.address, expect="prefill/b")
    assert init.stats()["peers"] == 0
    peer = init.connect(target.address, expect="prefill/a")
    assert peer.name == "prefill/a"
    init.read(peer, rdst, [0], region.id, [0], len(src)).wait()
    assert np.array_equal(dst, src)
    with pytest.raises(PeerChanged):  # the live peer is not handed out under another name either
        init.connect(target.address, expect="prefill/b")
    assert init.connect(target.address).id == peer.id
    with pytest.raises(ValueError, match="expect"):
        init.connect(target.address, expect="")


def _tcp_sockets_to(port: int) -> list:
    """This process's TCP sockets connected to ``port`` or accepted on it (duplicates: closing them closes
    nothing of the engine's)."""
    import os
    import socket

    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(int(fd))
        except OSError:
            continue  # (closed meanwhile)
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) \
                    and port in (s.getsockname()[1], s.getpeername()[1]):
                found.append(s)
                continue
        except OSError:
            pass  # a listener has no peer
        s.close()
    return found


def test_every_connection_keeps_alive_while_idle(make_pair, kind):
    """Both backends: a peer's connections (the native engine's streams, both ends; Mooncake's side
    channel, both ends) run TCP keepalive after 60 s idle, every 10 s, 3 probes: a decode keeps its peers
    open between requests, and a NAT or firewall that forgot an idle flow would swallow the next request
    until its deadline."""
    import socket

    p = make_pair(kind)
    p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096).wait()
    socks = _tcp_sockets_to(int(p.target.address.rsplit(":", 1)[1]))
    try:
        conns = [s for s in socks if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0]
        assert len(conns) >= 2, "both ends of at least one connection"
        for s in conns:
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert [s.getsockopt(socket.IPPROTO_TCP, o) for o in
                    (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)] == [60, 10, 3]
    finally:
        for s in socks:
            s.close()


class _SlowStatus:
    """Mooncake's engine, whose first chunk takes `delay` seconds to settle (a large or slow transfer)."""

    def __init__(self, real, delay):
        self._real, self._delay, self._first = real, delay, True

    def get_batch_transfer_status(self, ids):
        if self._first:
            self._first = False
            time.sleep(self._delay)
        return self._real.get_batch_transfer_status(ids)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_cancel_of_a_batch_still_queued_behind_another_returns_at_once(make_backend):
    """Nothing of a batch queued behind another has been submitted to Mooncake: cancel() settles it at once,
    as the native engine's does (it waited settle_s for the peer's worker, then raised NotSettled, saying
    the memory may still be written, which was false)."""
    opts = MooncakeConfig(settle_s=0.5)
    target = make_backend("mooncake", options=opts, name="target")
    init = make_backend("mooncake", options=opts, name="initiator", listen=None)
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    rsrc, rdst = target.register(src, Access.READ), init.register(dst)
    init._engine = _SlowStatus(init._engine, 3.0)  # before connect: the peer's worker takes it
    peer = init.connect(target.address)
    first = init.read(peer, rdst, [0], rsrc.id, [0], 4096)
    queued = init.read(peer, rdst, [8192], rsrc.id, [8192], 4096)
    time.sleep(0.2)  # the worker is inside `first`
    t0 = time.monotonic()
    assert queued.cancel() is True
    assert time.monotonic() - t0 < 0.2
    assert queued.settled
    first.wait()


def test_a_wait_whose_timeout_ends_as_the_batch_finishes_reports_the_outcome(make_pair):
    """wait()'s timeout and the batch's end race: wait_for gives up, the worker finishes (DONE, every byte in
    place), and wait()'s cancel() returns False (it had already ended): wait() returns the batch's outcome,
    as the native engine does (it raised TimeoutError_). The race is forced by letting wait_for report a
    timeout once the batch has settled."""
    p = make_pair("mooncake")
    b = p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 4096)
    real = b._cond.wait_for

    def late(pred, timeout=None):
        b._cond.wait_for = real  # once: cancel()'s own wait is the real one
        real(pred, timeout=10)   # the batch settles ...
        return False             # ... just as the timeout passed

    b._cond.wait_for = late
    b.wait(0.5)
    assert np.array_equal(p.dst[:4096], p.src[:4096])
