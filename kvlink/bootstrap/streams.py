"""Streamed KV: how far prefill has got with requests it is still computing, by transfer id. Pure logic
against the caller's clock; the pairing table owns one (no sockets, no threads).

Each prefill rank reports pieces. A piece says: the KV of the first ``num_tokens`` tokens is in place in
these full blocks (by position, one list per KV cache group), at this ``epoch`` (the request's (re)start
count on prefill: a preempted request starts again, maybe in other blocks). Pieces are cumulative, so a
lost piece costs nothing and a late one is stale. Per rank:

- an ``index`` at or below the last one applied is a duplicate: the first arrival wins, the copy is
  counted and changes nothing (indices only grow, across chunks and restarts alike);
- an ``epoch`` below the rank's is stale: counted, ignored;
- a piece for a transfer whose stream has ended (prefill published the whole request, or abandoned it,
  or decode stopped waiting) is dropped and counted, and the answer names the transfer, so prefill stops
  sending for it;
- a piece naming a transfer id that another request (or engine) streams under is refused
  (``StreamConflict``): the pairing table counts it and answers that transfer "ended" too, while the other
  pieces of the call apply.

Layer-wise pieces (sent per layer while a step computes) add the running step's further blocks
(``step_block_ids``: full ones, and in the step that completes the prompt its last, partial one) and ``layers``: those blocks hold their KV in every layer whose index (the model's,
the same on every rank and stage) is below it. A rank's progress orders as (``num_tokens``, ``layers``):
within a step layers grow, and the step's end moves ``num_tokens`` on with ``layers`` back to 0.

Decode sees one merged progress: once every rank of the engine has reported at the same epoch, the
lowest rank by that order (the minimum is what every rank has: a TP rank lagging, or a PP stage that has
not reached the step's layers yet, holds it back; a later stage's layer index counts the earlier stages'
layers, which its forward needed done). ``version`` grows with every change, so a long poll asks for
"newer than the version I have"; ``block_version`` grows only when the whole blocks change, for a
reader that does not take layer-wise progress. The end of the stream is the published record itself
(the pairing table's ``publish``): it never repeats the tail as a piece.
"""

from __future__ import annotations

import collections
import dataclasses
import enum


