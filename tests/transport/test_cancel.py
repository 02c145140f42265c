"""What Batch.cancel() reports: True when the call stopped a running batch,
False when the batch had already finished and its outcome stands (the C
code KVL_FINISHED, csrc/kvl.h), an error for a bad handle."""

from __future__ import annotations

import numpy as np
import pytest

from kvlink import _binding as B
from kvlink.errors import Canceled, InvalidArgument, TimeoutError_
from tests.fakes import SlowTarget


@pytest.fixture
def stalled(make_engine):
    """An initiator connected to a peer that never answers: its batches stay in flight."""
    target = SlowTarget(token=b"kvlink-test-token", stall=True)
    init = make_engine(name="i", listen=None, streams=1)
    dst = np.zeros(8192, dtype=np.uint8)
    yield init, init.connect(target.address), init.register(dst)
    target.close()


def test_cancel_stops_a_running_batch_and_says_so_once(stalled):
    init, peer, rdst = stalled
    b = init.read(peer, rdst, [0], 1, [0], 4096)
    assert b.poll() is False  # still in flight
    assert b.cancel() is True
    with pytest.raises(Canceled):
        b.wait()
    assert b.cancel() is False  # nothing left to stop
    with pytest.raises(Canceled):  # and the outcome is still the first cancel's
        b.poll()


def test_cancel_after_a_timeout_keeps_the_timeout(stalled):
    init, peer, rdst = stalled
    b = init.read(peer, rdst, [0], 1, [0], 4096)
    with pytest.raises(TimeoutError_):
        b.wait(timeout_s=0.2)
    assert b.cancel() is False
    with pytest.raises(TimeoutError_):
        b.poll()


def test_cancel_after_completion_changes_nothing(pair):
    p = pair()
    b = p.init.read(p.peer, p.rdst, [0, 8192], p.rsrc.id, [4096, 65536], 4096)
    b.wait()
    assert b.cancel() is False
    assert b.poll() is True  # still a success, not a cancellation
    assert np.array_equal(p.dst[:4096], p.src[4096:8192])
    assert np.array_equal(p.dst[8192:12288], p.src[65536:69632])


def test_binding_turns_a_bad_handle_into_an_error():
    with pytest.raises(InvalidArgument, match="cancel batch"):
        B.batch_cancel(B.ffi.NULL)


def test_waiting_runs_a_small_batch_itself_and_still_keeps_its_timeout(stalled):
    """A waiter that takes a small one-part batch off the queue (the latency path) runs it in its own thread;
    against a silent peer wait(timeout) still ends at its timeout, not at the batch's own (30 s here)."""
    import time

    init, peer, rdst = stalled
    b = init.read(peer, rdst, [0], 1, [0], 4096, timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError_):
        b.wait(timeout_s=0.3)
    assert time.monotonic() - t0 < 5.0
    assert init.stats()["parts_inline"] == 1  # the waiter ran it (else this test proves nothing)


def test_releasing_a_running_batch_stops_it_before_its_memory_goes(make_engine):
    """Batch.release() (or garbage collection) of a READ still in flight: once it returns nothing lands in the
    destination, though the peer sends every byte right after."""
    import threading
    import time

    from tests import wire

    n = 8 << 20
    go, sent = threading.Event(), threading.Event()
    ls = __import__("socket").create_server(("127.0.0.1", 0))

    def target():
        c, _ = ls.accept()
        wire.server_handshake(c, b"kvlink-test-token")
        (_, _, _, _, seq, _), _ = wire.recv_frame(c)
        go.wait(10)
        try:
            c.sendall(wire.frame(wire.READ_RESP, wire.status_body(0, total=n), seq=seq) + b"\xab" * n)
        except OSError:
            pass  # the initiator hung up: what we want
        sent.set()
        time.sleep(2)
        c.close()

    threading.Thread(target=target, daemon=True).start()
    init = make_engine(name="i", listen=None, streams=1)
    peer = init.connect(f"127.0.0.1:{ls.getsockname()[1]}")
    dst = np.zeros(n, dtype=np.uint8)
    b = init.read(peer, init.register(dst), 0, 0x10001, 0, n, timeout_s=20)
    time.sleep(0.2)  # on the wire: the worker waits for the answer
    b.release()
    go.set()
    assert sent.wait(10)
    time.sleep(0.3)
    assert not dst.any()
    ls.close()
