"""Copies between a worker's KV blocks and its host staging pool (the torch side of staging.py).

The pool is one host tensor ``[layers, slots + 1, segments, segment_bytes]`` of bytes (pinned when the KV
is on CUDA), registered with the transport as one region (layout.pool_geometry). It is layer-major, so
one layer of a run of consecutive slots is one byte range: a streamed layer's copy (device -> pool) and a
landing copy of some layers (pool -> device) are each one plain async copy per run. (Slot-major, one
layer of a run is strided in host memory, and PyTorch copies a strided device -> host destination
through a pageable bounce buffer, which blocks the calling thread - vLLM's - until the device reaches the
copy: seen on an H100, every layer of the forward waited for the device.) Each layer's KV tensor is seen
as bytes ``[num_blocks, segments, segment_bytes]`` through its BlockLayout, whatever the backend's layout;
the copies themselves see those bytes as the widest integer (8, 4, 2 or 1 bytes) that divides every
segment, stride and address (``_element``): an indexed copy does its work per element. On a CPU, landing
(``index_copy_``) runs 3.9x faster as int64 than byte-wise (bench/results/cpu-s27-stager.txt); on an H200,
MLA's whole-request staging ran at 1.3 GB/s byte-wise against ~30 for the other layouts (session 26), with
the byte-wise gather the suspect, not yet measured wide.

On CUDA the copies run on two streams of the stager's own, after an event recorded on vLLM's stream when
the work was handed over (so after the forward that wrote the blocks, or after whatever used a block before
it was given to this request), through a fixed device scratch buffer of two halves (``CHUNK_BYTES`` each).
A round gathers blocks into one half on the kernel stream (an index_select), then the copy stream moves
that half over the bus (one copy per run of consecutive slots) while the kernel stream gathers the next
round into the other half; landing runs the other way (bus copy into a half, then an index_copy_ into the
blocks). Each half is reused only after an event says the last round that used it is done, in either
direction. (With one stream the gather, ~20% of a request's device time on an H100, added to the copies.)
Nothing synchronizes the device on vLLM's thread; ``Pending.done()`` asks an event. The stager warms up
when it is built (each kind of copy once, at full size, of bytes that stay as they were: ``_warm``), so
the first forward that streams does not pay for first-time allocations and kernel loading. On CPU (staging
forced) the copies are plain indexed copies, run on the caller's thread (the worker hands prefill's to a
thread of its own).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from kvlink.vllm.layout import BlockLayout

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # device scratch for one round of a gather or a scatter


def _element(layout: BlockLayout, addresses: list[int]) -> int:
    """The widest integer (8, 4, 2 or 1 bytes) that divides a block's segment, its strides and the
    ``addresses`` (each layer's first byte and its byte offset into its storage, the pool's first byte): the
    copies may then see the bytes as such integers."""
    sizes = [layout.segment_bytes, layout.block_stride, layout.segment_stride or layout.segment_bytes, *addresses]
    return next(e for e in (8, 4, 2, 1) if all(x % e == 0 for x in sizes))


def _dtype(element: int) -> Any:
    """The torch integer of ``element`` bytes."""
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[element]


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """[(index into slots, first slot, count)] of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and s == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, s, 1))
    return out


class Pending:
    """A copy under way: ``done()`` never blocks, ``wait()`` does (never on vLLM's thread)."""

    def __init__(self, done: Callable[[], bool], wait: Callable[[], None]):
        self.done, self.wait = done, wait


DONE = Pending(lambda: True, lambda: None)


def both(a: Pending, b: Pending) -> Pending:
    """Done when ``a`` and ``b`` are."""
    return Pending(lambda: a.done() and b.done(), lambda: (a.wait(), b.wait()) and None)


def event_pending(ev: Any) -> Pending:
    """A CUDA event (``query``, ``synchronize``) as a Pending."""
    return Pending(ev.query, ev.synchronize)


