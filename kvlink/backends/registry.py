"""The backend registry: transport backends by the name a setting gives.

The transport layer defines the contract (:mod:`kvlink.transport.backend`) and knows no backend by name;
this module maps names to factories. Built in: ``tcp`` (the native engine over TCP), ``same-host`` (the
native engine, which must copy same-host peers' memory directly), ``auto`` (same-host where both ends are
on one host and it is permitted, else TCP) and ``mooncake`` (Mooncake's transfer engine). Others, a test's
fake included, are added with :func:`register_backend`.

A factory is called as ``factory(config, options)``: ``config`` is the :class:`EngineConfig` every backend
takes, ``options`` the backend's own settings object or None.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from kvlink.transport import Backend, Engine, EngineConfig

Factory = Callable[[EngineConfig, Any], Backend]

_lock = threading.Lock()  # guards _factories (registration; lookups read a dict, atomic under the GIL)
_factories: dict[str, Factory] = {}

BACKENDS: Mapping[str, Factory] = MappingProxyType(_factories)
"""The registered kinds and their factories, read-only and live: ``kind in BACKENDS``, ``tuple(BACKENDS)``."""


def register_backend(kind: str, factory: Factory, *, replace_existing: bool = False) -> None:
    """Make ``open_backend(kind, ...)`` call ``factory(config, options)``. A kind already registered is
    refused unless ``replace_existing``."""
    if not isinstance(kind, str) or not kind or not kind.isprintable() or kind != kind.strip() or " " in kind:
        raise ValueError(f"backend kind must be a non-empty name without spaces, got {kind!r}")
    if not callable(factory):
        raise TypeError(f"backend factory for {kind!r} must be callable, got {factory!r}")
    with _lock:
        if kind in _factories and not replace_existing:
            raise ValueError(f"backend kind {kind!r} is already registered")
        _factories[kind] = factory


def unregister_backend(kind: str) -> None:
    """Forget a kind (a plug-in being unloaded, a test cleaning up); KeyError if it is not registered."""
    with _lock:
        if kind not in _factories:
            raise KeyError(f"backend kind {kind!r} is not registered")
        del _factories[kind]


def open_backend(kind: str, config: EngineConfig | None = None, options: Any = None) -> Backend:
    """A backend of a registered kind. ``options`` are the backend's own settings (a
    :class:`~kvlink.backends.MooncakeConfig` for ``mooncake``); the native kinds take none."""
    factory = _factories.get(kind)
    if factory is None:
        raise ValueError(f"backend must be one of {', '.join(_factories)}, got {kind!r}")
    return factory(config or EngineConfig(), options)


def device_memory(kind: str) -> tuple[bool, str]:
    """Whether backend ``kind`` can register GPU memory (move device KV with no host staging), and why
    not, without opening it: the scheduler and the workers decide staging from this one answer."""
    if kind == "mooncake":
        from kvlink.backends.mooncake_config import mooncake_device_memory

        return mooncake_device_memory()
    if kind in ("auto", "tcp", "same-host"):
        return False, f"kvlink's {kind} transport moves host memory only"
    return False, f"backend {kind!r} does not say it registers device memory"


def _native(same_host: str) -> Factory:
    def open_native(config: EngineConfig, options: Any) -> Backend:
        if options is not None:
            raise ValueError(f"the native engine takes no backend options, got {options!r}")
        return Engine(replace(config, same_host=same_host))

    return open_native


def _mooncake(config: EngineConfig, options: Any) -> Backend:
    # Imported here: the backend's module is only needed by those who pick it.
    from kvlink.backends.mooncake import MooncakeBackend
    from kvlink.backends.mooncake_config import MooncakeConfig

    if options is None:
        options = MooncakeConfig.from_env()  # opened by name: the environment is this edge's only source
    elif not isinstance(options, MooncakeConfig):
        raise TypeError(f"mooncake backend options must be a MooncakeConfig, got {type(options).__name__}")
    return MooncakeBackend(config, options)


for _kind, _factory in (("auto", _native("auto")), ("tcp", _native("off")), ("same-host", _native("require")),
                        ("mooncake", _mooncake)):
    register_backend(_kind, _factory)
