"""MooncakeConfig: the Mooncake backend's settings, validated once.

Given to :class:`kvlink.backends.mooncake.MooncakeBackend` at construction; the backend never reads the
environment. :meth:`MooncakeConfig.from_env` is for the edge that opens a backend by name
(:func:`kvlink.backends.open_backend` without options).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MooncakeConfig:
    """Settings of one Mooncake backend, validated once.

    protocol: Mooncake transport ('tcp', 'rdma', ...). device: RDMA device
    filter ('' = all). host: the address Mooncake advertises to peers
    (default: the listen host, else 127.0.0.1). max_queued: Mooncake's
    per-peer queue limit; batches go in chunks of half of it. settle_s: how
    long cancel() waits at most for a chunk in flight. transfer_timeout_s:
    when Mooncake gives up waiting on a chunk (whole seconds, at least 5, as
    Mooncake takes it). max_queued and transfer_timeout_s are handed to
    Mooncake at construction.
    """

    protocol: str = "tcp"
    device: str = ""
    host: str | None = None
    max_queued: int = 1024
    settle_s: float = 10.0
    transfer_timeout_s: int = 30

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.isidentifier():
            raise ValueError(f"protocol must be a Mooncake protocol name such as 'tcp' or 'rdma', "
                             f"got {self.protocol!r}")
        if not isinstance(self.device, str) or not self.device.isprintable():
            raise ValueError(f"device must be a printable device filter such as 'mlx5_0' or '', got {self.device!r}")
        if self.host is not None and (not isinstance(self.host, str) or not self.host.isprintable()
                                      or not self.host.strip() or " " in self.host):
            raise ValueError(f"host must be an address peers can reach, or None, got {self.host!r}")
        if not isinstance(self.max_queued, int) or isinstance(self.max_queued, bool) or self.max_queued < 2:
            raise ValueError(f"max_queued must be an int >= 2, got {self.max_queued!r}")
        if not isinstance(self.settle_s, (int, float)) or not 0 < self.settle_s <= 3600:
            raise ValueError(f"settle_s must be in (0, 3600] seconds, got {self.settle_s!r}")
        if not isinstance(self.transfer_timeout_s, int) or isinstance(self.transfer_timeout_s, bool) \
                or not 5 <= self.transfer_timeout_s <= 86400:
            raise ValueError(f"transfer_timeout_s must be whole seconds in 5..86400, got {self.transfer_timeout_s!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MooncakeConfig:
        """The config from environment variables, for the edge that opens a backend by name:
        KVLINK_MOONCAKE_PROTOCOL / _DEVICE / _HOST, and Mooncake's own MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER
        and MC_TRANSFER_TIMEOUT. A malformed value raises ValueError naming the variable."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {"protocol": env.get("KVLINK_MOONCAKE_PROTOCOL", "tcp"),
                              "device": env.get("KVLINK_MOONCAKE_DEVICE", ""),
                              "host": env.get("KVLINK_MOONCAKE_HOST") or None}
        for var, name in (("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "max_queued"),
                          ("MC_TRANSFER_TIMEOUT", "transfer_timeout_s")):
            if env.get(var):
                try:
                    kw[name] = int(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} is not a whole number") from None
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"mooncake settings from the environment: {e}") from None


def mooncake_device_memory() -> tuple[bool, str]:
    """Whether the installed Mooncake transfer engine registers GPU memory: its CUDA build
    (``mooncake-transfer-engine``) does, the ``-non-cuda`` build does not."""
    from importlib import metadata

    def have(dist: str) -> bool:
        try:
            metadata.version(dist)
            return True
        except metadata.PackageNotFoundError:
            return False

    if have("mooncake-transfer-engine"):
        return True, "the CUDA build of Mooncake's transfer engine registers device memory"
    if have("mooncake-transfer-engine-non-cuda"):
        return False, ("the installed Mooncake is the non-CUDA build (mooncake-transfer-engine-non-cuda): it "
                       "cannot register device memory; install mooncake-transfer-engine for GPU-direct")
    return False, "Mooncake's transfer engine is not installed"