class Stager:
    """``overlap=False`` runs every CUDA copy on one stream, whole scratch per round (the A/B of
    tools/gpu_stager_bench.py); ``warm=False`` skips the warm-up (the cold-start probe)."""

    def __init__(self, kv_caches: dict[str, Any], layout: BlockLayout, slots: int, *, overlap: bool = True,
                 warm: bool = True, wide: bool = True):
        import torch

        first = next(iter(kv_caches.values()))
        self.device = first.device
        self.cuda = self.device.type == "cuda"
        self.layout, self.slots = layout, slots
        n, seg = layout.segments, layout.segment_bytes
        self.slot_bytes = len(kv_caches) * layout.block_bytes
        self.pool = torch.zeros((len(kv_caches), slots + 1, n, seg), dtype=torch.uint8, pin_memory=self.cuda)
        self.views = [self._bytes(t) for t in kv_caches.values()]
        # what the copies index: the same memory as wide elements (``wide=False``: bytes, the A/B of
        # tools/gpu_stager_bench.py)
        self.element = _element(layout, [v.data_ptr() for v in self.views] + [v.storage_offset() for v in self.views]
                                + [self.pool.data_ptr()]) if wide else 1
        self._views = [self._bytes(t, self.element) for t in kv_caches.values()]
        self._pool = self.pool.view(_dtype(self.element))
        # CUDA: one copy is queued at a time (the waiter threads land batches concurrently): the halves of the
        # scratch are shared, and their events are what keep one round's use of a half from overlapping the next.
        self._queue_lock = threading.Lock()
        self._indices: dict[tuple[int, ...], Any] = {}  # CUDA: recent block-id tensors on the device (_index)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=self.device)  # bus copies (D2H, H2D)
            self.kernels = torch.cuda.Stream(device=self.device) if overlap else self.stream  # gathers, scatters
            halves = 2 if overlap else 1  # each half is CHUNK_BYTES: halves of half the size double the
            # rounds of a whole request, and its copies are bound by their launches (tools/gpu_stager_bench.py)
            self.chunk = max(1, min(slots, CHUNK_BYTES // self.slot_bytes))
            # each half: blocks of one layer each; a copy of fewer layers gives each a larger share
            scratch = torch.empty((halves, len(kv_caches) * self.chunk, n, seg // self.element),
                                  dtype=_dtype(self.element), device=self.device)
            self._halves = list(scratch)
            self._free: list[Any] = [None] * halves  # event: the last round that used the half is done
            self._round = 0
            if warm:
                self._warm()

    @property
    def pool_span(self) -> tuple[int, int]:
        return self.pool.data_ptr(), self.pool.numel()

    def _bytes(self, t: Any, element: int = 1) -> Any:
        """The layer's blocks ``[num_blocks, segments, segment_bytes / element]`` as integers of ``element``
        bytes (a view of its storage; ``element`` divides every size, stride and offset: ``_element``)."""
        import torch

        lay, e = self.layout, element
        raw = torch.empty(0, dtype=_dtype(e), device=t.device)
        return raw.set_(t.untyped_storage(), t.storage_offset() * t.element_size() // e,
                        (lay.num_blocks, lay.segments, lay.segment_bytes // e),
                        (lay.block_stride // e, (lay.segment_stride or lay.segment_bytes) // e, 1))

    def _warm(self) -> None:
        """Run each kind of copy once at full size, before vLLM runs a forward and before the pool is
        registered with the transport (no peer reads it yet): blocks ``0..k-1`` into slots ``0..k-1`` (slot 0
        is the null slot; the others are free), one layer and every layer, then back into the same blocks,
        which writes the bytes they already hold. First-time costs (loading the kernels a full-size copy
        uses: a warm-up of one block did not take them away, on an H200; pinned block-id memory; events)
        then land at start-up rather than on the first forward that streams (19-24 ms there)."""
        k = min(self.chunk, self.slots + 1, self.layout.num_blocks)
        ids = list(range(k))
        self.to_pool(ids, ids, self.fence(), 0).wait()
        self.to_pool(ids, ids, self.fence()).wait()
        self.from_pool(ids, ids, self.fence(), [0]).wait()
        self.from_pool(ids, ids, self.fence()).wait()
        self._indices.clear()

    def fence(self) -> Any:
        """An event on vLLM's current stream (CUDA): copies started later wait for what it had queued."""
        if not self.cuda:
            return None
        import torch

        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def marker(self) -> Pending:
        """Done when every copy into the pool queued so far is (CUDA; on CPU they are done on return). A
        request whose blocks all went into the pool layer by layer as it computed is staged with nothing left
        to copy: this is what its end waits for, and so what its publish waits for."""
        if not self.cuda:
            return DONE
        with self._queue_lock:  # every copy into the pool ends on the copy stream, after its gather
            return event_pending(self._mark(self.stream))

    def to_pool(self, blocks: list[int], slots: list[int], after: Any = None, layer: int | None = None) -> Pending:
        """Copy device blocks into pool slots (prefill): every layer, or only the ``layer``-th (streamed KV,
        as the forward goes). CPU: done on return."""
        import torch

        layers = list(enumerate(self._views)) if layer is None else [(layer, self._views[layer])]
        if not self.cuda:
            bi = torch.tensor(blocks)
            for li, v in layers:
                rows = v.index_select(0, bi)
                for i, s, n in _runs(slots):
                    self._pool[li, s:s + n].copy_(rows[i:i + n])
            return DONE
        if not layers:
            return DONE
        if not blocks:
            return self.marker()
        with self._queued(after):
            per = self._per_layer(len(layers))
            for at in range(0, len(blocks), per):
                half, h = self._take(self.kernels)  # the gather writes the half first
                with torch.cuda.stream(self.kernels):
                    bi = self._index(blocks[at:at + per])
                    k = len(bi)
                    for j, (li, v) in enumerate(layers):
                        torch.index_select(v, 0, bi, out=h[j * per:j * per + k])
                    gathered = self._mark(self.kernels)
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(gathered)
                    for j, (li, _v) in enumerate(layers):
                        buf = h[j * per:j * per + k]
                        for i, s, n in _runs(slots[at:at + k]):  # contiguous on both sides: never a bounce buffer
                            self._pool[li, s:s + n].copy_(buf[i:i + n], non_blocking=True)
                    self._free[half] = self._mark(self.stream)
            return self._pending(half)

    def from_pool(self, slots: list[int], blocks: list[int], after: Any = None,
                  layers: list[int] | None = None) -> Pending:
        """Copy pool slots into device blocks (decode): every layer, or only the ``layers``-th (a layer-wise
        streamed read landed only those). CPU: done on return."""
        import torch

        views = list(enumerate(self._views)) if layers is None else [(li, self._views[li]) for li in layers]
        if not self.cuda:
            bi = torch.tensor(blocks)
            rows = torch.empty((len(blocks), *self._pool.shape[2:]), dtype=self._pool.dtype)
            for layer, v in views:
                for i, s, n in _runs(slots):
                    rows[i:i + n].copy_(self._pool[layer, s:s + n])
                v.index_copy_(0, bi, rows)
            return DONE
        if not views or not blocks:
            return DONE
        with self._queued(after):
            per = self._per_layer(len(views))
            for at in range(0, len(blocks), per):
                half, h = self._take(self.stream)  # the bus copy writes the half first
                k = len(blocks[at:at + per])
                with torch.cuda.stream(self.stream):  # only the layers asked for cross the bus
                    for j, (layer, _v) in enumerate(views):
                        buf = h[j * per:j * per + k]
                        for i, s, n in _runs(slots[at:at + k]):
                            buf[i:i + n].copy_(self._pool[layer, s:s + n], non_blocking=True)
                    landed = self._mark(self.stream)
                with torch.cuda.stream(self.kernels):
                    self.kernels.wait_event(landed)
                    bi = self._index(blocks[at:at + per])
                    for j, (_layer, v) in enumerate(views):
                        v.index_copy_(0, bi, h[j * per:j * per + k])
                    self._free[half] = self._mark(self.kernels)
            return self._pending(half)

    def _per_layer(self, layers: int) -> int:
        """Blocks of each of ``layers`` layers one round of a copy moves through a half of the scratch."""
        return self.chunk * len(self.views) // layers

    def _take(self, writer: Any) -> tuple[int, Any]:
        """The next half of the scratch, once ``writer`` (the stream that writes it first in this round) has
        waited for the last round that used it, in either direction. The other stream touches the half only
        after an event ``writer`` records behind its write, so it waits too."""
        half = self._round % len(self._halves)
        self._round += 1
        if self._free[half] is not None:
            writer.wait_event(self._free[half])
        return half, self._halves[half]

    @staticmethod
    def _mark(stream: Any) -> Any:
        """An event recorded on ``stream``; one waited for on the host sleeps (a default event spins a core)."""
        import torch

        ev = torch.cuda.Event(blocking=True)
        ev.record(stream)
        return ev

    @contextlib.contextmanager
    def _queued(self, after: Any):
        """Queue copies on the stager's streams, one caller at a time, the kernel stream (the one that reads
        or writes vLLM's blocks; the copy stream follows its events) after ``after``. If queueing fails
        part-way, what was queued is waited for before the error goes on: the caller then gives the memory
        back, and nothing of ours may still write into it."""
        with self._queue_lock:
            if after is not None:
                self.kernels.wait_event(after)
            try:
                yield
            except BaseException:
                self.stream.synchronize()
                self.kernels.synchronize()
                raise

    def _index(self, blocks: list[int]) -> Any:
        """Block ids on the device, copied from pinned memory on the kernel stream (called inside it): a
        pageable copy would wait for that stream, and so for vLLM's forward, on the calling thread. The last
        few are kept (a streamed step copies the same blocks once per layer); only the kernel stream ever
        reads them."""
        import torch

        key = tuple(blocks)
        got = self._indices.pop(key, None)
        if got is None:
            got = torch.tensor(blocks, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        self._indices[key] = got
        while len(self._indices) > 8:
            self._indices.pop(next(iter(self._indices)))
        return got

    def _pending(self, half: int) -> Pending:
        """Done when the copy's last round is: its event on the stream that ran the round's final step,
        after the other stream's steps it needed."""
        return event_pending(self._free[half])
