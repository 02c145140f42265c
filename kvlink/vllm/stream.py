"""Streamed KV, prefill's side: while a request is still computing, the blocks it has finished are
announced as pieces, so decode reads them during prefill and only the tail is left when it ends.

Granularity (``stream_granularity``):

- "layer" (default): during each step's forward, as every attention layer's KV is written (on entry to
  its attention op where vLLM writes the KV in an op before it, else on exit: connector.py), a piece says
  the step's new full blocks hold their KV in the layers up to that one; after the forward, that they are
  whole. The chunk that completes the prompt streams too, layer by layer, so a prompt of one chunk (most
  prompts on GPUs, whose token budget is 2k-16k) overlaps its transfer with its own forward and the tail
  decode reads after the published record is at most the last layer's share (the prompt's last, partial
  block streams layer by layer with that chunk: no later forward writes its prompt's positions). Pieces
  are cumulative: the sender sends only the newest per request of whatever queued, in place, while its
  last call was out, so a slow bootstrap call costs overlap, never the forward.
- "step": one piece per request per step, after the step's forward; a one-chunk prompt streams nothing
  and the tail is the last chunk's blocks (``max_num_batched_tokens``). One bootstrap call per step.

- ``StreamPlanner`` (scheduler process, pure): follows each streamed request's block table through
  vLLM's scheduler output (new requests, appended blocks, a restart after preemption) and, per step,
  says which blocks the step's forward completes (full ones, and layer-wise the prompt's partial last
  one in the chunk that completes it; and how many were whole before it). Per step, the
  chunk that completes the prompt gets no step-end piece: the published record follows it at once and is
  the end of the stream.
- ``PrefillStream`` (worker process, vLLM's thread): after each layer and each forward, the pieces to send
  (``LayerClock``: which layers are done) and, with host staging, the pool copies first (``StagedCopies``).
- ``PieceSender`` (worker process, one thread): sends pieces once their KV is in place (on CUDA, after an
  event recorded behind the layer or forward that wrote it), and stops sending for transfers the server
  says are over (decode stopped waiting, published, abandoned). It never blocks vLLM's thread.

Host staging (layer granularity only): a streamed request's blocks are copied into its pool slots layer by
layer during the forward, and pieces name the slots (staging.py ``reserve``; ``StagedCopies``).

Which requests stream: ``do_remote_decode`` with a transfer id (concurrent pairing: decode waits for it
while prefill computes) on an engine with ``stream_kv`` on, one KV cache group of full attention and no
Mamba state (the state exists only at the end); with host staging, only per layer and only when the pool
has room for the request when it starts. Others publish once, as before.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlink import trace
from kvlink.vllm.stager import both, event_pending

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSpec:
    """One step of a streamed request, scheduler -> worker: after this step's forward the first
    ``num_tokens`` tokens are in ``block_ids``, of which the first ``whole`` blocks were complete before it
    (layer-wise pieces announce the others layer by layer). ``last``: the step completes the prompt (no
    step-end piece: the published record follows); layer-wise, its ``block_ids`` end with the prompt's
    last, partial block, whose KV is final once the step's layers have written it."""

    request_id: str
    transfer_id: str
    index: int
    epoch: int
    num_tokens: int
    block_ids: tuple[int, ...]
    whole: int = 0
    last: bool = False
    # host staging: ``block_ids`` are the request's pool slots (what decode reads) and these its device
    # blocks, by position; the worker copies each layer of the step's new ones into the slots as it goes
    device_ids: tuple[int, ...] = ()
    prompt_sha: str | None = None  # the whole prompt's digest (params.prompt_digest), ``prompt_tokens`` tokens
    prompt_tokens: int = 0
    block_size: int = field(kw_only=True)


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
        if sp.prompt_sha is not None:
            out.update(prompt_sha=sp.prompt_sha, prompt_tokens=sp.prompt_tokens)
        if not self.layers:
            return dict(out, num_tokens=sp.num_tokens, block_ids=[list(sp.block_ids)])
        return dict(out, num_tokens=sp.whole * sp.block_size, block_ids=[list(sp.block_ids[:sp.whole])],
                    step_block_ids=[list(sp.block_ids[sp.whole:])], layers=self.layers)


def step_pieces(specs: list[StreamSpec], layer_wise: bool) -> list[Piece]:
    """After a step's forward: its blocks are whole (not for the chunk that completes the prompt)."""
    if not layer_wise:
        return [Piece(sp, sp.index) for sp in specs]
    return [Piece(sp, sp.index * LAYER_SLOTS + LAYER_SLOTS - 1) for sp in specs if not sp.last]


