"""Streamed KV, prefill's side: while a request is still computing, the blocks it has finished are
announced as pieces, so decode reads them during prefill and only the tail is left when it ends.

Granularity: one piece per request per engine step (per chunked-prefill chunk), sent after the step's
forward, not one per layer. A piece is one small HTTP call per rank and step to the bootstrap server
(all of a step's requests in one call); one per layer would be that call times the number of layers,
each on the forward's critical path, to gain at most one chunk's worth of overlap (the last chunk's
layers). The tail decode reads after the end is the last chunk's blocks: ``max_num_batched_tokens``
sets it (docs/connector.md, "Streamed KV").

- ``StreamPlanner`` (scheduler process, pure): follows each streamed request's block table through
  vLLM's scheduler output (new requests, appended blocks, a restart after preemption) and, per step,
  says which full blocks will be computed once the step's forward is done. The chunk that completes the
  prompt gets no piece: the published record follows it at once and is the end of the stream.
- ``PieceSender`` (worker process, one thread): sends a step's pieces after its forward (on CUDA, after
  an event recorded behind that forward), and stops sending for transfers the server says are over
  (decode stopped waiting, published, abandoned). It never blocks vLLM's thread.

Which requests stream: ``do_remote_decode`` with a transfer id (concurrent pairing: decode waits for it
while prefill computes) on an engine with ``stream_kv`` on, one KV cache group of full attention, no host
staging and no Mamba state (the state exists only at the end). Others publish once, as before.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSpec:
    """One piece, scheduler -> worker: after this step, the first ``num_tokens`` tokens are in ``block_ids``."""

    request_id: str
    transfer_id: str
    index: int
    epoch: int
    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass
class _Streamed:
    transfer_id: str
    prompt_tokens: int
    epoch: int = 0
    index: int = 0
    blocks: list[int] = field(default_factory=list)
    sent_blocks: int = 0  # full blocks the last piece covered
    scheduled: bool = False  # seen in a scheduler output since its (re)start


class StreamPlanner:
    """Scheduler side: which blocks of which streamed request each step completes. Pure."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._reqs: dict[str, _Streamed] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def track(self, rid: str, transfer_id: str, prompt_tokens: int) -> None:
        """A streamed request was allocated blocks (again, after a preemption: a new epoch)."""
        r = self._reqs.get(rid)
        if r is None:
            self._reqs[rid] = _Streamed(transfer_id, prompt_tokens)
            return
        r.epoch += 1  # restarted: its blocks may be others, and what was announced may be stale
        r.blocks, r.sent_blocks, r.scheduled = [], 0, False

    def finished(self, rid: str) -> int:
        """The request ended; its epoch (published with the record)."""
        r = self._reqs.pop(rid, None)
        return r.epoch if r is not None else 0

    def step(self, new: list[tuple[str, list[int], int]],
             cached: list[tuple[str, list[int] | None, bool, int]],
             scheduled: dict[str, int]) -> list[StreamSpec]:
        """This step's pieces. ``new``: (request, block ids, computed tokens) of newly scheduled requests;
        ``cached``: (request, new block ids or None, resumed (ids replace the table), computed tokens);
        ``scheduled``: tokens scheduled this step per request."""
        out = []
        seen: dict[str, int] = {}
        for rid, blocks, computed in new:
            r = self._reqs.get(rid)
            if r is not None:
                if r.scheduled:  # scheduled as new again without a track(): a restart all the same
                    self.track(rid, r.transfer_id, r.prompt_tokens)
                r.blocks, r.scheduled = list(blocks), True
                seen[rid] = computed
        for rid, blocks, resumed, computed in cached:
            r = self._reqs.get(rid)
            if r is None:
                continue
            if resumed:
                if r.scheduled:
                    self.track(rid, r.transfer_id, r.prompt_tokens)
                r.blocks = list(blocks or ())
            elif blocks:
                r.blocks.extend(blocks)
            r.scheduled = True
            seen[rid] = computed
        for rid, computed in seen.items():
            r = self._reqs[rid]
            done = computed + scheduled.get(rid, 0)
            if done >= r.prompt_tokens:
                continue  # the last chunk: the published record ends the stream
            full = min(done // self.block_size, len(r.blocks))
            if full <= r.sent_blocks:
                continue
            r.index += 1
            r.sent_blocks = full
            out.append(StreamSpec(rid, r.transfer_id, r.index, r.epoch, full * self.block_size,
                                  tuple(r.blocks[:full])))
        return out


class PieceSender:
    """Worker side: one thread sends each step's pieces once that step's KV is in place."""

    def __init__(self, send: Callable[[list[StreamSpec]], list[str]], count: Callable[[str, int], None]):
        self._send, self._count = send, count
        self._queue: queue.Queue = queue.Queue()
        self._ended: dict[str, None] = {}  # transfer ids the server said are over (bounded, oldest first)
        self._thread = threading.Thread(target=self._run, name="kvlink-stream", daemon=True)
        self._thread.start()

    def submit(self, pieces: list[StreamSpec], fence: Any = None) -> None:
        """After the step's forward (vLLM's thread): ``fence`` is a CUDA event recorded behind it, or None
        when the KV is in place already (CPU)."""
        self._queue.put((pieces, fence))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while not self._queue.empty():  # steps that queued while the last call was out: one call
                nxt = self._queue.get()
                if nxt is None:
                    self._flush(batch)
                    return
                batch.append(nxt)
            self._flush(batch)

    def _flush(self, batch: list) -> None:
        pieces = []
        for step, fence in batch:
            if fence is not None:
                fence.synchronize()  # the forward that wrote these blocks has finished on the device
            pieces += [p for p in step if p.transfer_id not in self._ended]
        if not pieces:
            return
        try:
            ended = self._send(pieces)
        except Exception as e:  # noqa: BLE001 - a lost piece costs overlap, never correctness
            logger.debug("kvlink: sending %d streamed pieces failed: %s", len(pieces), e)
            return
        self._count("pieces_sent", len(pieces))
        if ended:
            self._count("pieces_ended", len(ended))
            for tid in ended:
                self._ended[tid] = None
            while len(self._ended) > 65536:
                self._ended.pop(next(iter(self._ended)))
