"""Worker side of KVLinkConnector: the adapter between vLLM's worker, the transport and the pull table.

register_kv_caches() registers the cache with a transport backend. A prefill worker advertises one READ
region per layer to the bootstrap server (with a lease kept by a Heartbeater); a decode worker registers
the whole cache allocation as one WRITE region, so all layers of all requests from one remote engine go
in one batched READ. Where a block lives in a layer's tensor (vLLM CPU's layout, FlashAttention's K/V
planes, FlashInfer, NHD/HND, MLA) is layout.py's; the KV must still be in host memory.

Decode's pulls live in a PullTable (pulls.py): pure logic, events in, actions out. Its one lock, and the
carrying out of its actions (resolve, post a READ, cancel a batch, renew leases) outside that lock, are
puller.py's (``Puller``, the decode half of this class). Pulls never block the forward pass.

Threads, why each exists, and what it may touch (everything shared is in the table, under ``_lock``):
- vLLM's worker thread: start_load_kv (submit, cancel, frees), transfer_results, get_stats. When a
  pull's params name a peer already connected (sequential pairing) it resolves and posts the READ itself:
  no network, and no thread hand-off (up to the GIL switch interval while vLLM's loop spins). Once a step
  it polls posted batches without blocking, so a finished READ is reported in that step.
- kvlink-resolve (pool of 4): bootstrap lookups (concurrent pairing), first contact with a prefill engine
  (registration, compat check, connect) and pairing; then posts. Touches the bootstrap clients, the
  transport's connect, ``_remotes`` (under the lock).
- kvlink-wait (pool of 8): blocks on one posted batch each (the GIL is released) and reports its end.
- kvlink-cancel (one): asks the backend to stop batches the table wants cancelled; a backend's cancel may
  wait for a chunk in flight (Mooncake), which must not stall vLLM's thread or the ticker.
- kvlink-pulls (one): deadlines, cancels that have not settled yet, renewals due; sleeps until the next.
- kvlink-lease (pool, one call per (bootstrap server, prefill engine) group): lease renewals, so a hung
  bootstrap server delays only its own pulls (lease.py).
- Prefill only: the Heartbeater keeps this rank's registration alive (kvlink.bootstrap).
- The transport's own threads (C streams, Mooncake's) never call into this module.

vLLM pins a CPU worker's threads to its OMP cores (``VLLM_CPU_OMP_THREADS_BIND``) and threads inherit
that. With ``spread_threads`` the connector's threads, and the transport threads they start (stream
threads are created at connect, on a resolver thread), may run on any CPU instead. Off by default: the
worker's idle loop yields (sched_yield) to them on its own core, and on 2 cores spreading measured slower.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvlink import trace
from kvlink.backends import open_backend
from kvlink.transport import Access, EngineConfig
from kvlink.vllm.compat import (PROTOCOL_VERSION, attn_desc, compat_fields, compat_hash, kv_head_scales, kv_scales,
                                layer_layout)
from kvlink.vllm.config import ConnectorConfig
from kvlink.vllm.contact import engine_name
from kvlink.vllm.layout import (Geometry, LayoutError, block_layout, pool_geometry, state_layout,
                                tokens_per_block)
from kvlink.vllm.lease import LeaseCalls, reader_of
from kvlink.vllm.metadata import KVLinkMetadata
from kvlink.vllm.nudge import Nudger
from kvlink.vllm.plan import layer_indices
from kvlink.vllm.puller import Puller, _Remote
from kvlink.vllm.shard import MappingError, heads_of
from kvlink.vllm.pulls import PullTable
from kvlink.vllm.stager import DONE, Pending, Stager
from kvlink.vllm.staging import MIB, SlotPool, pool_slots, staging_wanted
from kvlink.vllm.stats import KVLinkStats
from kvlink.vllm.stream import PieceSender, PrefillStream

logger = logging.getLogger(__name__)

# Threads resolving pulls (contact, long polls for records and pieces): waiting pulls at once, per rank. Each
# holds a long poll at prefill's bootstrap server (3/4 of its max_connections, 4,096 by default, for all).
RESOLVERS = 64


@dataclass(frozen=True)
class RankInfo:
    engine_id: str
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    model: str
    pp_rank: int = 0
    pp_size: int = 1
    kv_heads: int = 0  # the model's KV heads over all TP ranks (0: this rank's heads x tp_size)
    mla: bool = False  # the KV cache is MLA's latent (no heads)
    num_layers: int = 0  # the model's KV layers, all PP stages (0: the layers this rank registers)
    groups: str = ""  # the KV cache groups' specs, as the compatibility check compares them
    kv_format: str = ""  # compat.kv_format of vLLM's cache_dtype (quantized formats share uint8 tensors)
    rope: str = ""  # compat.rope_desc of the model's config: how its keys are rotated
    weights: str = ""  # compat.weights_desc: the revision, weight quantization and hf overrides, where set
    dp_local: int = 0  # this engine's DP rank on its host (connector.dp_local_of; 0 without data parallelism)
    launch: str | None = None  # this engine's start, shared with its scheduler (connector.launch_of)

    @property
    def index(self) -> int:
        """This rank among its engine's TP x PP ranks (a DP rank is an engine of its own)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def port_index(self) -> int:
        """This rank's transport port, counted from ``transport_port``: one per (DP rank on this host, PP
        stage, TP rank) (every DP rank reads the same ``transport_port``)."""
        return self.dp_local * self.pp_size * self.tp_size + self.index


