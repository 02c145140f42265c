"""The proxy's configuration: one frozen, validated object built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlink.bootstrap.schema import is_token
from kvlink.vllm.params import BadParams, check

MODES = ("sequential", "concurrent")


@dataclass(frozen=True)
class ProxyConfig:
    """Where the proxy listens and which vLLM servers it routes to.

    ``prefill_bootstrap`` and ``prefill_engine_ids`` are only used in concurrent mode: they are the
    bootstrap URL and engine id of each prefill server, in the same order as ``prefill`` (a single
    value applies to all). Without an engine id the decode side learns it from the bootstrap server
    by transfer id. Both follow the rules of the kv_transfer_params fields they become
    (``remote_bootstrap_addr``, ``remote_engine_id``): a value decode would refuse is refused here, at
    start-up; bootstrap URLs are kept in their checked form.
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "sequential"
    timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    prefill_bootstrap: tuple[str, ...] = ()
    prefill_engine_ids: tuple[str, ...] = ()
    # the bootstrap servers' bearer token, for reporting prefill requests decode never took (release.py)
    bootstrap_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ValueError("at least one --prefill URL is required")
        if not self.decode:
            raise ValueError("at least one --decode URL is required")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://: {url!r}")
        object.__setattr__(self, "prefill_bootstrap", _checked("--prefill-bootstrap", "remote_bootstrap_addr",
                                                               self.prefill_bootstrap))
        object.__setattr__(self, "prefill_engine_ids", _checked("--prefill-engine-id", "remote_engine_id",
                                                                self.prefill_engine_ids))
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.bootstrap_token is not None and not is_token(self.bootstrap_token):
            raise ValueError("the bootstrap token must be non-empty printable ASCII without surrounding whitespace "
                             "or line breaks")
        for name, v in (("--timeout", self.timeout_s), ("--connect-timeout", self.connect_timeout_s)):
            if not (isinstance(v, (int, float)) and 0 < v <= 86_400):  # (NaN fails too)
                raise ValueError(f"{name} must be a number of seconds in (0, 86400], got {v!r}")
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port out of range: {self.port}")
        if self.mode == "concurrent":
            if not self.prefill_bootstrap:
                raise ValueError("concurrent mode needs --prefill-bootstrap URL (the prefill's "
                                 "kvlink bootstrap server, one per --prefill or one for all)")
            if len(self.prefill_bootstrap) not in (1, len(self.prefill)):
                raise ValueError("give one --prefill-bootstrap per --prefill, or exactly one")
            if len(self.prefill_engine_ids) not in (0, 1, len(self.prefill)):
                raise ValueError("give one --prefill-engine-id per --prefill, exactly one, or none")

    def bootstrap_for(self, prefill_index: int) -> str:
        b = self.prefill_bootstrap
        return b[0] if len(b) == 1 else b[prefill_index]

    def engine_id_for(self, prefill_index: int) -> str | None:
        ids = self.prefill_engine_ids
        if not ids:
            return None
        return ids[0] if len(ids) == 1 else ids[prefill_index]


def _checked(option: str, field: str, values: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(check(field, v) for v in values)
    except BadParams as e:
        raise ValueError(f"{option}: {e}") from None
