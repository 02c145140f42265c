"""MooncakeBackend: the backend contract over Mooncake's transfer engine.

Wraps ``mooncake.engine.TransferEngine`` (pip ``mooncake-transfer-engine-non-cuda``,
which needs Debian's ``libibverbs1`` and ``librdmacm1`` even for TCP) with
peer-to-peer handshake (no metadata server). Its settings are one
:class:`MooncakeConfig` given at construction (protocol ``tcp`` by default;
``rdma`` and anything else Mooncake accepts passes through); nothing here reads
the environment. Mooncake itself reads its settings from environment variables
when its engine is created: the backend exports the config's values to them
once, at construction (:func:`_start_transfer_engine`), so Mooncake and this
module agree on the queue limit and the give-up time.

Addresses. Mooncake moves bytes between raw virtual addresses. Here peers
name regions by id, as with the native engine: ``connect`` fetches the
peer's region table over an authenticated side channel
(:mod:`kvlink.backends.sidechannel`, HMAC challenge with the engine token)
and every descriptor is translated and checked locally (bounds, access,
region id) before anything is submitted. Nothing above this module sees a
remote address. A region id unknown to the cached table triggers one
refresh of the table before ``UnknownRegion`` is raised.

What Mooncake cannot do, and how it shows:
- No abort of a submitted batch. Batches are cut into chunks of at most
  ``max_queued // 2`` descriptors, submitted one after another by one worker
  thread per peer. ``cancel()`` stops submitting further chunks and waits
  (bounded) for the chunk in flight to settle; then nothing is written into
  the local memory again. If it cannot settle in time it raises
  :class:`NotSettled` (the memory may still be written: keep it alive and
  call ``cancel()`` again later). ``capabilities.cancel`` is False.
- No CRC (``EngineConfig(crc=True)`` raises :class:`Unsupported`), no
  same-host copy (``same_host="require"`` raises Unsupported); ``streams`` is
  ignored (Mooncake's own knob is ``MC_TCP_LANES_PER_PEER``, left to the user).
- Access flags and bounds are enforced by the initiator from the table, not
  by the target: Mooncake's target only checks that an address lies in some
  registered buffer. Mooncake's RPC and data ports listen on ALL interfaces
  whatever host is given, unauthenticated: the token protects the table and
  the notifications, not the data plane. Use it on trusted networks.
- ``Region.unregister`` waits for this backend's own batches on the region,
  but cannot see a peer's one-sided accesses in flight.
- Mooncake gives up waiting on a batch after ``transfer_timeout_s``
  (its ``MC_TRANSFER_TIMEOUT``, default 30 s) and frees it while slices may
  still be queued; such a batch is reported as :class:`NotSettled` too, and
  it keeps counting on its local region: ``unregister`` raises TimeoutError_
  (keep the memory) until ``close()`` destroys the Mooncake engine.
- Mooncake answers a batch's status at its first failed slice, while the
  chunk's other slices go on, and nothing reports their end: a failed chunk
  is reported (failed, settled) only ``settle_s`` plus its bytes at
  ``SETTLE_FLOOR_BPS`` after Mooncake's answer (chunks are also cut at
  ``MAX_CHUNK_BYTES``, so that wait stays bounded).
  A batch is reported by poll/wait only once settled (or NotSettled).
- One peer per address, as with the native engine: ``connect`` again returns
  the live peer; one whose side channel closed (its process ended or
  restarted) takes no batch (PeerClosed) and the next connect replaces it
  (its thread ends once its queued batches have). Received notifications are bounded as with the
  native engine (65,536 and 16 MiB; beyond that the sender gets QueueFull).

Quirks handled: a per-peer queue limit (``max_queued``, Mooncake's
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, default 1024; a larger batch on a
cold connection fails as a whole): hence the chunks. Log noise:
``MC_LOG_LEVEL=WARNING`` and glog's ``GLOG_minloglevel=2`` are set (unless
already set) at construction, before Mooncake loads.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlink.backends.mooncake_config import MooncakeConfig, mooncake_device_memory
from kvlink.backends.sidechannel import SideClient, SideServer, decode_table, encode_table
from kvlink.errors import (AccessDenied, Canceled, Closed, ConnectError, KVLinkError, NotSettled, PeerChanged,
                           PeerClosed, QueueFull, RemoteError, SystemError_, TimeoutError_, UnknownRegion)
from kvlink.transport.backend import Capabilities, Unsupported
from kvlink.transport.config import EngineConfig, check_name, join_hostport, split_hostport
from kvlink.transport.descriptors import check_descriptors, check_remote_bounds
from kvlink.transport.region import Access, memory_for

logger = logging.getLogger(__name__)

MAX_NOTIFY = 4096  # the native engine's limit, kept the same for callers
# A failed chunk's other slices may move on unseen: it is settled only after settle_s plus its bytes at this
# rate (a floor well under any link Mooncake runs on), and chunks carry at most MAX_CHUNK_BYTES.
SETTLE_FLOOR_BPS = 100e6
MAX_CHUNK_BYTES = 256 << 20
MAX_NOTES, MAX_NOTE_BYTES = 65536, 16 << 20  # received and not drained, at most (as the native engine)


_MOONCAKE_ENV_LOCK = threading.Lock()  # the environment Mooncake reads is process-wide


def _start_transfer_engine(mc: MooncakeConfig, host: str) -> Any:
    """A Mooncake TransferEngine, initialized, advertising ``host``.

    Mooncake takes its settings from the environment: logging when it loads, the give-up time when an
    engine is created, the queue limit when it is initialized. So they are exported here, once per
    backend: quieter logs unless set already, and the config's queue limit and give-up time, overriding what
    was set so that Mooncake and this module agree."""
    with _MOONCAKE_ENV_LOCK:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        os.environ.setdefault("GLOG_minloglevel", "2")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise Unsupported(f"mooncake backend: cannot import mooncake.engine ({e}); install "
                              "mooncake-transfer-engine-non-cuda and Debian's libibverbs1 librdmacm1") from None
        os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(mc.max_queued)
        os.environ["MC_TRANSFER_TIMEOUT"] = str(mc.transfer_timeout_s)
        engine = TransferEngine()
        if engine.initialize(host, "P2PHANDSHAKE", mc.protocol, mc.device) != 0:
            raise SystemError_(f"mooncake: initialize({host!r}, P2PHANDSHAKE, {mc.protocol!r}, {mc.device!r}) "
                               "failed")
    return engine


class MooncakeRegion:
    """A registered region; ``id`` is what peers name in their descriptors."""

    def __init__(self, backend: MooncakeBackend, obj: Any, access: Access, rid: int):
        self._backend = backend
        self.addr, self.length, self._keep, self.writable = memory_for(obj, access)
        self.access = Access(access)
        self.id = rid
        self.inflight = 0  # this backend's batches using it; guarded by backend._cond
        self._live = True

    @property
    def registered(self) -> bool:
        return self._live

    def unregister(self, timeout_s: float = 30.0) -> None:
        """Forget the region: peers no longer see it in the table; waits (bounded)
        for this backend's own batches on it. Peers' one-sided accesses in
        flight cannot be seen (see the module docstring)."""
        if self._live:
            self._backend._unregister(self, timeout_s)

    def __repr__(self) -> str:
        return f"MooncakeRegion(id=0x{self.id:x}, length={self.length}, access={self.access!r})"


@dataclass(eq=False)
class MooncakePeer:
    id: int
    address: str
    name: str
    session: str = field(repr=False)
    _client: SideClient = field(repr=False)
    _table: dict[int, tuple[int, int, int]] = field(repr=False)
    _queue: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _worker: threading.Thread | None = field(default=None, repr=False)


class MooncakeBatch:
    """One READ or WRITE; poll(), wait(timeout_s), cancel() as in the native engine."""

    PENDING, DONE, FAILED, CANCELED = range(4)

    def __init__(self, backend: MooncakeBackend, region: MooncakeRegion, op: str, chunks: list, nbytes: int,
                 timeout_s: float):
        self._backend, self._region, self.op, self._chunks = backend, region, op, chunks
        self.nbytes = nbytes
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._cond = threading.Condition()
        self._state = self.PENDING        # guarded by _cond
        self._error: KVLinkError | None = None  # guarded by _cond
        self._stop = False                # cancel requested; guarded by _cond
        self._settled = False             # the worker is done with it; guarded by _cond
        self._unsafe = False              # Mooncake gave up while slices may be queued
        self._stopped_unreported = False  # cancel stopped it; no cancel() has returned True yet; guarded by _cond
        self._started = False             # the peer's worker took it (may have submitted a chunk); guarded by _cond

    # -- worker side -------------------------------------------------------------------
    def _take(self) -> bool:
        """Worker side: claim the batch before its first chunk; False if cancel() already settled it."""
        with self._cond:
            if self._settled:
                return False
            self._started = True
            return True

    def _finish(self, state: int, error: KVLinkError | None, unsafe: bool = False) -> None:
        with self._cond:
            if self._settled:  # settled by cancel() before the worker took it: counted off there
                return
            if self._state == self.PENDING:
                self._state, self._error = state, error
            self._settled, self._unsafe = True, unsafe
            self._cond.notify_all()
        if not unsafe:  # one Mooncake gave up on may still write: its region stays counted (unregister waits)
            self._backend._batch_done(self._region)

    def _should_stop(self) -> bool:
        with self._cond:
            return self._stop

    # -- caller side -------------------------------------------------------------------
    @property
    def settled(self) -> bool:
        """True once Mooncake no longer holds any of this batch's transfers."""
        with self._cond:
            return self._settled and not self._unsafe

    def _raise(self) -> None:
        if self._unsafe:
            raise NotSettled("mooncake gave up waiting on this batch while transfers may still be queued "
                             f"(transfer_timeout_s); its local memory may still be written: {self._error}")
        if self._error is not None:
            raise self._error

    def poll(self) -> bool:
        """True when finished; raises the batch's error if it failed. A batch is reported only once Mooncake
        is done with it (settled) or gave up on it (NotSettled): never while a chunk may still write."""
        with self._cond:
            if self._state == self.PENDING or not (self._settled or self._unsafe):
                return False
            self._raise()
            return True

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until finished; raise its error if it failed. When timeout_s
        (default: the batch's own timeout plus a second) passes first, the
        batch is canceled and TimeoutError_ raised (NotSettled if its chunk in
        flight does not settle within the backend's settle_s)."""
        t = self._timeout_s + 1.0 if timeout_s is None else timeout_s
        with self._cond:
            done = self._cond.wait_for(lambda: self._settled, timeout=max(0.0, t) if t < 1e9 else None)  # inf: forever
            if done:
                self._raise()
                return
        if not self.cancel():  # it had ended meanwhile: its outcome stands (as the native engine's wait)
            with self._cond:
                self._raise()
                return
        raise TimeoutError_(f"mooncake batch not finished within {t:.3f} s; canceled")

    def cancel(self, timeout_s: float | None = None) -> bool:
        """Submit no further chunk and wait (bounded by timeout_s, default the
        backend's settle_s) until the chunk in flight settles. Once this
        returns, nothing is written into the batch's local memory again; if
        it cannot settle in time, NotSettled is raised (call again later).

        Returns True if cancelling stopped the batch (poll/wait raise
        Canceled), False if it had already ended (its outcome stands). As
        with the native engine, one call returns True for a stopped batch:
        the first that returns, so after NotSettled the call that settles it."""
        t = self._backend.mooncake.settle_s if timeout_s is None else timeout_s
        with self._cond:
            self._stop = True
            if self._state == self.PENDING:
                self._state, self._error = self.CANCELED, Canceled("mooncake batch canceled")
                self._stopped_unreported = True
            if not self._started and not self._settled:  # nothing submitted: settled now, not when the worker gets here
                self._settled = True
                self._cond.notify_all()
                release = True
            else:
                release = False
        if release:
            with self._backend._cond:
                self._backend._stats["canceled"] += 1
            self._backend._batch_done(self._region)
        with self._cond:
            if not self._cond.wait_for(lambda: self._settled, timeout=max(0.0, t)):
                raise NotSettled(f"mooncake cannot abort submitted transfers and the chunk in flight did not "
                                 f"settle within {t:.3f} s: its local memory may still be written; keep it alive "
                                 "and call cancel() again")
            if self._unsafe:
                self._raise()
            stopped, self._stopped_unreported = self._stopped_unreported, False
            return stopped

    def __enter__(self) -> MooncakeBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class MooncakeBackend:
    """The backend contract over Mooncake's transfer engine (see module docstring)."""

    kind = "mooncake"

    def __init__(self, config: EngineConfig | None = None, mooncake: MooncakeConfig | None = None):
        self.config = cfg = config or EngineConfig()
        self.mooncake = mc = mooncake or MooncakeConfig()
        if cfg.crc:
            raise Unsupported("mooncake backend: no per-descriptor CRC (crc=True)")
        if cfg.same_host == "require":
            raise Unsupported("mooncake backend: no same-host copy (same_host='require')")
        self.capabilities = Capabilities(read=True, write=True, notify=True, cancel=False, crc=False,
                                         same_host=False, network=True, device_memory=mooncake_device_memory()[0])
        host, port = split_hostport(cfg.listen, "listen") if cfg.listen else (None, 0)
        self._host = host
        mc_host = mc.host or (host if host not in (None, "0.0.0.0", "::") else "127.0.0.1")
        self._engine = _start_transfer_engine(mc, mc_host)
        self.session = f"{mc_host}:{self._engine.get_rpc_port()}"
        self._chunk = max(1, mc.max_queued // 2)
        self._cond = threading.Condition()
        self._regions: dict[int, MooncakeRegion] = {}  # guarded by _cond
        self._peers: dict[int, MooncakePeer] = {}      # guarded by _cond
        self._retired: list[MooncakePeer] = []         # replaced peers, their threads joined at close; _cond
        self._late = 0                                 # failed batches settling later (_settle_later); _cond
        self._notes: list[tuple[str, bytes]] = []      # guarded by _cond
        self._note_bytes = 0                           # payload bytes in _notes; guarded by _cond
        self._stats = dict.fromkeys(("batches", "descriptors", "bytes_read", "bytes_written", "failed",
                                     "canceled", "notifies_sent", "notifies_received", "notifs_dropped", "chunks"), 0)
        self._rid = itertools.count(secrets.randbelow(1 << 20) << 8 | 1)  # ids never reused
        self._pid = itertools.count(1)
        self._closed = False
        self._side = None
        if host is not None:
            self._side = SideServer(host, port, cfg.token, cfg.name, self._table_bytes, self._queue_note,
                                    cfg.handshake_timeout_s, cfg.max_conns)
        logger.info("kvlink mooncake backend %r: side channel %s, mooncake session %s (%s)", cfg.name,
                    self.address, self.session, mc.protocol)

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def address(self) -> str | None:
        """The side channel's 'host:port' that peers connect() to."""
        return None if self._side is None else join_hostport(self._host, self._side.port)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("mooncake backend is closed")

    def close(self) -> None:
        """Stop serving, cancel queued batches, wait (bounded) for chunks in
        flight, unregister everything and destroy the Mooncake engine."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            for p in peers:
                p._queue.put(None)
            peers += self._retired  # (their None is queued already)
            regions = list(self._regions.values())
        if self._side is not None:
            self._side.close()
        stuck = False
        for p in peers:
            if p._worker is not None:
                p._worker.join(self.mooncake.settle_s)
                stuck |= p._worker.is_alive()
            p._client.close()
        with self._cond:  # failed chunks whose other slices may still land
            stuck |= not self._cond.wait_for(lambda: self._late == 0,
                                             timeout=self.mooncake.settle_s + MAX_CHUNK_BYTES / SETTLE_FLOOR_BPS + 1.0)
        if stuck:  # destroying the engine under a thread still inside it would crash the process
            logger.warning("kvlink mooncake backend: transfers still in flight at close; engine leaked")
            return
        for r in regions:
            self._engine.unregister_memory(r.addr)
            r._live = False
        self._engine = None

    def __enter__(self) -> MooncakeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory ------------------------------------------------------------------------
    def register(self, obj: Any, access: Access = Access.READ) -> MooncakeRegion:
        """Register a buffer-protocol object, a CPU torch tensor, or (address, length)."""
        self._check_open()
        region = MooncakeRegion(self, obj, access, next(self._rid) & 0xFFFFFFFF)
        if self._engine.register_memory(region.addr, region.length) != 0:
            raise SystemError_(f"mooncake: register_memory of {region.length} bytes failed (already registered?)")
        with self._cond:
            self._regions[region.id] = region
        return region

    def _unregister(self, region: MooncakeRegion, timeout_s: float) -> None:
        with self._cond:
            self._regions.pop(region.id, None)  # out of the table at once
            if not self._cond.wait_for(lambda: region.inflight == 0, timeout=timeout_s):
                self._regions[region.id] = region
                raise TimeoutError_(f"region 0x{region.id:x}: batches still in flight after {timeout_s} s (or given "
                                    "up by Mooncake with transfers possibly queued: keep the memory until close)")
            region._live = False
        if self._engine is not None:
            self._engine.unregister_memory(region.addr)

    def _table_bytes(self) -> bytes:
        with self._cond:
            regions = [(r.id, r.addr if r.access else 0, r.length, int(r.access)) for r in self._regions.values()]
        return encode_table(self.session, regions)

    # -- peers -------------------------------------------------------------------------
    def connect(self, address: str, expect: str | None = None) -> MooncakePeer:
        """Authenticate to a peer's side channel at 'host:port', fetch its region
        table and open its Mooncake segment. One peer per address, as with the
        native engine: a live one is returned; one whose side channel closed
        (its process ended or restarted) is retired for a new one. ``expect``:
        only the engine of that name (PeerChanged if the address answers as
        another; a live peer there under another name whose side channel
        outlived its process is retired once this connect is answered)."""
        self._check_open()
        if expect is not None:
            check_name(expect, "expect", empty=False)
        live = self._live_peer(address)
        if live is not None and expect in (None, live.name):
            return live
        host, port = split_hostport(address, "peer address")
        cfg = self.config
        client = SideClient(host, port, cfg.token, cfg.name, cfg.connect_timeout_s, cfg.handshake_timeout_s)
        try:
            if expect is not None and client.peer_name != expect:
                raise PeerChanged(f"mooncake: {address} answers as engine {client.peer_name!r}, not {expect!r}")
            session, table = decode_table(self._fetch(client)[1:])
            if self._engine.send_probe(session) != 0:
                raise ConnectError(f"mooncake: peer {address} (session {session}) does not answer")
        except BaseException:
            client.close()
            raise
        peer = MooncakePeer(next(self._pid), address, client.peer_name, session, client, table)
        peer._worker = threading.Thread(target=self._work, args=(peer,), name="kvlink-mc-peer", daemon=True)
        with self._cond:
            self._check_open()
            live = self._live_peer(address)
            if live is not None and live.name != peer.name:
                if client.gone():  # ours heard a process that has left since: the table's is the newer
                    client.close()
                    raise PeerChanged(f"mooncake: {address} answered as engine {peer.name!r}, then {live.name!r}")
                live = None  # the address answers as another engine now: that peer's process left it
            if live is None:
                for p in [p for p in self._peers.values() if p.address == address]:
                    del self._peers[p.id]  # gone: it takes no new batch (_submit checks under this lock)
                    self._retired.append(p)
                    p._queue.put(None)  # its thread ends after the batches queued before
                    p._client.close()  # (its side channel holds one of the other side's max_conns slots)
                self._peers[peer.id] = peer
                peer._worker.start()
        if live is not None:  # another connect got there first
            client.close()
            return live
        return peer

    def peer_stale(self, peer: MooncakePeer) -> bool:
        """True when ``peer``'s side channel closed (its process ended or restarted) or it was retired."""
        with self._cond:
            retired = peer.id not in self._peers
        return retired or peer._client.gone()

    def _live_peer(self, address: str) -> MooncakePeer | None:
        with self._cond:
            peers = [p for p in self._peers.values() if p.address == address]
        return next((p for p in peers if not p._client.gone()), None)

    def _fetch(self, client: SideClient) -> bytes:
        reply = client.request(b"T", self.config.op_timeout_s)
        if reply[:1] != b"T":
            raise RemoteError(f"side channel: unexpected reply {reply[:1]!r} to a table request")
        return reply

    def _lookup(self, peer: MooncakePeer, rids: np.ndarray) -> dict[int, tuple[int, int, int]]:
        wanted = {int(r) for r in np.unique(rids)}
        if not wanted <= peer._table.keys():
            _, peer._table = decode_table(self._fetch(peer._client)[1:])
            missing = wanted - peer._table.keys()
            if missing:
                raise UnknownRegion(f"remote region 0x{min(missing):x} is not registered at peer {peer.name}")
        return peer._table

    # -- batches -----------------------------------------------------------------------
    def read(self, peer: MooncakePeer, local: MooncakeRegion, local_offsets: Any, remote_regions: Any,
             remote_offsets: Any, lengths: Any, timeout_s: float | None = None) -> MooncakeBatch:
        """Pull remote bytes into ``local`` at ``local_offsets``."""
        if not local.writable:
            raise ValueError("the destination region of a READ must be writable memory")
        return self._submit("read", peer, local, local_offsets, remote_regions, remote_offsets, lengths, timeout_s)

    def write(self, peer: MooncakePeer, local: MooncakeRegion, local_offsets: Any, remote_regions: Any,
              remote_offsets: Any, lengths: Any, timeout_s: float | None = None) -> MooncakeBatch:
        """Push bytes of ``local`` at ``local_offsets`` into the peer's regions."""
        return self._submit("write", peer, local, local_offsets, remote_regions, remote_offsets, lengths, timeout_s)

    def _submit(self, op: str, peer: MooncakePeer, local: MooncakeRegion, local_offsets: Any, remote_regions: Any,
                remote_offsets: Any, lengths: Any, timeout_s: float | None) -> MooncakeBatch:
        self._check_open()
        if not isinstance(local, MooncakeRegion) or local._backend is not self or not local.registered:
            raise ValueError("local region is not registered with this backend")
        self._check_peer(peer)
        if peer._client.gone():
            raise PeerClosed(f"peer {peer.name} at {peer.address} closed its side channel (its process ended or "
                             "restarted: its regions are not the ones known here); connect again")
        t = self.config.op_timeout_s if timeout_s is None else timeout_s
        d = check_descriptors(local.length, local_offsets, remote_regions, remote_offsets, lengths)
        n, regs, lens = len(d), d.each_region(), d.each_length()
        # Remote: translate (region id, offset) through the peer's table, checking access and bounds.
        table = self._lookup(peer, regs)
        need = Access.READ if op == "read" else Access.WRITE
        base = np.empty(n, dtype=np.uint64)
        rlen = np.empty(n, dtype=np.uint64)
        for rid in np.unique(regs):
            addr, length, access = table[int(rid)]
            if not access & need:
                raise AccessDenied(f"remote region 0x{int(rid):x} at peer {peer.name} does not permit {op.upper()}")
            sel = regs == rid
            base[sel], rlen[sel] = addr, length
        check_remote_bounds(d, rlen)
        laddr, raddr = d.local_offsets + np.uint64(local.addr), d.remote_offsets + base
        chunks = [(laddr[a:b].tolist(), raddr[a:b].tolist(), lens[a:b].tolist())
                  for a, b in chunk_bounds(lens, self._chunk, MAX_CHUNK_BYTES)]
        batch = MooncakeBatch(self, local, op, chunks, d.nbytes, t)
        with self._cond:  # one lock with unregister and with a retire's end-of-queue mark
            self._check_open()
            self._check_peer(peer)
            if self._regions.get(local.id) is not local:  # unregistered meanwhile (it waits only for counted ones)
                raise ValueError("local region is not registered with this backend")
            local.inflight += 1
            self._stats["batches"] += 1
            self._stats["descriptors"] += n
            self._stats["bytes_read" if op == "read" else "bytes_written"] += batch.nbytes
            peer._queue.put(batch)
        return batch

    def _check_peer(self, peer: MooncakePeer) -> None:
        if any(p is peer for p in self._retired):
            raise PeerClosed(f"peer {peer.name} at {peer.address} was replaced (its side channel closed: its process "
                             "ended or restarted); connect again")
        if not isinstance(peer, MooncakePeer) or self._peers.get(peer.id) is not peer:
            raise ValueError("unknown peer (connect() it with this backend)")

    def _batch_done(self, region: MooncakeRegion) -> None:
        with self._cond:
            region.inflight -= 1
            self._cond.notify_all()

    def _work(self, peer: MooncakePeer) -> None:
        """One thread per peer: chunks go to Mooncake one at a time (its per-peer
        queue limit), each waited for before the next, so cancel has a
        boundary to stop at."""
        eng = self._engine
        while True:
            batch = peer._queue.get()
            if batch is None:
                break
            if not batch._take():
                continue  # canceled while queued: settled already
            submit = eng.batch_transfer_async_read if batch.op == "read" else eng.batch_transfer_async_write
            error, state, unsafe, late, late_bytes = None, MooncakeBatch.DONE, False, False, 0
            for local_addrs, remote_addrs, lens in batch._chunks:
                if batch._should_stop() or self._closed:
                    error, state = Canceled("mooncake batch canceled"), MooncakeBatch.CANCELED
                    break
                if time.monotonic() > batch._deadline:
                    error, state = TimeoutError_(f"mooncake batch timed out after {batch._timeout_s} s"), \
                        MooncakeBatch.FAILED
                    break
                # (before the submit: Mooncake's give-up clock may start inside it, and a give-up taken for a
                # failed slice would be settled while slices stay queued; this errs towards a give-up)
                t0 = time.monotonic()
                bid = submit(peer.session, local_addrs, remote_addrs, lens)
                if bid == 0:
                    error, state = ConnectError(f"mooncake: submit to {peer.name} ({peer.session}) failed"), \
                        MooncakeBatch.FAILED
                    break
                with self._cond:
                    self._stats["chunks"] += 1
                if eng.get_batch_transfer_status([bid]) != 0:
                    # Mooncake reports a failed slice, or gave up waiting (transfer_timeout_s): in the
                    # latter case it freed the batch with slices possibly still queued.
                    unsafe = time.monotonic() - t0 >= self.mooncake.transfer_timeout_s
                    error, state = RemoteError(f"mooncake: {batch.op} from {peer.name} failed"), MooncakeBatch.FAILED
                    # It answers at the first failed slice and frees the batch; the chunk's other slices go on
                    # and say nothing when they end: the batch is told failed (and settled) settle_s later.
                    late = not unsafe
                    late_bytes = sum(lens)
                    break
            with self._cond:
                if state == MooncakeBatch.FAILED:
                    self._stats["failed"] += 1
                elif state == MooncakeBatch.CANCELED:
                    self._stats["canceled"] += 1
            if late:
                self._settle_later(batch, state, error, late_bytes)
            else:
                batch._finish(state, error, unsafe)
        while True:  # closing: whatever is still queued was never submitted
            try:
                batch = peer._queue.get_nowait()
            except queue.Empty:
                return
            if batch is not None:
                batch._finish(MooncakeBatch.CANCELED, Closed("mooncake backend closed"))

    def _settle_later(self, batch: MooncakeBatch, state: int, error: KVLinkError | None, nbytes: int) -> None:
        """Finish ``batch`` once its failed chunk's other slices (``nbytes`` in all) may have landed: settle_s
        plus those bytes at SETTLE_FLOOR_BPS from now, on a timer; the peer's thread goes on with the next
        batches. close() waits for these."""
        def finish():
            batch._finish(state, error)
            with self._cond:
                self._late -= 1
                self._cond.notify_all()

        with self._cond:
            self._late += 1
        timer = threading.Timer(self.mooncake.settle_s + nbytes / SETTLE_FLOOR_BPS, finish)
        timer.daemon = True
        timer.start()

    # -- notifications, stats ----------------------------------------------------------
    def notify(self, peer: MooncakePeer, payload: bytes, timeout_s: float | None = None) -> None:
        """Send a small opaque message (<= 4096 bytes) over the authenticated side
        channel and wait for the peer to queue it."""
        self._check_open()
        if not isinstance(payload, (bytes, bytearray)) or not 1 <= len(payload) <= MAX_NOTIFY:
            raise ValueError(f"payload must be 1..{MAX_NOTIFY} bytes")
        t = self.config.op_timeout_s if timeout_s is None else timeout_s
        reply = peer._client.request(b"N" + bytes(payload), t)
        if reply == b"F":
            raise QueueFull(f"peer {peer.name} refused the notification: its queue is full")
        if reply != b"K":
            raise RemoteError("side channel: notification not acknowledged")
        with self._cond:
            self._stats["notifies_sent"] += 1

    def _queue_note(self, sender: str, payload: bytes) -> bool:
        """Queue a received notification; False (refused, counted) beyond the native engine's bounds."""
        with self._cond:
            if (len(payload) > MAX_NOTIFY or len(self._notes) >= MAX_NOTES
                    or self._note_bytes + len(payload) > MAX_NOTE_BYTES):
                self._stats["notifs_dropped"] += 1
                return False
            self._notes.append((sender, payload))
            self._note_bytes += len(payload)
            self._stats["notifies_received"] += 1
            return True

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """Received notifications as (sender name, payload), oldest first."""
        with self._cond:
            notes, self._notes, self._note_bytes = self._notes, [], 0
        return notes

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self._stats, peers=len(self._peers), regions=len(self._regions))


def chunk_bounds(lens: Any, max_count: int, max_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive chunks of ``lens``: at most ``max_count`` descriptors and, unless one
    descriptor alone is larger, ``max_bytes`` each."""
    ends = np.cumsum(np.asarray(lens, dtype=np.uint64), dtype=np.uint64)  # (sums < 2^60: check_descriptors)
    out, a, n = [], 0, len(ends)
    while a < n:
        before = int(ends[a - 1]) if a else 0
        b = min(a + max_count, int(np.searchsorted(ends, np.uint64(before + max_bytes), side="right")))
        b = max(b, a + 1)
        out.append((a, b))
        a = b
    return out
