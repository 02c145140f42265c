"""Copies between a worker's KV blocks and its host staging pool (the torch side of staging.py).

The pool is one host tensor ``[layers, slots + 1, segments, segment_bytes]`` of bytes (pinned when the KV
is on CUDA), registered with the transport as one region (layout.pool_geometry). It is layer-major, so
one layer of a run of consecutive slots is one byte range: a streamed layer's copy (device -> pool) and a
landing copy of some layers (pool -> device) are each one plain async copy per run. (Slot-major, one
layer of a run is strided in host memory, and PyTorch copies a strided device -> host destination
through a pageable bounce buffer, which blocks the calling thread - vLLM's - until the device reaches the
copy: seen on an H100, every layer of the forward waited for the device.) Each layer's KV tensor is seen
as bytes ``[num_blocks, segments, segment_bytes]`` through its BlockLayout, whatever the backend's layout.

On CUDA every copy runs on the stager's own stream, after an event recorded on vLLM's stream when the
work was handed over (so after the forward that wrote the blocks, or after whatever used a block before
it was given to this request), through a fixed device scratch buffer (``CHUNK_BYTES``): a gather of the
blocks into the scratch, then one copy per run of consecutive slots. Nothing synchronizes the device on
vLLM's thread; ``Pending.done()`` asks the stream's event. On CPU (staging forced) the copies are plain
indexed copies, run on the caller's thread (the worker hands prefill's to a thread of its own).
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


class Stager:
    def __init__(self, kv_caches: dict[str, Any], layout: BlockLayout, slots: int):
        import torch

        first = next(iter(kv_caches.values()))
        self.device = first.device
        self.cuda = self.device.type == "cuda"
        self.layout, self.slots = layout, slots
        n, seg = layout.segments, layout.segment_bytes
        self.slot_bytes = len(kv_caches) * layout.block_bytes
        self.pool = torch.zeros((len(kv_caches), slots + 1, n, seg), dtype=torch.uint8, pin_memory=self.cuda)
        self.views = [self._bytes(t) for t in kv_caches.values()]
        # CUDA: one copy is queued at a time (the waiter threads land batches concurrently): the scratch is
        # shared, and the stream's order is what keeps one copy's use of it from overlapping the next's.
        self._queue_lock = threading.Lock()
        self._indices: dict[tuple[int, ...], Any] = {}  # CUDA: recent block-id tensors on the device (_index)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=self.device)
            self.chunk = max(1, min(slots, CHUNK_BYTES // self.slot_bytes))
            # blocks of one layer each; a copy of fewer layers gives each of them a larger share (one round)
            self.scratch = torch.empty((len(kv_caches) * self.chunk, n, seg), dtype=torch.uint8, device=self.device)

    @property
    def pool_span(self) -> tuple[int, int]:
        return self.pool.data_ptr(), self.pool.numel()

    def _bytes(self, t: Any) -> Any:
        """The layer's blocks as bytes ``[num_blocks, segments, segment_bytes]`` (a view of its storage)."""
        import torch

        lay = self.layout
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return raw.as_strided((lay.num_blocks, lay.segments, lay.segment_bytes),
                              (lay.block_stride, lay.segment_stride or lay.segment_bytes, 1),
                              t.storage_offset() * t.element_size())

    def fence(self) -> Any:
        """An event on vLLM's current stream (CUDA): copies started later wait for what it had queued."""
        if not self.cuda:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def to_pool(self, blocks: list[int], slots: list[int], after: Any = None, layer: int | None = None) -> Pending:
        """Copy device blocks into pool slots (prefill): every layer, or only the ``layer``-th (streamed KV,
        as the forward goes). CPU: done on return."""
        import torch

        layers = list(enumerate(self.views)) if layer is None else [(layer, self.views[layer])]
        if not self.cuda:
            bi = torch.tensor(blocks)
            for li, v in layers:
                rows = v.index_select(0, bi)
                for i, s, n in _runs(slots):
                    self.pool[li, s:s + n].copy_(rows[i:i + n])
            return DONE
        if not layers:
            return DONE
        with self._queued(after):
            per = self._per_layer(len(layers))
            for at in range(0, len(blocks), per):
                bi = self._index(blocks[at:at + per])
                k = len(bi)
                for j, (li, v) in enumerate(layers):
                    buf = self.scratch[j * per:j * per + k]
                    torch.index_select(v, 0, bi, out=buf)
                    for i, s, n in _runs(slots[at:at + k]):  # contiguous on both sides: never a bounce buffer
                        self.pool[li, s:s + n].copy_(buf[i:i + n], non_blocking=True)
            return self._event()

    def from_pool(self, slots: list[int], blocks: list[int], after: Any = None,
                  layers: list[int] | None = None) -> Pending:
        """Copy pool slots into device blocks (decode): every layer, or only the ``layers``-th (a layer-wise
        streamed read landed only those). CPU: done on return."""
        import torch

        views = list(enumerate(self.views)) if layers is None else [(li, self.views[li]) for li in layers]
        if not self.cuda:
            bi = torch.tensor(blocks)
            rows = torch.empty((len(blocks), self.layout.segments, self.layout.segment_bytes), dtype=torch.uint8)
            for layer, v in views:
                for i, s, n in _runs(slots):
                    rows[i:i + n].copy_(self.pool[layer, s:s + n])
                v.index_copy_(0, bi, rows)
            return DONE
        if not views:
            return DONE
        with self._queued(after):
            per = self._per_layer(len(views))
            for at in range(0, len(blocks), per):
                bi = self._index(blocks[at:at + per])
                k = len(bi)
                for j, (layer, v) in enumerate(views):  # only the layers asked for cross the bus
                    buf = self.scratch[j * per:j * per + k]
                    for i, s, n in _runs(slots[at:at + k]):
                        buf[i:i + n].copy_(self.pool[layer, s:s + n], non_blocking=True)
                    v.index_copy_(0, bi, buf)
            return self._event()

    def _per_layer(self, layers: int) -> int:
        """Blocks of each of ``layers`` layers one round of a copy moves through the scratch."""
        return self.chunk * len(self.views) // layers

    @contextlib.contextmanager
    def _queued(self, after: Any):
        """Queue copies on the stager's stream, after ``after``, one caller at a time. If queueing fails
        part-way, what was queued is waited for before the error goes on: the caller then gives the memory
        back, and nothing of ours may still write into it."""
        import torch

        with self._queue_lock, torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            try:
                yield
            except BaseException:
                self.stream.synchronize()
                raise

    def _index(self, blocks: list[int]) -> Any:
        """Block ids on the device, copied from pinned memory on the stager's stream: a pageable copy would
        wait for that stream, and so for vLLM's forward, on the calling thread. The last few are kept (a
        streamed step copies the same blocks once per layer); only the stager's stream ever reads them."""
        import torch

        key = tuple(blocks)
        got = self._indices.pop(key, None)
        if got is None:
            got = torch.tensor(blocks, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        self._indices[key] = got
        while len(self._indices) > 8:
            self._indices.pop(next(iter(self._indices)))
        return got

    def _event(self) -> Pending:
        import torch

        ev = torch.cuda.Event()
        ev.record(self.stream)
        return Pending(ev.query, ev.synchronize)
