"""An in-process fake of kvlink's transport backend: an Engine with the backend contract's surface.

Engines find each other through a module-level table keyed by address; READ/WRITE copy bytes with
ctypes.memmove between registered regions, on a background thread so batches complete asynchronously.
The configuration, access flags, capabilities and errors are kvlink's own (kvlink.transport,
kvlink.errors): code under test sees what the real engine would give it. Tests register it as a backend
(``kvlink.backends.register_backend("fake", lambda config, options: Engine(config))``) or use ``Engine``.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlink.errors import (AccessDenied, AuthError, Canceled, Closed, ConnectError, OutOfRange, PeerClosed,
                           TimeoutError_, UnknownRegion)
from kvlink.transport import Access, Capabilities, EngineConfig
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
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
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
        it had already finished (its outcome stands)."""
        if self._done.is_set():
            return False
        self._cancelled.set()
        self._done.wait(5)
        return isinstance(self._error, Canceled)

    def release(self) -> None:
        """Nothing to free (kept for parity with the native Batch)."""


class Engine:
    # Test hooks: delay every batch by this many seconds; fail every batch with this error.
    delay_s = 0.0
    fail_with: Exception | None = None

    kind = "fake"

    def __init__(self, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
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

    def connect(self, address: str) -> Peer:
        self._check_open()
        with _LOCK:
            eng = _ENGINES.get(address)
        if eng is None or eng._closed:
            raise ConnectError(f"cannot reach {address}: no fake engine listens there")
        if eng.config.token != self.config.token:
            raise AuthError(f"authentication with {address} failed: the peers hold different tokens")
        return Peer(address, eng.config.name)

    def _xfer(self, peer: Peer, local: Region, lo: Any, rids: Any, ro: Any, ln: Any, write: bool) -> Batch:
        self._check_open()
        lo = np.asarray(lo, np.uint64).reshape(-1)
        n = len(lo)
        rids = np.broadcast_to(np.asarray(rids, np.uint32), (n,))
        ro = np.asarray(ro, np.uint64).reshape(-1)
        ln = np.broadcast_to(np.asarray(ln, np.uint64), (n,))
        b = Batch(int(ln.sum()))
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
                for i in range(n):
                    if b._cancelled.is_set():
                        raise Canceled("batch canceled")
                    rr = remote._regions.get(int(rids[i]))
                    if rr is None:
                        raise UnknownRegion(f"descriptor {i}: peer {peer.address} has no region {int(rids[i])}")
                    if not rr.access & need:
                        raise AccessDenied(f"descriptor {i}: region {rr.id} does not allow {need.name}")
                    a, o, m = int(lo[i]), int(ro[i]), int(ln[i])
                    if a + m > local.length or o + m > rr.length:
                        raise OutOfRange(f"descriptor {i}: {m} B at local {a} / remote {o} runs past a region "
                                         f"(local {local.length} B, remote {rr.length} B)")
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
