"""Engine: the pythonic face of the C transport engine."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlink import _binding as B
from kvlink.errors import Closed, PeerChanged, UnknownPeer
from kvlink.fdlimit import fd_room
from kvlink.transport.backend import Capabilities
from kvlink.transport.batch import Batch
from kvlink.transport.config import EngineConfig, check_name, join_hostport, split_hostport
from kvlink.transport.descriptors import check_descriptors, check_one
from kvlink.transport.region import Access, Region

logger = logging.getLogger(__name__)

FD_HEADROOM = 256  # descriptors beyond the engine's connections: the listener, the process's own files

PROTOCOL_VERSION = B.PROTOCOL_VERSION
CONNECT_TRIES = 3  # a peer closed to make room between connect's two calls is connected again


@dataclass(frozen=True)
class Peer:
    id: int
    address: str
    name: str
    same_host: bool = False  # READs copy the peer's memory directly


class Engine:
    """A transport engine: registers memory, connects to peers, and moves
    batches of (local offset, remote region, remote offset, length)
    descriptors. Use as a context manager or call close()."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        host, port = split_hostport(cfg.listen, "listen") if cfg.listen else (None, 0)
        self._h = B.engine_create(
            listen_host=host, listen_port=port, token=cfg.token, name=cfg.name, streams=cfg.streams, crc=cfg.crc,
            allow_insecure=cfg.allow_insecure, op_timeout_ms=int(cfg.op_timeout_s * 1000),
            connect_timeout_ms=int(cfg.connect_timeout_s * 1000),
            handshake_timeout_ms=int(cfg.handshake_timeout_s * 1000), max_conns=cfg.max_conns,
            same_host={"off": 0, "auto": 1, "require": 2}[cfg.same_host], max_peers=cfg.max_peers)
        self._host = host
        self.kind = "tcp" if cfg.same_host == "off" else "same-host"
        self.capabilities = Capabilities(crc=True, same_host=cfg.same_host != "off")
        self._lock = threading.Lock()
        self._calls = 0  # calls inside the C engine now (under _lock); close() waits for none
        self._idle = threading.Condition(self._lock)
        # Registered regions: held so their memory (Region._keep) lives while peers may still read it.
        self._regions: set[Region] = set()
        self.port = B.engine_port(self._h)
        logger.info("kvlink engine %r: listen=%s streams=%d crc=%s auth=%s", cfg.name, self.address, cfg.streams,
                    cfg.crc, "token" if cfg.token else "none")
        need = (cfg.max_conns if cfg.listen else 0) + cfg.max_peers * cfg.streams + FD_HEADROOM
        soft = fd_room(need)
        if soft is not None:
            logger.warning("kvlink engine %r: serving max_conns=%d and connecting max_peers=%d x %d streams needs "
                           "about %d file descriptors, but this process may open %d (RLIMIT_NOFILE): connections "
                           "past that fail; raise it (ulimit -n) or lower the limits", cfg.name,
                           cfg.max_conns if cfg.listen else 0, cfg.max_peers, cfg.streams, need, soft)

    # -- lifecycle -----------------------------------------------------------------
    @contextmanager
    def _using(self) -> Iterator[Any]:
        """The C handle for one call; close() waits for the calls under way before it frees the engine."""
        with self._lock:
            h = self._h
            if h is None:
                raise Closed("engine is closed")
            self._calls += 1
        try:
            yield h
        finally:
            with self._lock:
                self._calls -= 1
                if not self._calls:
                    self._idle.notify_all()

    @property
    def address(self) -> str | None:
        return None if self._host is None else join_hostport(self._host, self.port)

    def close(self) -> None:
        """Fail every batch in flight, close every connection, join every thread. Calls under way in other
        threads are told to give up (Closed) and waited for first: the engine is freed under none of them."""
        with self._lock:
            h, self._h = self._h, None
            if h is not None:
                B.engine_stop(h)
                self._idle.wait_for(lambda: not self._calls)
        if h is not None:
            self._log_events(h)
            B.engine_destroy(h)

    def __del__(self) -> None:
        # Dropped unclosed (Engine <-> Region is a cycle): the C engine would go on serving the regions' memory
        # after the collector frees it. Finalizers run before a cycle's objects are cleared, so closing here
        # stops the engine while that memory is still alive.
        if getattr(self, "_h", None) is None:
            return
        try:  # closed first: a warning filter that raises (-W error) must not keep the engine serving
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the modules it needs may be gone already
            pass
        try:
            warnings.warn(f"kvlink engine {getattr(getattr(self, 'config', None), 'name', '?')!r} was not closed",
                          ResourceWarning, stacklevel=1)
        except Exception:  # noqa: BLE001 - (ResourceWarning raised as an error: nothing to do with it here)
            pass

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory ----------------------------------------------------------------------
    def register(self, obj: Any, access: Access = Access.READ) -> Region:
        """Register a buffer-protocol object, a CPU torch tensor, or (address, length)."""
        region = Region(self, obj, access)
        self._regions.add(region)
        return region

    # -- peers -----------------------------------------------------------------------
    def connect(self, address: str, expect: str | None = None) -> Peer:
        """Connect (all streams, authenticated) to a peer engine at 'host:port'. ``expect``: only to the
        engine of that name (PeerChanged if the address answers as another; a peer of an earlier process
        there is retired)."""
        host, port = split_hostport(address, "peer address")
        if expect is not None:
            check_name(expect, "expect", empty=False)
        for attempt in range(CONNECT_TRIES):
            with self._using() as h:
                last = attempt == CONNECT_TRIES - 1
                try:
                    try:
                        pid = B.peer_connect(h, host, port, expect)
                    except PeerChanged:
                        # The address changed engines while this connect ran: again when any engine will do;
                        # else the address answers as another engine than expected (or did: the caller asks
                        # again later).
                        if last or expect is not None:
                            raise
                        continue
                    try:
                        name = B.peer_name(h, pid)
                        local, why = B.peer_local(h, pid)
                        break
                    except (UnknownPeer, PeerChanged):
                        # Another connect closed this peer meanwhile (the least recently used idle one, the
                        # table full, every other peer busy) or retired it: connect again.
                        if last:
                            raise
                finally:
                    self._log_events(h)
        if expect is not None and name != expect:  # (the engine guarantees it; a peer must never be misnamed)
            raise PeerChanged(f"{address} answers as engine {name!r}, not {expect!r}")
        if self.config.same_host != "off":
            logger.info("kvlink peer %s (%s): %s", address, name, why if local else f"TCP, because {why}")
        return Peer(pid, address, name, local)

    def peer_stale(self, peer: Peer) -> bool:
        """True when ``peer`` may no longer be the process it named: retired (another engine answered at its
        address), closed, or a connection of its closed by the other end while idle (its process ended, or
        the path dropped the connection). Nothing is sent. A caller that keeps peers asks before using one
        again and then connects anew, naming the engine it expects."""
        with self._using() as h:
            try:
                return B.peer_stale(h, peer.id)
            except (UnknownPeer, PeerChanged):
                return True

    # -- batches ---------------------------------------------------------------------
    def read(self, peer: Peer, local: Region, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
             lengths: Any, timeout_s: float | None = None) -> Batch:
        """Pull remote bytes into ``local`` at ``local_offsets``."""
        if not local.writable:
            raise ValueError("the destination region of a READ must be writable memory")
        return self._submit(B.OP_READ, peer, local, local_offsets, remote_regions, remote_offsets, lengths,
                            timeout_s)

    def write(self, peer: Peer, local: Region, local_offsets: Any, remote_regions: Any, remote_offsets: Any,
              lengths: Any, timeout_s: float | None = None) -> Batch:
        """Push bytes of ``local`` at ``local_offsets`` into the peer's regions."""
        return self._submit(B.OP_WRITE, peer, local, local_offsets, remote_regions, remote_offsets, lengths,
                            timeout_s)

    def _submit(self, op: int, peer: Peer, local: Region, local_offsets: Any, remote_regions: Any,
                remote_offsets: Any, lengths: Any, timeout_s: float | None) -> Batch:
        if not local.registered:
            raise ValueError("local region is not registered")
        t = self.config.op_timeout_s if timeout_s is None else timeout_s
        if type(local_offsets) is int and type(remote_offsets) is int and type(lengths) is int \
                and type(remote_regions) is int:
            check_one(local.length, local_offsets, remote_regions, remote_offsets, lengths)  # no arrays
            with self._using() as e:
                h = B.submit_one(e, peer.id, op, local.addr + local_offsets, remote_regions, remote_offsets,
                                 lengths, max(1, int(t * 1000)))
            return Batch(h, local, lengths, t)
        d = check_descriptors(local.length, local_offsets, remote_regions, remote_offsets, lengths)
        with self._using() as e:
            h = B.submit(e, peer.id, op, d.local_offsets + np.uint64(local.addr), d.remote_regions,
                         d.remote_offsets, d.lengths, max(1, int(t * 1000)))
        return Batch(h, local, d.nbytes, t)

    # -- notifications, events, stats ----------------------------------------------
    def notify(self, peer: Peer, payload: bytes, timeout_s: float | None = None) -> None:
        """Send a small opaque message (<= 4096 bytes) and wait for the peer to queue it."""
        if not isinstance(payload, (bytes, bytearray)) or not 1 <= len(payload) <= B.MAX_NOTIFY:
            raise ValueError(f"payload must be 1..{B.MAX_NOTIFY} bytes")
        t = self.config.op_timeout_s if timeout_s is None else timeout_s
        with self._using() as h:
            B.notify(h, peer.id, bytes(payload), max(1, int(t * 1000)))

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """Received notifications as (sender engine name, payload), oldest first."""
        with self._using() as h:
            return B.drain_notifications(h)

    def events(self) -> list[tuple[str, str]]:
        """Drain what the engine logged (refused peers and why, failed batches) and log it."""
        with self._using() as h:
            return self._log_events(h)

    def stats(self) -> dict[str, int]:
        with self._using() as h:
            return B.engine_stats(h)

    @staticmethod
    def _log_events(h: Any) -> list[tuple[str, str]]:
        if h is None:
            return []
        evs = B.events(h)
        for name, msg in evs:
            logger.warning("kvlink engine: %s (%s)", msg, name)
        return evs
