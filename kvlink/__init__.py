"""kvlink: move an LLM's paged KV cache from a prefill engine to a decode engine.

The transport names below load the C extension on first use, so the pure
Python parts (bootstrap server, proxy) import without it.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {"Engine", "EngineConfig", "Access", "Region", "Peer", "Batch", "PROTOCOL_VERSION"}

__all__ = sorted(_LAZY | {"__version__"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvlink import transport

        return getattr(transport, name)
    raise AttributeError(f"module 'kvlink' has no attribute {name!r}")
