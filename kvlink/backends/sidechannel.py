"""The Mooncake backend's side channel: an authenticated TCP exchange that
hands a peer this backend's region table and carries notifications.

Mooncake moves bytes between raw virtual addresses and leaves exchanging
them to its users. kvlink never lets those addresses reach the layers above
a backend: the initiating backend fetches the target's table (region id ->
base address, length, access) here, at connect time, and translates
(region id, offset) descriptors itself.

Wire: frames of a 4-byte big-endian length and a body (1 type byte + payload).

    server -> client  HELLO  b"H" MAGIC nonce_s(32)
    client -> server  AUTH   b"A" nonce_c(32) mac_c(32) name
    server -> client  OK     b"O" mac_s(32) name          (or ERR b"E" reason, then close)
    then each request and reply carries a 16-byte tag: HMAC(session key, seq | body)
    client -> server  TABLE  b"T"            reply b"T" json {"session": "host:port", "regions": [[id, addr, len, access]]}
    client -> server  NOTIFY b"N" payload    reply b"K"

mac_c = HMAC-SHA256(token, "kvlmc1 client" nonce_s nonce_c name), mac_s likewise
with "kvlmc1 server" and the nonces swapped, session key = HMAC-SHA256(token,
"kvlmc1 session" nonce_s nonce_c). Both sides prove the token without sending
it; a replayed or spliced frame fails its tag. Without a token (loopback
only, see EngineConfig) the key is empty: framing, no authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvlink.errors import AuthError, ConnectError, PeerClosed, ProtocolError, TimeoutError_
from kvlink.transport.config import check_name

logger = logging.getLogger(__name__)

MAGIC = b"KVLMC1"
MAX_FRAME = 1 << 20
TAG = 16


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class Tagger:
    """Per-direction sequence numbers and tags for frames after the handshake."""

    def __init__(self, key: bytes):
        self.key, self.sent, self.recvd = key, 0, 0

    def seal(self, body: bytes) -> bytes:
        self.sent += 1
        return _mac(self.key, struct.pack(">Q", self.sent), body)[:TAG] + body

    def open(self, frame: bytes) -> bytes:
        if len(frame) < TAG + 1:
            raise ProtocolError("side channel: short frame")
        self.recvd += 1
        tag, body = frame[:TAG], frame[TAG:]
        if not hmac.compare_digest(tag, _mac(self.key, struct.pack(">Q", self.recvd), body)[:TAG]):
            raise AuthError("side channel: frame tag mismatch (tampered, replayed or wrong token)")
        return body


KEEPALIVE = (60, 10, 3)  # idle s, interval s, probes: as the native engine's connections (csrc/kvl_internal.h)


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive on a side-channel connection: it stays open while idle (a decode keeps its peers), so a
    NAT or firewall on the path must not forget it, and a host that vanished must be noticed (``gone``)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, v in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
            if hasattr(socket, opt):  # Linux names; others keep the system's timers
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
    except OSError:  # (a socket the peer reset already: its first use says so)
        pass


def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; by ``deadline`` (time.monotonic) if given, else by the socket's timeout per recv. A peer
    that trickles bytes is cut off at the deadline (socket.timeout), not after one timeout per byte."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("side channel: deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerClosed("side channel: peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, deadline: float | None = None) -> bytes:
    (n,) = struct.unpack(">I", recv_exact(sock, 4, deadline))
    if not 1 <= n <= MAX_FRAME:
        raise ProtocolError(f"side channel: frame length {n} out of range")
    return recv_exact(sock, n, deadline)


def peer_name_of(raw: bytes) -> str:
    """A peer's name from its handshake: an engine name (printable ASCII, at most MAX_NAME), as the native
    engine's handshake allows; ProtocolError otherwise."""
    try:
        name = raw.decode("ascii")
        check_name(name, "the peer's name")
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"side channel: malformed peer name: {e}") from None
    return name


