"""The C frame decoder, fuzzed with hypothesis: whatever bytes arrive it
answers 'complete', 'need more' or a named error, and never reads past them."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink import _binding as B
from tests import wire

KNOWN = {"OK", "INPROGRESS", "KVL_EPROTO", "KVL_EVERSION", "KVL_ETOOBIG"}


def check(frame: bytes) -> tuple[int, str, str]:
    rc, name, why = B.proto_check(frame)
    assert name in KNOWN, (name, why)
    if rc < 0:
        assert why, "an error must name its reason"
    return rc, name, why


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes(data):
    check(data)


def valid_frames():
    d = wire.descs_body([(0x10001, 0, 16), (0x10001, 4096, 32)])
    return [
        wire.frame(wire.HELLO, wire.hello_body(bytes(32), True, "peer")),
        wire.frame(wire.CHALLENGE, wire.hello_body(bytes(32), False, "srv", bytes(32))),
        wire.frame(wire.AUTH, bytes(32)),
        wire.frame(wire.WELCOME),
        wire.frame(wire.READ_REQ, d, seq=3),
        wire.frame(wire.WRITE_REQ, d, flags=wire.F_CRC),
        wire.frame(wire.READ_RESP, wire.status_body(0, 48)),
        wire.frame(wire.ERROR, wire.status_body(-8, msg="wrong token")),
        wire.frame(wire.NOTIFY, b"req-1 pulled"),
    ]


def test_valid_frames_decode_and_every_prefix_needs_more():
    for f in valid_frames():
        assert check(f)[1] == "OK"
        for cut in range(len(f)):
            assert check(f[:cut])[1] == "INPROGRESS"


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(valid_frames()), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6),
       st.integers(0, 64))
def test_mutated_valid_frames(frame, flips, chop):
    b = bytearray(frame)
    for pos, val in flips:
        if b:
            b[pos % len(b)] = val
    check(bytes(b[: max(0, len(b) - chop)]) if chop % 3 == 0 else bytes(b))


def test_lengths_are_bounded_before_anything_else():
    huge = struct.pack("<IBBHII", wire.MAGIC, 1, wire.READ_REQ, 0, 0, 0xFFFFFFFF)
    assert check(huge)[1] == "KVL_ETOOBIG"
    assert check(huge[:4] + b"\x07" + huge[5:])[1] == "KVL_EVERSION"
    assert check(b"XXXX" + huge[4:])[1] == "KVL_EPROTO"
    count = wire.frame(wire.READ_REQ, struct.pack("<II", 70000, 0) + bytes(24))
    rc, name, why = check(count)
    assert name == "KVL_ETOOBIG" and "70000" in why
