"""Worker side of KVLinkConnector: the adapter between vLLM's worker, the transport and the pull table.

register_kv_caches() registers the cache with a transport backend. A prefill worker advertises one READ
region per layer to the bootstrap server (with a lease kept by a Heartbeater); a decode worker registers
the whole cache allocation as one WRITE region, so all layers of all requests from one remote engine go
in one batched READ. Where a block lives in a layer's tensor (vLLM CPU's layout, FlashAttention's K/V
planes, FlashInfer, NHD/HND, MLA) is layout.py's; the KV must still be in host memory.

Decode's pulls live in a PullTable (pulls.py): pure logic, events in, actions out. This module owns the
one lock around it, carries out its actions (resolve, post a READ, cancel a batch, renew leases) outside
that lock, and feeds what happened back as events. Pulls never block the forward pass.

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
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvlink import trace
from kvlink.backends import open_backend
from kvlink.bootstrap.errors import BootstrapUnavailable
from kvlink.errors import Canceled, NotSettled
from kvlink.transport import Access, EngineConfig
from kvlink.vllm.compat import PROTOCOL_VERSION, compat_fields, compat_hash
from kvlink.vllm.contact import LocalKV, PullFailed, legs_for
from kvlink.vllm.config import ConnectorConfig
from kvlink.vllm.layout import (Geometry, LayoutError, block_layout, pool_geometry, state_layout,
                                tokens_per_block)
from kvlink.vllm.lease import LeaseCalls
from kvlink.vllm.metadata import KVLinkMetadata, PullSpec
from kvlink.vllm.nudge import Nudger
from kvlink.vllm.plan import (LayerMap, PairingError, ReadPlan, build_plan, group_pairs, layer_indices, ready_pairs,
                              step_pairs)
from kvlink.vllm.pulls import ALL_LAYERS, CancelBatch, Lease, Post, PullTable, Renew, Resolve
from kvlink.vllm.stager import DONE, Pending, Stager
from kvlink.vllm.staging import MIB, SlotPool, pool_slots, staging_wanted
from kvlink.vllm.stats import KVLinkStats
from kvlink.vllm.stream import PieceSender, PrefillStream

logger = logging.getLogger(__name__)


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

    @property
    def port_index(self) -> int:
        """This rank's transport port, counted from ``transport_port``: one per (PP stage, TP rank)."""
        return self.pp_rank * self.tp_size + self.tp_rank


@dataclass(eq=False)
class _Leg:
    """One prefill rank a pull reads from: our peer handle and the layers (or head ranges) it serves."""

    peer: Any
    layers: list[LayerMap]
    tp_rank: int
    pp_rank: int


@dataclass(eq=False)
class _Remote:
    """A prefill engine we pull from: one leg per prefill rank we read (shard.py; one with equal TP and no
    PP). Hashed by identity: the table groups READY pulls by it, and a batch is one READ per leg."""

    key: tuple[str, str]  # (bootstrap url, engine id)
    legs: list[_Leg]