def encode_table(session: str, regions: list[tuple[int, int, int, int]]) -> bytes:
    return json.dumps({"session": session, "regions": [list(r) for r in regions]}).encode()


def decode_table(data: bytes) -> tuple[str, dict[int, tuple[int, int, int]]]:
    """(Mooncake session id, {region id: (addr, length, access)}); rejects malformed tables."""
    try:
        d = json.loads(data)
        session = d["session"]
        table = {}
        for rid, addr, length, access in d["regions"]:
            if not all(isinstance(v, int) and v >= 0 for v in (rid, addr, length, access)) or length <= 0 \
                    or addr + length > 1 << 64:
                raise ValueError(f"bad region entry {rid, addr, length, access}")
            table[rid] = (addr, length, access)
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ProtocolError(f"side channel: malformed region table: {type(e).__name__}: {e}") from None
    if not isinstance(session, str) or ":" not in session:
        raise ProtocolError(f"side channel: malformed Mooncake session id {session!r}")
    return session, table


class SideServer:
    """Serves the region table and receives notifications on (host, port)."""

    def __init__(self, host: str, port: int, token: bytes | None, name: str, table: Callable[[], bytes],
                 on_notify: Callable[[str, bytes], bool], handshake_timeout_s: float, max_conns: int):
        self._key = token or b""
        self._name, self._table, self._on_notify = name, table, on_notify
        self._hs_timeout, self._max_conns = handshake_timeout_s, max_conns
        self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # guarded by _lock
        # ... of those, the ones still in their handshake, oldest first (make_room); guarded by _lock
        self._handshaking: dict[socket.socket, None] = {}
        self._threads: list[threading.Thread] = []  # guarded by _lock
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_loop, name="kvlink-mc-side", daemon=True)
        self._accepter.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepter.join(5)
        for t in list(self._threads):
            t.join(5)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed or not self._make_room():
                    conn.close()
                    continue
                self._conns.add(conn)
                self._handshaking[conn] = None
                keep_alive(conn)
                t = threading.Thread(target=self._serve, args=(conn,), name="kvlink-mc-side-conn", daemon=True)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _make_room(self) -> bool:
        """Under _lock, for a new connection: at most a quarter of max_conns may be in their handshake, and
        all together max_conns. Beyond either, the connection that has waited longest in its handshake is
        closed for the new one, so sockets that connect and say nothing (or trickle) cannot keep
        authenticated peers out; with none in their handshake, the new one is refused."""
        cap = max(1, self._max_conns // 4)
        while len(self._handshaking) >= cap or len(self._conns) >= self._max_conns:
            if not self._handshaking:
                return False
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            try:
                oldest.shutdown(socket.SHUT_RDWR)  # its thread ends and drops it from _conns
            except OSError:
                pass
            self._conns.discard(oldest)
        return True

    def _serve(self, conn: socket.socket) -> None:
        try:
            deadline = time.monotonic() + self._hs_timeout  # the whole handshake, however the bytes trickle
            nonce_s = os.urandom(32)
            conn.settimeout(self._hs_timeout)
            send_frame(conn, b"H" + MAGIC + nonce_s)
            f = recv_frame(conn, deadline)
            if f[:1] != b"A" or len(f) < 65:
                raise ProtocolError("side channel: expected AUTH")
            nonce_c, mac_c, peer_name = f[1:33], f[33:65], f[65:]
            if not hmac.compare_digest(mac_c, _mac(self._key, b"kvlmc1 client", nonce_s, nonce_c, peer_name)):
                send_frame(conn, b"Eauthentication failed")
                raise AuthError("side channel: a peer failed authentication (wrong token)")
            sender = peer_name_of(peer_name)
            with self._lock:  # welcomed: never closed as still in its handshake from here on
                if self._handshaking.pop(conn, False) is False:
                    return  # closed for a newer connection meanwhile
            name = self._name.encode()
            send_frame(conn, b"O" + _mac(self._key, b"kvlmc1 server", nonce_c, nonce_s, name) + name)
            tag = Tagger(_mac(self._key, b"kvlmc1 session", nonce_s, nonce_c))
            conn.settimeout(None)
            while True:
                body = tag.open(recv_frame(conn))
                if body == b"T":
                    send_frame(conn, tag.seal(b"T" + self._table()))
                elif body[:1] == b"N" and len(body) > 1:
                    send_frame(conn, tag.seal(b"K" if self._on_notify(sender, body[1:]) else b"F"))
                else:
                    raise ProtocolError(f"side channel: unknown request {body[:1]!r}")
        except (PeerClosed, OSError):
            pass
        except (AuthError, ProtocolError) as e:
            logger.warning("kvlink mooncake side channel: refused a peer: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._handshaking.pop(conn, None)
            conn.close()


class SideClient:
    """One authenticated connection to a peer's side channel."""

    def __init__(self, host: str, port: int, token: bytes | None, name: str, connect_timeout_s: float,
                 handshake_timeout_s: float):
        key = token or b""
        try:
            self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as e:
            raise ConnectError(f"mooncake side channel {host}:{port}: {e}") from None
        keep_alive(self._sock)
        self._lock = threading.Lock()
        try:
            deadline = time.monotonic() + handshake_timeout_s  # the whole handshake, however the bytes trickle
            f = recv_frame(self._sock, deadline)
            if f[:1] != b"H" or f[1:7] != MAGIC or len(f) != 39:
                raise ProtocolError("side channel: the peer is not a kvlink Mooncake backend (bad HELLO)")
            nonce_s, nonce_c = f[7:39], os.urandom(32)
            me = name.encode()
            send_frame(self._sock, b"A" + nonce_c + _mac(key, b"kvlmc1 client", nonce_s, nonce_c, me) + me)
            f = recv_frame(self._sock, deadline)
            if f[:1] == b"E":
                raise AuthError(f"side channel: peer refused us: {f[1:].decode('ascii', 'replace')}")
            if f[:1] != b"O" or len(f) < 33:
                raise ProtocolError("side channel: expected OK")
            mac_s, peer_name = f[1:33], f[33:]
            if not hmac.compare_digest(mac_s, _mac(key, b"kvlmc1 server", nonce_c, nonce_s, peer_name)):
                raise AuthError("side channel: the peer does not hold our token")
            self.peer_name = peer_name_of(peer_name)
            self._tag = Tagger(_mac(key, b"kvlmc1 session", nonce_s, nonce_c))
        except socket.timeout:
            self._sock.close()
            raise TimeoutError_("side channel: handshake timed out") from None
        except BaseException:
            self._sock.close()
            raise

    def request(self, body: bytes, timeout_s: float) -> bytes:
        with self._lock:
            try:
                deadline = time.monotonic() + timeout_s
                self._sock.settimeout(timeout_s)
                send_frame(self._sock, self._tag.seal(body))
                return self._tag.open(recv_frame(self._sock, deadline))
            except socket.timeout:
                self._sock.close()  # a late reply would desynchronize the tags: this connection is done
                raise TimeoutError_("side channel: request timed out") from None
            except OSError as e:
                raise PeerClosed(f"side channel: {e}") from None

    def gone(self) -> bool:
        """The peer closed this connection (its process ended: a restart at the same address is another
        process, whose memory the cached table does not describe). Nothing arrives unasked on it, so
        anything readable between requests is the end."""
        if not self._lock.acquire(blocking=False):
            return False  # a request is under way: it will tell
        try:
            self._sock.setblocking(False)
            try:
                return self._sock.recv(1, socket.MSG_PEEK) == b""
            except (BlockingIOError, InterruptedError):
                return False
            finally:
                self._sock.setblocking(True)
        except OSError:  # closed (here, or by close() meanwhile)
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        self._sock.close()
