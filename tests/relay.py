"""The suite's one network relay: a TCP relay on 127.0.0.1 in front of a real engine that forwards both
directions between each client and the upstream, for tests that reach the engine through ``address``
(an initiator's ``connect``, or decode through ``transport_advertise``).

Its options act on the upstream-to-client direction, where READ data flows: ``flip_after`` flips one
byte (once, at that offset of a connection's stream) so CRC has something to catch; ``rate`` throttles
it (bytes/s, None = full speed, changeable while running with ``throttle``) so a pull is held slow on
purpose, or so a benchmark sees a link of that rate. ``refuse_type`` acts on the other direction: a client
frame of that type is not passed on but answered with an ERROR frame, and the connection closed, as an
engine that predates the frame type does (version skew). ``hold_next`` keeps the upstream's answers on one
coming connection back until the test lets them through (a peer slow mid-handshake), and ``retarget``
sends the connections accepted from then on to another upstream (another process at the address).

The rate is one link's: every connection's bytes share it, each chunk leaving when the link has carried
the bytes before it (a clock of when the link is next free). A pump thread that wakes late sends its
next chunk at once, so up to ``SLACK_S`` of a late wake-up is caught up instead of lost, as a NIC keeps
sending while a CPU is busy; an idle link earns no more credit than that. ``realtime`` runs the pump
threads SCHED_FIFO where allowed, so a busy CPU does not slow the emulated wire (benchmarks). Both of
its sockets are TCP_NODELAY: without it the end of a READ's answer waited behind the client's delayed
ACK (Nagle), and a 4 MB READ took 50 ms instead of 12 over a 326 MB/s link.
"""

from __future__ import annotations

import os
import socket
import threading
import time


