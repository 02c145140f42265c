"""Worker side of KVLinkConnector (runs in each worker process, next to the KV cache tensors).

register_kv_caches() registers the cache with a kvlink transport Engine. A prefill worker advertises
one READ region per layer to the bootstrap server (with a lease kept by a Heartbeater); a decode worker
registers the whole cache allocation as one WRITE region, so that all layers of all requests from one
remote engine go in one batched READ.

Pulls never block the forward pass. start_load_kv() posts the READ itself when the params name a peer
already connected (sequential pairing: no network needed, and no thread hand-off, which costs up to the
GIL switch interval while vLLM's worker loop spins); otherwise it hands the PullSpec to a resolver thread
(bootstrap lookups where the params lack the blocks, first-contact checks once per remote engine), which
posts as soon as it is resolved. Ready pulls are grouped by remote engine (one READ per engine). A
waiter thread blocks on each batch (no polling) and get_transfer_results() checks finished batches on
vLLM's own thread, so a pull completes, or fails (PeerClosed when prefill dies), as soon as the
transport says so; failed pulls are listed per request as well as by block. The Puller thread re-posts
batches split by a cancel and enforces the deadlines. Every pull has one deadline (``pull_timeout_s``)
covering lookup, connect and READ; a LeaseRenewer keeps prefill's lease alive while a pull runs.

A READ that finished is trusted only with proof that prefill still held the blocks when it ended: the
READ ended before ``held_until``, the bound the last successful lease renewal (or the concurrent lookup)
gave. A new pull's first renewal goes out at once, in parallel with its READ, so this costs no time
unless the READ beats the renewal's round trip; until then the pull waits in ``_confirming``. A lease that
ran out before decode got to the request (a long queue) is reported by that renewal, and the pull is
recomputed instead of decoding from blocks prefill may have reused.

vLLM pins a CPU worker's threads to its OMP cores (``VLLM_CPU_OMP_THREADS_BIND``) and threads inherit
that. With ``spread_threads`` the connector's threads, and the transport threads they start (stream
threads are created at connect, on a resolver thread), may run on any CPU instead. Off by default: the
worker's idle loop yields (sched_yield) to them on its own core, and on 2 cores spreading measured slower.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlink.vllm.compat import PROTOCOL_VERSION, compat_fields, compat_hash
from kvlink.vllm.config import ConnectorConfig
from kvlink.vllm.lease import LeaseRenewer, LeaseTerm
from kvlink.vllm.metadata import KVLinkMetadata, PullSpec
from kvlink.vllm.plan import LayerMap, ReadPlan, build_plan
from kvlink.vllm.stats import KVLinkStats

logger = logging.getLogger(__name__)


def transport_module():
    """The transport implementation (tests substitute an in-process fake here)."""
    import kvlink.transport

    return kvlink.transport


class PullFailed(Exception):
    """A pull cannot complete; the message says why (logged once per request)."""


@dataclass(frozen=True)
class RankInfo:
    engine_id: str
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    model: str


@dataclass
class _Remote:
    """A prefill rank we pulled from: its registration, our peer handle and layer map."""

    key: tuple[str, str]  # (bootstrap url, engine id)
    peer: Any
    layers: list[LayerMap]
    block_bytes: int


@dataclass
class _Pull:
    spec: PullSpec
    deadline: float
    remote: _Remote | None = None
    pairs: list[tuple[int, int]] = field(default_factory=list)
    remote_request_id: str | None = None
    term: LeaseTerm | None = None  # set once prefill's request is known; read by the LeaseRenewer
    held_until: float = 0.0  # monotonic time until which prefill provably holds the blocks
    read_at: float = 0.0  # when its READ finished (0: not yet)
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    reported: bool = False  # set once, under the worker lock, when the outcome is handed to vLLM


@dataclass
class _InFlight:
    batch: Any
    pulls: list[_Pull]
    started: float
    nbytes: int
    nblocks: int
    ndesc: int


class KVLinkWorker:
    def __init__(self, cfg: ConnectorConfig, rank: RankInfo, role: str):
        self.cfg, self.rank, self.role = cfg, rank, role
        self.tp = transport_module()
        self.engine = None
        self.kv_caches: dict[str, Any] = {}
        self.layer_names: list[str] = []
        self.compat: dict = {}
        self.compat_hash = ""
        self.block_bytes = 0
        self._local_region = None
        self._local_offsets: dict[str, int] = {}
        self._heartbeater = None
        self._bootstrap_url: str | None = cfg.bootstrap_url
        self._clients = None
        self._lock = threading.Lock()  # guards everything below shared with the Puller thread
        self._wake = threading.Condition(self._lock)
        self._resolving: dict[str, _Pull] = {}
        self._ready: list[_Pull] = []
        self._inflight: list[_InFlight] = []
        self._confirming: dict[str, _Pull] = {}  # READ done, waiting for proof that the lease held
        self._done: set[str] = set()
        self._done_at: dict[str, float] = {}  # ok pulls not yet collected by vLLM: when they settled
        self._failed: dict[str, tuple[int, ...]] = {}
        self._load_error_blocks: set[int] = set()
        self._frees: set[str] = set()
        self._stats = KVLinkStats()
        self.totals = KVLinkStats()  # since start, never reset (tests, demo)
        self._remotes: dict[tuple[str, str], _Remote] = {}
        self._mismatch_logged: set[tuple[str, str]] = set()
        self._closed = False
        self._resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlink-resolve",
                                            initializer=self._place_thread)
        self._waiter = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvlink-wait",
                                          initializer=self._place_thread)
        self._bytes_local_seen = 0
        self._thread: threading.Thread | None = None
        self._renewer: LeaseRenewer | None = None
        self._running_sent: int | None = None  # last pulls_in_progress gauge handed out

    def _place_thread(self) -> None:
        """Let the calling thread (and threads it starts) run on any CPU rather than vLLM's OMP core."""
        if not self.cfg.spread_threads or not hasattr(os, "sched_setaffinity"):
            return
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError as e:  # a cpuset may forbid it: stay where vLLM put us
            logger.debug("kvlink: cannot widen thread affinity: %s", e)

    # ----- start-up ----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        import torch

        if not kv_caches:
            raise RuntimeError("kvlink: vLLM gave no KV cache tensors to register")
        first = next(iter(kv_caches.values()))
        for name, t in kv_caches.items():
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise RuntimeError(f"kvlink: KV cache {name} must be a contiguous CPU tensor "
                                   f"(got {getattr(t, 'device', type(t))}); kvlink moves host memory only")
            if t.shape != first.shape or t.dtype != first.dtype:
                raise RuntimeError("kvlink: all KV cache layers must have the same shape and dtype")
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        num_blocks, kv_heads, block_size, last = first.shape
        self.block_bytes = first[0].numel() * first.element_size()
        layout = f"cpu:[blocks,{kv_heads},{block_size},{last}]"
        self.compat = compat_fields(model=self.rank.model, kv_dtype=str(first.dtype).replace("torch.", ""),
                                    layout=layout, tokens_per_block=block_size,
                                    num_layers=len(kv_caches), kv_heads=kv_heads, head_size=last // 2)
        self.compat_hash = compat_hash(self.compat)

        tp = self.tp
        self.engine = tp.open_backend(self.cfg.transport_backend, tp.EngineConfig(
            listen=self.cfg.transport_listen(self.rank.tp_rank),
            token=self.cfg.transport_token_bytes,
            name=f"{self.rank.engine_id}/tp{self.rank.tp_rank}", streams=self.cfg.transport_streams,
            crc=self.cfg.crc, op_timeout_s=self.cfg.transfer_timeout_s,
            connect_timeout_s=self.cfg.connect_timeout_s, allow_insecure=self.cfg.allow_insecure))
        if self.role in ("kv_producer", "kv_both"):
            self._layer_regions = {n: self.engine.register(t, access=tp.Access.READ)
                                   for n, t in kv_caches.items()}
        if self.role in ("kv_consumer", "kv_both"):
            self._register_destination(kv_caches)
            self._thread = threading.Thread(target=self._run, name="kvlink-puller", daemon=True)
            self._thread.start()
            self._renewer = LeaseRenewer(self._clients_for, self._leased_pulls, self._abort,
                                         self._lease_held).start()
        logger.info("kvlink: %s worker tp%d/%d transport %s (backend %s, streams %d, auth %s, crc %s), "
                    "%d layers, %d blocks of %d B/layer, compat %s, threads %s",
                    self.role, self.rank.tp_rank, self.rank.tp_size, self.engine.address,
                    self.cfg.transport_backend, self.cfg.transport_streams,
                    "token" if self.cfg.transport_token else "none (loopback only)"
                    if not self.cfg.allow_insecure else "none", self.cfg.crc, len(kv_caches), num_blocks,
                    self.block_bytes, self.compat_hash,
                    "any CPU" if self.cfg.spread_threads else "pinned with the worker")

    def _register_destination(self, kv_caches: dict[str, Any]) -> None:
        tensors = list(kv_caches.values())
        ptrs = [t.data_ptr() for t in tensors]
        lo = min(ptrs)
        hi = max(p + t.numel() * t.element_size() for p, t in zip(ptrs, tensors))
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self.role == "kv_both" or hi - lo > total:
            # Not one allocation (or also a source): one region per layer, one READ per layer.
            access = self.tp.Access.READ | self.tp.Access.WRITE
            if self.role == "kv_both":
                self._local_region = None
                self._layer_dest = self._layer_regions
            else:
                self._layer_dest = {n: self.engine.register(t, access=access) for n, t in kv_caches.items()}
            self._local_offsets = {n: 0 for n in kv_caches}
        else:
            self._local_region = self.engine.register((lo, hi - lo), access=self.tp.Access.WRITE)
            self._local_offsets = {n: t.data_ptr() - lo for n, t in kv_caches.items()}
            self._layer_dest = {}

    def _clients_for(self, url: str):
        from kvlink.vllm.scheduler import _Clients

        if self._clients is None:
            self._clients = _Clients(self.cfg)
        return self._clients.get(url)

    def _ensure_registered(self, bootstrap_url: str | None) -> None:
        """Prefill: register this rank with the bootstrap server once its URL is known; keep it alive."""
        if self._heartbeater is not None or self.role not in ("kv_producer", "kv_both"):
            return
        url = self._bootstrap_url or bootstrap_url
        if url is None or self.engine is None:
            return
        from kvlink.bootstrap import EngineRegistration, Heartbeater, KVLayerSpec

        first = next(iter(self.kv_caches.values()))
        layers = [KVLayerSpec(name=n, region_id=r.id, block_bytes=self.block_bytes,
                              num_blocks=first.shape[0], tokens_per_block=self.compat["tokens_per_block"],
                              dtype=self.compat["kv_dtype"], layout=self.compat["layout"])
                  for n, r in self._layer_regions.items()]
        reg = EngineRegistration(engine_id=self.rank.engine_id, dp_rank=self.rank.dp_rank,
                                 dp_size=self.rank.dp_size, tp_rank=self.rank.tp_rank,
                                 tp_size=self.rank.tp_size,
                                 transport_addr=self.cfg.advertised(self.rank.tp_rank) or self.engine.address,
                                 layers=layers, protocol_version=PROTOCOL_VERSION,
                                 compat_hash=self.compat_hash)
        cli = self._clients_for(url)
        try:
            cli.register_engine(reg, self.cfg.engine_lease_s)  # first time synchronously: decode may ask soon
        except Exception as e:  # noqa: BLE001 - the heartbeater retries
            logger.warning("kvlink: registering with bootstrap %s failed: %s; retrying", url, e)
        self._heartbeater = Heartbeater(cli, reg, self.cfg.engine_lease_s).start()
        self._bootstrap_url = url
        logger.info("kvlink: engine %s tp%d registered with bootstrap %s", self.rank.engine_id,
                    self.rank.tp_rank, url)

    # ----- per step ----------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVLinkMetadata | None) -> None:
        if meta is None:
            return
        if meta.bootstrap_url is not None:
            self._ensure_registered(meta.bootstrap_url)
        if meta.frees:
            with self._lock:
                self._frees.update(meta.frees)
        if meta.pulls:
            for spec in meta.pulls:
                self._submit(spec)
        for rid in meta.cancels:
            self._cancel(rid)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call.

        A failed pull is in both receiving sets (vLLM releases it from its wait and recomputes it) and its
        blocks are in take_load_error_blocks() no later than this call's step.
        """
        self._settle_finished()
        with self._lock:
            sending, self._frees = self._frees, set()
            failed = set(self._failed)
            recving = self._done | failed
            self._done = set()
            self._failed = {}
            if self._done_at:
                now = time.monotonic()
                for settled in self._done_at.values():
                    self._stats.sample("handoff_s", now - settled)
                self._done_at = {}
        return sending, recving, failed

    def take_load_error_blocks(self) -> set[int]:
        """Local block ids of pulls that failed since the last call."""
        with self._lock:
            blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def get_stats(self) -> KVLinkStats | None:
        with self._lock:
            stats, self._stats = self._stats, KVLinkStats()
            if self.role in ("kv_consumer", "kv_both"):
                running = (len(self._resolving) + len(self._ready) + len(self._confirming)
                           + sum(len(f.pulls) for f in self._inflight))
                if running != self._running_sent:
                    self._running_sent = running
                    stats.set_gauge("pulls_in_progress", running)
                local = self._bytes_local()
                if local > self._bytes_local_seen:
                    stats.add("bytes_local", local - self._bytes_local_seen)
                    self._bytes_local_seen = local
            self.totals.aggregate(stats)
        return None if stats.is_empty() else stats

    def _bytes_local(self) -> int:
        """Bytes the transport copied same-host (process_vm_readv) since start; 0 if it cannot say."""
        stats = getattr(self.engine, "stats", None)
        try:
            return int(stats().get("bytes_local", 0)) if stats is not None else 0
        except Exception:  # noqa: BLE001 - statistics only
            return 0

    def _lease_held(self, pulls: list[_Pull], held_until: float) -> None:
        """LeaseRenewer: prefill holds these pulls' blocks until at least ``held_until``."""
        with self._lock:
            self._stats.add("lease_renewals", len(pulls))
            for p in pulls:
                p.held_until = max(p.held_until, held_until)
            proven = [p for p in pulls if self._confirming.get(p.spec.request_id) is p
                      and p.read_at < p.held_until]
        for p in proven:
            self._finish(p, ok=True)

    def _settle_lease(self, pull: _Pull) -> None:
        """A pull's READ finished: done if the lease provably held until then, else wait for a renewal."""
        with self._lock:
            if pull.reported:
                return
            if pull.read_at >= pull.held_until:
                self._confirming[pull.spec.request_id] = pull
                self._stats.add("lease_proof_waits")
                if pull.term is not None:
                    pull.term.next_renew = 0.0  # due now
                wait = True
            else:
                wait = False
        if not wait:
            self._finish(pull, ok=True)
        elif self._renewer is not None:
            self._renewer.kick()

    def snapshot(self) -> dict:
        """Totals since start including what get_stats() has not handed out yet."""
        with self._lock:
            return KVLinkStats(data={k: (list(v) if isinstance(v, list) else v)
                                     for k, v in self.totals.data.items()}).aggregate(self._stats).data

    # ----- pulls -------------------------------------------------------------------------------------

    def _submit(self, spec: PullSpec) -> None:
        pull = _Pull(spec, time.monotonic() + self.cfg.pull_timeout_s)
        if not spec.local_block_ids:
            self._finish(pull, ok=True)
            return
        with self._lock:
            self._resolving[spec.request_id] = pull
            src = spec.source
            known = (src.block_ids is not None and src.engine_id is not None and src.request_id is not None
                     and (src.bootstrap_url, src.engine_id) in self._remotes)
        if known:
            # Sequential pairing with a peer we already talk to: nothing to ask the network, so post the
            # READ now, on vLLM's thread, instead of waking a resolver (a GIL hand-off costs up to the
            # 5 ms switch interval while the worker's idle loop spins; measured ~9 ms per request).
            self._resolve(pull)
        else:
            self._resolver.submit(self._resolve, pull)

    def _resolve(self, pull: _Pull) -> None:
        """Find the remote record and engine, check compatibility, connect; then post. On a resolver thread,
        or inline from _submit when everything is known already (no network)."""
        src = pull.spec.source
        try:
            cli = self._clients_for(src.bootstrap_url)
            engine_id, remote_rid, blocks = src.engine_id, src.request_id, src.block_ids
            lease_s = src.lease_s or self.cfg.lease_s
            # Sequential params say nothing of how much of the lease is left: renew at once.
            first_renewal = 0.0
            if src.transfer_id is not None and (blocks is None or engine_id is None):
                wait = max(0.0, min(self.cfg.lookup_wait_s, pull.deadline - time.monotonic()))
                sent = time.monotonic()
                rec = cli.lookup_transfer(src.transfer_id, wait_s=wait, engine_id=engine_id)
                engine_id, remote_rid, blocks = rec.engine_id, rec.request_id, tuple(rec.block_ids[0])
                pull.held_until = sent + rec.lease_remaining_s
                first_renewal = min(lease_s, rec.lease_remaining_s) / 3
            pull.remote_request_id = remote_rid
            with self._lock:
                pull.term = LeaseTerm(src.bootstrap_url, engine_id, remote_rid, lease_s,
                                      time.monotonic() + first_renewal)
            if first_renewal == 0.0 and self._renewer is not None:
                self._renewer.kick()
            remote = self._remote(cli, src.bootstrap_url, engine_id)
            skip = pull.spec.skip_remote_blocks
            wanted = blocks[skip:skip + len(pull.spec.local_block_ids)]
            if len(wanted) < len(pull.spec.local_block_ids):
                raise PullFailed(f"prefill published {len(blocks)} blocks, decode needs "
                                 f"{skip + len(pull.spec.local_block_ids)}")
            pull.pairs = list(zip(pull.spec.local_block_ids, wanted))
            pull.remote = remote
        except Exception as e:  # noqa: BLE001 - any failure means: recompute locally
            self._finish(pull, ok=False, why=_why(e))
            return
        with self._wake:
            if self._resolving.pop(pull.spec.request_id, None) is None or pull.cancelled:
                return  # cancelled meanwhile (already reported)
            self._ready.append(pull)
        self._post_ready()  # on this thread: no hand-off to the puller before the READ is posted

    def _remote(self, cli, url: str, engine_id: str) -> _Remote:
        key = (url, engine_id)
        with self._lock:
            remote = self._remotes.get(key)
        if remote is not None:
            return remote
        reg = cli.get_engine(engine_id, tp_rank=self.rank.tp_rank, dp_rank=0)
        if reg.tp_size != self.rank.tp_size:
            raise PullFailed(f"prefill engine {engine_id} runs TP={reg.tp_size}, this decode TP="
                             f"{self.rank.tp_size}: kvlink supports equal TP only (rank i pulls from rank i)")
        if reg.compat_hash != self.compat_hash or reg.protocol_version != PROTOCOL_VERSION:
            if key not in self._mismatch_logged:
                self._mismatch_logged.add(key)
                logger.error("kvlink: engine %s is not compatible: remote compat %s (protocol %d), local "
                             "compat %s (protocol %d) = %s", engine_id, reg.compat_hash, reg.protocol_version,
                             self.compat_hash, PROTOCOL_VERSION, self.compat)
            raise PullFailed(f"compat mismatch with {engine_id}: remote {reg.compat_hash}, local "
                             f"{self.compat_hash}")
        by_name = {layer.name: layer for layer in reg.layers}
        missing = [n for n in self.layer_names if n not in by_name]
        if missing:
            raise PullFailed(f"prefill engine {engine_id} lacks layers {missing[:3]}")
        peer = self.engine.connect(reg.transport_addr)
        layers = [LayerMap(n, self._local_offsets[n], by_name[n].region_id, self.block_bytes)
                  for n in self.layer_names]
        remote = _Remote(key, peer, layers, self.block_bytes)
        with self._lock:
            self._remotes[key] = remote
        logger.info("kvlink: connected to prefill engine %s tp%d at %s", engine_id, self.rank.tp_rank,
                    reg.transport_addr)
        return remote

    def _leased_pulls(self) -> list[tuple[_Pull, LeaseTerm]]:
        """LeaseRenewer: the pulls still running whose prefill request is known."""
        with self._lock:
            pulls = [*self._resolving.values(), *self._ready, *self._confirming.values(),
                     *(p for f in self._inflight for p in f.pulls)]
            return [(p, p.term) for p in pulls if p.term is not None and not p.reported]

    def _abort(self, pull: _Pull, why: str) -> None:
        """Fail a running pull now (deadline passed, lease lost): stop its READ, recompute it."""
        self._detach(pull.spec.request_id)
        self._finish(pull, ok=False, why=why)

    def _cancel(self, rid: str) -> None:
        pull = self._detach(rid)
        if pull is None:
            return  # already reported
        with self._lock:
            pull.cancelled = True
            if pull.reported:
                return
            pull.reported = True
            self._stats.add("pulls_cancelled")
            self._done.add(rid)

    def _detach(self, rid: str) -> _Pull | None:
        """Take a request out of wherever it is (resolving, ready, in flight); None if it is not there.

        An in-flight batch carrying it is cancelled (nothing lands in our blocks after cancel returns) and
        the other requests of that batch are posted again.
        """
        with self._lock:
            pull = self._resolving.pop(rid, None) or self._confirming.pop(rid, None)
            if pull is None:
                pull = next((p for p in self._ready if p.spec.request_id == rid), None)
                if pull is not None:
                    self._ready.remove(pull)
            fl = None
            if pull is None:
                fl = next((f for f in self._inflight if any(p.spec.request_id == rid for p in f.pulls)), None)
                if fl is not None:
                    self._inflight.remove(fl)
        if fl is not None:
            fl.batch.cancel()
            pull = next(p for p in fl.pulls if p.spec.request_id == rid)
            with self._wake:
                self._ready.extend(p for p in fl.pulls if p is not pull and not p.reported)
                self._wake.notify()
        return pull

    def _finish(self, pull: _Pull, ok: bool, why: str = "") -> None:
        rid = pull.spec.request_id
        with self._lock:
            self._resolving.pop(rid, None)
            self._confirming.pop(rid, None)
            if pull.reported:
                return  # exactly one outcome per request
            pull.reported = True
            if ok:
                self._done.add(rid)
                self._stats.add("pulls_ok")
                if pull.read_at:
                    now = time.monotonic()
                    self._stats.sample("pull_s", now - pull.submitted)
                    self._done_at[rid] = now
            else:
                self._failed[rid] = pull.spec.local_block_ids
                self._load_error_blocks.update(pull.spec.local_block_ids)
                self._stats.add("pulls_failed")
                if pull.remote is not None:
                    self._remotes.pop(pull.remote.key, None)  # reconnect next time
        if not ok:
            logger.warning("kvlink: pull for request %s failed: %s; kv_load_failure_policy applies", rid, why)

    def _run(self) -> None:
        """Puller thread: post pulls put back by a cancel, enforce deadlines. Never polls a batch."""
        self._place_thread()
        while True:
            try:
                with self._wake:
                    if self._closed:
                        return
                    if not self._ready:
                        running = self._resolving or self._inflight
                        self._wake.wait(0.1 if running else 0.5)  # deadlines are checked this often
                    if self._closed:
                        return
                self._post_ready()
                self._expire()
            except Exception:  # noqa: BLE001 - a dead puller would leave every decode request waiting
                logger.exception("kvlink: puller round failed")

    def _post_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        if ready:
            self._post(ready)

    def _expire(self) -> None:
        """Fail every pull past its deadline, wherever it is (lookup, connect, queued, READ)."""
        now = time.monotonic()
        with self._lock:
            late = [p for p in (*self._resolving.values(), *self._ready, *self._confirming.values(),
                                *(p for f in self._inflight for p in f.pulls))
                    if p.deadline < now and not p.reported]
        for p in late:
            self._abort(p, f"no KV within pull_timeout_s={self.cfg.pull_timeout_s:g} s")

    def _post(self, ready: list[_Pull]) -> None:
        by_remote: dict[tuple[str, str], list[_Pull]] = {}
        for p in ready:
            by_remote.setdefault(p.remote.key, []).append(p)
        for pulls in by_remote.values():
            remote = pulls[0].remote
            dests = [(self._local_region, remote.layers)] if self._local_region is not None else [
                (self._layer_dest[lm.name], [lm]) for lm in remote.layers]
            for region, layers in dests:
                plan = ReadPlan.concat([build_plan(layers, p.pairs) for p in pulls])
                try:
                    batch = self.engine.read(remote.peer, region, plan.local_offsets, plan.remote_region_ids,
                                             plan.remote_offsets, plan.lengths,
                                             timeout_s=self.cfg.transfer_timeout_s)
                except Exception as e:  # noqa: BLE001
                    for p in pulls:
                        self._finish(p, ok=False, why=_why(e))
                    break
                nblocks = sum(len(p.pairs) for p in pulls) * len(layers)
                fl = _InFlight(batch, pulls, time.monotonic(), plan.nbytes, nblocks, len(plan))
                with self._lock:
                    self._inflight.append(fl)
                self._waiter.submit(self._await, fl)

    def _settle_finished(self) -> None:
        """vLLM's thread, once a step: settle batches that are already done (a non-blocking check), so
        the result goes out in this step even when the waiter thread has not got the GIL back yet."""
        with self._lock:
            inflight = list(self._inflight)
        for fl in inflight:
            try:
                done, err = fl.batch.poll(), None
            except Exception as e:  # noqa: BLE001
                done, err = True, e
            if done:
                self._complete(fl, err)  # at most once per batch: the waiter's call then finds it gone

    def _await(self, fl: _InFlight) -> None:
        """Waiter thread: block on one batch (the GIL is released meanwhile), then settle its pulls.

        A batch that is cancelled (abort, shutdown) returns here with an error and is ignored below; one
        that outlives transfer_timeout_s is cancelled by wait() itself; a dropped connection (prefill died)
        fails it at once.
        """
        err = None
        try:
            fl.batch.wait(self.cfg.transfer_timeout_s + 1.0)
        except Exception as e:  # noqa: BLE001
            err = e
        try:
            self._complete(fl, err)
        except Exception:  # noqa: BLE001 - never lose a pull silently
            logger.exception("kvlink: settling a batch failed")
            for p in fl.pulls:
                self._finish(p, ok=False, why="internal error settling the batch")

    def _complete(self, fl: _InFlight, err: BaseException | None) -> None:
        now = time.monotonic()
        with self._lock:
            if fl not in self._inflight:
                return  # cancelled meanwhile: its pulls were reported or posted again
            self._inflight.remove(fl)
            # A request counts as done only when every batch carrying it is done.
            others = {p.spec.request_id for f in self._inflight for p in f.pulls}
        if err is None:
            with self._lock:
                self._stats.add("batches")
                self._stats.add("bytes_pulled", fl.nbytes)
                self._stats.add("blocks_pulled", fl.nblocks)
                self._stats.add("descriptors", fl.ndesc)
                self._stats.sample("transfer_s", now - fl.started)
            for p in fl.pulls:
                if p.spec.request_id not in others:
                    if self.cfg.debug_corrupt_kv:
                        self._corrupt(p)
                    p.read_at = now
                    self._settle_lease(p)
        else:
            for p in fl.pulls:
                self._finish(p, ok=False, why=_why(err))
            with self._lock:  # drop sibling batches of failed requests
                failed = {p.spec.request_id for p in fl.pulls}
                siblings = [f for f in self._inflight if any(p.spec.request_id in failed for p in f.pulls)]
                for f in siblings:
                    self._inflight.remove(f)
            for f in siblings:
                f.batch.cancel()

    def _corrupt(self, pull: _Pull) -> None:
        import torch

        ids = torch.tensor([lb for lb, _ in pull.pairs], dtype=torch.long)
        g = torch.Generator().manual_seed(0)
        for t in self.kv_caches.values():
            t[ids] = torch.randn(t[ids].shape, generator=g).to(t.dtype)

    # ----- shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._wake:
            self._closed = True
            inflight, self._inflight = self._inflight, []
            self._wake.notify_all()
        for fl in inflight:
            try:
                fl.batch.cancel()
            except Exception:  # noqa: BLE001
                pass
        self._resolver.shutdown(wait=False, cancel_futures=True)
        self._waiter.shutdown(wait=False, cancel_futures=True)  # cancel above (or close below) ends waits
        if self._renewer is not None:
            self._renewer.stop()
        if self._heartbeater is not None:
            self._heartbeater.stop()
        if self._clients is not None:
            self._clients.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _why(e: BaseException) -> str:
    name = getattr(e, "name", None) or type(e).__name__
    return f"{name}: {e}"