class PieceStatus(str, enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE = "stale"
    ENDED = "ended"


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    """The merged progress decode sees: tokens every rank has in place, and their blocks per group."""

    engine_id: str
    request_id: str
    version: int
    epoch: int
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    block_version: int = 0
    step_block_ids: tuple[tuple[int, ...], ...] = ()
    layers: int = 0
    prompt_sha: str | None = None  # the whole prompt's digest, as the stream's first piece gave it
    prompt_tokens: int = 0


@dataclasses.dataclass(slots=True)
class _Rank:
    index: int
    epoch: int
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    step_block_ids: tuple[tuple[int, ...], ...] = ()
    layers: int = 0

    @property
    def order(self) -> tuple[int, int]:
        return self.num_tokens, self.layers


@dataclasses.dataclass(slots=True, eq=False)
class _Stream:
    engine_id: str
    request_id: str
    ranks: int
    touched: float
    by_rank: dict[int, _Rank] = dataclasses.field(default_factory=dict)
    progress: Progress | None = None
    version: int = 0
    block_version: int = 0
    prompt: tuple[str | None, int] = (None, 0)  # (digest, tokens) of the prompt, from the first piece with one


@dataclasses.dataclass(slots=True)
class StreamStats:
    pieces: int = 0
    duplicates: int = 0
    stale: int = 0
    dropped: int = 0  # for a stream that had ended
    stopped: int = 0  # streams decode stopped


class StreamConflict(ValueError):
    """A piece names a transfer id that another request (or engine) streams under."""


class StreamBook:
    """Live streams by transfer id, and a bounded, time-limited memory of ended ones."""

    def __init__(self, max_streams: int = 50_000, ttl_s: float = 600.0) -> None:
        self.max_streams, self.ttl_s = max_streams, ttl_s
        self.stats = StreamStats()
        self._live: collections.OrderedDict[str, _Stream] = collections.OrderedDict()  # least recently touched first
        self._ended: collections.OrderedDict[str, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def piece(self, engine_id: str, rank: int, ranks: int, transfer_id: str, request_id: str, index: int,
              epoch: int, num_tokens: int, block_ids: list[list[int]], now: float,
              step_block_ids: list[list[int]] = (), layers: int = 0, prompt_sha: str | None = None,
              prompt_tokens: int = 0) -> PieceStatus:
        """Apply one piece of rank ``rank`` (of ``ranks``); see the module docstring for the rules."""
        if transfer_id in self._ended:
            self.stats.dropped += 1
            return PieceStatus.ENDED
        stream = self._live.get(transfer_id)
        if stream is None:
            self._sweep(now)
            if len(self._live) >= self.max_streams:  # the oldest stream is forgotten: decode falls back to the
                oldest = next(iter(self._live))  # published record, which it waits for anyway
                del self._live[oldest]
            stream = self._live[transfer_id] = _Stream(engine_id, request_id, ranks, now)
        elif (stream.engine_id, stream.request_id, stream.ranks) != (engine_id, request_id, ranks):
            raise StreamConflict(f"transfer id {transfer_id!r} streams request {stream.request_id!r} of engine "
                                 f"{stream.engine_id!r} ({stream.ranks} ranks)")
        stream.touched = now
        self._live.move_to_end(transfer_id)
        if prompt_sha is not None and stream.prompt[0] is None:
            stream.prompt = (prompt_sha, prompt_tokens)
        last = stream.by_rank.get(rank)
        if last is not None and index <= last.index:
            self.stats.duplicates += 1
            return PieceStatus.DUPLICATE
        if last is not None and epoch < last.epoch:
            self.stats.stale += 1
            return PieceStatus.STALE
        step = tuple(tuple(g) for g in step_block_ids) if layers and any(step_block_ids) else ()
        stream.by_rank[rank] = _Rank(index, epoch, num_tokens, tuple(tuple(g) for g in block_ids), step,
                                     layers if step else 0)
        self.stats.pieces += 1
        self._merge(stream)
        return PieceStatus.APPLIED

    def progress(self, transfer_id: str) -> Progress | None:
        stream = self._live.get(transfer_id)
        return stream.progress if stream is not None else None

    def ended(self, transfer_id: str) -> bool:
        return transfer_id in self._ended

    def owner(self, transfer_id: str) -> tuple[str, str] | None:
        """The (engine id, request id) streaming ``transfer_id``, if a stream of it is live."""
        stream = self._live.get(transfer_id)
        return (stream.engine_id, stream.request_id) if stream is not None else None

    def end_engine(self, engine_id: str, now: float) -> list[str]:
        """The engine's process is gone (a rank re-registered elsewhere, or it expired): what it streamed
        names blocks of a process that no longer holds them. Returns the transfer ids ended."""
        tids = [t for t, st in self._live.items() if st.engine_id == engine_id]
        for tid in tids:
            self.end(tid, now)
        return tids

    def end(self, transfer_id: str, now: float) -> None:
        """The stream is over (published whole, abandoned): later pieces are dropped."""
        self._live.pop(transfer_id, None)
        self._ended[transfer_id] = now
        self._ended.move_to_end(transfer_id)
        self._sweep(now)

    def stop(self, transfer_id: str, now: float) -> bool:
        """Decode no longer waits for this transfer: prefill's next pieces are answered "ended". Returns
        True if it had already ended."""
        was = transfer_id in self._ended
        if not was:
            self.stats.stopped += 1
        self.end(transfer_id, now)
        return was

    def sweep(self, now: float) -> None:
        self._sweep(now)

    # ----- internals --------------------------------------------------------------------------------------

    def _merge(self, stream: _Stream) -> None:
        if len(stream.by_rank) < stream.ranks:
            return  # a rank has not reported yet: it may not have the KV in place
        epochs = {r.epoch for r in stream.by_rank.values()}
        if len(epochs) != 1:
            return  # ranks disagree (a restart reaches them one by one): wait until they agree
        low = min(stream.by_rank.values(), key=lambda r: r.order)
        old = stream.progress
        whole = (low.epoch, low.num_tokens, low.block_ids)
        if old is not None and (old.epoch, old.num_tokens, old.block_ids) == whole:
            if (old.step_block_ids, old.layers) == (low.step_block_ids, low.layers):
                return
        else:
            stream.block_version += 1
        stream.version += 1
        stream.progress = Progress(stream.engine_id, stream.request_id, stream.version, low.epoch,
                                   low.num_tokens, low.block_ids, stream.block_version, low.step_block_ids,
                                   low.layers, *stream.prompt)

    def _sweep(self, now: float) -> None:
        # Live streams nobody touched for ttl_s: prefill died without abandoning them (oldest first: the loop
        # stops at the first recent one, so a new stream costs no scan of the others).
        while self._live and now - next(iter(self._live.values())).touched >= self.ttl_s:
            self._live.popitem(last=False)
        while self._ended and (len(self._ended) > self.max_streams
                               or now - next(iter(self._ended.values())) >= self.ttl_s):
            self._ended.popitem(last=False)
