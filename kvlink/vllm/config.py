"""The connector's configuration: ``kv_connector_extra_config`` read once, validated, frozen.

An unknown key or a bad value stops start-up with a message that names it and lists the valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvlink.bootstrap.config import is_loopback
from kvlink.transport.config import MAX_PEERS, MAX_STREAMS

ROLES = ("kv_producer", "kv_consumer", "kv_both")
STAGING_MODES = ("auto", "always", "never")
KV_CACHE_LAYOUTS = ("hnd", "any")


class ConnectorConfigError(ValueError):
    """kv_connector_extra_config has an unknown key or a bad value."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Every knob of KVLinkConnector, with its default. Keys of kv_connector_extra_config."""

    # Bootstrap server. Prefill runs an embedded one in its scheduler process unless bootstrap_url is set.
    bootstrap_url: str | None = None
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    bootstrap_token: str | None = field(default=None, repr=False)
    # Decode: the bootstrap servers a request's kv_transfer_params may name (remote_bootstrap_addr); None:
    # any. Decode calls the server a request names, with its token, and connects where that server says.
    bootstrap_allow: tuple[str, ...] | None = None
    bootstrap_timeout_s: float = 5.0
    # The embedded server's cap on open connections (BootstrapConfig.max_connections; long polls 3/4 of it).
    bootstrap_max_connections: int = 4096
    # Transport engine of each worker. "auto": same-host peers are copied directly (process_vm_readv)
    # when the kernel allows it, else TCP; "tcp": always TCP; "same-host": refuse anything else.
    transport_backend: str = "auto"
    transport_host: str = "127.0.0.1"
    transport_port: int = 0  # rank (dp, pp, tp) listens on transport_port + (dp * pp_size + pp) * tp_size + tp (0: any)
    transport_advertise: str | None = None  # host:port published instead of the listen address (port + i too)
    transport_token: str | None = field(default=None, repr=False)
    transport_streams: int = 2
    # The native engine's limits: connections a prefill rank serves (every decode rank that reads it holds
    # transport_streams of them) and peers a decode rank keeps (one per prefill rank it reads).
    transport_max_conns: int = 4096
    transport_max_peers: int = 1024
    crc: bool = False
    # Without transport_token the transport is unauthenticated: allowed on loopback only (the engine
    # refuses peers from elsewhere) unless allow_insecure is set; a non-loopback transport_host without a
    # token stops start-up.
    allow_insecure: bool = False
    # Let the connector's threads (and the transport threads they start) run on any CPU instead of
    # inheriting vLLM's OMP pinning (VLLM_CPU_OMP_THREADS_BIND). Off by default: on the 2-core benchmark
    # machine spreading made same-host copies slower and their tail longer (bench/results/connector.md).
    spread_threads: bool = False
    # Prefill: stream a request's finished blocks to decode while it still computes (concurrent pairing
    # only: decode is waiting by then; stream.py). Off by default until measured where it pays: on the
    # 2-core benchmark machine it cut the exposed transfer to 6-23% but raised TTFT over loopback
    # (bench/results/stream.md). Off: publish once, at the end.
    stream_kv: bool = False
    # How finely a streamed request is announced: "layer" (after each attention layer of each step, so a
    # prompt of one chunk streams too and the tail is about one layer) or "step" (after each chunked-
    # prefill step's forward: one bootstrap call per step, a one-chunk prompt streams nothing).
    stream_granularity: str = "layer"
    # Per layer: announce a layer on entry to its attention op where vLLM wrote its KV in an op of its own
    # just before (decode reads it while the attention computes); false: when the op returns, always.
    stream_layer_on_entry: bool = True
    # Decode, streamed KV: start the request's first step while prefill still computes its last layers,
    # each layer waiting for that layer's KV to land, and check prefill's record at the step's end
    # (lockstep.py). It takes decode's step off the time to first token, and may hold the other requests
    # of that step up to about stream_lockstep_stall_ms. Off by default; refused at start-up where it could
    # not be exact (lockstep.why_not_lockstep).
    stream_lockstep: bool = False
    stream_lockstep_stall_ms: float = 10.0
    # An armed pull whose outcome has not come this long after it was armed fails (its request with it):
    # decode's step, and every request in it, waits for that outcome.
    stream_lockstep_max_wait_s: float = 5.0
    # Timing.
    lease_s: float = 30.0  # how long prefill keeps a finished request's blocks for decode
    engine_lease_s: float = 15.0  # registration lease of a worker; heartbeats every third of it
    transfer_timeout_s: float = 30.0  # one batched READ, end to end
    connect_timeout_s: float = 5.0
    lookup_wait_s: float = 30.0  # concurrent pairing: longest wait for prefill to publish
    pull_timeout_s: float = 60.0  # decode: longest wait of one request for its KV, lookup to last byte
    release_poll_s: float = 0.02  # prefill: how often it asks the bootstrap for released requests
    # Prefill: while its engine has nothing to run but blocks held for decode, vLLM steps it about once
    # a millisecond so the connector can report frees. Each such step waits up to this long for a
    # release instead (a release ends the wait at once), so the idle engine stops competing with decode
    # for CPU. A new request arriving meanwhile starts up to this much later. 0: no wait.
    idle_step_wait_ms: float = 10.0
    # Decode: while its engine has nothing to run but requests waiting for their KV (concurrent pairing
    # waits through the whole of prefill's compute), vLLM steps it back to back so the connector can
    # report finished pulls; that loop takes CPU from prefill's forward on a shared host, and the GIL
    # from the worker's threads in the engine's process. Each such step waits this long first; the
    # worker's nudge (nudge.py) ends the wait when a pull ends. 0: no wait.
    pull_step_wait_ms: float = 5.0
    # Host staging of KV that lives on a GPU (staging.py). "auto": stage when the KV is on a device the
    # transport cannot address (kvlink's TCP and same-host transports, a non-CUDA Mooncake build), move it
    # straight from device memory when it can (a CUDA Mooncake build), never stage host KV; "always": stage
    # whatever the KV's device (prefill frees its vLLM blocks as soon as they are copied out; tests use it
    # on CPU); "never": device KV only through a backend that registers device memory, else start-up stops.
    staging: str = "auto"
    staging_pool_mb: int = 2048  # each worker's pinned host pool (prefill: staged copies; decode: landing)
    # transport_backend "mooncake": MooncakeConfig's keys (protocol, device, host, max_queued, settle_s,
    # transfer_timeout_s). Unset: read once from KVLINK_MOONCAKE_* / MC_* environment variables.
    mooncake: dict | None = None
    mooncake_config: Any = field(default=None, init=False, repr=False, compare=False)  # built from the above
    # The KV cache layout kvlink asks vLLM for (connector.get_required_kvcache_layout): "hnd", heads outermost
    # in each block, as NIXL asks (another TP reads a head range per block); "any": no preference, for a
    # MultiConnector beside a connector that needs another layout (vLLM refuses two).
    kv_cache_layout: str = "hnd"

    def __post_init__(self) -> None:
        from kvlink.bootstrap.schema import is_token

        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                and v > 0):
                raise ConnectorConfigError(f"kv_connector_extra_config[{f.name!r}] must be a positive "
                                           f"number of seconds, got {v!r}")
            lo, hi, why = SECONDS.get(f.name, (0.0, 86_400.0, ""))
            if f.name.endswith("_s") and not lo <= v <= hi:  # (also inf: a wait the OS or aiohttp cannot take)
                raise ConnectorConfigError(f"kv_connector_extra_config[{f.name!r}] must be {lo:g}..{hi:g} seconds"
                                           f"{why}, got {v!r}")
        v = self.bootstrap_token
        if isinstance(v, str) and v and not is_token(v):
            raise ConnectorConfigError("kv_connector_extra_config['bootstrap_token'] must be printable ASCII without "
                                       "surrounding whitespace or line breaks (it travels in an HTTP header)")
        v = self.transport_token  # (the handshake's key: its UTF-8 bytes, whatever they are)
        if isinstance(v, str) and not 1 <= len(_utf8(v)) <= 1024:
            raise ConnectorConfigError("kv_connector_extra_config['transport_token'] must be text of 1..1024 "
                                       "UTF-8 bytes")
        if not isinstance(self.transport_host, str) or not self.transport_host:
            raise ConnectorConfigError("kv_connector_extra_config['transport_host'] must be a host name or address, "
                                       f"got {self.transport_host!r}")
        if not isinstance(self.bootstrap_host, str) or not self.bootstrap_host:
            raise ConnectorConfigError("kv_connector_extra_config['bootstrap_host'] must be a host name or address, "
                                       f"got {self.bootstrap_host!r}")
        for key in ("bootstrap_port", "transport_port"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 65535:
                raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be a port "
                                           f"number 0..65535, got {v!r}")
        v = self.bootstrap_max_connections
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConnectorConfigError("kv_connector_extra_config['bootstrap_max_connections'] must be a positive "
                                       f"integer, got {v!r}")
        if (not isinstance(self.transport_streams, int) or isinstance(self.transport_streams, bool)
                or not 1 <= self.transport_streams <= MAX_STREAMS):
            raise ConnectorConfigError("kv_connector_extra_config['transport_streams'] must be an "
                                       f"integer 1..{MAX_STREAMS}, got {self.transport_streams!r}")
        for key, top in (("transport_max_conns", 65536), ("transport_max_peers", MAX_PEERS)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be an integer 1..{top}, "
                                           f"got {v!r}")
        for key in ("crc", "allow_insecure", "spread_threads", "stream_kv", "stream_layer_on_entry",
                    "stream_lockstep"):
            if not isinstance(getattr(self, key), bool):
                raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be true or false")
        v = self.stream_lockstep_stall_ms
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 10_000:
            raise ConnectorConfigError("kv_connector_extra_config['stream_lockstep_stall_ms'] must be a number "
                                       f"of milliseconds 0..10000, got {v!r}")
        if self.stream_granularity not in ("layer", "step"):
            raise ConnectorConfigError("kv_connector_extra_config['stream_granularity'] must be \"layer\" or "
                                       f"\"step\", got {self.stream_granularity!r}")
        for key in ("bootstrap_url", "bootstrap_token", "transport_token", "transport_advertise"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be a non-empty "
                                           f"string, got {v!r}")
        if self.bootstrap_allow is not None:
            from kvlink.bootstrap.client import canonical_url

            v = self.bootstrap_allow
            if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(u, str) for u in v):
                raise ConnectorConfigError("kv_connector_extra_config['bootstrap_allow'] must be a list of "
                                           f"bootstrap server URLs, got {v!r}")
            try:
                object.__setattr__(self, "bootstrap_allow", tuple(canonical_url(u) for u in v))
            except ValueError as e:
                raise ConnectorConfigError(f"kv_connector_extra_config['bootstrap_allow']: {e}") from None
        if self.bootstrap_url is not None:
            from kvlink.bootstrap.client import canonical_url  # the one rule for a bootstrap address

            try:
                object.__setattr__(self, "bootstrap_url", canonical_url(self.bootstrap_url))
            except ValueError as e:
                raise ConnectorConfigError(f"kv_connector_extra_config['bootstrap_url']: {e}") from None
        from kvlink.backends import BACKENDS  # the registry: a kind registered by a plug-in counts too

        if self.transport_backend not in BACKENDS:
            raise ConnectorConfigError("kv_connector_extra_config['transport_backend'] must be one of "
                                       f"{tuple(BACKENDS)}, got {self.transport_backend!r}")
        if self.transport_advertise is not None and not _is_hostport(self.transport_advertise):
            raise ConnectorConfigError("kv_connector_extra_config['transport_advertise'] must be host:port, "
                                       f"got {self.transport_advertise!r}")
        if not self.transport_token and not self.allow_insecure and not is_loopback(self.transport_host):
            raise ConnectorConfigError(
                f"kv_connector_extra_config['transport_host'] is {self.transport_host!r}, not loopback, and no "
                "'transport_token' is set: anyone who can reach that address could read this engine's KV "
                "cache. Set 'transport_token' (the same secret on prefill and decode), or listen on "
                "127.0.0.1, or set 'allow_insecure': true to accept an unauthenticated transport")
        for key in ("idle_step_wait_ms", "pull_step_wait_ms"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1000:
                raise ConnectorConfigError(f"kv_connector_extra_config['{key}'] must be a number 0..1000, "
                                           f"got {v!r}")
        if self.mooncake is not None and not isinstance(self.mooncake, dict):
            raise ConnectorConfigError("kv_connector_extra_config['mooncake'] must be an object of Mooncake "
                                       f"settings, got {self.mooncake!r}")
        if self.transport_backend == "mooncake" or self.mooncake is not None:
            object.__setattr__(self, "mooncake_config", _mooncake_config(self.mooncake))
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ConnectorConfigError(f"kv_connector_extra_config['kv_cache_layout'] must be one of "
                                       f"{KV_CACHE_LAYOUTS}, got {self.kv_cache_layout!r}")
        if self.staging not in STAGING_MODES:
            raise ConnectorConfigError(f"kv_connector_extra_config['staging'] must be one of {STAGING_MODES}, "
                                       f"got {self.staging!r}")
        v = self.staging_pool_mb
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 20:
            raise ConnectorConfigError("kv_connector_extra_config['staging_pool_mb'] must be an integer number "
                                       f"of MiB 1..{1 << 20}, got {v!r}")

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.valid_keys()))
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; valid keys: "
                                       f"{', '.join(cls.valid_keys())}")
        try:
            return cls(**extra)
        except TypeError as e:  # pragma: no cover - guarded by the unknown-key check
            raise ConnectorConfigError(str(e)) from None

    def transport_listen(self, index: int) -> str:
        """The listen address of the rank with port index ``index`` (RankInfo.port_index): one port per rank."""
        return f"{self.transport_host}:{self.transport_port + index if self.transport_port else 0}"

    def advertised(self, index: int) -> str | None:
        """The address the rank with port index ``index`` publishes instead of its listen address, if any."""
        if self.transport_advertise is None:
            return None
        host, _, port = self.transport_advertise.rpartition(":")
        return f"{host}:{int(port) + index}"

    @property
    def transport_token_bytes(self) -> bytes | None:
        return self.transport_token.encode() if self.transport_token else None


