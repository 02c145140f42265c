"""Descriptor validation, shared by every backend.

A READ or WRITE moves a batch of descriptors (local offset, remote region id, remote offset, length).
Everything that can be checked without the peer is checked here, before anything is submitted: array
types and shapes, counts, positive lengths, region ids that fit the wire's 32 bits, remote ranges that
do not overflow 64 bits, and the local bounds (overflow-safe). Remote bounds and access need the peer's
region table: the native engine's target checks them (and reports them at ``wait``); a backend that knows
the table locally (Mooncake) calls :func:`check_remote_bounds`.

Errors name the culprit: which argument or which descriptor, and which bound. Malformed arguments raise
:class:`~kvlink.errors.InvalidArgument`, ranges outside a region :class:`~kvlink.errors.OutOfRange`; both
are ``ValueError``; a batch whose lengths add up to more than 2^60 bytes :class:`~kvlink.errors.TooBig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlink.errors import InvalidArgument, OutOfRange, TooBig

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
MAX_BATCH_BYTES = 1 << 60  # csrc/kvl_batch.c's KVL__MAX_BATCH_BYTES: far beyond any batch, clear of 64-bit wrap


@dataclass(frozen=True, eq=False)
class Descriptors:
    """A checked batch of ``len(self)`` descriptors as contiguous arrays. ``remote_regions`` and ``lengths``
    hold either one value for every descriptor or one per descriptor (the C engine takes both forms)."""

    local_offsets: np.ndarray   # uint64, n
    remote_regions: np.ndarray  # uint32, 1 or n
    remote_offsets: np.ndarray  # uint64, n
    lengths: np.ndarray         # uint64, 1 or n
    nbytes: int

    def __len__(self) -> int:
        return len(self.local_offsets)

    def each_region(self) -> np.ndarray:
        """Region ids, one per descriptor (a read-only view when one id is shared)."""
        return np.broadcast_to(self.remote_regions, (len(self),))

    def each_length(self) -> np.ndarray:
        """Lengths, one per descriptor (a read-only view when one length is shared)."""
        return np.broadcast_to(self.lengths, (len(self),))


def check_descriptors(local_length: int, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
                      lengths: Any) -> Descriptors:
    """Check a batch against a local region of ``local_length`` bytes. ``local_offsets`` and
    ``remote_offsets`` give one entry per descriptor; ``remote_regions`` and ``lengths`` one entry, or one
    per descriptor. Each may be an int, a sequence or a 1-D integer array."""
    loff = _ints(local_offsets, "local_offsets", U64_MAX, np.uint64)
    n = len(loff)
    if n == 0:
        raise InvalidArgument("a batch needs at least one descriptor (local_offsets is empty)")
    roff = _ints(remote_offsets, "remote_offsets", U64_MAX, np.uint64)
    if len(roff) != n:
        raise InvalidArgument(f"remote_offsets has {len(roff)} entries, local_offsets {n}: one per descriptor")
    regs = _ints(remote_regions, "remote_regions", U32_MAX, np.uint32)
    if len(regs) not in (1, n):
        raise InvalidArgument(f"remote_regions has {len(regs)} entries, expected 1 or {n} (one per descriptor)")
    lens = _ints(lengths, "lengths", U64_MAX, np.uint64)
    if len(lens) not in (1, n):
        raise InvalidArgument(f"lengths has {len(lens)} entries, expected 1 or {n} (one per descriptor)")
    zero = lens == 0
    if zero.any():
        raise InvalidArgument(f"descriptor {_first(zero)}: length 0; lengths must be positive")
    wraps = lens > np.uint64(U64_MAX) - roff
    if wraps.any():
        i = _first(wraps)
        raise InvalidArgument(f"descriptor {i}: remote offset {int(roff[i])} + length {_at(lens, i)} overflows "
                              "64 bits")
    # Overflow-safe: offset <= size and length <= size - offset.
    size = np.uint64(local_length)
    beyond = (loff > size) | (lens > size - np.minimum(loff, size))
    if beyond.any():
        i = _first(beyond)
        raise OutOfRange(f"descriptor {i}: local offset {int(loff[i])} + length {_at(lens, i)} ends beyond the "
                         f"local region of {local_length} bytes")
    if len(lens) != n:
        nbytes = int(lens[0]) * n
    elif int(lens.max()) * n <= MAX_BATCH_BYTES:
        nbytes = int(lens.sum())  # cannot wrap
    else:
        nbytes = sum(map(int, lens))  # numpy's uint64 sum would wrap
    if nbytes > MAX_BATCH_BYTES:
        raise TooBig(f"the batch's {n} lengths add up to {nbytes} bytes, more than 2^60")
    return Descriptors(loff, regs, roff, lens, nbytes)


def check_one(local_length: int, local_offset: int, remote_region: int, remote_offset: int, length: int) -> None:
    """:func:`check_descriptors` for one descriptor given as plain ints, without numpy (the latency path):
    the same checks and the same messages."""
    for what, v, top in (("local_offsets", local_offset, U64_MAX), ("remote_regions", remote_region, U32_MAX),
                         ("remote_offsets", remote_offset, U64_MAX), ("lengths", length, U64_MAX)):
        if v < 0:
            raise InvalidArgument(f"{what}[0] is negative ({v})")
        if v > top:
            raise InvalidArgument(f"{what}[0] = {v} does not fit {top.bit_length()} bits")
    if length == 0:
        raise InvalidArgument("descriptor 0: length 0; lengths must be positive")
    if remote_offset + length > U64_MAX:
        raise InvalidArgument(f"descriptor 0: remote offset {remote_offset} + length {length} overflows 64 bits")
    if local_offset + length > local_length:
        raise OutOfRange(f"descriptor 0: local offset {local_offset} + length {length} ends beyond the local "
                         f"region of {local_length} bytes")


def check_remote_bounds(descs: Descriptors, region_lengths: np.ndarray) -> None:
    """Check each descriptor's remote range against the length of the region it names
    (``region_lengths``: one per descriptor), overflow-safe."""
    roff, lens = descs.remote_offsets, descs.lengths
    size = np.asarray(region_lengths, dtype=np.uint64)
    beyond = (roff > size) | (lens > size - np.minimum(roff, size))
    if beyond.any():
        i = _first(beyond)
        raise OutOfRange(f"descriptor {i}: remote offset {int(roff[i])} + length {_at(lens, i)} ends beyond "
                         f"remote region 0x{int(descs.each_region()[i]):x} of {int(size[i])} bytes")


def _ints(values: Any, what: str, top: int, dtype: type) -> np.ndarray:
    """``values`` as a contiguous 1-D array of ``dtype``, refusing what would wrap on conversion."""
    arr = np.asarray(values)
    if arr.ndim > 1:
        raise InvalidArgument(f"{what} must be an int or a 1-D array, got shape {arr.shape}")
    if arr.size == 0:  # [] is float64 to numpy; the caller says what an empty argument means
        return np.empty(0, dtype=dtype)
    if arr.dtype.kind not in "ui":
        raise InvalidArgument(f"{what} must be integers, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.dtype.kind == "i":
        neg = arr < 0
        if neg.any():
            i = _first(neg)
            raise InvalidArgument(f"{what}[{i}] is negative ({int(arr[i])})")
    if top < U64_MAX and int(arr.max()) > top:
        i = int(np.argmax(arr))
        raise InvalidArgument(f"{what}[{i}] = {int(arr[i])} does not fit {top.bit_length()} bits")
    return np.ascontiguousarray(arr, dtype=dtype)


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _at(arr: np.ndarray, i: int) -> int:
    """Entry ``i`` of a one-or-n array."""
    return int(arr[i if len(arr) > 1 else 0])
