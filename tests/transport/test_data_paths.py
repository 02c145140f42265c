"""READ and WRITE over real sockets: correctness on random shapes, coalescing,
striping, notifications, CRC."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlink.errors import ChecksumMismatch, InvalidArgument

SIZE = 1 << 20

descs = st.lists(
    st.tuples(st.integers(0, SIZE - 1), st.integers(0, SIZE - 1), st.integers(1, 70_000)),
    min_size=1, max_size=200)


def _clip(ds):
    """Keep descriptors inside both buffers and destinations non-overlapping."""
    out, used = [], np.zeros(SIZE, dtype=bool)
    for r, l, n in ds:
        n = min(n, SIZE - r, SIZE - l)
        if n > 0 and not used[l:l + n].any():
            used[l:l + n] = True
            out.append((r, l, n))
    return out


@pytest.fixture(scope="module")
def shared_pair():
    from kvlink.transport import Access, Engine, EngineConfig

    token = b"k" * 16
    target = Engine(EngineConfig(name="t", token=token, streams=3))
    init = Engine(EngineConfig(name="i", listen=None, token=token, streams=3))
    src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, dtype=np.uint8)
    sink = np.zeros(SIZE, dtype=np.uint8)
    rsrc = target.register(src, Access.READ)
    rsink = target.register(sink, Access.WRITE)
    rdst = init.register(dst)
    peer = init.connect(target.address)
    yield init, peer, src, dst, sink, rsrc, rsink, rdst
    init.close()
    target.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ds=descs)
def test_read_random_shapes(shared_pair, ds):
    init, peer, src, dst, _, rsrc, _, rdst = shared_pair
    ds = _clip(ds)
    dst[:] = 0
    r = np.array([d[0] for d in ds], dtype=np.uint64)
    lo = np.array([d[1] for d in ds], dtype=np.uint64)
    n = np.array([d[2] for d in ds], dtype=np.uint64)
    init.read(peer, rdst, lo, rsrc.id, r, n).wait()
    for a, b, k in ds:
        assert np.array_equal(dst[b:b + k], src[a:a + k])
    # nothing outside the destinations was touched
    mask = np.zeros(SIZE, dtype=bool)
    for _, b, k in ds:
        mask[b:b + k] = True
    assert not dst[~mask].any()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ds=descs)
def test_write_random_shapes(shared_pair, ds):
    init, peer, _, dst, sink, _, rsink, rdst = shared_pair
    ds = _clip(ds)  # (local source, remote destination, length), destinations disjoint
    dst[:] = np.random.default_rng(len(ds)).integers(0, 256, SIZE, dtype=np.uint8)
    sink[:] = 0
    lo = np.array([d[0] for d in ds], dtype=np.uint64)
    r = np.array([d[1] for d in ds], dtype=np.uint64)
    n = np.array([d[2] for d in ds], dtype=np.uint64)
    init.write(peer, rdst, lo, rsink.id, r, n).wait()
    for a, b, k in ds:
        assert np.array_equal(sink[b:b + k], dst[a:a + k])


def test_contiguous_descriptors_coalesce(pair):
    p = pair(streams=1)
    # 64 blocks contiguous on both sides, then one that is not
    lo = np.arange(64, dtype=np.uint64) * 4096
    ro = lo + 8192
    lo = np.append(lo, np.uint64(500_000))
    ro = np.append(ro, np.uint64(700_000))
    b = p.init.read(p.peer, p.rdst, lo, p.rsrc.id, ro, 4096)
    b.wait()
    assert b.descriptors == 2
    assert np.array_equal(p.dst[: 64 * 4096], p.src[8192: 8192 + 64 * 4096])
    assert np.array_equal(p.dst[500_000:504_096], p.src[700_000:704_096])


def test_large_batch_is_striped_over_streams(pair):
    p = pair(streams=4, size=8 << 20)
    b = p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 8 << 20)
    b.wait()
    # one 8 MiB descriptor is cut into one piece per stream
    assert b.descriptors == 4
    assert np.array_equal(p.dst, p.src)
    assert p.target.stats()["server_conns"] == 4


def test_scalar_and_array_lengths_and_regions(pair):
    p = pair()
    lo = np.array([0, 10_000], dtype=np.uint64)
    p.init.read(p.peer, p.rdst, lo, np.array([p.rsrc.id] * 2), [100, 200], np.array([10, 20])).wait()
    assert np.array_equal(p.dst[0:10], p.src[100:110])
    assert np.array_equal(p.dst[10_000:10_020], p.src[200:220])


def test_notifications_carry_sender_name(pair):
    p = pair()
    for i in range(50):
        p.init.notify(p.peer, f"req-{i} pulled".encode())
    got = p.target.drain_notifications()
    assert got == [("initiator", f"req-{i} pulled".encode()) for i in range(50)]
    assert p.target.drain_notifications() == []
    with pytest.raises(ValueError):
        p.init.notify(p.peer, b"x" * 4097)


@pytest.mark.parametrize("crc", [False, True])
def test_crc_on_and_off_move_the_same_bytes(pair, crc):
    p = pair(crc=crc)
    lo = np.arange(100, dtype=np.uint64) * 8192
    p.init.read(p.peer, p.rdst, lo, p.rsrc.id, lo[::-1].copy(), 4096).wait()
    for i in range(100):
        assert np.array_equal(p.dst[i * 8192:i * 8192 + 4096], p.src[(99 - i) * 8192:(99 - i) * 8192 + 4096])


def test_crc_catches_corruption_in_flight(make_engine):
    """A relay between initiator and target flips one data byte: with CRC the
    batch fails with ChecksumMismatch; without CRC the corruption goes through."""
    from kvlink.transport import Access
    from tests.relay import Relay

    target = make_engine(name="target")
    src = np.full(256 * 1024, 7, dtype=np.uint8)
    rsrc = target.register(src, Access.READ)
    for crc in (True, False):
        relay = Relay(target.address, flip_after=200_000)
        try:
            init = make_engine(name=f"init-crc-{crc}", listen=None, crc=crc, streams=1)
            dst = np.zeros_like(src)
            rdst = init.register(dst)
            peer = init.connect(relay.address)
            b = init.read(peer, rdst, [0], rsrc.id, [0], src.nbytes)
            if crc:
                with pytest.raises(ChecksumMismatch, match="checksum mismatch in descriptor 0"):
                    b.wait()
            else:
                b.wait()
                assert (dst != src).sum() == 1
            assert relay.flipped
        finally:
            relay.close()


def test_bad_local_arguments_are_refused_before_anything_moves(pair):
    p = pair()
    with pytest.raises(ValueError, match="beyond the local region"):
        p.init.read(p.peer, p.rdst, [SIZE - 10], p.rsrc.id, [0], 100)
    with pytest.raises(ValueError, match="positive"):
        p.init.read(p.peer, p.rdst, [0], p.rsrc.id, [0], 0)
    with pytest.raises(ValueError, match="entries"):
        p.init.read(p.peer, p.rdst, [0, 1], p.rsrc.id, [0], [1, 2, 3])
    with pytest.raises(ValueError, match="negative"):
        p.init.read(p.peer, p.rdst, [-1], p.rsrc.id, [0], 1)
    ro = p.init.register(b"read-only bytes")
    with pytest.raises(ValueError, match="writable"):
        p.init.read(p.peer, ro, [0], p.rsrc.id, [0], 4)
    with pytest.raises(InvalidArgument):
        from kvlink import _binding as B

        B.region_register(p.init._h, 0, 10, 1)
    assert not p.dst.any()


def test_torch_tensors_and_raw_address_regions(make_engine):
    import torch

    from kvlink.transport import Access

    target = make_engine(name="target")
    init = make_engine(name="init", listen=None)
    kv = torch.arange(4096, dtype=torch.bfloat16).reshape(8, 512)  # what vLLM hands a connector, in small
    rsrc = target.register(kv, Access.READ)
    assert rsrc.length == kv.numel() * kv.element_size()
    dst = torch.zeros_like(kv)
    rdst = init.register((dst.data_ptr(), dst.numel() * dst.element_size()))  # (address, length)
    peer = init.connect(target.address)
    row = kv.shape[1] * kv.element_size()
    init.read(peer, rdst, [0, 7 * row], rsrc.id, [7 * row, 0], row).wait()
    assert torch.equal(dst[0], kv[7]) and torch.equal(dst[7], kv[0])
    with pytest.raises(ValueError, match="contiguous"):
        target.register(kv.t(), Access.READ)
