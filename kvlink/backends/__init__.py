"""Transport backends, and the registry that opens one by name.

``open_backend(kind, config, options=None)`` returns an implementation of the contract in
:mod:`kvlink.transport.backend`: the native engine (``tcp``, ``same-host``, ``auto``) or Mooncake's transfer
engine (``mooncake``, :mod:`kvlink.backends.mooncake`). ``BACKENDS`` lists the registered kinds;
``register_backend`` adds one. See ``docs/backends.md``.
"""

from kvlink.backends.mooncake_config import MooncakeConfig
from kvlink.backends.registry import (BACKENDS, Factory, device_memory, open_backend, register_backend,
                                      unregister_backend)

__all__ = ["BACKENDS", "Factory", "device_memory", "MooncakeConfig", "open_backend", "register_backend", "unregister_backend"]
