"""The one seam between Python and the C engine.

Only this module touches the engine's ``ffi``/``lib``. Every C return code is
checked here and turned into a :mod:`kvlink.errors` exception; the API above
it sees plain Python values and opaque handles. (The benchmark yardsticks are
a separate extension, wrapped by ``kvlink.bench.baseline`` with ``check``.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlink._kvlink_c import ffi, lib
from kvlink.errors import error_for

INPROGRESS = lib.KVL_INPROGRESS
FINISHED = lib.KVL_FINISHED
PROTOCOL_VERSION = lib.KVL_PROTOCOL_VERSION
ACCESS_NONE = lib.KVL_ACCESS_NONE
ACCESS_READ = lib.KVL_ACCESS_READ
ACCESS_WRITE = lib.KVL_ACCESS_WRITE
OP_READ = lib.KVL_OP_READ
OP_WRITE = lib.KVL_OP_WRITE
MAX_NAME = lib.KVL_MAX_NAME
MAX_NOTIFY = lib.KVL_MAX_NOTIFY
MAX_STREAMS = lib.KVL_MAX_STREAMS
MAX_PEERS = lib.KVL_MAX_PEERS
MAX_DESC_PER_MSG = lib.KVL_MAX_DESC_PER_MSG
_MSG = lib.KVL_MAX_EVENT_MSG + 1

Handle = Any  # an opaque cdata pointer


def err_name(code: int) -> str:
    return ffi.string(lib.kvl_err_name(code)).decode()


def _raise(code: int, what: str, detail: str = "") -> None:
    name = err_name(code)
    text = ffi.string(lib.kvl_strerror(code)).decode()
    msg = f"{what}: {name}: {text}" + (f": {detail}" if detail else "")
    raise error_for(code, name, msg)


def check(code: int, what: str, detail: str | None = None) -> int:
    """Raise for a negative code; detail defaults to the C side's last message."""
    if code < 0:
        if detail is None:
            detail = ffi.string(lib.kvl_last_message()).decode(errors="replace")
        _raise(code, what, detail)
    return code


# ---- engine ------------------------------------------------------------------

def engine_create(*, listen_host: str | None, listen_port: int, token: bytes | None, name: str, streams: int,
                  crc: bool, allow_insecure: bool, op_timeout_ms: int, connect_timeout_ms: int,
                  handshake_timeout_ms: int, max_conns: int, same_host: int, max_peers: int) -> Handle:
    cfg = ffi.new("kvl_config *")
    lib.kvl_config_init(cfg)
    keep = []
    if listen_host is not None:
        keep.append(ffi.new("char[]", listen_host.encode()))
        cfg.listen_host = keep[-1]
    cfg.listen_port = listen_port
    if token is not None:
        keep.append(ffi.new("uint8_t[]", token))
        cfg.token = keep[-1]
        cfg.token_len = len(token)
    keep.append(ffi.new("char[]", name.encode()))
    cfg.name = keep[-1]
    cfg.streams = streams
    cfg.crc = int(crc)
    cfg.allow_insecure = int(allow_insecure)
    cfg.op_timeout_ms = op_timeout_ms
    cfg.connect_timeout_ms = connect_timeout_ms
    cfg.handshake_timeout_ms = handshake_timeout_ms
    cfg.max_conns = max_conns
    cfg.same_host = same_host
    cfg.max_peers = max_peers
    out = ffi.new("kvl_engine **")
    where = f"listen on {listen_host}:{listen_port}" if listen_host else "create engine"
    check(lib.kvl_engine_create(cfg, out), where, "")
    return out[0]


def engine_stop(h: Handle) -> None:
    lib.kvl_engine_stop(h)


def engine_destroy(h: Handle) -> None:
    lib.kvl_engine_destroy(h)


def engine_port(h: Handle) -> int:
    return int(lib.kvl_engine_port(h))


def engine_stats(h: Handle) -> dict[str, int]:
    s = ffi.new("kvl_stats *")
    lib.kvl_engine_stats(h, s)
    return {f: int(getattr(s, f)) for f, _ in ffi.typeof("kvl_stats").fields}


def events(h: Handle) -> list[tuple[str, str]]:
    code = ffi.new("int *")
    buf = ffi.new("char[]", _MSG)
    out = []
    while lib.kvl_event_next(h, code, buf, _MSG):
        out.append((err_name(code[0]), ffi.string(buf).decode(errors="replace")))
    return out


# ---- regions -----------------------------------------------------------------

def region_register(h: Handle, addr: int, length: int, access: int) -> int:
    out = ffi.new("uint32_t *")
    check(lib.kvl_region_register(h, addr, length, access, out), f"register {length} bytes at 0x{addr:x}", "")
    return int(out[0])


def region_unregister(h: Handle, region_id: int, timeout_ms: int) -> None:
    check(lib.kvl_region_unregister(h, region_id, timeout_ms), f"unregister region 0x{region_id:x}", "")


def buffer_address(obj: Any, writable: bool) -> tuple[int, int, Any]:
    """Address and length of a buffer-protocol object, and the cdata that keeps it pinned."""
    buf = ffi.from_buffer("char[]", obj, require_writable=writable)
    return int(ffi.cast("uintptr_t", buf)), len(buf), buf


