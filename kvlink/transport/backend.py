"""The transport backend contract: what the connector and `kvlink bench` use.

A backend registers memory, connects to peers, moves batches of
(local offset, remote region, remote offset, length) descriptors with
completion, and sends small notifications. The native C engine
(:class:`kvlink.transport.Engine`) is one implementation; others (Mooncake)
live in :mod:`kvlink.backends`, which also holds the registry that opens a
backend by name (``kvlink.backends.open_backend``): this layer knows no
backend by name. What a backend cannot do is in its ``capabilities`` and
refused with :class:`Unsupported`, never faked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvlink.errors import KVLinkError


class Unsupported(KVLinkError, NotImplementedError):
    """The selected backend cannot do this (see its capabilities)."""

    kvl_name = "KVL_EUNSUPPORTED"


@dataclass(frozen=True)
class Capabilities:
    read: bool = True
    write: bool = True
    notify: bool = True
    cancel: bool = True        # cancel stops the transfer; no late writes after it returns
    crc: bool = False          # per-descriptor integrity check available
    same_host: bool = False    # copies straight from the peer's memory (no network)
    network: bool = True       # reaches peers on other hosts
    device_memory: bool = False  # registers GPU memory: moves device KV without host staging


@runtime_checkable
class RegionLike(Protocol):
    id: int
    addr: int
    length: int

    def unregister(self, timeout_s: float = ...) -> None: ...


@runtime_checkable
class BatchLike(Protocol):
    """One READ or WRITE in flight.

    ``poll()`` is True once it finished (and raises its error if it failed); ``wait(timeout_s)`` blocks
    until then. ``cancel()`` returns True if cancelling stopped the batch (``poll``/``wait`` then raise
    :class:`~kvlink.errors.Canceled`), False if it had already ended (its outcome stands); exactly one call
    returns True for a batch that cancel stopped. Once ``cancel()`` returns, nothing is written into the
    batch's local memory again. A backend that cannot stop a transfer in flight (``capabilities.cancel`` is
    False) raises :class:`~kvlink.errors.NotSettled` while it still may: keep the memory alive and call
    ``cancel()`` again; the call that returns reports whether the batch was stopped.
    """

    nbytes: int

    def poll(self) -> bool: ...

    def wait(self, timeout_s: float | None = ...) -> None: ...

    def cancel(self) -> bool: ...


@runtime_checkable
class Backend(Protocol):
    kind: str  # "tcp", "same-host", "mooncake", ...
    capabilities: Capabilities

    @property
    def address(self) -> str | None: ...

    def register(self, obj: Any, access: Any = ...) -> RegionLike: ...

    def connect(self, address: str, expect: str | None = None) -> Any: ...

    def peer_stale(self, peer: Any) -> bool: ...

    def read(self, peer: Any, local: Any, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
             lengths: Any, timeout_s: float | None = None) -> BatchLike: ...

    def write(self, peer: Any, local: Any, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
              lengths: Any, timeout_s: float | None = None) -> BatchLike: ...

    def notify(self, peer: Any, payload: bytes, timeout_s: float | None = None) -> None: ...

    def drain_notifications(self) -> list[tuple[str, bytes]]: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...

