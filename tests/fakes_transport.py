"""An in-process fake of kvlink.transport with the same surface (Engine, EngineConfig, Access, ...).

Engines find each other through a module-level table keyed by address; READ/WRITE copy bytes with
ctypes.memmove between registered regions, on a background thread so batches complete asynchronously.
Tests switch a module to it with ``install(monkeypatch, module)`` or use it directly.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import time
from dataclasses import dataclass

import numpy as np


class KVLinkError(Exception):
    code = -1
    name = "EFAKE"


class TimeoutError_(KVLinkError, TimeoutError):
    name = "ETIMEDOUT"


class PeerGone(KVLinkError):
    name = "ECONNRESET"


class Access(enum.IntFlag):
    READ = 1
    WRITE = 2


@dataclass(frozen=True)
class EngineConfig:
    listen: str = "127.0.0.1:0"
    token: bytes | None = None
    name: str = "fake"
    streams: int = 2
    crc: bool = False
    op_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    allow_insecure: bool = False


_ENGINES: dict[str, "Engine"] = {}
_PORTS = itertools.count(40000)
_LOCK = threading.Lock()


def _addr_len(obj):
    if isinstance(obj, tuple):
        return int(obj[0]), int(obj[1])
    if hasattr(obj, "data_ptr"):
        return obj.data_ptr(), obj.numel() * obj.element_size()
    arr = np.frombuffer(obj, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


class Region:
    def __init__(self, eng, rid, addr, length, access, keep):
        self._eng, self.id, self.addr, self.length, self.access, self._keep = eng, rid, addr, length, access, keep

    def unregister(self):
        self._eng._regions.pop(self.id, None)


@dataclass(frozen=True)
class Peer:
    address: str
    name: str


class Batch:
    def __init__(self):
        self._done = threading.Event()
        self._error: Exception | None = None
        self._cancelled = False

    def poll(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise self._error
        return self._done.is_set()

    def wait(self, timeout_s=None):
        if not self._done.wait(timeout_s):
            self.cancel()
            raise TimeoutError_("batch timed out")
        if self._error is not None:
            raise self._error

    def cancel(self):
        self._cancelled = True
        self._done.wait(5)


class Engine:
    # Test hooks: delay every batch by this many seconds; fail every batch with this error.
    delay_s = 0.0
    fail_with: Exception | None = None

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        host = cfg.listen.rsplit(":", 1)[0]
        self.address = f"{host}:{next(_PORTS)}"
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count(1)
        self._notes: list[tuple[str, bytes]] = []
        self._closed = False
        with _LOCK:
            _ENGINES[self.address] = self

    def register(self, obj, access=Access.READ | Access.WRITE):
        addr, length = _addr_len(obj)
        r = Region(self, next(self._ids), addr, length, access, obj)
        self._regions[r.id] = r
        return r

    def connect(self, address: str) -> Peer:
        with _LOCK:
            eng = _ENGINES.get(address)
        if eng is None or eng._closed:
            raise PeerGone(f"cannot reach {address}")
        if eng.cfg.token != self.cfg.token:
            raise KVLinkError("authentication failed")
        return Peer(address, eng.cfg.name)

    def _xfer(self, peer, local_region, lo, rids, ro, ln, write):
        b = Batch()
        lo = np.asarray(lo, np.uint64)
        n = len(lo)
        rids = np.broadcast_to(np.asarray(rids, np.uint32), (n,))
        ro = np.asarray(ro, np.uint64)
        ln = np.broadcast_to(np.asarray(ln, np.uint64), (n,))

        def run():
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)
                if self.fail_with is not None:
                    raise self.fail_with
                remote = _ENGINES.get(peer.address)
                if remote is None or remote._closed:
                    raise PeerGone(f"peer {peer.address} gone")
                for i in range(n):
                    if b._cancelled:
                        raise KVLinkError("cancelled")
                    rr = remote._regions.get(int(rids[i]))
                    if rr is None:
                        raise KVLinkError(f"unknown remote region {int(rids[i])}")
                    a, o, m = int(lo[i]), int(ro[i]), int(ln[i])
                    if a + m > local_region.length or o + m > rr.length:
                        raise KVLinkError("descriptor out of bounds")
                    src, dst = (rr.addr + o, local_region.addr + a) if not write else \
                        (local_region.addr + a, rr.addr + o)
                    ctypes.memmove(dst, src, m)
            except Exception as e:  # noqa: BLE001 - reported through the batch
                b._error = e
            b._done.set()

        threading.Thread(target=run, daemon=True).start()
        return b

    def read(self, peer, local_region, local_offsets, remote_region_ids, remote_offsets, lengths,
             timeout_s=None):
        return self._xfer(peer, local_region, local_offsets, remote_region_ids, remote_offsets, lengths, False)

    def write(self, peer, local_region, local_offsets, remote_region_ids, remote_offsets, lengths,
              timeout_s=None):
        return self._xfer(peer, local_region, local_offsets, remote_region_ids, remote_offsets, lengths, True)

    def notify(self, peer, payload: bytes):
        eng = _ENGINES.get(peer.address)
        if eng is None:
            raise PeerGone(peer.address)
        eng._notes.append((self.cfg.name, bytes(payload)))

    def drain_notifications(self):
        out, self._notes = self._notes, []
        return out

    def close(self):
        self._closed = True
        with _LOCK:
            _ENGINES.pop(self.address, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_backend(kind: str, config: EngineConfig) -> Engine:
    """Same signature as kvlink.transport.open_backend; every kind is the in-process fake."""
    return Engine(config)


# ----- network fakes for the real-vLLM tests ------------------------------------------------------------


class ThrottledRelay:
    """A TCP relay in front of a real transport engine (advertised to decode via ``transport_advertise``).

    ``rate`` (bytes/s, None = unthrottled) limits the engine-to-client direction, where READ data flows,
    so a pull can be held slow on purpose. ``first_byte`` is set when throttled data starts to flow;
    ``first_at`` / ``last_at`` bracket the throttled bytes.
    """

    CHUNK = 8192

    def __init__(self, upstream: str):
        import socket

        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.rate: float | None = None
        self.first_byte = threading.Event()
        self.first_at = self.last_at = 0.0
        self.throttled_bytes = 0
        self._socks: list = []
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def throttle(self, rate: float | None) -> None:
        """Limit READ data to ``rate`` bytes/s from now on (None: full speed, counters kept)."""
        with self._lock:
            self.rate = rate
            if rate is not None:
                self.first_byte.clear()
                self.first_at = self.last_at = 0.0
                self.throttled_bytes = 0

    def _accept(self) -> None:
        import socket

        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return  # closed
            try:
                u = socket.create_connection(self.upstream, timeout=5)
                u.settimeout(None)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src, dst, downstream: bool) -> None:
        import socket

        try:
            while True:
                data = src.recv(self.CHUNK if downstream and self.rate else 1 << 16)
                if not data:
                    break
                rate = self.rate if downstream else None  # read after recv: bytes that arrive after
                if rate:                                  # throttle() are all throttled
                    with self._lock:
                        if not self.first_byte.is_set():
                            self.first_at = time.monotonic()
                            self.first_byte.set()
                        self.throttled_bytes += len(data)
                    time.sleep(len(data) / rate)  # the throttle itself, not synchronization
                    with self._lock:
                        self.last_at = time.monotonic()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        import socket

        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:  # shutdown first: a pump thread blocked in recv would keep a bare close() from
            try:         # sending anything, and the peers would not see the connection drop
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass


class StalledPeer:
    """Accepts TCP connections and never answers (a hung prefill: bootstrap or transport)."""

    def __init__(self):
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.url = f"http://{self.address}"
        self.accepted = threading.Event()
        self._conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(c)  # kept open, never read from or written to
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass
