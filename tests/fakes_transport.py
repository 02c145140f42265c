"""An in-process fake of kvlink's transport backend: an Engine with the backend contract's surface.

Engines find each other through a module-level table keyed by address; READ/WRITE copy bytes with
ctypes.memmove between registered regions, on a background thread so batches complete asynchronously.
The configuration, access flags, capabilities, descriptor checks and errors are kvlink's own
(kvlink.transport, kvlink.errors): code under test sees what the real engine would give it. Tests register
it as a backend (``kvlink.backends.register_backend("fake", Engine)``: it takes ``(config, options)``) or
use ``Engine``.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlink.errors import (AccessDenied, AuthError, Canceled, Closed, ConnectError, NotSettled, PeerChanged,
                           PeerClosed, TimeoutError_, UnknownRegion)
from kvlink.transport import Access, Capabilities, EngineConfig
from kvlink.transport.config import check_name
from kvlink.transport.descriptors import check_descriptors, check_remote_bounds
from kvlink.transport.region import memory_for

__all__ = ["Batch", "Engine", "Peer", "Region"]

_ENGINES: dict[str, Engine] = {}
_PORTS = itertools.count(40000)
_LOCK = threading.Lock()


class Region:
    def __init__(self, eng: Engine, rid: int, obj: Any, access: Access):
        self._eng, self.id, self.access = eng, rid, Access(access)
        self.addr, self.length, self._keep, self.writable = memory_for(obj, self.access)

    def unregister(self, timeout_s: float = 30.0) -> None:
        self._eng._regions.pop(self.id, None)

    @property
    def registered(self) -> bool:
        return self.id in self._eng._regions


@dataclass(frozen=True)
class Peer:
    address: str
    name: str


class Batch:
    def __init__(self, nbytes: int, cancel_cannot_stop: bool = False):
        self.nbytes = nbytes
        self.cancels = 0  # calls to cancel()
        self._cancel_cannot_stop = cancel_cannot_stop
        self._done = threading.Event()
        self._error: Exception | None = None
        self._cancelled = threading.Event()

    def poll(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise self._error
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._done.wait(timeout_s):
            self.cancel()
            raise TimeoutError_(f"batch not finished within {timeout_s} s; canceled")
        if self._error is not None:
            raise self._error

    def cancel(self) -> bool:
        """As the native Batch: True if this call stopped the batch (poll/wait then raise Canceled), False if
        it had already finished (its outcome stands). With ``Engine.cancel_cannot_stop`` (as Mooncake's), a
        batch in flight is not stopped: NotSettled, until it has finished by itself."""
        self.cancels += 1
        if self._done.is_set():
            return False
        if self._cancel_cannot_stop:
            raise NotSettled("fake transport: a batch in flight cannot be stopped (cancel_cannot_stop)")
        self._cancelled.set()
        self._done.wait(5)
        return isinstance(self._error, Canceled)

    def release(self) -> None:
        """Nothing to free (kept for parity with the native Batch)."""


class Engine:
    # Test hooks: delay every batch by this many seconds; fail every batch with this error; a cancel cannot
    # stop a batch in flight (raises NotSettled until it has finished, as with Mooncake).
    delay_s = 0.0
    fail_with: Exception | None = None
    cancel_cannot_stop = False

    kind = "fake"

    def __init__(self, config: EngineConfig | None = None, options: Any = None):
        self.config = cfg = config or EngineConfig()
        self.options = options  # what open_backend was given; the fake takes no options of its own
        self.capabilities = Capabilities()
        if cfg.listen is None:
            self.address: str | None = None  # initiator-only, as the real engine
        else:
            self.address = f"{cfg.listen.rpartition(':')[0]}:{next(_PORTS)}"
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count(1)
        self._notes: list[tuple[str, bytes]] = []
        self._closed = False
        if self.address is not None:
            with _LOCK:
                _ENGINES[self.address] = self

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("engine is closed")

    def register(self, obj: Any, access: Access = Access.READ) -> Region:
        self._check_open()
        r = Region(self, next(self._ids), obj, access)
        self._regions[r.id] = r
        return r

    def connect(self, address: str, expect: str | None = None) -> Peer:
        self._check_open()
        if expect is not None:
            check_name(expect, "expect", empty=False)
        with _LOCK:
            eng = _ENGINES.get(address)
        if eng is None or eng._closed:
            raise ConnectError(f"cannot reach {address}: no fake engine listens there")
        if eng.config.token != self.config.token:
            raise AuthError(f"authentication with {address} failed: the peers hold different tokens")
        if expect is not None and eng.config.name != expect:
            raise PeerChanged(f"{address} answers as engine {eng.config.name!r}, not {expect!r}")
        return Peer(address, eng.config.name)

    def peer_stale(self, peer: Peer) -> bool:
        """The engine ``peer`` named closed, or another answers at its address."""
        with _LOCK:
            eng = _ENGINES.get(peer.address)
        return eng is None or eng._closed or eng.config.name != peer.name

    def _xfer(self, peer: Peer, local: Region, lo: Any, rids: Any, ro: Any, ln: Any, write: bool) -> Batch:
        self._check_open()
        if not write and not local.writable:
            raise ValueError("the destination region of a READ must be writable memory")
        d = check_descriptors(local.length, lo, rids, ro, ln)  # what the engine refuses before submitting
        n, lo, rids, ro, ln = len(d), d.local_offsets, d.each_region(), d.remote_offsets, d.each_length()
        b = Batch(d.nbytes, self.cancel_cannot_stop)
        need = Access.WRITE if write else Access.READ

        def run() -> None:
            try:
                if self.delay_s:
                    b._cancelled.wait(self.delay_s)  # a cancel ends the delay
                if b._cancelled.is_set():
                    raise Canceled("batch canceled")
                if self.fail_with is not None:
                    raise self.fail_with
                with _LOCK:
                    remote = _ENGINES.get(peer.address)
                if remote is None or remote._closed:
                    raise PeerClosed(f"peer {peer.address} closed the connection")
                # Remote checks need the peer's table: the real engine's target makes them, reported at wait.
                remote_lengths = np.empty(n, np.uint64)
                for i in range(n):
                    rr = remote._regions.get(int(rids[i]))
                    if rr is None:
                        raise UnknownRegion(f"descriptor {i}: peer {peer.address} has no region {int(rids[i])}")
                    if not rr.access & need:
                        raise AccessDenied(f"descriptor {i}: region {rr.id} does not allow {need.name}")
                    remote_lengths[i] = rr.length
                check_remote_bounds(d, remote_lengths)
                for i in range(n):
                    if b._cancelled.is_set():
                        raise Canceled("batch canceled")
                    rr = remote._regions[int(rids[i])]
                    a, o, m = int(lo[i]), int(ro[i]), int(ln[i])
                    src, dst = (rr.addr + o, local.addr + a) if not write else (local.addr + a, rr.addr + o)
                    ctypes.memmove(dst, src, m)
            except Exception as e:  # noqa: BLE001 - reported through the batch, as the engine would
                b._error = e
            b._done.set()

        threading.Thread(target=run, daemon=True).start()
        return b

    def read(self, peer: Peer, local: Region, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
             lengths: Any, timeout_s: float | None = None) -> Batch:
        return self._xfer(peer, local, local_offsets, remote_regions, remote_offsets, lengths, False)

    def write(self, peer: Peer, local: Region, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
              lengths: Any, timeout_s: float | None = None) -> Batch:
        return self._xfer(peer, local, local_offsets, remote_regions, remote_offsets, lengths, True)

    def notify(self, peer: Peer, payload: bytes, timeout_s: float | None = None) -> None:
        self._check_open()
        with _LOCK:
            eng = _ENGINES.get(peer.address)
        if eng is None or eng._closed:
            raise PeerClosed(f"peer {peer.address} closed the connection")
        eng._notes.append((self.config.name, bytes(payload)))

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        out, self._notes = self._notes, []
        return out

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._closed = True
        if self.address is not None:
            with _LOCK:
                _ENGINES.pop(self.address, None)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
