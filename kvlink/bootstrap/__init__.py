"""kvlink's bootstrap (pairing) server: where prefill and decode engines find each other.

Read in this order: ``schema`` (what travels), ``table`` (the pairing logic, pure), ``server`` (HTTP adapter
and embedded server; ``gate``: its cap on open connections), ``client`` (typed synchronous client), ``pool`` (one
client per server URL), ``heartbeat`` (keeping a rank registered), ``cli`` (standalone). The HTTP API is described in ``docs/bootstrap.md``.
"""

from kvlink.bootstrap.client import BootstrapClient
from kvlink.bootstrap.config import BootstrapConfig, TableLimits
from kvlink.bootstrap.errors import (
    BootstrapConfigError,
    BootstrapError,
    BootstrapUnavailable,
    Conflict,
    InvalidField,
    LookupTimeout,
    NotFound,
    PayloadTooLarge,
    RequestExpired,
    RequestGone,
    RequestReleased,
    TooManyWaiters,
    TableFull,
    Unauthorized,
    UnreadableAnswer,
    UnknownEngine,
    UnknownRequest,
)
from kvlink.bootstrap.heartbeat import Heartbeater
from kvlink.bootstrap.pool import ClientPool
from kvlink.bootstrap.schema import EngineRegistration, KVLayerSpec, Outcome, RequestRecord, RequestStatus
from kvlink.bootstrap.server import BootstrapServer
from kvlink.bootstrap.table import PairingTable

__all__ = [
    "BootstrapClient",
    "BootstrapConfig",
    "BootstrapConfigError",
    "BootstrapError",
    "BootstrapServer",
    "BootstrapUnavailable",
    "ClientPool",
    "Conflict",
    "EngineRegistration",
    "Heartbeater",
    "InvalidField",
    "KVLayerSpec",
    "LookupTimeout",
    "NotFound",
    "Outcome",
    "PairingTable",
    "PayloadTooLarge",
    "RequestExpired",
    "RequestGone",
    "RequestRecord",
    "RequestReleased",
    "RequestStatus",
    "TableLimits",
    "TooManyWaiters",
    "TableFull",
    "Unauthorized",
    "UnreadableAnswer",
    "UnknownEngine",
    "UnknownRequest",
]
