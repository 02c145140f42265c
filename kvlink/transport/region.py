"""Registered memory regions and their access flags."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from kvlink import _binding as B

if TYPE_CHECKING:
    from kvlink.transport.engine import Engine


class Access(enum.IntFlag):
    """What peers may do with a region (the owner may always use it locally)."""

    NONE = B.ACCESS_NONE
    READ = B.ACCESS_READ
    WRITE = B.ACCESS_WRITE


def memory_of(obj: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, length, keep-alive) of a buffer-protocol object, a CPU torch
    tensor, or an (address, length) pair."""
    if isinstance(obj, tuple):
        if len(obj) != 2 or not all(isinstance(v, int) for v in obj) or obj[0] <= 0 or obj[1] <= 0:
            raise ValueError(f"expected (address, length) with positive ints, got {obj!r}")
        return obj[0], obj[1], None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # a torch tensor, without importing torch
        if getattr(obj.device, "type", "cpu") != "cpu":
            raise ValueError(f"only CPU tensors can be registered, got device {obj.device}")
        if not obj.is_contiguous():
            raise ValueError("tensor must be contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj
    return B.buffer_address(obj, writable)


def memory_for(obj: Any, access: Access) -> tuple[int, int, Any, bool]:
    """(address, length, keep-alive, writable) of the memory a region with
    this access would cover; read-only memory is fine unless peers may WRITE."""
    try:
        addr, length, keep = memory_of(obj, writable=True)
        writable = True
    except (BufferError, ValueError) as e:  # read-only memory: BufferError, or ValueError from numpy
        try:
            addr, length, keep = memory_of(obj, writable=False)
        except (BufferError, ValueError):
            raise e from None  # not a matter of writability (not contiguous, ...)
        if access & Access.WRITE:
            raise ValueError("a region peers may WRITE needs writable memory") from None
        writable = False
    if length == 0:
        raise ValueError("cannot register an empty buffer")
    return addr, length, keep, writable


class Region:
    """A registered region. ``id`` is what peers name in their descriptors."""

    def __init__(self, engine: Engine, obj: Any, access: Access):
        self._engine = engine
        self.addr, self.length, self._keep, self.writable = memory_for(obj, access)
        self.access = Access(access)
        with engine._using() as h:
            self.id = B.region_register(h, self.addr, self.length, int(self.access))
        self._live = True

    def unregister(self, timeout_s: float = 30.0) -> None:
        """Refuse new remote accesses, wait for those in flight, then forget the region."""
        if self._live:
            with self._engine._using() as h:
                B.region_unregister(h, self.id, int(timeout_s * 1000))
            self._live = False
            self._engine._regions.discard(self)

    @property
    def registered(self) -> bool:
        return self._live

    def __repr__(self) -> str:
        return f"Region(id=0x{self.id:x}, length={self.length}, access={self.access!r})"
