"""The Python wrappers' handles over the C engine: an engine dropped unclosed, a batch released while another
thread waits on it, a wait without end, read-only memory registered for peers to read."""

from __future__ import annotations

import gc

import pytest

from kvlink.errors import KVLinkError
from kvlink.transport import Access, Engine, EngineConfig


def test_an_engine_dropped_without_close_stops_serving_memory_the_collector_freed():
    """Engine <-> Region is a reference cycle: an engine nobody closed is collected, and with it the objects its
    regions kept alive. Its finalizer closes it first (with a ResourceWarning): else the C engine went on
    serving those addresses to peers (and taking WRITEs), and a peer's READ returned whatever the heap held
    there then, without an error."""
    init = Engine(EngineConfig(name="i", listen=None))
    try:
        def target():
            t = Engine(EngineConfig(name="t"))
            secret = bytearray(b"\x11" * 8192)
            return t.address, t.register(secret, Access.READ).id

        address, rid = target()
        gc.collect()
        junk = [bytearray(b"\xAA" * 8192) for _ in range(64)]  # the heap reuses what the collector freed
        dst = bytearray(8192)
        local = init.register(dst, Access.WRITE)
        with pytest.raises(KVLinkError):  # nobody serves it any more
            peer = init.connect(address)
            init.read(peer, local, 0, rid, 0, 8192).wait(5)
        assert 0xAA not in dst, "a READ returned another object's bytes from freed memory"
        del junk
    finally:
        init.close()


_RELEASE_DURING_WAIT = r"""
import faulthandler, random, sys, threading, time
import numpy as np
from kvlink.transport import Access, Engine, EngineConfig
faulthandler.dump_traceback_later(40, exit=True)  # a waiter stuck on freed memory: exit 1 with its stack
t, i = Engine(EngineConfig(name="t", streams=4)), Engine(EngineConfig(name="i", listen=None, streams=4))
src, dst = np.ones(16 << 20, np.uint8), np.zeros(16 << 20, np.uint8)
rs, rd = t.register(src), i.register(dst, Access.WRITE)
p = i.connect(t.address)
for k in range(150):
    b = i.read(p, rd, 0, rs.id, 0, 16 << 20)
    def w(b=b):
        try:
            b.wait(10)
        except Exception:
            pass
    th = threading.Thread(target=w, daemon=True)
    th.start()
    time.sleep(random.random() * 0.004)
    b.release()  # the waiter is (usually) inside kvl_batch_wait on this handle
    th.join(12)
    if th.is_alive():
        print("waiter stuck past its own 10 s timeout", flush=True)
        sys.exit(2)
i.close(); t.close()
print("done", flush=True)
"""


def test_release_while_another_thread_waits_does_not_free_the_handle_under_it():
    """Batch.release() stops the batch and lets the handle go; the handle is freed once no call on it is under
    way. (It freed it at once, ffi.release, while a wait() in another thread was inside kvl_batch_wait on it:
    the waiter slept on a freed mutex and condvar, seen stuck past its own timeout.)"""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _RELEASE_DURING_WAIT], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-1500:])


def test_wait_forever_waits_instead_of_raising_while_the_batch_still_writes():
    """Batch.wait(float('inf')) (or any timeout past 2^32 ms, ~49.7 days) waits for the batch (it raised
    OverflowError before C was called, while the batch went on writing: a raise from wait() means it ended)."""
    import numpy as np

    with Engine(EngineConfig(name="t")) as t, Engine(EngineConfig(name="i", listen=None)) as i:
        src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
        rs, rd = t.register(src), i.register(dst, Access.WRITE)
        b = i.read(i.connect(t.address), rd, 0, rs.id, 0, 4096)
        b.wait(float("inf"))
        assert np.array_equal(src, dst)


def test_a_read_only_numpy_array_can_be_registered_for_peers_to_read():
    """Read-only memory registers for READ: bytes (BufferError for a writable view) and a read-only numpy
    array (numpy's ValueError) alike."""
    import numpy as np

    with Engine(EngineConfig(name="t")) as t:
        ro = np.frombuffer(b"x" * 4096, dtype=np.uint8)
        r = t.register(ro, Access.READ)
        assert r.length == 4096 and not r.writable


def test_the_finalizer_closes_even_where_warnings_are_errors(monkeypatch):
    """Under ``-W error`` the ResourceWarning raises: the engine is closed before it is warned about."""
    import warnings

    closed, real = [], Engine.close
    monkeypatch.setattr(Engine, "close", lambda self: (closed.append(1), real(self)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = Engine(EngineConfig(name="t"))
        e.register(bytearray(4096), Access.READ)
        del e
        gc.collect()
    assert closed
