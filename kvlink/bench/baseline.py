"""The benchmark yardsticks `kvlink bench` measures the engine against: a raw
single-connection TCP request/response and a memcpy of the same blocks
(csrc/kvl_baseline.c). They are their own extension module,
``kvlink.bench._baseline_c``, so the production engine does not carry them;
only the bench imports this. Their return codes are the engine's (csrc/kvl.h)
and become exceptions through ``kvlink._binding.check``, the one place that
maps them."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlink._binding import check
from kvlink.bench._baseline_c import ffi, lib

# Requests the raw TCP server answers with something other than buffer bytes.
RAW_INFO = 0  # the JSON the target was started with
RAW_RSS = (1 << 64) - 1  # the target's resident set size, one u64


def rawtcp_serve(host: str, port: int, addr: int, length: int, info: str) -> tuple[Any, int]:
    out = ffi.new("struct kvl_rawtcp **")
    port_out = ffi.new("uint16_t *")
    check(lib.kvl_rawtcp_serve(host.encode(), port, ffi.cast("void *", addr), length, info.encode(), out, port_out),
          f"raw TCP baseline listen on {host}:{port}", "")
    return out[0], int(port_out[0])


def rawtcp_stop(h: Any) -> None:
    lib.kvl_rawtcp_stop(h)


def rawtcp_connect(host: str, port: int) -> int:
    fd = ffi.new("int *")
    check(lib.kvl_rawtcp_connect(host.encode(), port, fd), f"raw TCP baseline connect to {host}:{port}", "")
    return int(fd[0])


def rawtcp_fetch(fd: int, n: int, dst_addr: int, cap: int) -> int:
    got = ffi.new("uint64_t *")
    check(lib.kvl_rawtcp_fetch(fd, n, ffi.cast("void *", dst_addr), cap, got), "raw TCP baseline fetch", "")
    return int(got[0])


def rawtcp_close(fd: int) -> None:
    lib.kvl_rawtcp_close(fd)


def memcpy_blocks(dst_addrs: np.ndarray, src_addrs: np.ndarray, length: int) -> None:
    lib.kvl_memcpy_blocks(ffi.from_buffer("uint64_t[]", dst_addrs), ffi.from_buffer("uint64_t[]", src_addrs),
                          length, len(dst_addrs))
