"""The transport backend contract: what the connector and `kvlink bench` use.

A backend registers memory, connects to peers, moves batches of
(local offset, remote region, remote offset, length) descriptors with
completion, and sends small notifications. The native C engine
(:class:`kvlink.transport.Engine`) is one implementation; others (Mooncake)
live in :mod:`kvlink.backends`. Callers pick one with :func:`open_backend`
and never see which; what a backend cannot do is in its ``capabilities``
and refused with :class:`Unsupported`, never faked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvlink.errors import KVLinkError

BACKENDS = ("tcp", "mooncake", "same-host", "auto")


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


@runtime_checkable
class RegionLike(Protocol):
    id: int
    addr: int
    length: int

    def unregister(self, timeout_s: float = ...) -> None: ...


@runtime_checkable
class BatchLike(Protocol):
    nbytes: int

    def poll(self) -> bool: ...

    def wait(self, timeout_s: float | None = ...) -> None: ...

    def cancel(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    kind: str  # "tcp", "same-host", "mooncake"
    capabilities: Capabilities

    @property
    def address(self) -> str | None: ...

    def register(self, obj: Any, access: Any = ...) -> RegionLike: ...

    def connect(self, address: str) -> Any: ...

    def read(self, peer: Any, local: Any, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
             lengths: Any, timeout_s: float | None = None) -> BatchLike: ...

    def write(self, peer: Any, local: Any, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
              lengths: Any, timeout_s: float | None = None) -> BatchLike: ...

    def notify(self, peer: Any, payload: bytes, timeout_s: float | None = None) -> None: ...

    def drain_notifications(self) -> list[tuple[str, bytes]]: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def open_backend(kind: str, config: Any) -> Backend:
    """A backend by setting: 'tcp' (the native engine), 'mooncake' (Mooncake's
    transfer engine), 'same-host' (native engine that must copy peer memory
    directly), 'auto' (same-host where both ends are on one host and it is
    permitted, else TCP). ``config`` is an :class:`EngineConfig`."""
    if kind not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    if kind == "mooncake":
        from kvlink.backends.mooncake import MooncakeBackend

        return MooncakeBackend(config)
    from dataclasses import replace

    from kvlink.transport.engine import Engine

    same = {"tcp": "off", "same-host": "require", "auto": "auto"}[kind]
    if getattr(config, "same_host", same) != same:
        config = replace(config, same_host=same)
    return Engine(config)
