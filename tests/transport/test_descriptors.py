"""Descriptor validation (kvlink.transport.descriptors), shared by the native engine and Mooncake: every
refusal names the argument or the descriptor and the bound, and what passes comes out as the arrays the
backends submit."""

from __future__ import annotations

import numpy as np
import pytest

from kvlink.errors import InvalidArgument, OutOfRange, TooBig
from kvlink.transport.descriptors import U64_MAX, check_descriptors, check_one, check_remote_bounds

SIZE = 1 << 16


def test_a_good_batch_comes_out_as_contiguous_arrays():
    d = check_descriptors(SIZE, [0, 4096, 8192], 7, np.array([100, 200, 300], dtype=np.int64), 4096)
    assert len(d) == 3 and d.nbytes == 3 * 4096
    assert d.local_offsets.dtype == np.uint64 and d.remote_offsets.dtype == np.uint64
    assert d.remote_regions.dtype == np.uint32 and d.lengths.dtype == np.uint64
    assert all(a.flags.c_contiguous for a in (d.local_offsets, d.remote_regions, d.remote_offsets, d.lengths))
    assert d.remote_regions.tolist() == [7] and d.each_region().tolist() == [7, 7, 7]
    assert d.each_length().tolist() == [4096] * 3
    d = check_descriptors(SIZE, [0, 10], [1, 2], [0, 0], [10, SIZE - 10])  # exactly to the end
    assert d.nbytes == SIZE and d.each_region().tolist() == [1, 2]


@pytest.mark.parametrize("args, message", [
    (([], 1, [], 1), "a batch needs at least one descriptor"),
    (([0, 1], 1, [0], 1), "remote_offsets has 1 entries, local_offsets 2"),
    (([0, 1], [1, 2, 3], [0, 0], 1), "remote_regions has 3 entries, expected 1 or 2"),
    (([0, 1], 1, [0, 0], [1, 2, 3]), "lengths has 3 entries, expected 1 or 2"),
    (([0, 1.5], 1, [0, 0], 1), "local_offsets must be integers, got dtype float64"),
    (([0], 1, ["0"], 1), "remote_offsets must be integers"),
    (([[0, 1]], 1, [0, 0], 1), r"local_offsets must be an int or a 1-D array, got shape \(1, 2\)"),
    (([0, -4], 1, [0, 0], 1), r"local_offsets\[1\] is negative \(-4\)"),
    (([0], 1, [-1], 1), r"remote_offsets\[0\] is negative"),
    (([0], [-1], [0], 1), r"remote_regions\[0\] is negative"),
    (([0], [1 << 32], [0], 1), r"remote_regions\[0\] = 4294967296 does not fit 32 bits"),
    (([0, 8], 1, [0, 0], [4, 0]), "descriptor 1: length 0; lengths must be positive"),
    (([0], 1, [U64_MAX - 3], 8), r"descriptor 0: remote offset 18446744073709551612 \+ length 8 overflows 64 bits"),
])
def test_malformed_batches_are_refused_naming_the_culprit(args, message):
    with pytest.raises(InvalidArgument, match=message):
        check_descriptors(SIZE, *args)


@pytest.mark.parametrize("loff, length, index", [([0, SIZE - 10], 11, 1), ([SIZE + 1], 1, 0), ([0, 0, 5], SIZE, 2),
                                                 ([U64_MAX], 2, 0), ([1], U64_MAX - 100, 0)])
def test_local_bounds_name_the_descriptor_and_the_bound(loff, length, index):
    """Overflow-safe: offset + length is never computed in 64 bits."""
    with pytest.raises(OutOfRange) as err:
        check_descriptors(SIZE, loff, 1, [0] * len(loff), length)
    assert str(err.value) == (f"descriptor {index}: local offset {loff[index]} + length {length} ends beyond the "
                              f"local region of {SIZE} bytes")
    assert isinstance(err.value, ValueError)


def test_one_descriptor_of_plain_ints_gets_the_same_checks_and_messages():
    check_one(SIZE, 0, 1, 0, SIZE)
    cases = [((SIZE - 10, 1, 0, 11), OutOfRange), ((-1, 1, 0, 1), InvalidArgument), ((0, 1, -1, 1), InvalidArgument),
             ((0, -1, 0, 1), InvalidArgument), ((0, 1 << 32, 0, 1), InvalidArgument), ((0, 1, 0, 0), InvalidArgument),
             ((0, 1, U64_MAX, 1), InvalidArgument), ((1 << 64, 1, 0, 1), InvalidArgument)]
    for (loff, region, roff, length), kind in cases:
        with pytest.raises(kind) as one:
            check_one(SIZE, loff, region, roff, length)
        with pytest.raises(kind) as batch:
            check_descriptors(SIZE, [loff] if loff < 1 << 64 else np.array([loff], dtype=object), [region], [roff],
                              [length])
        if loff < 1 << 64:
            assert str(one.value) == str(batch.value)


def test_remote_bounds_name_the_descriptor_region_and_size():
    d = check_descriptors(SIZE, [0, 100, 200], [0xA1, 0xA2, 0xA1], [0, 4000, 0], 100)
    check_remote_bounds(d, np.array([100, 4100, 100]))
    with pytest.raises(OutOfRange, match=r"descriptor 1: remote offset 4000 \+ length 100 ends beyond remote region "
                                         r"0xa2 of 4099 bytes"):
        check_remote_bounds(d, np.array([100, 4099, 100]))
    d = check_descriptors(SIZE, [0], 3, [U64_MAX - 200], 100)  # no overflow in the check
    with pytest.raises(OutOfRange, match="descriptor 0"):
        check_remote_bounds(d, np.array([1 << 20]))


def test_a_batch_beyond_2_to_the_60_bytes_is_too_big_also_where_numpy_would_wrap():
    d = check_descriptors(U64_MAX, np.zeros(1 << 10, np.uint64), 1, np.zeros(1 << 10, np.uint64), 1 << 50)
    assert d.nbytes == 1 << 60  # the limit itself passes
    with pytest.raises(TooBig, match=f"1025 lengths add up to {1025 << 50} bytes"):
        check_descriptors(U64_MAX, np.zeros(1025, np.uint64), 1, np.zeros(1025, np.uint64), 1 << 50)
    lens = np.array([1 << 63, 1 << 63, 5], np.uint64)  # numpy's sum: 5
    with pytest.raises(TooBig, match=f"add up to {(1 << 64) + 5} bytes"):
        check_descriptors(U64_MAX, [0, 0, 0], 1, [0, 0, 0], lens)


def test_the_configs_limits_are_the_c_engines():
    """EngineConfig (and the connector's transport_streams) validate without loading the C core: their
    copies of its limits must agree with it, or a value passes validation and fails at engine start."""
    from kvlink import _binding as B
    from kvlink.transport import config

    assert (config.MAX_NAME, config.MAX_STREAMS, config.MAX_PEERS) == (B.MAX_NAME, B.MAX_STREAMS, B.MAX_PEERS)
    assert config.EngineConfig().max_peers == B.lib.KVL_DEFAULT_PEERS
