"""A second, independent implementation of kvlink's wire format (docs/protocol.md),
in Python, for tests that play a hostile or slow peer over real sockets."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

MAGIC = 0x4B4C564B
VERSION = 1
HDR = struct.Struct("<IBBHII")  # magic, version, type, flags, seq, body_len
HELLO, CHALLENGE, AUTH, WELCOME, READ_REQ, READ_RESP, WRITE_REQ, WRITE_RESP, NOTIFY, NOTIFY_ACK, ERROR = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15)
LPROBE, LPROBE_RESP = 16, 17  # the same-host probe
F_CRC = 1
LABEL_SERVER = b"kvlink-v1 server proof"
LABEL_CLIENT = b"kvlink-v1 client proof"
DESC = struct.Struct("<IIQQ")  # region, reserved, offset, length
STATUS = struct.Struct("<iIQH")  # status, index, total, msg_len


def frame(ftype: int, body: bytes = b"", *, seq: int = 0, flags: int = 0, version: int = VERSION,
          magic: int = MAGIC, body_len: int | None = None) -> bytes:
    return HDR.pack(magic, version, ftype, flags, seq, len(body) if body_len is None else body_len) + body


def hello_body(nonce: bytes, has_token: bool, name: str = "test-peer", mac: bytes | None = None) -> bytes:
    n = name.encode()
    return nonce + (mac or b"") + bytes([1 if has_token else 0, len(n)]) + n


def proof(token: bytes, label: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(token, label + nc + ns, hashlib.sha256).digest()


def descs_body(descs: list[tuple[int, int, int]]) -> bytes:
    return struct.pack("<II", len(descs), 0) + b"".join(DESC.pack(r, 0, o, n) for r, o, n in descs)


def status_body(status: int, total: int = 0, index: int = 0, msg: str = "") -> bytes:
    m = msg.encode()
    return STATUS.pack(status, index, total, len(m)) + m


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[tuple, bytes]:
    hdr = HDR.unpack(recv_exact(sock, HDR.size))
    return hdr, recv_exact(sock, hdr[5])


def parse_status(body: bytes) -> tuple[int, int, int, str]:
    st, idx, total, ml = STATUS.unpack_from(body)
    return st, idx, total, body[STATUS.size:STATUS.size + ml].decode()


def client_handshake(sock: socket.socket, token: bytes | None, name: str = "test-peer") -> str:
    """Authenticate to an engine as a client; returns the server's name."""
    nc = os.urandom(32)
    sock.sendall(frame(HELLO, hello_body(nc, token is not None, name)))
    (_, _, ftype, _, _, _), body = recv_frame(sock)
    if ftype == ERROR:
        raise PermissionError(parse_status(body)[3])
    ns, mac_s = body[:32], body[32:64]
    if token is not None and not hmac.compare_digest(mac_s, proof(token, LABEL_SERVER, nc, ns)):
        raise PermissionError("server failed to prove the token")
    sock.sendall(frame(AUTH, proof(token, LABEL_CLIENT, nc, ns) if token else bytes(32)))
    (_, _, ftype, _, _, _), welcome = recv_frame(sock)
    if ftype != WELCOME:
        raise PermissionError(parse_status(welcome)[3])
    return body[66:66 + body[65]].decode()


def server_handshake(sock: socket.socket, token: bytes | None, name: str = "fake-target") -> None:
    """Answer an engine's connection as a server."""
    _, body = recv_frame(sock)
    nc = body[:32]
    ns = os.urandom(32)
    mac = proof(token, LABEL_SERVER, nc, ns) if token else bytes(32)
    sock.sendall(frame(CHALLENGE, hello_body(ns, token is not None, name, mac)))
    recv_frame(sock)  # AUTH (not checked: this fake trusts its clients)
    sock.sendall(frame(WELCOME))


def connect(address: str, timeout: float = 5.0) -> socket.socket:
    host, _, port = address.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