def _mooncake_config(settings: dict | None):
    from dataclasses import fields as dc_fields

    from kvlink.backends.mooncake_config import MooncakeConfig

    if settings is None:
        try:
            return MooncakeConfig.from_env()
        except ValueError as e:
            raise ConnectorConfigError(f"Mooncake settings from the environment: {e}") from None
    valid = [f.name for f in dc_fields(MooncakeConfig)]
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ConnectorConfigError(f"unknown kv_connector_extra_config['mooncake'] key(s) {unknown}; valid keys: "
                                   f"{', '.join(valid)}")
    try:
        return MooncakeConfig(**settings)
    except ValueError as e:
        raise ConnectorConfigError(f"kv_connector_extra_config['mooncake']: {e}") from None


def _is_hostport(addr: str) -> bool:
    """host:port as a registration carries it (schema's address rule: an IPv6 host in brackets)."""
    from kvlink.bootstrap.schema import is_address

    return is_address(addr)


# Seconds settings: (least, most, why the most). Beyond what the bootstrap server (max_lease_s 600 by default,
# the embedded one's) or the transport (3600) take, a value passed start-up and failed at the first request.
SECONDS: dict[str, tuple[float, float, str]] = {
    "bootstrap_timeout_s": (0.001, 3600.0, ""),
    "stream_lockstep_max_wait_s": (0.001, 3600.0, ""),
    "lease_s": (0.1, 600.0, " (a bootstrap server's max_lease_s, 600 by default)"),
    "engine_lease_s": (1.0, 600.0, " (a bootstrap server's max_lease_s, 600 by default; heartbeats every third)"),
    "transfer_timeout_s": (0.001, 3600.0, " (the transport's bound)"),
    "connect_timeout_s": (0.001, 3600.0, " (the transport's bound)"),
    "lookup_wait_s": (0.001, 86_400.0, ""),
    "pull_timeout_s": (0.001, 86_400.0, ""),
    "release_poll_s": (0.001, 5.0, ""),
}


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8, or b"" where it cannot be (a lone surrogate)."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return b""
