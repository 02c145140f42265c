"""Configuration of the bootstrap server: one frozen, validated object, read once at the edge."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from pathlib import Path

from kvlink.bootstrap.errors import BootstrapConfigError
from kvlink.bootstrap.schema import MAX_IDS_PER_CALL, MAX_LEASE_S, is_token

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableLimits:
    """The limits the pairing table enforces (a slice of :class:`BootstrapConfig`)."""

    default_request_lease_s: float = 30.0
    max_lease_s: float = 600.0
    max_tombstones: int = 50_000
    tombstone_ttl_s: float = 600.0
    max_pending_outcomes: int = 200_000
    max_engines: int = 4096
    max_ranks_per_engine: int = 4096
    max_requests_per_engine: int = 262_144


@dataclasses.dataclass(frozen=True, kw_only=True)
class BootstrapConfig:
    """Everything the server reads; validated on construction (``BootstrapConfigError``, a ``ValueError``).

    With ``token`` set every route but ``GET /health`` needs ``Authorization: Bearer <token>``. Without a
    token the server binds only to a loopback address unless ``allow_insecure`` says otherwise.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = dataclasses.field(default=None, repr=False)
    allow_insecure: bool = False
    max_body_bytes: int = 4 << 20
    default_request_lease_s: float = 30.0
    max_lease_s: float = 600.0
    max_wait_s: float = 30.0
    max_lookup_ids: int = 4096
    max_waiters: int = 100_000
    max_tombstones: int = 50_000
    tombstone_ttl_s: float = 600.0
    max_pending_outcomes: int = 200_000
    max_engines: int = 4096
    max_ranks_per_engine: int = 4096
    max_requests_per_engine: int = 262_144
    sweep_interval_s: float = 0.5
    shutdown_timeout_s: float = 2.0
    # A connection that sends no request for this long is closed (aiohttp's own default is an hour, which
    # let anyone, token or not, hold descriptors until the server could accept no one); a body must arrive
    # within body_timeout_s of its headers.
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 10.0
    # Client connections open at once; one more is answered 503 and closed unread (gate.py). A busy decode
    # engine holds up to 18 per rank with one server (its worker's 16 resolver threads long-poll, a lease
    # renewal and its check) and 12 from its scheduler (releases, abandon waits), so 4096 admits 16 engines
    # of TP 8 (~2500) with room to spare, while 4096 idle sockets cost ~25 MB and stay well inside a server
    # process's descriptors (vLLM raises its soft RLIMIT_NOFILE to 65535; ``kvlink bootstrap`` raises its
    # own; start warns if it is low).
    max_connections: int = 4096

    @property
    def max_long_polls(self) -> int:
        """Long polls waiting at once: three quarters of ``max_connections``, so waiting decodes cannot take
        every connection from the publishes and heartbeats that end their waits."""
        return max(1, self.max_connections - self.max_connections // 4)

    def __post_init__(self) -> None:
        if not self.host:
            raise BootstrapConfigError("host must not be empty", field="host")
        if not 0 <= self.port < 65536:
            raise BootstrapConfigError(f"port {self.port} is not in 0..65535", field="port")
        if self.token is not None:
            if not is_token(self.token):
                raise BootstrapConfigError(
                    "token must be non-empty printable ASCII without surrounding whitespace or line breaks",
                    field="token"
                )
        elif not self.allow_insecure and not is_loopback(self.host):
            raise BootstrapConfigError(
                f"refusing to serve {self.host!r} without a token: give a token, bind a loopback address, "
                "or opt in with allow_insecure",
                field="host",
            )
        positive = ("default_request_lease_s", "max_lease_s", "max_wait_s", "sweep_interval_s", "tombstone_ttl_s",
                    "idle_timeout_s", "body_timeout_s")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise BootstrapConfigError(f"{name} must be a positive finite number, not {value!r}", field=name)
        if self.max_lease_s > MAX_LEASE_S:
            raise BootstrapConfigError(f"max_lease_s must be at most {MAX_LEASE_S}", field="max_lease_s")
        if self.default_request_lease_s > self.max_lease_s:
            raise BootstrapConfigError(
                "default_request_lease_s exceeds max_lease_s", field="default_request_lease_s"
            )
        if not 1 <= self.max_lookup_ids <= MAX_IDS_PER_CALL:
            raise BootstrapConfigError(f"max_lookup_ids must be in 1..{MAX_IDS_PER_CALL}", field="max_lookup_ids")
        for name in ("max_body_bytes", "max_waiters", "max_tombstones", "max_pending_outcomes", "max_engines",
                     "max_ranks_per_engine", "max_requests_per_engine", "max_connections"):
            if getattr(self, name) < 1:
                raise BootstrapConfigError(f"{name} must be at least 1", field=name)
        if self.shutdown_timeout_s < 0:
            raise BootstrapConfigError("shutdown_timeout_s must not be negative", field="shutdown_timeout_s")

    @classmethod
    def with_token_file(cls, token_file: str | Path | None, **kwargs: object) -> BootstrapConfig:
        """A config whose token is the content of ``token_file`` (stripped); ``None`` means no token."""
        token = None
        if token_file is not None:
            try:
                token = Path(token_file).read_text(encoding="utf-8").strip()
            except OSError as err:
                raise BootstrapConfigError(f"cannot read token file: {err}", field="token_file") from None
            except UnicodeDecodeError:
                raise BootstrapConfigError(f"token file {token_file} is not UTF-8 text", field="token_file") from None
            if not token:
                raise BootstrapConfigError(f"token file {token_file} is empty", field="token_file")
        return cls(token=token, **kwargs)  # type: ignore[arg-type]

    def table_limits(self) -> TableLimits:
        return TableLimits(
            default_request_lease_s=self.default_request_lease_s,
            max_lease_s=self.max_lease_s,
            max_tombstones=self.max_tombstones,
            tombstone_ttl_s=self.tombstone_ttl_s,
            max_pending_outcomes=self.max_pending_outcomes,
            max_engines=self.max_engines,
            max_ranks_per_engine=self.max_ranks_per_engine,
            max_requests_per_engine=self.max_requests_per_engine,
        )
