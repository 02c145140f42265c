"""Host staging of KV that lives on a device: the pool's slots and prefill's staging queue, as pure logic.

When the transport cannot address the KV cache's memory (a GPU and kvlink's TCP or same-host transport),
each worker keeps a pinned host pool of ``slots`` block slots; slot ``s`` holds block ``s`` of every layer
(layer-major: layout.pool_geometry), and slot 0 is never used, so a table entry 0 still means vLLM's null block.

Prefill: a finished request is queued here; when the pool has room its blocks get slots, the worker copies
them device -> pool (stager.py) and reports the request finished sending, so vLLM frees its device blocks
right away; the scheduler then publishes the slot table and the held table keeps the slots until decode
is done or the lease ends. When the pool is full the request waits here, keeping its device blocks (first
come, first staged), at most ``wait_s`` (the lease): then its device blocks are freed, its transfer marked
abandoned and decode computes the prompt. A request larger than the whole pool is refused at once.

Streamed KV through the pool (prefill, ``stream_kv``): a streamed request gets its slots when it starts
(``reserve``), the worker copies each layer of each step's new blocks into them as the forward goes (so
pieces name slots decode can read at once), and at the end only what was not copied yet is; the request
is then staged and published like any other. No room when it starts: it is not streamed (staged at the
end as usual).

Decode uses a SlotPool too (landing slots for a READ before the copy pool -> device); its pulls wait in
the pull table while the pool is full (pulls.py).

No threads, no torch: the scheduler holds a lock around the planner and feeds it ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlink.vllm.plan import NULL_BLOCK

MIB = 1 << 20


def staging_wanted(mode: str, device_type: str, backend_kind: str) -> tuple[bool, str]:
    """Whether this worker stages its KV through host memory, and why: one rule for the scheduler (which
    knows the device from vLLM's config) and the workers (which see the tensors). Raises ValueError, naming
    device, backend and setting, where ``staging: never`` leaves no way to move the KV."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"kvlink moves KV caches on CPU or CUDA devices; this one is on {device_type!r}")
    if mode == "always":
        return True, "staging: always"
    if device_type == "cpu":
        return False, "the KV cache is in host memory"
    from kvlink.backends import device_memory

    direct, why = device_memory(backend_kind)
    if direct:
        return False, f"GPU-direct: {why}"
    if mode == "never":
        raise ValueError(f"the KV cache is on {device_type} and transport backend {backend_kind!r} cannot move "
                         f"device memory ({why}); with staging 'never' there is no way to move it: set staging "
                         "to 'auto' (host staging) or use a backend that registers device memory (a CUDA "
                         "build of Mooncake)")
    return True, f"host staging: {why}"


def slot_bytes_of(kv_cache_config: Any) -> int:
    """Bytes of one slot (a block of every layer of this worker), from vLLM's KVCacheConfig: the scheduler
    and each worker size their pools with this one formula, so they agree on the slot count."""
    total = 0
    for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ():
        total += int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
    if total <= 0:
        raise ValueError("kvlink: cannot size the staging pool: the KV cache config names no layers")
    return total


def pp_slot_bytes(kv_cache_config: Any, num_layers: int, pp_size: int,
                  stage_sizes: list[int] | None = None) -> int:
    """Bytes of one slot as every PP stage counts it, so all agree on the slot count. vLLM hands the scheduler
    stage 0's KV cache config and each worker its own stage's; with uneven stages (vLLM gives the spare
    layers to the middle ones) a per-stage slot would give the larger stages fewer slots than the scheduler
    hands out. Equal stages by layer count may still hold unequal KV layers (attention-free layers, a
    drafter's on the last stage). So slots are counted for the largest stage: its layers times one layer's
    page, the same on every stage (a stage with more KV layers than that gets a larger pool, never fewer
    slots). Where groups' pages differ: equal stages count their own (assumed alike), unequal ones are
    refused. ``stage_sizes``: layers per stage (vLLM's split)."""
    own = slot_bytes_of(kv_cache_config)
    if pp_size <= 1:
        return own
    if stage_sizes is None:
        from vllm.distributed.utils import get_pp_indices

        stage_sizes = [b - a for a, b in (get_pp_indices(num_layers, r, pp_size) for r in range(pp_size))]
    pages = {int(g.kv_cache_spec.page_size_bytes) for g in kv_cache_config.kv_cache_groups}
    if len(pages) != 1 and len(set(stage_sizes)) == 1:
        return own
    if len(pages) != 1:
        raise ValueError(f"kvlink: host staging with PP stages of unequal layer counts {stage_sizes} needs one page "
                         f"size for every layer, this model has {sorted(pages)}: run PP with equal stages "
                         "(VLLM_PP_LAYER_PARTITION) or without host staging")
    return pages.pop() * max(stage_sizes)


def pool_slots(pool_mb: int, slot_bytes: int) -> int:
    """Usable slots of a pool of ``pool_mb`` MiB (slot 0 is reserved)."""
    return max(0, pool_mb * MIB // slot_bytes - 1)


class SlotPool:
    """Slots ``1..capacity``; allocation prefers one contiguous run (one descriptor, one copy)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._used = np.zeros(capacity + 1, bool)
        self._used[0] = True  # the null slot
        self.in_use = 0

    def allocate(self, n: int) -> tuple[int, ...] | None:
        """``n`` free slots (a contiguous run when there is one), or None when fewer are free."""
        if n > self.capacity - self.in_use:
            return None
        free = ~self._used
        # First run of n free slots: positions where a window of n is all free.
        if n > 0:
            c = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
            starts = np.flatnonzero(c[n:] - c[:-n] == n)
            slots = np.arange(starts[0], starts[0] + n) if len(starts) else np.flatnonzero(free)[:n]
        else:
            slots = np.empty(0, np.int64)
        self._used[slots] = True
        self.in_use += n
        return tuple(int(s) for s in slots)

    def free(self, slots: tuple[int, ...]) -> None:
        idx = np.asarray(slots, np.int64)
        if len(idx) and (idx.min() <= 0 or idx.max() > self.capacity or not self._used[idx].all()):
            raise ValueError(f"kvlink: freeing staging slots not in use: {sorted(slots)[:8]}")
        self._used[idx] = False
        self.in_use -= len(idx)


@dataclass
class StageJob:
    """One finished prefill request on its way into the pool."""

    request_id: str
    table: tuple[int, ...]  # vLLM's block table by position (null blocks included)
    since: float
    extra: Any = None  # what the scheduler publishes once staged (transfer id, tokens, epoch, prompt digest)
    slots: tuple[int, ...] = ()  # one per non-null entry of ``table``, once allocated
    waited: bool = False  # counted as a pool-full event already
    # Streamed into slots it could not keep (the pool had no room to grow them): pieces named slots another
    # request may get before decode's READs of them end, so the record must make decode read it all again
    # (published at the next epoch).
    restaged: bool = False

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(b for b in self.table if b != NULL_BLOCK)

    @property
    def slot_table(self) -> tuple[int, ...]:
        """``table`` with each device block replaced by its slot: what decode pairs by position."""
        it = iter(self.slots)
        return tuple(NULL_BLOCK if b == NULL_BLOCK else next(it) for b in self.table)


@dataclass
class StagePlanner:
    """Prefill's staging queue and the slots of staged requests (until decode is done with them)."""

    pool: SlotPool
    wait_s: float  # longest a request waits for room, keeping its device blocks
    counts: dict[str, int] = field(default_factory=dict)
    _queued: "OrderedDict[str, StageJob]" = field(default_factory=OrderedDict)
    _copying: dict[str, StageJob] = field(default_factory=dict)
    _staged: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request id -> its slots
    _reserved: dict[str, tuple[int, ...]] = field(default_factory=dict)  # streamed requests still computing
    _started: list[StageJob] = field(default_factory=list)  # streamed ones admitted, with their slots
    # Streamed requests whose reserved slots went back to the pool (aborted, refused, restaged): what the
    # worker copied into them layer by layer is another request's from now on (``take_dropped``).
    _dropped: list[str] = field(default_factory=list)

    def reserve(self, rid: str, n: int) -> tuple[int, ...] | None:
        """Slots for the ``n`` block positions of a streamed request that starts computing (the same ones
        again after a restart), or None when the pool has no room now (it is not streamed)."""
        if rid in self._reserved:
            return self._reserved[rid]
        slots = self.pool.allocate(n)
        if slots is None:
            self._count("stream_pool_full")
            return None
        self._reserved[rid] = slots
        return slots

    def unreserve(self, rid: str) -> None:
        """A streamed request ended without being staged (aborted, refused): its slots are free."""
        slots = self._reserved.pop(rid, None)
        if slots is not None:
            self.pool.free(slots)
            self._dropped.append(rid)

    def take_dropped(self) -> list[str]:
        """Streamed requests whose slots were given back since the last call (the worker forgets which of
        their positions it copied: the same slots may come back to them holding another request's KV)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def admit(self, rid: str, table: tuple[int, ...], now: float, extra: Any = None) -> str | None:
        """Queue a finished request; the reason it cannot be staged at all (larger than the pool), or None.
        A streamed one keeps the slots it streamed into and is copied (what is left of it) at once."""
        job = StageJob(rid, tuple(table), now, extra)
        need = len(job.blocks)
        slots = self._reserved.pop(rid, None)
        if slots is not None:
            more = self.pool.allocate(need - len(slots)) if need > len(slots) else ()
            if more is not None:
                if need < len(slots):
                    self.pool.free(slots[need:])
                job.slots = (slots + more)[:need]
                self._copying[rid] = job
                self._started.append(job)
                return None
            self.pool.free(slots)  # cannot grow it in place: staged from scratch, like any other
            self._dropped.append(rid)
            job.restaged = True
        if need > self.pool.capacity:
            self._count("staging_refused")
            return (f"the request needs {need} staging blocks but the staging pool holds {self.pool.capacity} "
                    "(raise staging_pool_mb)")
        self._queued[rid] = job
        return None

    def take_jobs(self, now: float) -> tuple[list[StageJob], list[StageJob]]:
        """(jobs to copy now, with slots; jobs that waited ``wait_s`` for room and are given up)."""
        expired = [j for j in self._queued.values() if now - j.since >= self.wait_s]
        for j in expired:
            del self._queued[j.request_id]
            self._count("staging_expired")
        start, self._started = self._started, []  # streamed ones: their slots were theirs already
        for j in list(self._queued.values()):
            slots = self.pool.allocate(len(j.blocks))
            if slots is None:  # first come, first staged: a big request is not starved by small ones
                if not j.waited:
                    j.waited = True
                    self._count("staging_pool_full")
                break
            j.slots = slots
            del self._queued[j.request_id]
            self._copying[j.request_id] = j
            start.append(j)
        return start, expired

    def staged(self, rid: str) -> StageJob | None:
        """The worker copied the request into its slots (its device blocks go back to vLLM)."""
        job = self._copying.pop(rid, None)
        if job is not None:
            self._staged[rid] = job.slots
            self._count("staged")
        return job

    def release(self, rid: str) -> bool:
        """Decode is done with a staged request (or its lease ended): its slots are free. False if the
        request is not staged here."""
        slots = self._staged.pop(rid, None)
        if slots is None:
            return False
        self.pool.free(slots)
        return True

    def device_blocks(self) -> int:
        """Device blocks vLLM still keeps for requests queued or being copied."""
        return sum(len(j.blocks) for j in (*self._queued.values(), *self._copying.values()))

    def freeing_blocks(self) -> int:
        """Device blocks that come back to vLLM without it preempting anyone: those being copied, and those
        of queued requests that fit, each in its turn, in the pool once staged requests' slots are free again
        (decode or their leases free them). Not those of a request (and the ones queued behind it) that
        needs slots reserved by streamed requests still computing: those end only if vLLM can schedule
        them, which may take a preemption."""
        n = sum(len(j.blocks) for j in self._copying.values())
        room = self.pool.capacity - sum(len(s) for s in self._reserved.values())
        for j in self._queued.values():  # first come, first staged
            if len(j.blocks) > room:
                break
            n += len(j.blocks)
        return n

    def busy(self) -> bool:
        return bool(self._queued or self._copying)

    def copying(self) -> bool:
        """Jobs handed to the worker whose copy has not been reported yet."""
        return bool(self._copying)

    def is_staging(self, rid: str) -> bool:
        return rid in self._queued or rid in self._copying

    def take_counts(self) -> dict[str, int]:
        counts, self.counts = self.counts, {}
        return counts

    def _count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n