class Relay:
    CHUNK = 8192  # recv size while throttled: the rate applies in small steps, not 64 KiB bursts
    SLACK_S = 0.002  # how far behind the link's clock a chunk may start (a pump that woke late)

    def __init__(self, upstream: str, *, flip_after: int | None = None, rate: float | None = None,
                 realtime: bool = False, refuse_type: int | None = None) -> None:
        host, _, port = upstream.rpartition(":")
        self.refuse_type = refuse_type
        self.refused = 0  # frames refused so far
        self.realtime = realtime
        self._link_free = 0.0  # when the link has carried every throttled byte so far (monotonic)
        self.upstream = (host, int(port))
        self.flip_after = flip_after
        self.flipped = False
        self.rate: float | None = None
        self.first_byte = threading.Event()  # set when throttled data starts to flow
        self.first_at = self.last_at = 0.0  # bracket the throttled bytes
        self.up_at = self.down_at = 0.0  # when data last went upstream (a request) and was last delivered down
        self.throttled_bytes = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._accepted = 0  # connections accepted so far
        self._holds: dict[int, threading.Event] = {}  # by accept index: its answers wait for the event
        self._held: list[threading.Event] = []  # every hold given out (close lets them all go)
        self.throttle(rate)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)  # accept polls: closing a socket does not wake a thread blocked in accept
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def throttle(self, rate: float | None) -> None:
        """Limit upstream-to-client data to ``rate`` bytes/s from now on; a rate starts the counters afresh,
        None (full speed) keeps them for the test to read."""
        with self._lock:
            self.rate = rate
            if rate is not None:
                self.first_byte.clear()
                self.first_at = self.last_at = self._link_free = 0.0
                self.throttled_bytes = 0

    def throttled(self) -> tuple[int, float]:
        """(bytes, seconds from the first to the last of them) throttled since the last ``throttle(rate)``."""
        with self._lock:
            return self.throttled_bytes, self.last_at - self.first_at

    def awaiting_answer(self) -> bool:
        """A client sent something upstream (a READ request: the transport sends nothing unasked) after the
        last data the relay delivered to a client: an answer is still owed."""
        with self._lock:
            return self.up_at > self.down_at

    def hold_next(self, skip: int = 0) -> threading.Event:
        """The upstream's answers on the connection accepted after ``skip`` others from now wait until the
        returned event is set."""
        ev = threading.Event()
        with self._lock:
            self._holds[self._accepted + skip] = ev
            self._held.append(ev)
        return ev

    def retarget(self, upstream: str) -> None:
        """Connections accepted from now on go to ``upstream`` (those already open stay where they are)."""
        host, _, port = upstream.rpartition(":")
        with self._lock:
            self.upstream = (host, int(port))

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                c, _ = self.sock.accept()  # blocking: a listener's timeout is not inherited
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return  # closed
            with self._lock:
                upstream, hold = self.upstream, self._holds.pop(self._accepted, None)
                self._accepted += 1
            try:
                u = socket.create_connection(upstream, timeout=5)
                u.settimeout(None)
                for s in (c, u):  # a wire forwards what it has: no Nagle hold behind a delayed ACK (40 ms)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._socks += [c, u]
            up = self._pump if self.refuse_type is None else self._pump_frames
            threading.Thread(target=up, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True, hold), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool,
              hold: threading.Event | None = None) -> None:
        if hold is not None:
            hold.wait()
        if self.realtime:
            try:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(20))  # this thread only
            except (OSError, AttributeError):
                pass
        seen = 0  # bytes of this connection's stream already forwarded
        try:
            while True:
                data = src.recv(self.CHUNK if downstream and self.rate else 1 << 16)
                if not data:
                    break
                if downstream:
                    data = self._corrupt(data, seen)
                    seen += len(data)
                    rate = self.rate  # read after recv: bytes that arrive after throttle() are all throttled
                    if rate:
                        self._throttle_chunk(len(data), rate)
                if not downstream:
                    with self._lock:  # before it is passed on: the answer is delivered after this
                        self.up_at = time.monotonic()
                dst.sendall(data)
                if downstream:
                    with self._lock:
                        self.down_at = time.monotonic()
        except OSError:
            pass
        finally:
            _shut(src, dst)

    def _pump_frames(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        """Client to upstream, frame by frame, refusing ``refuse_type`` frames."""
        from tests import wire

        try:
            while True:
                hdr = wire.recv_exact(src, wire.HDR.size)
                magic, version, ftype, flags, seq, body_len = wire.HDR.unpack(hdr)
                body = wire.recv_exact(src, body_len)
                if ftype == self.refuse_type:
                    with self._lock:
                        self.refused += 1
                    src.sendall(wire.frame(wire.ERROR, wire.status_body(-10, msg=f"unexpected frame type {ftype}"),
                                           seq=seq))
                    break
                dst.sendall(hdr + body)
        except (OSError, ConnectionError, EOFError):
            pass
        finally:
            _shut(src, dst)

    def _corrupt(self, data: bytes, seen: int) -> bytes:
        if self.flip_after is None or not seen <= self.flip_after < seen + len(data):
            return data
        with self._lock:
            if self.flipped:
                return data
            self.flipped = True
        i = self.flip_after - seen
        return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]

    def _throttle_chunk(self, n: int, rate: float) -> None:
        with self._lock:
            now = time.monotonic()
            if not self.first_byte.is_set():
                self.first_at = now
                self.first_byte.set()
            self.throttled_bytes += n
            self._link_free = leaves = max(self._link_free, now - self.SLACK_S) + n / rate
        delay = leaves - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the throttle itself, not synchronization
        with self._lock:
            self.last_at = time.monotonic()

    def close(self) -> None:
        """Stop accepting and drop every relayed connection (the peers see them close). Idempotent."""
        self._closed.set()
        self.sock.close()
        for ev in self._held:
            ev.set()
        self.drop()

    def drop(self) -> None:
        """Drop every relayed connection (the peers see them close); new ones are still relayed."""
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


def _shut(*socks: socket.socket) -> None:
    """Shut both ways (the peers see the connection end; a pump blocked in recv wakes)."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