# ---- peers, batches, notifications -------------------------------------------

def peer_connect(h: Handle, host: str, port: int, expect: str | None = None) -> int:
    out = ffi.new("uint32_t *")
    check(lib.kvl_peer_connect_as(h, host.encode(), port, ffi.NULL if expect is None else expect.encode(), out),
          f"connect to {host}:{port}")
    return int(out[0])


def peer_name(h: Handle, peer: int) -> str:
    name = ffi.new("char[]", MAX_NAME + 1)
    check(lib.kvl_peer_name(h, peer, name, MAX_NAME + 1), "peer name")
    return ffi.string(name).decode()


def peer_stale(h: Handle, peer: int) -> bool:
    return bool(check(lib.kvl_peer_stale(h, peer), "peer state"))


def peer_local(h: Handle, peer: int) -> tuple[bool, str]:
    why = ffi.new("char[]", _MSG)
    on = check(lib.kvl_peer_local(h, peer, why, _MSG), "peer same-host state")
    return bool(on), ffi.string(why).decode(errors="replace")


def submit(h: Handle, peer: int, op: int, local_addrs: np.ndarray, regions: np.ndarray, offsets: np.ndarray,
           lengths: np.ndarray, timeout_ms: int) -> Handle:
    """Arrays must be contiguous: uint64 (addresses, offsets, lengths) and uint32 (regions);
    regions and lengths may hold one value for all."""
    out = ffi.new("kvl_batch **")
    n = len(local_addrs)
    check(lib.kvl_submit(h, peer, op, ffi.from_buffer("uint64_t[]", local_addrs),
                         ffi.from_buffer("uint32_t[]", regions), len(regions),
                         ffi.from_buffer("uint64_t[]", offsets), ffi.from_buffer("uint64_t[]", lengths),
                         len(lengths), n, timeout_ms, out),
          f"submit {'READ' if op == OP_READ else 'WRITE'} of {n} descriptors")
    return ffi.gc(out[0], lib.kvl_batch_release)


def submit_one(h: Handle, peer: int, op: int, local_addr: int, region: int, offset: int, length: int,
               timeout_ms: int) -> Handle:
    """submit() for a single descriptor, without numpy (the latency path)."""
    out = ffi.new("kvl_batch **")
    a = ffi.new("uint64_t[3]", (local_addr, offset, length))
    r = ffi.new("uint32_t[1]", (region,))
    check(lib.kvl_submit(h, peer, op, a, r, 1, a + 1, a + 2, 1, 1, timeout_ms, out),
          f"submit {'READ' if op == OP_READ else 'WRITE'} of 1 descriptor")
    return ffi.gc(out[0], lib.kvl_batch_release)


def batch_release(b: Handle) -> None:
    ffi.release(b)


def _batch_failed(b: Handle, rc: int) -> None:
    check(rc, "batch", ffi.string(lib.kvl_batch_message(b)).decode(errors="replace"))


def batch_poll(b: Handle) -> bool:
    rc = lib.kvl_batch_poll(b)
    if rc == INPROGRESS:
        return False
    if rc:
        _batch_failed(b, rc)
    return True


def batch_wait(b: Handle, timeout_ms: int) -> None:
    rc = lib.kvl_batch_wait(b, timeout_ms)
    if rc:
        _batch_failed(b, rc)


def batch_cancel(b: Handle) -> bool:
    """True if this call stopped the running batch; False if it had already
    finished (its outcome, which poll/wait report, stands). Either way the
    engine writes no more into its memory."""
    rc = check(lib.kvl_batch_cancel(b), "cancel batch", "")
    return rc != FINISHED  # 0: stopped by this call


def batch_descriptors(b: Handle) -> int:
    return int(lib.kvl_batch_descriptors(b))


def notify(h: Handle, peer: int, payload: bytes, timeout_ms: int) -> None:
    check(lib.kvl_notify(h, peer, payload, len(payload), timeout_ms), "notify")


def drain_notifications(h: Handle) -> list[tuple[str, bytes]]:
    frm = ffi.new("char[]", MAX_NAME + 1)
    buf = ffi.new("char[]", MAX_NOTIFY)
    n = ffi.new("size_t *")
    out = []
    while check(lib.kvl_notif_next(h, frm, MAX_NAME + 1, buf, MAX_NOTIFY, n), "drain notifications") == 1:
        out.append((ffi.string(frm).decode(), bytes(ffi.buffer(buf, n[0]))))
    return out


# ---- pure helpers --------------------------------------------------------------

def proto_check(frame: bytes) -> tuple[int, str, str]:
    """Run the C frame decoder over bytes: (code, code name, reason)."""
    why = ffi.new("char[]", 256)
    rc = lib.kvl_proto_check(frame, len(frame), why, 256)
    return rc, err_name(rc), ffi.string(why).decode(errors="replace")


def crc32c(data: bytes | memoryview, crc: int = 0) -> int:
    buf = ffi.from_buffer(data)
    return int(lib.kvl_crc32c(crc, buf, len(buf)))
