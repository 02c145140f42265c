"""Streamed KV, prefill's side: while a request is still computing, the blocks it has finished are
announced as pieces, so decode reads them during prefill and only the tail is left when it ends.

Granularity (``stream_granularity``):

- "layer" (default): during each step's forward, after every attention layer, a piece says the step's
  new full blocks hold their KV in the layers up to that one (``save_kv_layer``); after the forward, that
  they are whole. The chunk that completes the prompt streams too, layer by layer, so a prompt of one
  chunk (most prompts on GPUs, whose token budget is 2k-16k) overlaps its transfer with its own forward
  and the tail decode reads after the published record is about the last layer's share plus the
  prompt's last, partial block. Pieces are cumulative: the sender sends only the newest per request of
  whatever queued while its last call was out, so a slow bootstrap call costs overlap, never the forward.
- "step": one piece per request per step, after the step's forward; a one-chunk prompt streams nothing
  and the tail is the last chunk's blocks (``max_num_batched_tokens``). One bootstrap call per step.

- ``StreamPlanner`` (scheduler process, pure): follows each streamed request's block table through
  vLLM's scheduler output (new requests, appended blocks, a restart after preemption) and, per step,
  says which full blocks the step's forward completes (and how many were whole before it). Per step, the
  chunk that completes the prompt gets no step-end piece: the published record follows it at once and is
  the end of the stream.
- ``PieceSender`` (worker process, one thread): sends pieces once their KV is in place (on CUDA, after an
  event recorded behind the layer or forward that wrote it), and stops sending for transfers the server
  says are over (decode stopped waiting, published, abandoned). It never blocks vLLM's thread.

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
    """One step of a streamed request, scheduler -> worker: after this step's forward the first
    ``num_tokens`` tokens are in ``block_ids``, of which the first ``whole`` blocks were complete before it
    (layer-wise pieces announce the others layer by layer). ``last``: the step completes the prompt (no
    step-end piece: the published record follows)."""

    request_id: str
    transfer_id: str
    index: int
    epoch: int
    num_tokens: int
    block_ids: tuple[int, ...]
    whole: int = 0
    last: bool = False


LAYER_SLOTS = 1024  # layer-wise: wire index = step index * LAYER_SLOTS + layers (the step's end: the last)


@dataclass(frozen=True)
class Piece:
    """What one rank tells the bootstrap server about a step (schema.StreamPiece): ``layers`` 0 says the
    step's blocks are whole; n says its new blocks hold their KV in the model's layers below n."""

    spec: StreamSpec
    index: int
    layers: int = 0

    @property
    def transfer_id(self) -> str:
        return self.spec.transfer_id

    def fields(self) -> dict[str, Any]:
        sp = self.spec
        out = dict(transfer_id=sp.transfer_id, request_id=sp.request_id, index=self.index, epoch=sp.epoch)
        if not self.layers:
            return dict(out, num_tokens=sp.num_tokens, block_ids=[list(sp.block_ids)])
        per_block = sp.num_tokens // len(sp.block_ids)
        return dict(out, num_tokens=sp.whole * per_block, block_ids=[list(sp.block_ids[:sp.whole])],
                    step_block_ids=[list(sp.block_ids[sp.whole:])], layers=self.layers)


def step_pieces(specs: list[StreamSpec], layer_wise: bool) -> list[Piece]:
    """After a step's forward: its blocks are whole (not for the chunk that completes the prompt)."""
    if not layer_wise:
        return [Piece(sp, sp.index) for sp in specs]
    return [Piece(sp, sp.index * LAYER_SLOTS + LAYER_SLOTS - 1) for sp in specs if not sp.last]


def layer_pieces(specs: list[StreamSpec], layer: int) -> list[Piece]:
    """After the attention layer of index ``layer`` of a step's forward: the step's new blocks hold it and
    every layer before it. None for a layer index the wire index cannot order."""
    if not 0 <= layer < LAYER_SLOTS - 2:
        return []
    return [Piece(sp, sp.index * LAYER_SLOTS + layer + 1, layer + 1) for sp in specs]


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

    def __init__(self, block_size: int, layer_wise: bool = False):
        self.block_size, self.layer_wise = block_size, layer_wise
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
            last = done >= r.prompt_tokens
            if last and not self.layer_wise:
                continue  # the last chunk: the published record ends the stream
            full = min(min(done, r.prompt_tokens) // self.block_size, len(r.blocks))
            whole = min(computed // self.block_size, full)
            if full <= max(r.sent_blocks, whole if self.layer_wise else 0):
                continue
            r.index += 1
            r.sent_blocks = full
            out.append(StreamSpec(rid, r.transfer_id, r.index, r.epoch, full * self.block_size,
                                  tuple(r.blocks[:full]), whole, last))
        return out


class PieceSender:
    """Worker side: one thread sends each step's pieces once that step's KV is in place."""

    def __init__(self, send: Callable[[list[Piece]], list[str]], count: Callable[[str, int], None]):
        self._send, self._count = send, count
        self._queue: queue.Queue = queue.Queue()
        self._ended: dict[str, None] = {}  # transfer ids the server said are over (bounded, oldest first)
        self._thread = threading.Thread(target=self._run, name="kvlink-stream", daemon=True)
        self._thread.start()

    def submit(self, pieces: list[Piece], fence: Any = None) -> None:
        """After a layer or the step's forward (vLLM's thread): ``fence`` is a CUDA event recorded behind
        it, or None when the KV is in place already (CPU)."""
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
        newest: dict[str, Any] = {}  # pieces are cumulative: the newest of each transfer says it all
        for step, fence in batch:
            if fence is not None:
                fence.synchronize()  # the forward (or layer) that wrote these blocks has finished on the device
            for p in step:
                if p.transfer_id not in self._ended and (p.transfer_id not in newest
                                                         or p.index > newest[p.transfer_id].index):
                    newest[p.transfer_id] = p
        pieces = list(newest.values())
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
