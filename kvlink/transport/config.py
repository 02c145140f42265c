"""EngineConfig: the transport engine's settings, validated once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MAX_NAME = 64
MAX_STREAMS = 16  # csrc/kvl.h KVL_MAX_STREAMS (this module does not load the C core: a test checks they agree)
MAX_PEERS = 4096  # csrc/kvl.h KVL_MAX_PEERS (the same)


def split_hostport(addr: str, what: str = "address") -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with a clear error."""
    if not isinstance(addr, str) or ":" not in addr:
        raise ValueError(f"{what} must be 'host:port', got {addr!r}")
    host, _, port_s = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"{what} {addr!r}: port {port_s!r} is not a number") from None
    if not host or not 0 <= port <= 65535:
        raise ValueError(f"{what} {addr!r}: need a host and a port in 0..65535")
    return host, port


def join_hostport(host: str, port: int) -> str:
    """The inverse of split_hostport: brackets an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_name(name: object, what: str, empty: bool = True) -> None:
    """An engine name as the handshake carries it: printable ASCII of at most MAX_NAME characters."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not name.isprintable() or not name.isascii() \
            or not (empty or name):
        raise ValueError(f"{what} must be printable ASCII of {'' if empty else '1 to '}at most {MAX_NAME} "
                         f"characters, got {name!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one transport engine.

    listen: 'host:port' to serve peers on (port 0: ephemeral), or None for an
        initiator-only engine.
    token: pre-shared token; peers must hold the same one. Without a token
        the engine only listens on loopback unless allow_insecure is set.
    streams: TCP connections per peer; large batches are striped over them.
    crc: verify a CRC32C of every descriptor this engine receives.
    max_conns: connections this engine serves at once (a prefill rank: every decode rank that reads it
        holds ``streams`` of them while it keeps the peer); beyond it a new connection is refused.
    max_peers: peers this engine connects to at once (a decode rank: one per prefill rank it reads); with
        the table full a connect closes the least recently used idle peer (the native engine; Mooncake's
        has no such table).
    """

    listen: str | None = "127.0.0.1:0"
    token: bytes | None = None
    name: str = "kvlink"
    streams: int = 2
    crc: bool = False
    op_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    allow_insecure: bool = False
    max_conns: int = 4096
    # "off", "auto" or "require": copy same-host peers' memory directly, and serve such copies ("off": neither)
    same_host: str = "off"
    max_peers: int = 1024  # (last: fields are also passed by position)

    def __post_init__(self) -> None:
        if self.listen is not None:
            host, _ = split_hostport(self.listen, "listen")
            if self.token is None and not self.allow_insecure and not is_loopback(host):
                raise ValueError(
                    f"listen={self.listen!r} without a token: an unauthenticated listener is only allowed on "
                    "loopback; set token, or allow_insecure=True to opt in")
        if self.token is not None and (not isinstance(self.token, bytes) or not 1 <= len(self.token) <= 1024):
            raise ValueError("token must be 1..1024 bytes")
        check_name(self.name, "name")
        if not isinstance(self.streams, int) or not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"streams must be 1..{MAX_STREAMS}, got {self.streams!r}")
        for field in ("op_timeout_s", "connect_timeout_s", "handshake_timeout_s"):
            v = getattr(self, field)
            if not isinstance(v, (int, float)) or not 0.001 <= v <= 3600:
                raise ValueError(f"{field} must be between 0.001 and 3600 seconds, got {v!r}")
        if self.same_host not in ("off", "auto", "require"):
            raise ValueError(f"same_host must be 'off', 'auto' or 'require', got {self.same_host!r}")
        if not isinstance(self.max_conns, int) or not 1 <= self.max_conns <= 65536:
            raise ValueError(f"max_conns must be 1..65536, got {self.max_conns!r}")
        if not isinstance(self.max_peers, int) or isinstance(self.max_peers, bool) \
                or not 1 <= self.max_peers <= MAX_PEERS:
            raise ValueError(f"max_peers must be 1..{MAX_PEERS}, got {self.max_peers!r}")

    @staticmethod
    def read_token_file(path: str) -> bytes:
        with open(path, "rb") as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