class _Batches:
    """Several transport batches (one READ per layer when the destination is not one region) as one.

    It fails only once every part has stopped: a part's error cancels the others first, so nothing
    reports the pulls failed (and vLLM reuses their blocks) while another part still writes into them.
    """

    def __init__(self, parts: list[Any]):
        self.parts = parts

    def poll(self) -> bool:
        """Non-blocking (vLLM's thread polls it): a failed part is reported as NotSettled, so the others are
        stopped by the kvlink-cancel thread (a backend's cancel may block) before the pulls fail."""
        done, error = True, None
        for b in self.parts:
            try:
                done = b.poll() and done
            except Exception as e:  # noqa: BLE001 - poll every part, then report
                error = error or e
        if error is not None:
            raise NotSettled(f"one READ of a batch failed ({type(error).__name__}: {error}); stopping the others")
        return done

    def wait(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for b in self.parts:
            try:
                b.wait(max(0.0, end - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                self._stop_all(e)

    def _stop_all(self, error: BaseException) -> None:
        self.cancel()  # NotSettled from here: the table keeps the pulls until a later cancel settles
        raise error

    def cancel(self) -> bool:
        stopped, unsettled = False, None
        for b in self.parts:
            try:
                stopped = bool(b.cancel()) or stopped
            except NotSettled as e:
                unsettled = unsettled or e
            except Exception:  # noqa: BLE001 - a part that failed by itself has stopped writing
                pass
        if unsettled is not None:
            raise unsettled
        return stopped


class _Landing:
    """Decode with host staging: a READ into landing slots, then the copy of those slots into the pulls'
    blocks, as one batch. It ends (``poll``/``wait``) only once the blocks hold the KV; ``cancel`` returns
    only once nothing writes into them: a copy under way is waited for (and the batch counts as finished),
    one not begun never begins."""

    def __init__(self, read: Any, stager: Stager, moves: list[tuple[int, int, tuple[int, ...] | None]], fence: Any):
        self.read, self.stager, self.moves, self.fence = read, stager, moves, fence
        self._lock = threading.Lock()
        self._copy: Pending | None = None
        self._copied = False
        self._stopped = False
        self.copy_s = 0.0

    def poll(self) -> bool:
        self.read.poll()  # raises the READ's error
        return self._copied

    def wait(self, timeout_s: float) -> None:
        self.read.wait(timeout_s)
        with self._lock:
            if self._stopped:
                raise Canceled("kvlink: batch cancelled before its copy into the KV cache")
            t0 = time.monotonic()
            # (slot, block, layers): None is every layer; a layer-wise streamed read moved only some
            for layers in dict.fromkeys(m[2] for m in self.moves):
                mine = [m for m in self.moves if m[2] == layers]  # (in order: CUDA's last copy ends last)
                self._copy = self.stager.from_pool([m[0] for m in mine], [m[1] for m in mine], self.fence,
                                                   None if layers is None else list(layers))
        self._copy.wait()
        self.copy_s = time.monotonic() - t0
        self._copied = True

    def cancel(self) -> bool:
        with self._lock:
            copy, self._stopped = self._copy, self._copy is None
        if copy is not None:
            copy.wait()  # under way: it finishes, and the batch with it
            self._copied = True
            return False
        self.read.cancel()  # NotSettled propagates: the landing slots stay claimed until it settles
        return True


def _not_settled(e: BaseException) -> bool:
    """The backend's way of saying "cancel asked, but the batch may still write" (Mooncake)."""
    return isinstance(e, NotSettled)


class KVLinkWorker:
    def __init__(self, cfg: ConnectorConfig, rank: RankInfo, role: str, slot_bytes: int | None = None,
                 layer_groups: dict[str, int] | None = None, state_layers: set[str] | None = None,
                 num_groups: int | None = None, num_blocks: int | None = None):
        self.cfg, self.rank, self.role = cfg, rank, role
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
        self._heartbeater = None
        self._bootstrap_url: str | None = cfg.bootstrap_url
        self._clients = None
        self._lock = threading.Lock()  # guards the table, _remotes, _frees
        self._wake = threading.Condition(self._lock)
        self._table = PullTable(cfg.pull_timeout_s)
        # Decode: a pull that ends nudges the scheduler out of its step's wait (nudge.py); once per handover
        self._nudger = Nudger(rank.engine_id) if role in ("kv_consumer", "kv_both") else None
        self._nudged = False  # under _lock: nudged since the last transfer_results
        self._remotes: dict[tuple[str, str], _Remote] = {}
        self._mismatch_logged: set[tuple[str, str]] = set()
        self._frees: set[str] = set()
        self._closed = False
        # Concurrent pairing holds a resolver for the whole of prefill's compute (long polls, streamed pieces).
        self._resolver = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvlink-resolve",
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

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        import torch

        if not kv_caches:
            raise RuntimeError("kvlink: vLLM gave no KV cache tensors to register")
        # State layers (Mamba: the connector names them) hand a byte view of their pages, or a list of state
        # tensors in one page; attention layers one tensor each.
        states = {n: (list(t) if isinstance(t, (list, tuple)) else [t]) for n, t in kv_caches.items()
                  if n in self._state_layers or isinstance(t, (list, tuple))}
        attn = {n: t for n, t in kv_caches.items() if n not in states}
        if not attn:
            raise RuntimeError(f"kvlink: no attention KV cache among {list(kv_caches)[:3]}")
        first = next(iter(attn.values()))
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
                n: state_layout([(x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.element_size()) for x in ts])
                for n, ts in states.items()}
            self.staged, why = staging_wanted(self.cfg.staging, first.device.type, self.cfg.transport_backend)
        except (LayoutError, ValueError) as e:
            raise RuntimeError(f"kvlink: {e} ({what})") from None
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
        self.compat = compat_fields(model=self.rank.model, kv_dtype=str(first.dtype).replace("torch.", ""),
                                    layout="+".join(sorted({lay.desc for lay in self.layouts.values()},
                                                           key=lambda d: (d.startswith("state"), d))),
                                    tokens_per_block=block_size,
                                    num_layers=self.rank.num_layers or len(kv_caches),
                                    kv_heads=self._total_heads, groups=self.rank.groups)
        self.compat_hash = compat_hash(self.compat)

        self.engine = open_backend(self.cfg.transport_backend, EngineConfig(
            listen=self.cfg.transport_listen(self.rank.port_index),
            token=self.cfg.transport_token_bytes,
            name=f"{self.rank.engine_id}/tp{self.rank.tp_rank}", streams=self.cfg.transport_streams,
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
            self._leases = LeaseCalls(self._clients_for, self._apply)
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
                              layout=self.compat["layout"], offset=self._source_geoms[n].offset,
                              block_stride=self._source_geoms[n].block_stride,
                              segment_stride=self._source_geoms[n].segment_stride,
                              group=self._layer_group.get(n, 0))
                  for n, r in self._layer_regions.items()]
        reg = EngineRegistration(engine_id=self.rank.engine_id, dp_rank=self.rank.dp_rank,
                                 dp_size=self.rank.dp_size, tp_rank=self.rank.tp_rank,
                                 tp_size=self.rank.tp_size, pp_rank=self.rank.pp_rank, pp_size=self.rank.pp_size,
                                 transport_addr=self.cfg.advertised(self.rank.port_index) or self.engine.address,
                                 layers=layers, protocol_version=PROTOCOL_VERSION,
                                 compat_hash=self.compat_hash, compat=self.compat)
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
        if meta.stages:
            self._stage(meta.stages)
        if meta.pulls and self._stager is not None:
            self._fence = self._stager.fence()  # their blocks' earlier users are queued before this
        for spec in meta.pulls:
            self._submit(spec)
        for rid in meta.cancels:
            self._apply(lambda t, now, rid=rid: t.cancel(rid, now))

    def send_pieces(self, specs: list, layer_name: str | None = None) -> None:
        """Prefill, vLLM's thread, after attention layer ``layer_name`` (layer-wise) or the step's forward
        (None): the step's streamed pieces go to the sender thread (stream.py, ``PrefillStream``)."""
        if self._bootstrap_url is None or self.engine is None:
            return
        if self._streamer is None:
            from kvlink.bootstrap.schema import StreamPiece

            cli = self._clients_for(self._bootstrap_url)
            rank, ranks = self.rank.port_index, self.rank.tp_size * self.rank.pp_size

            def send(pieces):
                return cli.stream_pieces(self.rank.engine_id, rank, ranks, [StreamPiece(**p.fields())
                                                                            for p in pieces])

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
            self._nudged = False
        failed = set(res.failed)
        if trace.enabled():
            for rid in res.done:
                trace.event("pull_done", rid=rid, failed=rid in failed)
        return sending | staged, res.done | failed, failed

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
            blocks = self._table.take_error_blocks()
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

    # ----- the table: events in, actions out ---------------------------------------------------------

    def _apply(self, event: Callable[[PullTable, float], list | None]) -> None:
        """Feed one event to the table under the lock, then carry out what it asks, outside the lock."""
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
            actions = event(self._table, now) or []
            if self._landing_slots:
                actions += self._give_back_landing(now)
            messages = self._table.take_messages()
            nudge = self._nudger is not None and not self._nudged and self._table.has_results()
            self._nudged = self._nudged or nudge
        if nudge:
            self._nudger.nudge()
        for m in messages:
            logger.warning("%s", m)
        self._carry_out(actions)

    def _carry_out(self, actions: list) -> None:
        # Posts first: a READ on the wire is what a request waits for; renewals run beside it.
        for a in sorted(actions, key=lambda a: not isinstance(a, Post)):
            try:
                self._execute(a)
            except Exception as e:  # noqa: BLE001 - the table hears of it, so no pull is left waiting
                logger.exception("kvlink: carrying out %s failed", type(a).__name__)
                if isinstance(a, Resolve):
                    self._apply(lambda t, now, rid=a.pull.rid, e=e: t.resolve_failed(rid, _why(e), now))
                elif isinstance(a, Renew):
                    self._apply(lambda t, now, a=a: t.renew_failed(a.group, a.rids, now))
                # A Post reports its own failures (_post); a CancelBatch is asked again by the ticker.

    def _execute(self, a) -> None:
        if isinstance(a, Post):
            self._post(a)
        elif isinstance(a, CancelBatch):
            self._canceller.submit(self._cancel_batch, a)
        elif isinstance(a, Renew):
            self._leases.run(a)
        elif isinstance(a, Resolve):
            self._resolver.submit(self._resolve, a.pull.spec)

    def _submit(self, spec: PullSpec) -> None:
        src = spec.source
        trace.event("pull_start", rid=spec.request_id)
        with self._lock:
            known = (src.block_ids is not None and src.engine_id is not None and src.request_id is not None
                     and (src.bootstrap_url, src.engine_id) in self._remotes)
            actions = self._table.submit(spec, time.monotonic())
        if actions and known:
            # Sequential pairing with a peer we already talk to: nothing to ask the network, so post the
            # READ now, on vLLM's thread, instead of waking a resolver (a GIL hand-off costs up to the
            # 5 ms switch interval while the worker's idle loop spins; measured ~9 ms per request).
            self._resolve(spec)
        else:
            self._carry_out(actions)

    def _resolve(self, spec: PullSpec, attempt: int = 0) -> None:
        """Find the remote record and engine, check compatibility, connect, pair; then post. On a resolver
        thread, or inline from _submit when everything is known already (no network). A bootstrap server
        that did not answer (a stall, a dropped connection) is asked again, up to twice, on a resolver
        thread while the pull's deadline allows: one slow answer does not cost decode a recompute."""
        src, rid = spec.source, spec.request_id
        trace.event("resolve", rid=rid, attempt=attempt)
        try:
            cli = self._clients_for(src.bootstrap_url)
            engine_id, remote_rid, blocks = src.engine_id, src.request_id, src.block_ids
            lease_s = src.lease_s or self.cfg.lease_s
            now = time.monotonic()
            held_until, renew_at = 0.0, now  # sequential params say nothing of the lease left: renew now
            epoch = 0
            if src.transfer_id is not None and (blocks is None or engine_id is None):
                found = self._await_record(cli, spec, engine_id)
                if found is None:
                    return  # cancelled meanwhile
                rec, now = found
                epoch = rec.epoch
                engine_id, remote_rid, blocks = rec.engine_id, rec.request_id, tuple(map(tuple, rec.block_ids))
                if spec.num_tokens is not None and rec.num_tokens != spec.num_tokens:
                    raise PairingError(f"request {rid}: prefill computed {rec.num_tokens} tokens, decode loads "
                                       f"{spec.num_tokens}: a Mamba state continues only from the tokens it saw")
                held_until = now + rec.lease_remaining_s
                renew_at = time.monotonic() + min(lease_s, rec.lease_remaining_s) / 3
            remote = self._remote(cli, src.bootstrap_url, engine_id)
            pairs = group_pairs(rid, spec.tables, blocks)
        except Exception as e:  # noqa: BLE001 - any failure means: recompute locally
            if isinstance(e, BootstrapUnavailable) and attempt < 2 and self._may_retry(rid):
                logger.info("kvlink: pull for request %s: %s; asking again", rid, _why(e))
                self._resolver.submit(self._resolve, spec, attempt + 1)
                return
            if isinstance(e, PullFailed) and e.reason:
                with self._lock:
                    self._stats.add(f"compat_refused.{e.reason}")
            # fail, not resolve_failed: a streamed piece's READ may be on the wire (it is stopped first)
            self._apply(lambda t, now: t.fail(rid, _why(e), now))
            return
        lease = Lease(src.bootstrap_url, engine_id, remote_rid, lease_s)
        self._apply(lambda t, now: t.resolved(rid, remote, pairs, lease, held_until, renew_at, now, epoch))

    def _may_retry(self, rid: str) -> bool:
        """The pull still runs and its deadline leaves room for one more bootstrap call."""
        with self._lock:
            pull = self._table.get(rid)
            return (pull is not None and not self._closed
                    and pull.deadline - time.monotonic() > self.cfg.bootstrap_timeout_s + 1.0)

    def _await_record(self, cli, spec: PullSpec, engine_id: str | None):
        """Concurrent pairing: long-poll the bootstrap server until prefill publishes the request, and
        meanwhile read the blocks it reports finished (streamed KV: pulls.py, ``piece``). Returns (the
        published record, when it was asked for), or None when the pull ended meanwhile."""
        rid, src = spec.request_id, spec.source
        after = 0 if spec.num_tokens is None else None  # a Mamba state exists only at the end: no pieces
        layers = self._layer_ids is not None
        while True:
            with self._lock:
                pull = self._table.get(rid)
                asked = time.monotonic()
                wait = max(0.0, min(self.cfg.lookup_wait_s, pull.deadline - asked)) if pull else 0.0
            if pull is None:
                return None
            rec = cli.lookup_transfer(src.transfer_id, wait_s=wait, engine_id=engine_id, after=after,
                                      layers=layers)
            trace.event("answer", rid=rid, transfer_id=src.transfer_id, partial=rec.partial, layers=rec.layers,
                        version=rec.version, asked=round(asked, 6))
            if not rec.partial:
                return rec, asked
            after = rec.version
            remote = self._remote(cli, src.bootstrap_url, rec.engine_id)
            whole = tuple(map(tuple, rec.block_ids))
            pairs: list[tuple[int, ...]] = ready_pairs(rid, spec.tables, whole)
            # layer-wise: the running step's blocks, in this rank's layers below rec.layers (all: whole)
            have = sum(1 for i in (self._layer_ids or {}).values() if i < rec.layers) if rec.step_block_ids else 0
            if have:
                hi = ALL_LAYERS if have == len(self._layer_rank) else have
                pairs += [(*pr, hi) for pr in step_pairs(rid, spec.tables, whole, tuple(map(tuple,
                                                                                          rec.step_block_ids)))]
            self._apply(lambda t, now, rec=rec, pairs=pairs: t.piece(rid, remote, pairs, rec.epoch, now))

    def _remote(self, cli, url: str, engine_id: str) -> _Remote:
        """The prefill engine's ranks this rank reads, connected (contact.py decides what, from which)."""
        key = (url, engine_id)
        with self._lock:
            remote = self._remotes.get(key)
        if remote is not None:
            return remote
        regs = cli.engine_ranks(engine_id)
        try:
            legs = legs_for(engine_id, regs, LocalKV(
                self.rank.tp_rank, self.rank.tp_size, self.rank.pp_rank, self.rank.pp_size, tuple(self.layer_names),
                self.layout, self._local_geoms, self._total_heads, self.compat, self.compat_hash,
                groups={n: self._layer_group.get(n, 0) for n in self.layer_names}, layouts=self.layouts))
        except PullFailed as e:
            if e.detail and key not in self._mismatch_logged:
                self._mismatch_logged.add(key)
                logger.error("%s", e.detail)
            raise
        remote = _Remote(key, [_Leg(self.engine.connect(reg.transport_addr), layers, reg.tp_rank, reg.pp_rank)
                               for reg, layers in legs])
        with self._lock:  # two first contacts at once: both use the first one's (one batch per engine)
            remote = self._remotes.setdefault(key, remote)
        logger.info("kvlink: connected to prefill engine %s (TP=%d, PP=%d) from tp%d pp%d: %s", engine_id,
                    regs[0].tp_size, regs[0].pp_size, self.rank.tp_rank, self.rank.pp_rank,
                    ", ".join(f"tp{reg.tp_rank} pp{reg.pp_rank} at {reg.transport_addr} ({len(layers)} layers)"
                              for reg, layers in legs))
        return remote

    @property
    def _total_heads(self) -> int:
        """The model's KV heads over all TP ranks (0: MLA's latent)."""
        if not self.layout.heads:
            return 0
        return self.rank.kv_heads or self.layout.heads * self.rank.tp_size

    def _post(self, a: Post) -> None:
        """One READ of every pull in ``a`` from its remote engine (one per layer if the destination is
        not one region); then the table hears it was posted, and a waiter thread blocks on it. With host
        staging the READ lands in slots of the staging pool and the batch copies them into the pulls'
        blocks before it ends (_Landing)."""
        remote: _Remote = a.remote
        pulls, landing = list(a.pulls), None
        if self._landing is not None:
            pulls, landing = self._claim_landing(a)
            if not pulls:
                return
        # (group, local block, remote block) per pull; with staging the local block is a landing slot
        pairs = {p.rid: [(0, slot, rb, lo, hi) for slot, rb, _, lo, hi in landing[p.rid]] if landing
                 else list(p.pairs) for p in pulls}
        # layer-blocks written: a group with no layers on this PP stage moves nothing here
        nblocks = sum(min(self._group_layers.get(g, 0), hi) - min(self._group_layers.get(g, 0), lo)
                      for p in pulls for g, _, _, lo, hi in pairs[p.rid])
        parts, nbytes, ndesc = [], 0, 0
        try:
            dests = [(leg.peer, self._local_region, leg.layers) for leg in remote.legs] \
                if self._local_region is not None else [
                (leg.peer, self._layer_dest[lm.name], [lm]) for leg in remote.legs for lm in leg.layers]
            for peer, region, layers in dests:  # one READ per prefill rank (and per layer without one region)
                plan = ReadPlan.concat([self._plan(layers, pairs[p.rid]) for p in pulls])
                if not len(plan):
                    continue  # a layer range none of this prefill rank's layers are in (PP)
                parts.append(self.engine.read(peer, region, plan.local_offsets, plan.remote_region_ids,
                                              plan.remote_offsets, plan.lengths,
                                              timeout_s=self.cfg.transfer_timeout_s))
                nbytes, ndesc = nbytes + plan.nbytes, ndesc + len(plan)
        except Exception as e:  # noqa: BLE001
            self._drop_remote(remote)
            if not parts:
                self._apply(lambda t, now: t.post_failed(a.batch, _why(e), now))
                return
            # Parts already on the wire may write until they are stopped: the pulls fail once they settle.
            handle = _Batches(parts)
            self._apply(lambda t, now: t.posted(a.batch, handle, nbytes, 0, ndesc, now))
            self._apply(lambda t, now: t.batch_unsettled(a.batch, _why(e), now))
            return
        if not parts:  # nothing of these ranges is on any rank this one reads (cannot happen: every layer is)
            self._apply(lambda t, now: t.posted(a.batch, None, 0, 0, 0, now))
            self._apply(lambda t, now: t.batch_ended(a.batch, None, now))
            return
        handle = parts[0] if len(parts) == 1 else _Batches(parts)
        if landing:
            moves = [(slot, lb, self._layer_span(lo, hi)) for p in pulls for slot, _, lb, lo, hi in landing[p.rid]]
            handle = _Landing(handle, self._stager, moves, self._fence)
        self._apply(lambda t, now: t.posted(a.batch, handle, nbytes, nblocks, ndesc, now))
        if trace.enabled():
            trace.event("read_post", batch=a.batch, rids=[p.rid for p in pulls], blocks=nblocks, bytes=nbytes)
        self._waiter.submit(self._await, a.batch, handle, remote)

    def _plan(self, layers: list[LayerMap], pairs: list[tuple[int, int, int, int, int]]) -> ReadPlan:
        """Descriptors of one pull's (group, local, remote, first layer, end layer) pairs over ``layers``:
        each group's blocks in that group's layers only (hybrid models: vLLM's block ids are per group),
        and a layer-wise streamed range in the layers of that range (by place among this rank's layers)."""
        parts = []
        for g, lo, hi in sorted({(g, lo, hi) for g, _, _, lo, hi in pairs}):
            mine = [m for m in layers if self._layer_group.get(m.name, 0) == g] if self._layer_group else layers
            if (lo, hi) != (0, ALL_LAYERS):
                mine = [m for m in mine if lo <= self._layer_rank.get(m.name, -1) < hi]
            parts.append(build_plan(mine, [(lb, rb) for gg, lb, rb, a, b in pairs if (gg, a, b) == (g, lo, hi)]))
        return parts[0] if len(parts) == 1 else ReadPlan.concat(parts) if parts else build_plan([], [])

    def _layer_span(self, lo: int, hi: int) -> tuple[int, ...] | None:
        """The stager's positions of this rank's layers in place range [lo, hi) (pulls.py); None: all."""
        if (lo, hi) == (0, ALL_LAYERS):
            return None
        return tuple(i for i, n in enumerate(self.kv_caches) if lo <= self._layer_rank.get(n, -1) < hi)

    def _claim_landing(self, a: Post) -> tuple[list, dict[str, list[tuple[int, int, int]]]]:
        """Landing slots for the pulls of ``a`` that fit in the staging pool now: (those pulls, rid ->
        [(slot, remote block, local block)]). The others wait (READY again) until a batch gives slots back;
        a pull larger than the whole pool fails. One event, so a batch that gives its slots back meanwhile
        finds the waiting pulls READY and posts them."""
        fit, landing = [], {}

        def claim(t: PullTable, now: float) -> list:
            deferred, refused, claimed = [], {}, []
            for p in a.pulls:
                n = len(p.pairs)
                if n > self._landing.capacity:
                    refused[p.rid] = (f"it needs {n} blocks of the staging pool, which holds "
                                      f"{self._landing.capacity} (raise staging_pool_mb)")
                    continue
                slots = self._landing.allocate(n)
                if slots is None:
                    deferred.append(p.rid)
                    continue
                fit.append(p)
                claimed += slots
                landing[p.rid] = [(s, rb, lb, lo, hi) for s, (_, lb, rb, lo, hi) in zip(slots, p.pairs)]
            if claimed:
                self._landing_slots[a.batch] = tuple(claimed)
            if deferred or refused:
                t.post_split(a.batch, deferred, refused, now)
            return []

        self._apply(claim)
        return fit, landing

    def _give_back_landing(self, now: float) -> list:
        """Under _lock: landing slots of batches the table let go (ended, settled) return to the pool, and
        pulls waiting for room are posted."""
        gone = [b for b in self._landing_slots if self._table.batch(b) is None]
        for b in gone:
            self._landing.free(self._landing_slots.pop(b))
        return self._table.take_posts(now) if gone else []

    def _await(self, batch: int, handle: Any, remote: _Remote) -> None:
        """Waiter thread: block on one batch (the GIL is released meanwhile), then report how it ended.

        A batch that outlives transfer_timeout_s is cancelled by wait() itself; a dropped connection
        (prefill died) fails it at once; one we cancelled ends here with an error the table ignores.
        """
        try:
            handle.wait(self.cfg.transfer_timeout_s + 1.0)
        except Exception as e:  # noqa: BLE001
            self._ended(batch, e, remote)
        else:
            trace.event("read_end", batch=batch)
            if isinstance(handle, _Landing):
                with self._lock:
                    self._stats.add("bytes_landed", sum(self._stager.slot_bytes if m[2] is None else
                                                        len(m[2]) * self.block_bytes for m in handle.moves))
                    self._stats.sample("landing_s", handle.copy_s)
            self._apply(lambda t, now: t.batch_ended(batch, None, now))

    def _settle_finished(self) -> None:
        """vLLM's thread, once a step: report batches that are already done (a non-blocking check), so
        the result goes out in this step even when the waiter thread has not got the GIL back yet."""
        with self._lock:
            posted = [(b.id, b.handle, b.remote) for b in self._table.batches()
                      if b.handle is not None and not b.cancel_wanted]
        for batch, handle, remote in posted:
            try:
                done = handle.poll()
            except Exception as e:  # noqa: BLE001
                self._ended(batch, e, remote)
                continue
            if done:
                self._apply(lambda t, now, batch=batch: t.batch_ended(batch, None, now))

    def _ended(self, batch: int, e: BaseException, remote: _Remote) -> None:
        if _not_settled(e):
            self._apply(lambda t, now: t.batch_unsettled(batch, _why(e), now))
            return
        with self._lock:
            b = self._table.batch(batch)
            ours = b is None or b.cancel_wanted  # the error of a cancel we asked for: the peer is fine
        if not ours:
            self._drop_remote(remote)  # reconnect next time
        self._apply(lambda t, now: t.batch_ended(batch, _why(e), now))

    def _cancel_batch(self, a: CancelBatch) -> None:
        """kvlink-cancel thread: ask the backend to stop a batch. Settled once cancel returns (nothing writes
        into its memory afterwards); a backend that cannot stop it says NotSettled, and the ticker asks
        again. A batch that had already finished (cancel returns False) keeps its outcome: its bytes are
        in place, so the other pulls it carried need no second READ."""
        try:
            stopped = a.handle.cancel()
        except NotSettled:
            return
        except Exception as e:  # noqa: BLE001 - it failed by itself: it writes nothing any more
            logger.debug("kvlink: cancel of batch %d: %s", a.batch, _why(e))
            stopped = True
        if stopped is False:
            try:
                finished_ok = a.handle.poll()
            except Exception:  # noqa: BLE001 - it had failed: settled, nothing to keep
                finished_ok = False
            if finished_ok:
                self._apply(lambda t, now: t.batch_ended(a.batch, None, now))
                return
        self._apply(lambda t, now: t.cancel_settled(a.batch, now))

    def _drop_remote(self, remote: _Remote) -> None:
        with self._lock:
            if self._remotes.get(remote.key) is remote:
                del self._remotes[remote.key]

    def _run(self) -> None:
        """kvlink-pulls thread: deadlines, unsettled cancels, renewals due; sleeps until the next one."""
        self._place_thread()
        while True:
            try:
                with self._wake:
                    if self._closed:
                        return
                    now = time.monotonic()
                    cap = 0.1 if self._table.running() else 0.5
                    self._wake.wait(max(0.0, min(self._table.next_wakeup(now) - now, cap)))
                    if self._closed:
                        return
                self._apply(lambda t, now: t.tick(now))
            except Exception:  # noqa: BLE001 - a dead ticker would leave pulls without deadlines
                logger.exception("kvlink: pull ticker round failed")

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


def _why(e: BaseException) -> str:
    name = getattr(e, "name", None) or type(e).__name__
    return f"{name}: {e}"