def layer_pieces(specs: list[StreamSpec], layers: int) -> list[Piece]:
    """During a step's forward: the step's new blocks hold every layer whose model index is below ``layers``
    (LayerClock). None for a count the wire index cannot order."""
    if not 1 <= layers < LAYER_SLOTS - 1:
        return []
    return [Piece(sp, sp.index * LAYER_SLOTS + layers, layers) for sp in specs]


@dataclass
class _Streamed:
    transfer_id: str
    prompt_tokens: int
    prompt_sha: str | None = None
    epoch: int = 0
    index: int = 0
    blocks: list[int] = field(default_factory=list)
    sent_blocks: int = 0  # blocks the last piece covered (full ones; the partial last one in the last chunk)
    scheduled: bool = False  # seen in a scheduler output since its (re)start


class StreamPlanner:
    """Scheduler side: which blocks of which streamed request each step completes. Pure."""

    def __init__(self, block_size: int, layer_wise: bool = False):
        self.block_size, self.layer_wise = block_size, layer_wise
        self._reqs: dict[str, _Streamed] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def track(self, rid: str, transfer_id: str, prompt_tokens: int, prompt_sha: str | None = None) -> None:
        """A streamed request was allocated blocks (again, after a preemption: a new epoch). ``prompt_sha``:
        its whole prompt's digest, which every piece carries (decode compares it before it reads)."""
        r = self._reqs.get(rid)
        if r is None:
            self._reqs[rid] = _Streamed(transfer_id, prompt_tokens, prompt_sha)
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
                    self.track(rid, r.transfer_id, r.prompt_tokens, r.prompt_sha)
                r.blocks, r.scheduled = list(blocks), True
                seen[rid] = computed
        for rid, blocks, resumed, computed in cached:
            r = self._reqs.get(rid)
            if r is None:
                continue
            if resumed:
                if r.scheduled:
                    self.track(rid, r.transfer_id, r.prompt_tokens, r.prompt_sha)
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
            # full blocks; layer-wise, the step that completes the prompt streams its partial block too
            full = min(-(-r.prompt_tokens // self.block_size) if last
                       else min(done, r.prompt_tokens) // self.block_size, len(r.blocks))
            # Whole (every layer in place) only what an earlier step of this request announced: a prefix-cache
            # hit may name blocks another request writes in this very forward (vLLM caches blocks when it
            # allocates them), so hits are claimed layer by layer like the step's own blocks.
            whole = min(computed // self.block_size, full, r.sent_blocks)
            if full <= max(r.sent_blocks, whole if self.layer_wise else 0):
                continue
            r.index += 1
            r.sent_blocks = full
            out.append(StreamSpec(rid, r.transfer_id, r.index, r.epoch,
                                  min(full * self.block_size, r.prompt_tokens), tuple(r.blocks[:full]), whole, last,
                                  prompt_sha=r.prompt_sha, prompt_tokens=r.prompt_tokens, block_size=self.block_size))
        return out


class LayerClock:
    """Prefill worker, one step's forward: which of this rank's layers have their KV in place. ``saved``
    returns the new ``layers`` of a piece (every layer of this rank whose model index is below it has
    saved, whatever order the forward ran them in), or None when that did not move."""

    def __init__(self, ids: dict[str, int]):
        self._ids, self._order = ids, sorted(set(ids.values()))
        self._saved: set[int] = set()
        self._next = 0

    def saved(self, name: str) -> int | None:
        i = self._ids.get(name)
        if i is None:
            return None
        self._saved.add(i)
        k = self._next
        while k < len(self._order) and self._order[k] in self._saved:
            k += 1
        if k == self._next:
            return None
        self._next = k
        return self._order[k] if k < len(self._order) else self._order[-1] + 1

    def reset(self) -> None:
        """The step's forward is over."""
        self._saved.clear()
        self._next = 0


class StagedCopies:
    """Prefill worker, streamed KV through the host staging pool: per request, the positions whose blocks
    are in their slots in every layer (at the request's epoch), so pieces claim only those as whole and the
    end-of-request copy skips them. Pure."""

    def __init__(self, layer_names):
        self.layer_names = frozenset(layer_names)
        self._prefix: dict[str, tuple[int, tuple[int, ...]]] = {}  # request -> (epoch, slots copied whole)
        self._step: dict[str, set[str]] = {}  # request -> layers copied in this step's forward

    def start(self, sp: StreamSpec) -> int:
        """The first position this step copies (all before it are whole in the pool at ``sp``'s epoch)."""
        epoch, slots = self._prefix.get(sp.request_id, (sp.epoch, ()))
        if epoch != sp.epoch or tuple(sp.block_ids[:len(slots)]) != slots:
            return 0  # restarted (or other slots): nothing copied so far counts
        return len(slots)

    def layer_copied(self, sp: StreamSpec, layer_name: str) -> None:
        self._step.setdefault(sp.request_id, set()).add(layer_name)

    def step_done(self, specs: list[StreamSpec]) -> set[str]:
        """After the forward: requests whose step's blocks were copied in every layer (now whole). One whose
        copy missed a layer is not: its pieces stop claiming more, and the end-of-request copy does it all."""
        whole = set()
        for sp in specs:
            if sp.device_ids and self._step.get(sp.request_id, set()) >= self.layer_names:
                self._prefix[sp.request_id] = (sp.epoch, tuple(sp.block_ids))
                whole.add(sp.request_id)
        self._step.clear()
        while len(self._prefix) > 65536:  # a backstop: the scheduler names the ones to forget (unstreamed)
            self._prefix.pop(next(iter(self._prefix)))
        return whole

    def take(self, rid: str, slots: tuple[int, ...]) -> int:
        """The request is staged into ``slots``: how many leading positions are in them already."""
        _, done = self._prefix.pop(rid, (0, ()))
        return len(done) if tuple(slots[:len(done)]) == done else 0

    def forget(self, rid: str) -> None:
        """The request's slots went back to the pool: nothing copied into them counts for it any more."""
        self._prefix.pop(rid, None)


class PrefillStream:
    """Prefill worker, vLLM's thread: after each attention layer and after each step's forward, which pieces
    of the step's streamed requests go out, and, with host staging, the copies into the pool they wait
    for (the worker owns the rest: bootstrap client, stager, statistics)."""

    def __init__(self, layer_wise: bool, layer_ids: dict[str, int] | None, kv_names: list[str], cuda: bool,
                 sender: "PieceSender", stager: Any = None):
        self.layer_wise = layer_wise and layer_ids is not None
        self.cuda, self.sender, self.stager = cuda, sender, stager
        self._clock = LayerClock(layer_ids or {})
        self._names = frozenset(kv_names)
        self.copies = StagedCopies(kv_names) if stager is not None else None
        self._layer_pos = {n: i for i, n in enumerate(kv_names)}  # the stager's layer order

    def layer_done(self, specs: list[StreamSpec], layer_name: str) -> None:
        """After attention layer ``layer_name`` of the step's forward."""
        fence = None
        if self.copies is not None and layer_name in self._names:
            fence, specs = self._copy_layer(specs, layer_name)
        layers = self._clock.saved(layer_name) if self.layer_wise else None
        if layers is not None:
            self._submit(layer_pieces(specs, layers), fence)

    def step_done(self, specs: list[StreamSpec]) -> None:
        """After the step's forward: its blocks are whole (a staged request's only if every layer was copied)."""
        self._clock.reset()
        whole = self.copies.step_done(specs) if self.copies is not None else set()
        fence = None
        if self.copies is not None and self.cuda:
            # The forward (vLLM's stream) and the layer copies into the pool (the stager's streams, which may
            # trail it): layer-wise, the last layer's piece waited for the copies already; without layer
            # pieces (no layer ids) nothing else would.
            fence = both(event_pending(self.stager.fence()), self.stager.marker())
        self._submit(step_pieces([sp for sp in specs if not sp.device_ids or sp.request_id in whole],
                                 self.layer_wise), fence)

    def _copy_layer(self, specs: list[StreamSpec], layer_name: str) -> tuple[Any, list[StreamSpec]]:
        """Copy this layer of each staged request's blocks not yet whole in its slots, on CUDA behind what
        vLLM queued so far. Returns (what the pieces wait for, the specs with ``whole`` at what is whole in
        the pool)."""
        li, fence, out = self._layer_pos[layer_name], None, []
        after = self.stager.fence()
        for sp in specs:
            if not sp.device_ids:
                out.append(sp)
                continue
            k = self.copies.start(sp)
            if k < len(sp.block_ids):
                fence = self.stager.to_pool(list(sp.device_ids[k:]), list(sp.block_ids[k:]), after, li)
            self.copies.layer_copied(sp, layer_name)
            out.append(dataclasses.replace(sp, whole=k) if k < sp.whole else sp)
        return (fence if self.stager.cuda else None), out

    def _submit(self, pieces: list[Piece], fence: Any) -> None:
        if not pieces:
            return
        if fence is None and self.cuda:
            import torch

            ev = torch.cuda.Event(blocking=True)  # the sender's wait sleeps rather than spins
            ev.record()  # behind what vLLM queued on the current stream (the layer, or the forward)
            fence = event_pending(ev)
        self.sender.submit(pieces, fence)


def _in_place(fence: Any, block: bool) -> bool:
    """Whether the device work behind ``fence`` is done (None: nothing to wait for); ``block`` waits for it.
    A fence that raises (a device error) counts as never done: its piece is not sent."""
    if fence is None:
        return True
    try:
        if block:
            fence.wait()
            return True
        return bool(fence.done())
    except Exception as e:  # noqa: BLE001 - a piece not sent costs overlap; one sent early, wrong tokens
        logger.warning("kvlink: waiting for streamed KV on the device failed (%s); its piece is not sent", e)
        return False


class PieceSender:
    """Worker side: one thread sends each step's pieces once that step's KV is in place."""

    def __init__(self, send: Callable[[list[Piece]], list[str]], count: Callable[[str, int], None]):
        self._send, self._count = send, count
        self._queue: queue.Queue = queue.Queue()
        self._ended: dict[str, None] = {}  # transfer ids the server said are over (bounded, oldest first)
        self._thread = threading.Thread(target=self._run, name="kvlink-stream", daemon=True)
        self._thread.start()

    def submit(self, pieces: list[Piece], fence: Any = None) -> None:
        """After a layer or the step's forward (vLLM's thread): ``fence`` says when the device work that puts
        these pieces' KV in place is done (``done()`` without blocking, ``wait()``: stager.Pending, on CUDA
        an event behind it), or is None when it is in place already (CPU)."""
        self._queue.put((pieces, fence))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        """Send in order, each piece as soon as its KV is in place. On a GPU vLLM's thread queues a whole
        forward's layers long before the device has run them: what queued is not sent together (that would
        wait for the last layer), but the first waiting item once its fence is done, with every item after it
        whose fence is done too (one call, the newest piece of each transfer)."""
        waiting: collections.deque = collections.deque()  # queued, not sent, in order
        closing = False
        while True:
            if not waiting:
                item = self._queue.get()
                if item is None:
                    return
                waiting.append(item)
            closing = self._drain(waiting, closing)
            first = waiting.popleft()
            if not _in_place(first[1], block=True):
                if closing and not waiting:
                    return  # (the close marker was taken already: waiting on the queue would never end)
                continue  # its device work failed: never announced (the record covers it, or nothing does)
            closing = self._drain(waiting, closing)  # what queued while we waited may be in place too
            ready = [first]
            while waiting and _in_place(waiting[0][1], block=False):
                ready.append(waiting.popleft())
            self._flush(ready)
            if closing and not waiting:
                return

    def _drain(self, waiting: collections.deque, closing: bool) -> bool:
        """Move whatever queued meanwhile into ``waiting``; True once the close marker was seen."""
        while not closing:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                closing = True
            else:
                waiting.append(nxt)
        return closing

    def _flush(self, batch: list) -> None:
        newest: dict[str, Any] = {}  # pieces are cumulative: the newest of each transfer says it all
        for step, _fence in batch:  # every fence here is done (_run)
            for p in step:
                if p.transfer_id not in self._ended and (p.transfer_id not in newest
                                                         or p.index > newest[p.transfer_id].index):
                    newest[p.transfer_id] = p
        pieces = list(newest.values())
        if not pieces:
            return
        if trace.enabled():
            trace.event("piece_send", pieces=[(p.transfer_id, p.index, p.layers, p.spec.epoch) for p in pieces])
        cpu = time.thread_time()
        try:
            ended = self._send(pieces)
        except ValueError as e:  # refused as malformed (InvalidField): one piece must not cost the others theirs
            if len(pieces) == 1 or not str(getattr(e, "field", "") or "").startswith("pieces"):
                self._count("pieces_failed", len(pieces))  # (a fault of the whole call: no piece alone helps)
                logger.debug("kvlink: %d streamed pieces refused: %s", len(pieces), e)
                return
            ended = []
            for p in pieces:
                try:
                    ended += self._send([p]) or []
                except Exception as e1:  # noqa: BLE001 - as below
                    self._count("pieces_failed", 1)
                    logger.debug("kvlink: streamed piece of transfer %s not sent: %s", p.transfer_id, e1)
                    pieces = [q for q in pieces if q is not p]
        except Exception as e:  # noqa: BLE001 - a lost piece costs overlap, never correctness
            self._count("pieces_failed", len(pieces))
            logger.debug("kvlink: sending %d streamed pieces failed: %s", len(pieces), e)
            return
        trace.event("piece_sent", n=len(pieces), ended=len(ended or ()), cpu_ms=1e3 * (time.thread_time() - cpu))
        self._count("pieces_sent", len(pieces))
        if ended:
            self._count("pieces_ended", len(ended))
            for tid in ended:
                self._ended[tid] = None
            while len(self._ended) > 65536:
                self._ended.pop(next(iter(self._ended)))