def head_dim_mismatch(layout_heads: int, tp_rank: int, tp_size: int, kv_heads: int) -> str | None:
    """Why the KV tensors' head dimension is not this rank's KV heads (None: it is, or there is nothing to
    compare: MLA, an unknown head count, a split vLLM itself would refuse). Some backends put something else
    there (b12x and rocm_attn: the K or V slot, with every head in the last dimension); read as heads, a head
    range of a block would be half of K or V."""
    if not layout_heads or not kv_heads:
        return None
    try:
        mine = len(heads_of(tp_rank, tp_size, kv_heads))
    except MappingError:
        return None
    if layout_heads == mine:
        return None
    return (f"the KV cache's head dimension holds {layout_heads}, but TP rank {tp_rank} of {tp_size} holds {mine} "
            f"of the model's {kv_heads} KV heads")


class KVLinkWorker(Puller):
    def __init__(self, cfg: ConnectorConfig, rank: RankInfo, role: str, slot_bytes: int | None = None,
                 layer_groups: dict[str, int] | None = None, state_layers: set[str] | None = None,
                 num_groups: int | None = None, num_blocks: int | None = None):
        self.cfg, self.rank, self.role = cfg, rank, role
        for key, addr in (("transport_port", f"x:{cfg.transport_port}"),
                          ("transport_advertise", cfg.transport_advertise)):
            port = int(addr.rpartition(":")[2]) if addr else 0
            if port and port + rank.port_index > 65535:
                raise RuntimeError(f"kvlink: kv_connector_extra_config[{key!r}] gives each rank a port from {port} "
                                   f"on; this rank (port index {rank.port_index}) would need "
                                   f"{port + rank.port_index}, past 65535")
        self._reader = reader_of(rank.engine_id, rank.launch)  # decode: how bootstrap servers know this engine
        # vLLM's KV cache groups (all of them, also those without a layer on this PP stage) and blocks per group
        self._num_groups = num_groups or len(set((layer_groups or {}).values())) or 1
        self._num_blocks = num_blocks
        self._state_layers = set(state_layers or ())  # layers of a Mamba group: a per-request state per block
        self._layer_group = dict(layer_groups or {})  # layer name -> KV cache group (hybrid models; else 0)
        self._group_layers: dict[int, int] = {0: 0}  # KV cache group -> layers of this rank in it
        self.slot_bytes = slot_bytes  # staging: bytes of one slot as the scheduler sizes the pool (staging.py)
        self.engine = None
        self.kv_caches: dict[str, Any] = {}
        self.layer_names: list[str] = []
        self.kv_scales: dict[str, tuple[float, float]] = {}  # fp8 caches: (K, V) scale per layer (compat.kv_scales)
        self.kv_head_scales: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {}  # compat.kv_head_scales
        self._layer_ids: dict[str, int] | None = None  # the model's index of each layer (plan.layer_indices)
        self._layer_rank: dict[str, int] = {}  # ... and its place among this rank's layers, by that index
        self.compat: dict = {}
        self.compat_hash = ""
        self.block_bytes = 0
        self.layout = None  # BlockLayout of every layer (register_kv_caches)
        self._local_region = None
        self._local_geoms: dict[str, Geometry] = {}  # where each layer's blocks sit in the destination region
        self._source_geoms: dict[str, Geometry] = {}  # ... and in the region prefill publishes
        self._layer_dest: dict[str, Any] = {}
        # Host staging (staging.py, stager.py): the pool's copies; prefill's copies under way; decode's
        # landing slots, per batch, given back when the table lets the batch go (under _lock).
        self.staged = False
        self._stager: Stager | None = None
        self._stage_exec: ThreadPoolExecutor | None = None
        self._staging: dict[str, tuple[Pending, float, int]] = {}  # vLLM's thread only
        self._landing: SlotPool | None = None
        self._landing_slots: dict[int, tuple[int, ...]] = {}
        self._landing_sent: int | None = None  # last staging_used_blocks gauge handed out
        self._fence = None  # CUDA event recorded when the latest pulls were handed over
        self._stats = KVLinkStats()  # what the table does not count (staging, refusals); under _lock
        # this process's registrations: a restart at the same address is a new instance (the bootstrap
        # server drops what the old one published; its block ids mean nothing here)
        self._instance = secrets.token_hex(8)
        self._heartbeater = None
        self._bootstrap_url: str | None = cfg.bootstrap_url
        self._clients = None
        self._lock = threading.Lock()  # guards the table, _remotes, _frees
        self._wake = threading.Condition(self._lock)
        self._landed = threading.Condition(self._lock)  # lock-step: a table event (a READ ended, an outcome)
        self._ls_errors: set[int] = set()  # lock-step: blocks of armed pulls that failed, for this step
        self._ls_evict: set[int] = set()  # ... of those, the ones vLLM has in its prefix cache
        self._ls_meta = None  # lock-step: what goes to the scheduler with this step (build_connector_worker_meta)
        self._ls_step_s = 0.0  # decode's step without lock-step waits (an average; 0: none measured yet)
        self._table = PullTable(cfg.pull_timeout_s)
        # Decode: a pull that ends nudges the scheduler out of its step's wait (nudge.py); once per handover
        self._nudger = Nudger(rank.engine_id) if role in ("kv_consumer", "kv_both") else None
        self._nudged = False  # under _lock: nudged since the last transfer_results
        self._remotes: dict[tuple[str, str], _Remote] = {}
        self._mismatch_logged: set[tuple[str, str]] = set()
        self._frees: set[str] = set()
        self._closed = False
        # Concurrent pairing holds a resolver for the whole of prefill's compute (long polls, streamed pieces):
        # one per waiting pull, so pulls whose prefill is slow or gone do not queue the others' first contact
        # (idle threads in a socket wait; made as needed). A pull that ended frees its own within a poll slice.
        self._resolver = ThreadPoolExecutor(max_workers=RESOLVERS, thread_name_prefix="kvlink-resolve",
                                            initializer=self._place_thread)
        self._waiter = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvlink-wait",
                                          initializer=self._place_thread)
        # A backend's cancel may wait for a chunk in flight (Mooncake: up to settle_s): never on vLLM's thread.
        self._canceller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlink-cancel",
                                             initializer=self._place_thread)
        self._leases: LeaseCalls | None = None
        self._streamer: PrefillStream | None = None  # prefill, streamed KV: what goes out after each layer/step
        self._bytes_local_seen = 0
        self._thread: threading.Thread | None = None
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

    def register_kv_caches(self, kv_caches: dict[str, Any], forward_context: dict | None = None) -> None:
        """``forward_context``: vLLM's attention modules by layer name (fp8 caches: their K/V scales)."""
        import torch

        if not kv_caches:
            raise RuntimeError("kvlink: vLLM gave no KV cache tensors to register")
        # State layers (Mamba: the connector names them) hand a byte view of their pages, or a list of state
        # tensors in one page; attention layers one tensor each.
        states = {n: (list(t) if isinstance(t, (list, tuple)) else [t]) for n, t in kv_caches.items()
                  if n in self._state_layers or isinstance(t, (list, tuple))}
        attn = {n: t for n, t in kv_caches.items() if n not in states}
        if not attn:
            raise RuntimeError(f"kvlink: no attention KV cache among {list(kv_caches)[:3]} (a pipeline stage of "
                               "state layers only?): kvlink lays blocks out by the attention blocks and needs at "
                               "least one attention layer on every rank")
        first = next(iter(attn.values()))
        self.kv_scales = kv_scales(forward_context or {}, list(attn)) if self.rank.kv_format else {}
        self.kv_head_scales = kv_head_scales(forward_context or {}, list(attn)) if self.rank.kv_format else {}
        attn_kinds = attn_desc(forward_context or {}, list(attn))
        for name, t in [*attn.items(), *((n, x) for n, ts in states.items() for x in ts)]:
            if not isinstance(t, torch.Tensor):
                raise RuntimeError(f"kvlink: KV cache {name} is not a tensor ({type(t).__name__})")
            if t.device != first.device:
                raise RuntimeError(f"kvlink: KV cache {name} is on {t.device}, the first layer on {first.device}")
        for name, t in attn.items():
            if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
                raise RuntimeError(f"kvlink: all KV cache layers must have the same shape, strides, dtype and "
                                   f"device; {name} has {list(t.shape)} {list(t.stride())} {t.dtype} on {t.device}, "
                                   f"the first {list(first.shape)} {list(first.stride())} {first.dtype} on "
                                   f"{first.device}")
        what = (f"KV cache {list(first.shape)} {first.dtype} on {first.device}, transport backend "
                f"{self.cfg.transport_backend!r}")
        try:
            self.layout = block_layout(first.shape, first.stride(), first.element_size(), mla=self.rank.mla)
            self.layouts = {n: self.layout for n in attn} | {
                n: state_layout([(x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.element_size(),
                                  str(x.dtype).replace("torch.", "")) for x in ts])
                for n, ts in states.items()}
            self.staged, why = staging_wanted(self.cfg.staging, first.device.type, self.cfg.transport_backend)
        except (LayoutError, ValueError) as e:
            raise RuntimeError(f"kvlink: {e} ({what})") from None
        why_heads = head_dim_mismatch(self.layout.heads, self.rank.tp_rank, self.rank.tp_size,
                                      0 if self.rank.mla else self.rank.kv_heads)
        if why_heads:
            raise RuntimeError(f"kvlink: {why_heads} (attention {attn_kinds or 'unknown'}; {what}): its blocks "
                               "are not laid out per KV head, which kvlink's head mapping assumes; refused "
                               "rather than cut them wrong")
        if self._num_blocks and self.layout.num_blocks != self._num_blocks:
            raise RuntimeError(f"kvlink: vLLM's KV cache has {self._num_blocks} blocks but hands the attention "
                               f"backend {self.layout.num_blocks} (kernel blocks smaller than vLLM's blocks); kvlink "
                               f"moves vLLM's blocks and does not map them onto kernel blocks ({what})")
        if states and self.staged:
            raise RuntimeError(f"kvlink: host staging ({why}) cannot move state layers (Mamba: {list(states)[:2]})")
        if self.staged and self.role == "kv_both":
            raise RuntimeError(f"kvlink: host staging ({why}) serves kv_producer and kv_consumer engines; a "
                               f"kv_both engine cannot stage ({what})")
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        self._layer_ids = layer_indices(self.layer_names)
        self._layer_rank = {n: i for i, n in enumerate(sorted(self._layer_ids, key=self._layer_ids.get))} \
            if self._layer_ids else {}
        unknown = [n for n in self.layer_names if self._layer_group and n not in self._layer_group]
        if unknown:
            raise RuntimeError(f"kvlink: KV cache layers {unknown[:3]} are in no KV cache group of vLLM's KV cache "
                               f"config ({len(set(self._layer_group.values()))} groups)")
        self._group_layers = {}
        for n in self.layer_names:
            g = self._layer_group.get(n, 0)
            self._group_layers[g] = self._group_layers.get(g, 0) + 1
        if first.device.type == "cpu":
            _request_amx_permission()
        num_blocks, block_size = self.layout.num_blocks, tokens_per_block(first.shape)
        self.block_bytes = self.layout.block_bytes
        for name in states:
            if layer_layout(self.layouts[name].desc) != self.layouts[name].desc:
                logger.info("kvlink: KV layout %s of %s, compared as its digest", self.layouts[name].desc, name)
                break
        self.compat = compat_fields(model=self.rank.model, kv_dtype=str(first.dtype).replace("torch.", ""),
                                    layout=layer_layout(self.layout.desc),
                                    tokens_per_block=block_size,
                                    num_layers=self.rank.num_layers or len(kv_caches),
                                    kv_heads=self._total_heads, groups=self.rank.groups,
                                    kv_format=self.rank.kv_format, rope=self.rank.rope, attn=attn_kinds,
                                    weights=self.rank.weights)
        self.compat_hash = compat_hash(self.compat)

        self.engine = open_backend(self.cfg.transport_backend, EngineConfig(
            listen=self.cfg.transport_listen(self.rank.port_index),
            token=self.cfg.transport_token_bytes,
            name=engine_name(self.rank.engine_id, self.rank.tp_rank, self._instance), streams=self.cfg.transport_streams,
            max_conns=self.cfg.transport_max_conns, max_peers=self.cfg.transport_max_peers,
            crc=self.cfg.crc, op_timeout_s=self.cfg.transfer_timeout_s,
            connect_timeout_s=self.cfg.connect_timeout_s, allow_insecure=self.cfg.allow_insecure),
            self.cfg.mooncake_config if self.cfg.transport_backend == "mooncake" else None)
        pool_region = self._open_staging(why) if self.staged else None
        n = len(kv_caches)
        if self.role in ("kv_producer", "kv_both"):
            if pool_region is not None:
                self._layer_regions = dict.fromkeys(kv_caches, pool_region)
                rows = self._stager.slots + 1
                self._source_geoms = {name: pool_geometry(self.layout, i, rows) for i, name in enumerate(kv_caches)}
            else:
                # one region per allocation: layers of different groups may share memory (a state layer's
                # pages and an attention layer's)
                spans: dict[int, int] = {}
                for name in kv_caches:
                    ptr = self._base(name)
                    spans[ptr] = max(spans.get(ptr, 0), self.layouts[name].span)
                regions = {ptr: self.engine.register((ptr, span), access=Access.READ) for ptr, span in spans.items()}
                self._layer_regions = {name: regions[self._base(name)] for name in kv_caches}
                self._source_geoms = {name: self.layouts[name].geometry() for name in kv_caches}
        if self.role in ("kv_consumer", "kv_both"):
            if pool_region is not None:
                self._local_region = pool_region
                rows = self._stager.slots + 1
                self._local_geoms = {name: pool_geometry(self.layout, i, rows) for i, name in enumerate(kv_caches)}
                self._landing = SlotPool(self._stager.slots)
            else:
                self._register_destination(kv_caches)
            self._leases = LeaseCalls(self._clients_for, self._apply, reader=self._reader)
            if self.cfg.stream_lockstep:
                self._start_lockstep()
            self._thread = threading.Thread(target=self._run, name="kvlink-pulls", daemon=True)
            self._thread.start()
        if self.role in ("kv_producer", "kv_both") and self._expected_bootstrap() is not None:
            self._ensure_registered(self._expected_bootstrap(), early=True)
        logger.info("kvlink: %s worker tp%d/%d transport %s (backend %s, streams %d, auth %s, crc %s), "
                    "%d layers, %d blocks of %d B/layer on %s (%s), compat %s, threads %s",
                    self.role, self.rank.tp_rank, self.rank.tp_size, self.engine.address,
                    self.cfg.transport_backend, self.cfg.transport_streams,
                    "token" if self.cfg.transport_token else "none (loopback only)"
                    if not self.cfg.allow_insecure else "none", self.cfg.crc, len(kv_caches), num_blocks,
                    self.block_bytes, first.device, why, self.compat_hash,
                    "any CPU" if self.cfg.spread_threads else "pinned with the worker")

    def _open_staging(self, why: str):
        """The host staging pool (stager.py), registered as one region; its slot count is the scheduler's."""
        slot_bytes = self.slot_bytes or len(self.kv_caches) * self.block_bytes
        slots = pool_slots(self.cfg.staging_pool_mb, slot_bytes)
        if slots < 1:
            raise RuntimeError(f"kvlink: staging_pool_mb={self.cfg.staging_pool_mb} holds no block of this "
                               f"model ({slot_bytes} B for one block of every layer); raise staging_pool_mb")
        self._stager = Stager(self.kv_caches, self.layout, slots)
        access = Access.READ if self.role == "kv_producer" else Access.WRITE
        region = self.engine.register(self._stager.pool_span, access=access)
        logger.info("kvlink: %s; staging pool of %d blocks (%.1f MiB%s)", why, slots,
                    self._stager.pool.numel() / MIB, ", pinned" if self._stager.cuda else "")
        if self.role == "kv_producer":
            self._stage_exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlink-stage",
                                                  initializer=self._place_thread)
        return region

    def _register_destination(self, kv_caches: dict[str, Any]) -> None:
        ptrs: dict[int, int] = {}  # allocation base -> span (layers of different groups may share one)
        for n in kv_caches:
            ptrs[self._base(n)] = max(ptrs.get(self._base(n), 0), self.layouts[n].span)
        lo, hi = min(ptrs), max(p + span for p, span in ptrs.items())
        if self.role == "kv_both" or hi - lo > sum(ptrs.values()):
            # Not one allocation (or also a source): one region per layer, one READ per layer.
            access = Access.READ | Access.WRITE
            if self.role == "kv_both":
                self._local_region = None
                self._layer_dest = self._layer_regions
            else:
                regions = {p: self.engine.register((p, span), access=access) for p, span in ptrs.items()}
                self._layer_dest = {n: regions[self._base(n)] for n in kv_caches}
            self._local_geoms = {n: self.layouts[n].geometry() for n in kv_caches}
        else:
            self._local_region = self.engine.register((lo, hi - lo), access=Access.WRITE)
            self._local_geoms = {n: self.layouts[n].geometry(self._base(n) - lo) for n in kv_caches}
            self._layer_dest = {}

    def _base(self, name: str) -> int:
        """Where layer ``name``'s blocks start: its tensor's data pointer (a state layer's first tensor)."""
        t = self.kv_caches[name]
        return (t[0] if isinstance(t, (list, tuple)) else t).data_ptr()

    def _clients_for(self, url: str):
        from kvlink.bootstrap import ClientPool

        with self._lock:
            if self._clients is None:
                self._clients = ClientPool(self.cfg.bootstrap_token, self.cfg.bootstrap_timeout_s, retries=1)
        return self._clients.get(url)

    def _expected_bootstrap(self) -> str | None:
        """Prefill: the bootstrap server's URL when the config fixes it (``bootstrap_url``, or the embedded
        server's ``bootstrap_port``), so the rank registers at start-up, before the first request: a decode
        paired concurrently with that request would otherwise find the engine unknown. None: learnt from
        the scheduler's first metadata."""
        if self.cfg.bootstrap_url is not None:
            return self.cfg.bootstrap_url
        if not self.cfg.bootstrap_port:
            return None
        host = self.cfg.bootstrap_host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        return f"http://[{host}]:{self.cfg.bootstrap_port}" if ":" in host else f"http://{host}:{self.cfg.bootstrap_port}"

    def _ensure_registered(self, bootstrap_url: str | None, early: bool = False) -> None:
        """Prefill: register this rank with the bootstrap server once its URL is known; keep it alive."""
        if self._heartbeater is not None or self.role not in ("kv_producer", "kv_both"):
            return
        url = self._bootstrap_url or bootstrap_url
        if url is None or self.engine is None:
            return
        from kvlink.bootstrap import EngineRegistration, Heartbeater, KVLayerSpec

        num_blocks = self._stager.slots + 1 if self.staged else self.layout.num_blocks
        layers = [KVLayerSpec(name=n, region_id=r.id, block_bytes=self.layouts[n].block_bytes, num_blocks=num_blocks,
                              tokens_per_block=self.compat["tokens_per_block"], dtype=self.compat["kv_dtype"],
                              layout=layer_layout(self.layouts[n].desc), offset=self._source_geoms[n].offset,
                              block_stride=self._source_geoms[n].block_stride,
                              segment_stride=self._source_geoms[n].segment_stride,
                              group=self._layer_group.get(n, 0),
                              k_scale=self.kv_scales.get(n, (None, None))[0],
                              v_scale=self.kv_scales.get(n, (None, None))[1],
                              k_head_scales=list(self.kv_head_scales[n][0]) or None if n in self.kv_head_scales else None,
                              v_head_scales=list(self.kv_head_scales[n][1]) or None if n in self.kv_head_scales else None)
                  for n, r in self._layer_regions.items()]
        reg = EngineRegistration(engine_id=self.rank.engine_id, dp_rank=self.rank.dp_rank,
                                 dp_size=self.rank.dp_size, tp_rank=self.rank.tp_rank,
                                 tp_size=self.rank.tp_size, pp_rank=self.rank.pp_rank, pp_size=self.rank.pp_size,
                                 transport_addr=self.cfg.advertised(self.rank.port_index) or self.engine.address,
                                 layers=layers, protocol_version=PROTOCOL_VERSION,
                                 compat_hash=self.compat_hash, compat=self.compat, instance=self._instance,
                                 launch=self.rank.launch)
        cli = self._clients_for(url)
        try:
            cli.register_engine(reg, self.cfg.engine_lease_s)  # first time synchronously: decode may ask soon
        except Exception as e:  # noqa: BLE001 - the heartbeater retries
            # At start-up the embedded server may not listen yet (vLLM starts it after the workers).
            (logger.info if early else logger.warning)("kvlink: registering with bootstrap %s failed: %s; "
                                                       "retrying", url, e)
        self._heartbeater = Heartbeater(cli, reg, self.cfg.engine_lease_s).start()
        self._bootstrap_url = url
        logger.info("kvlink: engine %s tp%d registered with bootstrap %s", self.rank.engine_id,
                    self.rank.tp_rank, url)

    # ----- per step (vLLM's thread) ------------------------------------------------------------------

    def start_load_kv(self, meta: KVLinkMetadata | None) -> None:
        if meta is None:
            return
        if meta.bootstrap_url is not None:
            self._ensure_registered(meta.bootstrap_url)
        if meta.frees:
            with self._lock:
                self._frees.update(meta.frees)
        if meta.unstreamed:
            self._forget_streamed(meta.unstreamed)
        if meta.stages:
            self._stage(meta.stages)
        if meta.pulls and self._stager is not None:
            self._fence = self._stager.fence()  # their blocks' earlier users are queued before this
        for spec in meta.pulls:
            self._submit(spec)
        for rid in meta.cancels:  # an armed request (lock-step) is vLLM's already: given back once settled
            self._apply(lambda t, now, rid=rid: t.free_armed(rid, now) if t.is_armed(rid) else t.cancel(rid, now))
        for rid in meta.lockstep_frees:
            self._apply(lambda t, now, rid=rid: t.free_armed(rid, now))

    def send_pieces(self, specs: list, layer_name: str | None = None) -> None:
        """Prefill, vLLM's thread, after attention layer ``layer_name`` (layer-wise) or the step's forward
        (None): the step's streamed pieces go to the sender thread (stream.py, ``PrefillStream``)."""
        if self._bootstrap_url is None or self.engine is None:
            return
        if self._streamer is None:
            from kvlink.bootstrap.schema import StreamPiece

            cli = self._clients_for(self._bootstrap_url)
            rank, ranks = self.rank.index, self.rank.tp_size * self.rank.pp_size

            def send(pieces):
                return cli.stream_pieces(self.rank.engine_id, rank, ranks, [StreamPiece(**p.fields())
                                                                            for p in pieces], self.rank.launch)

            def count(key: str, n: int) -> None:
                with self._lock:
                    self._stats.add(key, n)

            cuda = next(iter(self.kv_caches.values())).device.type == "cuda"
            self._streamer = PrefillStream(self.cfg.stream_granularity == "layer", self._layer_ids,
                                           list(self.kv_caches), cuda, PieceSender(send, count), self._stager)
        if layer_name is None:
            self._streamer.step_done(specs)
        else:
            self._streamer.layer_done(specs, layer_name)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call.

        A failed pull is in both receiving sets (vLLM releases it from its wait and recomputes it) and its
        blocks are in take_load_error_blocks() no later than this call's step.
        """
        self._settle_finished()
        staged = self._staged_done() if self._staging else set()
        with self._lock:
            sending, self._frees = self._frees, set()
            res = self._table.take_results(time.monotonic())
            armed, settled, freed = self._table.take_lockstep()
            evict, self._ls_evict = self._ls_evict, set()
            self._nudged = False
        if armed or settled or evict:
            from kvlink.vllm.metadata import KVLinkWorkerMeta

            self._ls_meta = KVLinkWorkerMeta(armed=armed, settled=settled, evict=evict)
        sending |= freed
        failed = set(res.failed)
        if trace.enabled():
            for rid in res.done:
                trace.event("pull_done", rid=rid, failed=rid in failed)
        return sending | staged, res.done | failed, failed

    def _forget_streamed(self, rids: list[str]) -> None:
        """Prefill, host staging: these streamed requests' slots went back to the pool (aborted, refused, or
        restaged from scratch): which positions were copied into them no longer says anything."""
        if self._streamer is not None and self._streamer.copies is not None:
            for rid in rids:
                self._streamer.copies.forget(rid)

    def _stage(self, jobs: list[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> None:
        """Prefill, vLLM's thread: copy finished requests' blocks into the slots the scheduler gave them. On
        CUDA the copies are queued on the stager's streams after everything vLLM queued so far (the forward
        that wrote the blocks), and a streamed request's end also waits for its layer copies still under way
        (they may trail vLLM's stream: the publish and the blocks' release wait for them); on CPU a thread
        of ours does them (a streamed request's layer copies were done on vLLM's thread)."""
        fence = self._stager.fence()
        for rid, blocks, slots in jobs:
            if self._streamer is not None and self._streamer.copies is not None:  # streamed: leading blocks
                k = self._streamer.copies.take(rid, slots)  # are in their slots already
                blocks, slots = blocks[k:], slots[k:]
            if self._stager.cuda:  # with no block left, the layer copies queued while it computed (marker)
                pending = self._stager.to_pool(list(blocks), list(slots), fence)
            elif not blocks:
                pending = DONE
            else:
                fut = self._stage_exec.submit(self._stager.to_pool, list(blocks), list(slots))
                pending = Pending(fut.done, fut.result)
            self._staging[rid] = (pending, time.monotonic(), len(blocks))

    def _staged_done(self) -> set[str]:
        """Requests whose copies finished: reported finished sending, so vLLM frees their device blocks now."""
        done = set()
        for rid, (pending, t0, nblocks) in list(self._staging.items()):
            if not pending.done():
                continue
            # A copy that failed raises here and stops the engine: a staged copy that may be wrong is never
            # published (an error on the device is fatal to vLLM anyway).
            pending.wait()
            del self._staging[rid]
            done.add(rid)
            with self._lock:
                self._stats.add("bytes_staged", nblocks * self._stager.slot_bytes)
                self._stats.sample("staging_s", time.monotonic() - t0)
        return done

    def take_load_error_blocks(self) -> set[int]:
        """Local block ids of pulls that failed since the last call. None with several KV cache groups: a
        block id names a block within its group only, and vLLM refuses (stops the engine on) block-level
        failures there; those pulls are reported per request (``failed_recving``) alone."""
        with self._lock:
            blocks = self._table.take_error_blocks() | self._ls_errors
            self._ls_errors = set()
        return set() if self._num_groups > 1 else blocks

    def get_stats(self) -> KVLinkStats | None:
        with self._lock:
            stats = KVLinkStats()
            counts, samples = self._table.take_stats()
            stats.aggregate(self._stats)
            self._stats = KVLinkStats()
            if self._landing is not None and self._landing.in_use != self._landing_sent:
                self._landing_sent = self._landing.in_use
                stats.set_gauge("staging_used_blocks", self._landing.in_use)
            for k, n in counts.items():
                stats.add(k, n)
            for k, vs in samples.items():
                for v in vs:
                    stats.sample(k, v)
            if self.role in ("kv_consumer", "kv_both"):
                running = self._table.running()
                if running != self._running_sent:
                    self._running_sent = running
                    stats.set_gauge("pulls_in_progress", running)
                local = self._bytes_local()
                if local > self._bytes_local_seen:
                    stats.add("bytes_local", local - self._bytes_local_seen)
                    self._bytes_local_seen = local
        return None if stats.is_empty() else stats

    def _bytes_local(self) -> int:
        """Bytes the transport copied same-host (process_vm_readv) since start; 0 if it cannot say."""
        stats = getattr(self.engine, "stats", None)
        try:
            return int(stats().get("bytes_local", 0)) if stats is not None else 0
        except Exception:  # noqa: BLE001 - statistics only
            return 0

    # ----- shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._wake:
            self._closed = True
            cancels = self._table.close()
            self._wake.notify_all()
        for a in cancels:
            try:
                a.handle.cancel()
            except Exception:  # noqa: BLE001
                pass
        self._resolver.shutdown(wait=False, cancel_futures=True)
        self._canceller.shutdown(wait=False, cancel_futures=True)
        self._waiter.shutdown(wait=False, cancel_futures=True)  # cancel above (or close below) ends waits
        if self._stage_exec is not None:
            self._stage_exec.shutdown(wait=True, cancel_futures=True)  # no copy into a pool being freed
        if self._leases is not None:
            self._leases.stop()
        if self._streamer is not None:
            self._streamer.sender.close()
        if self._heartbeater is not None:
            self._heartbeater.stop()
        if self._nudger is not None:
            self._nudger.close()
        if self._clients is not None:
            self._clients.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _request_amx_permission() -> None:
    """Ask Linux for AMX tile permission in this worker process, before its first forward.

    vLLM CPU's attention picks its AMX kernel when the CPU has AMX, but never asks the kernel for the
    permission (arch_prctl ARCH_REQ_XCOMP_PERM) that AMX needs; oneDNN asks as a side effect of a large
    bf16 matmul. A decode engine's first forward is one token (the prompt's KV was pulled), too small for
    that, so its first attention call dies with SIGILL (seen on a Sapphire Rapids VM). Asking here is
    harmless where AMX is absent or already permitted.
    """
    import torch

    try:
        if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
            logger.warning("kvlink: this CPU has AMX but the kernel refused AMX permission; vLLM's CPU "
                           "attention may fail with SIGILL")
    except (AttributeError, RuntimeError) as e:  # an older or newer torch without these helpers
        logger.debug("kvlink: cannot request AMX permission: %s", e)
