"""The pairing table: engines, published requests, leases, outcomes. Pure logic against an injected clock.

No sockets, no asyncio, no threads: the HTTP adapter calls it from its event loop thread only (the table is
not thread-safe), and tests drive it with a fake clock. Every public call first expires what is due, so the
answers never show a lease that has run out.

Lifecycle of a request (keyed by ``(engine_id, request_id)``, optionally also by a global ``transfer_id``)::

    publish -> live --release(pulled|abandoned)--> tombstone "released" + outcome for the engine
                    --lease runs out------------> tombstone "expired"  + outcome "expired"
                    --engine lease runs out, or the engine re-registers at a new address or from a new
                      process instance      --> tombstone "expired" (no outcome: the engine is gone/new)

An id that ended stays ended while its tombstone lasts: publishing it again is refused (410), so a retry
that lands late never revives blocks prefill freed, nor answers a decode that was told the id is gone.

Tombstones are a bounded, time-limited memory (oldest forgotten first), so a lookup can answer "expired"
or "released" instead of "unknown" for a while and memory stays flat. Outcomes wait per engine until the
engine acknowledges them by sequence number (``poll_released(ack=...)``), so a lost answer loses nothing.

Leases use one heap per kind holding the live object; a renewal only moves ``expires_at`` and the stale heap
entry is pushed again when it surfaces, so each live item has exactly one heap entry.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import secrets
import time
from collections.abc import Callable, Iterable

from kvlink.bootstrap.config import TableLimits
from kvlink.bootstrap.errors import (
    Conflict,
    InvalidField,
    RequestExpired,
    RequestGone,
    RequestReleased,
    TableFull,
    UnknownEngine,
    UnknownRequest,
)
from kvlink.bootstrap.streams import PieceStatus, Progress, StreamBook, StreamConflict
from kvlink.bootstrap.schema import (
    PREFILL_HOLD_LEASES,
    EngineRegistration,
    LookupAnswer,
    Outcome,
    RELEASE_OUTCOMES,
    PollReleasedAnswer,
    ReleasedRequest,
    RenewAnswer,
    RequestRecord,
    RequestStatus,
)

MAX_OUTCOMES_PER_POLL = 10_000

RankIndex = tuple[int, int, int]  # (dp_rank, tp_rank, pp_rank)


@dataclasses.dataclass(slots=True, eq=False)
class _Rank:
    registration: EngineRegistration
    lease_s: float
    expires_at: float


MAX_READERS = 8  # decode engines named as readers of one request


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    engine_id: str
    request_id: str
    transfer_id: str | None
    block_ids: list[list[int]]
    num_tokens: int
    expires_at: float
    epoch: int = 0
    prompt_sha: str | None = None
    lease_s: float = 0.0  # what prefill published it with: the most a renewal may promise decode
    launch: str | None = None  # the publisher's start (RequestRecord.launch)
    published_at: float = 0.0
    handed: bool = False  # a reader (decode) looked it up or renewed it: it may be reading the blocks
    doomed: bool = False  # the router released it while a reader may read: readers hear "released", the
    # outcome waits for the lease the reader was given (release)
    # The readers it was handed to (None: one that names none), until each releases it; beyond MAX_READERS
    # only None is added (any named reader's release then waits)
    readers: set[str | None] = dataclasses.field(default_factory=set)
    released: Outcome | None = None  # a reader released it while another may still read: the outcome waits
    done: set[str] = dataclasses.field(default_factory=set)  # named readers that released it (not handed again)


@dataclasses.dataclass(slots=True, eq=False)
class _Engine:
    engine_id: str
    ranks: dict[RankIndex, _Rank] = dataclasses.field(default_factory=dict)
    requests: dict[str, _Request] = dataclasses.field(default_factory=dict)
    outcomes: collections.deque[ReleasedRequest] = dataclasses.field(default_factory=collections.deque)
    polled_at: float | None = None  # prefill's last poll for outcomes (renew: what prefill still honours)


@dataclasses.dataclass(slots=True)
class TableStats:
    """Monotonic counters, read by the metrics collector at scrape time (no cost per request)."""

    engines_registered: int = 0
    engines_expired: int = 0
    published: int = 0
    looked_up: int = 0
    expired: int = 0
    released_pulled: int = 0
    released_abandoned: int = 0
    releases_deferred: int = 0  # router releases held until the lease a reader was given ran out
    renewals_capped: int = 0  # renewals refused: prefill would not hold the blocks that long
    transfers_abandoned: int = 0
    outcomes_dropped: int = 0
    conflicts: int = 0
    refused_full: int = 0


_LAYOUT_FIELDS = ("dp_size", "tp_size", "pp_size", "protocol_version", "compat_hash", "layers")
_ENGINE_WIDE_FIELDS = ("dp_size", "tp_size", "pp_size", "protocol_version", "compat_hash")


class PairingTable:
    """Registered engine ranks and published requests with their leases. See the module docstring."""

    def __init__(
        self,
        limits: TableLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        server_id: str | None = None,
    ) -> None:
        self.limits = limits or TableLimits()
        self.clock = clock
        self.server_id = server_id or secrets.token_hex(8)
        self.stats = TableStats()
        self.on_publish: Callable[[RequestRecord], None] | None = None
        """Called after each new publish; the HTTP adapter wakes its long polls with it."""
        self.on_transfer_end: Callable[[str], None] | None = None
        """Called with a transfer id that was abandoned before anything was published under it."""
        self.on_progress: Callable[[str], None] | None = None
        """Called with a transfer id whose streamed progress moved (pieces)."""
        self.streams = StreamBook(self.limits.max_tombstones, self.limits.tombstone_ttl_s)
        self._engines: dict[str, _Engine] = {}
        self._transfers: dict[str, _Request] = {}
        self._rank_heap: list[tuple[float, int, _Rank]] = []
        self._request_heap: list[tuple[float, int, _Request]] = []
        self._tie = itertools.count()
        # Outcome sequence numbers, one count for the whole table: an engine dropped and registered again
        # under the same id (its lease lapsed) must not reuse numbers its poller already acknowledged.
        self._seq = itertools.count(1)
        self._tombstones: collections.OrderedDict[tuple[str, str], tuple[RequestStatus, float]] = (
            collections.OrderedDict()
        )
        self._transfer_tombstones: collections.OrderedDict[str, tuple[RequestStatus, float]] = (
            collections.OrderedDict()
        )

    # ----- sizes ------------------------------------------------------------------------------------------

    @property
    def num_engine_ranks(self) -> int:
        return sum(len(e.ranks) for e in self._engines.values())

    @property
    def num_requests(self) -> int:
        return sum(len(e.requests) for e in self._engines.values())

    @property
    def num_tombstones(self) -> int:
        return len(self._tombstones) + len(self._transfer_tombstones)

    @property
    def num_pending_outcomes(self) -> int:
        return sum(len(e.outcomes) for e in self._engines.values())

    # ----- engines ----------------------------------------------------------------------------------------

    def register_engine(self, registration: EngineRegistration, lease_s: float) -> bool:
        """Register or renew one rank; True when the rank was new. Conflict if its layout changed; TableFull
        beyond max_engines or max_ranks_per_engine. The same rank from a new process (another transport
        address, or another ``instance``) drops what the old process published and streamed."""
        now = self._sweep()
        lease_s = self._lease(lease_s)
        rank_index = (registration.dp_rank, registration.tp_rank, registration.pp_rank)
        engine = self._engines.get(registration.engine_id)
        if engine is None:
            if len(self._engines) >= self.limits.max_engines:
                self.stats.refused_full += 1
                raise TableFull(f"this server already keeps {len(self._engines)} engines (max_engines); engine "
                                f"{registration.engine_id!r} is refused until one unregisters or expires",
                                field="registration.engine_id")
            engine = self._engines[registration.engine_id] = _Engine(registration.engine_id)
        existing = engine.ranks.get(rank_index)
        if existing is not None:
            old = existing.registration
            if not old.same_layout(registration):
                self.stats.conflicts += 1
                field = next(f for f in _LAYOUT_FIELDS if getattr(old, f) != getattr(registration, f))
                raise Conflict(
                    f"rank {rank_index} of engine {registration.engine_id!r} is registered with another "
                    f"{field}; it is replaced only after its lease runs out",
                    field=f"registration.{field}",
                )
            # (launch: a registrant without an instance restarted at the same address says so by its launch)
            new_instance = ((registration.instance is not None and registration.instance != old.instance)
                            or (registration.launch is not None and registration.launch != old.launch))
            if old.transport_addr != registration.transport_addr or new_instance:
                # A new process behind the same engine id (at a new address, or a restart at a fixed port
                # that says so by its instance): the block ids published by the old one mean nothing in the
                # new one, so pulling them would read someone else's KV cache.
                self._drop_requests(engine, now)
                existing.registration = registration
            existing.lease_s = lease_s
            existing.expires_at = now + lease_s
            return False
        for other in engine.ranks.values():
            for field in _ENGINE_WIDE_FIELDS:
                if getattr(other.registration, field) != getattr(registration, field):
                    self.stats.conflicts += 1
                    raise Conflict(
                        f"engine {registration.engine_id!r} has live ranks with another {field}",
                        field=f"registration.{field}",
                    )
            break
        if len(engine.ranks) >= self.limits.max_ranks_per_engine:
            self.stats.refused_full += 1
            raise TableFull(f"engine {registration.engine_id!r} already has {len(engine.ranks)} live ranks "
                            f"(max_ranks_per_engine); rank {rank_index} is refused, nothing stored",
                            field="registration.engine_id")
        rank = _Rank(registration, lease_s, now + lease_s)
        engine.ranks[rank_index] = rank
        heapq.heappush(self._rank_heap, (rank.expires_at, next(self._tie), rank))
        self.stats.engines_registered += 1
        return True

    def heartbeat(self, engine_id: str, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0,
                  instance: str | None = None) -> float:
        """Renew a rank's lease by the length it registered with; UnknownEngine if it is not live. Conflict,
        nothing renewed, when ``instance`` names another process than the one registered (the rank was
        registered again by its replacement: the old process must not keep the new one's lease alive)."""
        now = self._sweep()
        rank = self._rank(engine_id, (dp_rank, tp_rank, pp_rank))
        registered = rank.registration.instance
        if instance is not None and registered is not None and instance != registered:
            self.stats.conflicts += 1
            raise Conflict(f"rank {(dp_rank, tp_rank, pp_rank)} of engine {engine_id!r} is registered by another "
                           f"process (instance {registered!r}, not {instance!r}): this one was replaced",
                           field="instance")
        rank.expires_at = now + rank.lease_s
        return rank.lease_s

    def unregister_engine(self, engine_id: str, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> bool:
        """Remove a rank now (graceful shutdown); idempotent. The last rank takes the engine's requests."""
        now = self._sweep()
        engine = self._engines.get(engine_id)
        if engine is None or engine.ranks.pop((dp_rank, tp_rank, pp_rank), None) is None:
            return False
        if not engine.ranks:
            self._drop_engine(engine, now)
        return True

    def get_engine(self, engine_id: str, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> EngineRegistration:
        self._sweep()
        return self._rank(engine_id, (dp_rank, tp_rank, pp_rank)).registration

    def engine_ranks(self, engine_id: str) -> list[EngineRegistration]:
        """All live ranks of an engine, ordered by (dp, tp, pp) rank."""
        self._sweep()
        engine = self._engine(engine_id)
        return [engine.ranks[k].registration for k in sorted(engine.ranks)]

    # ----- requests ---------------------------------------------------------------------------------------

    def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: list[list[int]],
        num_tokens: int,
        lease_s: float | None = None,
        transfer_id: str | None = None,
        epoch: int = 0,
        prompt_sha: str | None = None,
        launch: str | None = None,
    ) -> RequestRecord:
        """Publish a finished prefill request. The same publish again renews it while it is live; a different
        one conflicts. A request id or transfer id that already ended (its tombstone says released or
        expired) is refused with RequestReleased / RequestExpired, nothing stored. It ends the request's
        stream of pieces, if it had one (streams.py). Conflict, nothing stored, from another ``launch``
        than the engine's live ranks' (_check_launch)."""
        now = self._sweep()
        engine = self._engine(engine_id)
        self._check_launch(engine, launch, f"request {request_id!r}")
        _check_blocks(engine, block_ids, "block_ids")
        lease_s = self._lease(self.limits.default_request_lease_s if lease_s is None else lease_s)
        existing = engine.requests.get(request_id)
        if existing is not None:
            if (existing.transfer_id, existing.block_ids, existing.num_tokens, existing.prompt_sha) != (
                transfer_id,
                block_ids,
                num_tokens,
                prompt_sha,
            ):
                self.stats.conflicts += 1
                raise Conflict(f"request {request_id!r} is already published with other content", field="request_id")
            # a retried publish renews; it never shortens what a renewal promised decode (prefill would free
            # blocks decode believes are held)
            existing.expires_at = max(existing.expires_at, now + lease_s)
            return self._record(existing, now)
        tomb = self._tombstones.get((engine_id, request_id))
        if tomb is not None:
            raise _gone(tomb[0], f"request {request_id!r} of engine {engine_id!r}", "request_id")
        tomb = self._transfer_tombstones.get(transfer_id) if transfer_id is not None else None
        if tomb is not None:
            raise _gone(tomb[0], f"transfer id {transfer_id!r}", "transfer_id")
        if transfer_id is not None and transfer_id in self._transfers:
            self.stats.conflicts += 1
            raise Conflict(f"transfer id {transfer_id!r} is bound to another live request", field="transfer_id")
        owner = self.streams.owner(transfer_id) if transfer_id is not None else None
        if owner is not None and owner != (engine_id, request_id):
            # (a retried prefill leg: the same id twice) decode may have read, even computed over, the streamed
            # request's blocks already; another request's record must not end that stream as if it were its own
            self.stats.conflicts += 1
            raise Conflict(f"transfer id {transfer_id!r} is streamed by request {owner[1]!r} of engine "
                           f"{owner[0]!r}: nothing stored", field="transfer_id")
        if len(engine.requests) >= self.limits.max_requests_per_engine:
            self.stats.refused_full += 1
            raise TableFull(f"engine {engine_id!r} already has {len(engine.requests)} published requests "
                            "(max_requests_per_engine): request refused, nothing stored", field="request_id")
        request = _Request(engine_id, request_id, transfer_id, block_ids, num_tokens, now + lease_s, epoch,
                           prompt_sha, lease_s, launch, published_at=now)
        engine.requests[request_id] = request
        if transfer_id is not None:
            self._transfers[transfer_id] = request
            self.streams.end(transfer_id, now)
        heapq.heappush(self._request_heap, (request.expires_at, next(self._tie), request))
        self.stats.published += 1
        record = self._record(request, now)
        if self.on_publish is not None:
            self.on_publish(record)
        return record

    def lookup(self, engine_id: str, request_ids: Iterable[str]) -> LookupAnswer:
        """Grouped lookup: each distinct id lands in exactly one of ready/expired/released/unknown. Prefill's
        reconcile asks it what the server still holds, decode beside a renewal whether the record is the one
        its params name: it hands nothing to a reader (the renewal does), and a request a router released
        while its reader's lease runs (``release``) is still held."""
        now = self._sweep()
        engine = self._engine(engine_id)
        ready: list[RequestRecord] = []
        expired: list[str] = []
        released: list[str] = []
        unknown: list[str] = []
        by_status = {RequestStatus.EXPIRED: expired, RequestStatus.RELEASED: released}
        for request_id in dict.fromkeys(request_ids):
            request = engine.requests.get(request_id)
            if request is not None:  # (a router's release still deferred: held, as prefill must keep seeing it)
                ready.append(self._record(request, now))
                continue
            tomb = self._tombstones.get((engine_id, request_id))
            (by_status[tomb[0]] if tomb is not None else unknown).append(request_id)
        self.stats.looked_up += len(ready) + len(expired) + len(released) + len(unknown)
        return LookupAnswer(ready=ready, expired=expired, released=released, unknown=unknown)

    def lookup_transfer(self, transfer_id: str, after: int | None = None,
                        layers: bool = False, peek: bool = False, reader: str | None = None) -> RequestRecord | RequestStatus:
        """The published record; else, with ``after`` (streamed KV), prefill's progress once its version
        is above ``after`` (a partial record, no lease; with ``layers``, layer-wise progress too, else
        whole blocks only, versioned by them); else what is known of the id. ``peek``: the caller looks
        without reading (the router before it releases, decode before it reports it done): the record is not
        handed to a reader, and one a router released while a reader's lease runs (``release``) is still
        answered, so decode can report it and prefill free it at once. ``reader``: the decode engine handed
        the record (``release``)."""
        now = self._sweep()
        self.stats.looked_up += 1
        request = self._transfers.get(transfer_id)
        if request is not None and not peek and (request.doomed or reader is not None and reader in request.done):
            return RequestStatus.RELEASED  # (the router gave it up, or this reader released it already)
        if request is not None:
            if not peek:
                _hand(request, reader)
            return self._record(request, now)
        tomb = self._transfer_tombstones.get(transfer_id)
        if tomb is not None:
            return tomb[0]
        if after is not None:
            progress = self.streams.progress(transfer_id)
            if progress is not None and (progress.version if layers else progress.block_version) > after:
                engine = self._engines.get(progress.engine_id)
                return _partial(transfer_id, progress, layers, _launch_of(engine) if engine else None)
        return RequestStatus.UNKNOWN

    # ----- streamed KV ------------------------------------------------------------------------------------

    def stream_pieces(self, engine_id: str, rank: int, ranks: int, pieces: Iterable,
                      launch: str | None = None) -> list[str]:
        """One prefill rank's pieces (schema.StreamPiece); returns the transfer ids whose stream is over,
        so that rank stops sending for them. Rules: streams.py. A piece whose transfer id another request
        (or engine) streams under is not applied: counted as a conflict and its id returned as over, while
        the call's other pieces apply. Conflict, nothing applied, from another ``launch`` than the engine's
        live ranks' (_check_launch)."""
        now = self._sweep()
        engine = self._engine(engine_id)
        self._check_launch(engine, launch, "streamed pieces")
        reg = next(iter(engine.ranks.values())).registration if engine.ranks else None
        if reg is not None and ranks != reg.tp_size * reg.pp_size:
            raise InvalidField(f"ranks={ranks}, but engine {engine_id!r} registered TP={reg.tp_size} x "
                               f"PP={reg.pp_size} ranks", field="ranks")
        if reg is not None and not 0 <= rank < ranks:
            raise InvalidField(f"rank {rank} is not one of the engine's {ranks} ranks", field="rank")
        ended: dict[str, None] = {}  # ordered, each id once
        pieces = list(pieces)
        for i, p in enumerate(pieces):
            _check_blocks(engine, p.block_ids, f"pieces[{i}].block_ids")
            _check_blocks(engine, p.step_block_ids, f"pieces[{i}].step_block_ids")
        for p in pieces:
            tid = p.transfer_id
            if (tid in self._transfers or tid in self._transfer_tombstones) and not self.streams.ended(tid):
                self.streams.end(tid, now)  # published (or abandoned) already: the piece came late
            try:
                status = self.streams.piece(engine_id, rank, ranks, tid, p.request_id, p.index, p.epoch,
                                            p.num_tokens, p.block_ids, now, p.step_block_ids, p.layers,
                                            p.prompt_sha, p.prompt_tokens)
            except StreamConflict:
                self.stats.conflicts += 1
                ended[tid] = None
                continue
            if status is PieceStatus.ENDED:
                ended[tid] = None
            elif status is PieceStatus.APPLIED and self.on_progress is not None:
                self.on_progress(tid)
        return list(ended)

    def stop_stream(self, transfer_id: str) -> bool:
        """Decode gave the request up: prefill's later pieces for it are dropped (and it is told so)."""
        return self.streams.stop(transfer_id, self._sweep())

    def has_engine(self, engine_id: str) -> bool:
        self._sweep()
        return engine_id in self._engines

    def renew(self, engine_id: str, request_ids: Iterable[str], lease_s: float,
              reader: str | None = None) -> RenewAnswer:
        """Extend the leases of live requests (decode is still pulling); reports the ids it could not renew.

        A request is renewed by ``lease_s`` but never by more than prefill published it with: prefill keeps
        its blocks on the strength of its own lease (held.py: a renewal the server took promises decode at
        most that much), so a decode asking for longer must not be told it has it. Nor beyond what prefill
        honours when it cannot reach this server (``_hold_cap``): a request past that is reported expired
        (decode trusts no READ on it from then on). ``lease_s`` in the answer, only where some request got
        less than asked: the least any got (decode trusts that much from when it asked). A request the
        router released while a reader may read (``release``) is reported released. ``reader``: the decode
        engine renewing (``release``)."""
        now = self._sweep()
        engine = self._engine(engine_id)
        lease_s = self._lease(lease_s)
        renewed: list[str] = []
        expired: list[str] = []
        released: list[str] = []
        unknown: list[str] = []
        least: float | None = None
        by_status = {RequestStatus.EXPIRED: expired, RequestStatus.RELEASED: released}
        for request_id in dict.fromkeys(request_ids):
            request = engine.requests.get(request_id)
            if request is not None and (request.doomed or reader is not None and reader in request.done):
                released.append(request_id)  # (the router gave it up, or this reader released it already)
                continue
            if request is not None:
                granted = min(lease_s, request.lease_s, self._hold_cap(engine, request) - now)
                if granted <= 0:  # prefill may free it before any lease given now ends: no trust from here on
                    self.stats.renewals_capped += 1
                    expired.append(request_id)
                    continue
                request.expires_at = max(request.expires_at, now + granted)
                _hand(request, reader)
                renewed.append(request_id)
                least = granted if least is None else min(least, granted)
                continue
            tomb = self._tombstones.get((engine_id, request_id))
            (by_status[tomb[0]] if tomb is not None else unknown).append(request_id)
        return RenewAnswer(renewed=renewed, expired=expired, released=released, unknown=unknown,
                           lease_s=least if least is not None and least < lease_s else None)

    def release(self, engine_id: str, request_id: str, outcome: Outcome, router: bool = False,
                reader: str | None = None) -> bool:
        """Decode is done with a request. Returns True if it was already released (idempotent; the first
        outcome wins). RequestExpired if its lease ran out first: the blocks may have been reused.

        ``router``: the caller is not the reader but the router (the proxy), which gives up a request whose
        client left or whose decode leg failed. Its decode may still be reading the blocks, on the strength
        of a lease this server gave it (a transfer lookup or a renewal), and hear of the abort only later. So
        once a reader was handed the request, a router's release is deferred: readers hear "released" from now
        on (no transfer lookup or renewal trusts it again), and prefill gets the outcome (and frees the blocks)
        when the lease given out runs out, or at once when the reader releases it itself; until then grouped
        lookups, prefill's reconcile among them, see it held.

        ``reader``: the decode engine releasing (its id and start). Several engines may read one request (a
        request's samples spread over decode's data-parallel engines, a decode leg retried on another replica);
        one's release must not free the blocks under another's READ, trusted on a lease this server gave it.
        So while another reader was handed it and a lease given out runs, the release waits (the request stays
        live; the others renew as before): prefill gets the first outcome when the last reader handed it
        releases it, or when the lease runs out. A release naming no reader (an older decode) counts as one
        reader: it frees at once unless a reader that named itself was handed it."""
        now = self._sweep()
        if not isinstance(outcome, Outcome) or outcome not in RELEASE_OUTCOMES:  # "pulled" == PULLED: check the type
            raise InvalidField(f"outcome must be pulled or abandoned, not {outcome!r}", field="outcome")
        engine = self._engine(engine_id)
        live = engine.requests.get(request_id)
        if live is not None and (live.doomed or live.released is not None):
            if not router:  # a reader is done with it: the last frees it (the first outcome stands)
                others = _other_readers(live, reader)
                _done(live, reader)
                if not others:
                    del engine.requests[request_id]
                    self._end(engine, live, RequestStatus.RELEASED, live.released or Outcome.ABANDONED, now)
            elif live.released is not None and live.handed:  # the router gives up the readers still reading
                live.doomed = True
            return True
        if live is not None and router and live.handed and live.expires_at > now:
            live.doomed = True
            self.stats.released_abandoned += 1
            self.stats.releases_deferred += 1
            return False
        if live is not None and not router and live.expires_at > now and _other_readers(live, reader):
            if reader is not None and reader not in live.readers and None not in live.readers:
                return False  # never handed it (aborted first, a local hit): the readers' releases decide
            live.released = outcome
            _done(live, reader)
            self.stats.releases_deferred += 1
            if outcome is Outcome.PULLED:
                self.stats.released_pulled += 1
            else:
                self.stats.released_abandoned += 1
            return False
        request = engine.requests.pop(request_id, None)
        if request is None:
            tomb = self._tombstones.get((engine_id, request_id))
            if tomb is None:
                raise UnknownRequest(f"request {request_id!r} of engine {engine_id!r} is unknown", field="request_id")
            if tomb[0] is RequestStatus.EXPIRED:
                raise RequestExpired(
                    f"request {request_id!r} expired before it was released; its blocks may have been reused",
                    field="request_id",
                )
            return True
        self._end(engine, request, RequestStatus.RELEASED, outcome, now)
        if outcome is Outcome.PULLED:
            self.stats.released_pulled += 1
        else:
            self.stats.released_abandoned += 1
        return False

    def abandon_transfer(self, engine_id: str | None, transfer_id: str, request_id: str | None = None) -> bool:
        """Give up a transfer id: prefill's request was aborted (maybe before it published anything), or,
        with no ``engine_id``, whoever chose the id (the proxy) knows nothing will be published under it.

        Leaves a "released" transfer tombstone, so a decode waiting for the id, or asking later, hears 410
        ``released`` at once instead of waiting for its own deadline. A live request of this engine bound
        to the id is released as abandoned (its outcome queued like any release), unless ``request_id``
        names another request: prefill abandons only its own (several requests may share an id, and one
        refused publish must not release the one holding it). Conflict, nothing changed, when the id is
        bound to or streamed by another engine or (``request_id``) another request, or, without
        ``engine_id``, bound to or streamed by any. Idempotent: returns True when the id had already ended.
        A request a reader was handed is released as a router's release is (``release``): deferred while
        the lease given out runs, readers hearing "released" from now on.
        """
        now = self._sweep()
        engine = self._engine(engine_id) if engine_id is not None else None
        request = self._transfers.get(transfer_id)
        owner = (request.engine_id, request.request_id) if request is not None else self.streams.owner(transfer_id)
        if owner is not None:
            self._check_owner(transfer_id, owner, "bound to" if request is not None else "streamed by",
                              engine_id, request_id)
        self.streams.end(transfer_id, now)
        if request is not None:
            assert engine is not None  # _check_owner: the owner was named
            if request.doomed:
                return True  # abandoned (or given up by the router) already, its outcome deferred
            if request.handed and request.expires_at > now:
                # A reader was handed it (the abandon raced a publish a long poll answered): as a router's
                # release, deferred until the lease given out runs out or the readers release it (release).
                request.doomed = True
                self.stats.releases_deferred += 1
            else:
                del engine.requests[request.request_id]
                self._end(engine, request, RequestStatus.RELEASED, Outcome.ABANDONED, now)
            self.stats.released_abandoned += 1
        elif transfer_id in self._transfer_tombstones:
            return True
        else:
            self._bury(self._transfer_tombstones, transfer_id, RequestStatus.RELEASED, now)
        self.stats.transfers_abandoned += 1
        if self.on_transfer_end is not None:
            self.on_transfer_end(transfer_id)
        return False

    def poll_released(self, engine_id: str, server_id: str | None = None, ack: int = 0,
                      launch: str | None = None, seen: float | None = None) -> PollReleasedAnswer:
        """Outcomes of the engine's requests not yet acknowledged.

        ``ack`` acknowledges every outcome with ``seq <= ack`` (only when ``server_id`` names this table:
        sequence numbers restart with the server). Conflict, nothing acknowledged, from another ``launch``
        than the engine's live ranks' (_check_launch): a process replaced under the engine id and still
        polling would take the new one's outcomes, and its polls would stand for the new process being in
        touch, which lengthens what a renewal promises (_hold_cap).

        ``seen``: the ``now`` of the last answer the poller got. Prefill counts itself in touch as of an
        answer it received (kvlink.vllm.held), so the engine counts as polled as of that answer's time, not
        this poll's, whose answer may be lost (a timeout, a proxy's 504): prefill's silence may have begun
        before it. Without ``seen`` (an older client) as of this poll.
        """
        engine = self._engine(engine_id)
        self._check_launch(engine, launch, "a poll for outcomes", "nothing acknowledged")
        now = self._sweep()
        if seen is None:
            engine.polled_at = now
        elif seen > 0 and server_id == self.server_id:  # (another server's clock means nothing here)
            engine.polled_at = max(engine.polled_at or 0.0, min(seen, now))
        if server_id == self.server_id:
            while engine.outcomes and engine.outcomes[0].seq <= ack:
                engine.outcomes.popleft()
        released = list(itertools.islice(engine.outcomes, MAX_OUTCOMES_PER_POLL))
        return PollReleasedAnswer(server_id=self.server_id, released=released, now=None if seen is None else now)

    def expire(self) -> None:
        """Expire everything that is due now (the adapter also calls this periodically)."""
        self.streams.sweep(self._sweep())

    # ----- internals --------------------------------------------------------------------------------------

    def _check_owner(self, transfer_id: str, owner: tuple[str, str], how: str, engine_id: str | None,
                     request_id: str | None) -> None:
        """abandon_transfer: Conflict unless the caller named the engine (and request, if any) that owns it."""
        owner_engine, owner_request = owner
        held = f"transfer id {transfer_id!r} is {how} request {owner_request!r} of engine {owner_engine!r}"
        if engine_id is None:
            self.stats.conflicts += 1
            raise Conflict(f"{held}: name that engine to abandon it", field="engine_id")
        if owner_engine != engine_id:
            self.stats.conflicts += 1
            raise Conflict(f"{held}, not of engine {engine_id!r}: left alone", field="transfer_id")
        if request_id is not None and owner_request != request_id:
            self.stats.conflicts += 1
            raise Conflict(f"{held}, not request {request_id!r}: nothing released", field="request_id")

    def _check_launch(self, engine: _Engine, launch: str | None, what: str, kept: str = "nothing stored") -> None:
        """Conflict when ``launch`` (the sender's start) is not that of every live rank that names one. A
        process replaced under the same engine id (a rolling restart: the new one registered while the old
        one still finished its requests) would otherwise publish block ids that decode then reads from the
        new process's memory: wrong KV under a matching prompt digest."""
        if launch is None:
            return
        for rank in engine.ranks.values():
            live = rank.registration.launch
            if live is not None and live != launch:
                self.stats.conflicts += 1
                raise Conflict(f"{what} of engine {engine.engine_id!r} comes from launch {launch!r}, but the "
                               f"engine's ranks are registered by launch {live!r}: the sender was replaced; "
                               f"{kept}", field="launch")

    @staticmethod
    def _hold_cap(engine: _Engine, request: _Request) -> float:
        """Until when prefill holds ``request``'s blocks even if it stops hearing from this server: it frees a
        request it has no word on once ``PREFILL_HOLD_LEASES`` of its leases have passed since publishing
        it and it has not heard from the server for a lease (kvlink.vllm.held). So a renewal given now must
        end by the later of those, counted from what this server saw (the publish, prefill's last poll):
        a prefill cut off from this server while decode is not would otherwise free blocks under a READ
        decode was told is covered."""
        cap = request.published_at + PREFILL_HOLD_LEASES * request.lease_s
        if engine.polled_at is not None:
            cap = max(cap, engine.polled_at + request.lease_s)
        return cap

    def _lease(self, lease_s: float) -> float:
        if not 0 < lease_s <= self.limits.max_lease_s:
            raise InvalidField(f"lease_s must be in (0, {self.limits.max_lease_s}]", field="lease_s")
        return float(lease_s)

    def _engine(self, engine_id: str) -> _Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            raise UnknownEngine(f"engine {engine_id!r} is not registered (or its lease ran out)", field="engine_id")
        return engine

    def _rank(self, engine_id: str, index: RankIndex) -> _Rank:
        rank = self._engine(engine_id).ranks.get(index)
        if rank is None:
            raise UnknownEngine(
                f"rank (dp, tp, pp) = {index} of engine {engine_id!r} is not registered", field="engine_id"
            )
        return rank

    @staticmethod
    def _record(request: _Request, now: float) -> RequestRecord:
        return RequestRecord(
            engine_id=request.engine_id,
            request_id=request.request_id,
            transfer_id=request.transfer_id,
            block_ids=request.block_ids,
            num_tokens=request.num_tokens,
            lease_remaining_s=max(0.0, request.expires_at - now),
            epoch=request.epoch,
            prompt_sha=request.prompt_sha,
            launch=request.launch,
        )

    def _sweep(self) -> float:
        now = self.clock()
        heap = self._rank_heap
        while heap and heap[0][0] <= now:
            _, _, rank = heapq.heappop(heap)
            reg = rank.registration
            engine = self._engines.get(reg.engine_id)
            index = (reg.dp_rank, reg.tp_rank, reg.pp_rank)
            if engine is None or engine.ranks.get(index) is not rank:
                continue  # unregistered earlier
            if rank.expires_at > now:
                heapq.heappush(heap, (rank.expires_at, next(self._tie), rank))
                continue
            del engine.ranks[index]
            if not engine.ranks:
                self.stats.engines_expired += 1
                self._drop_engine(engine, now)
        heap = self._request_heap
        while heap and heap[0][0] <= now:
            _, _, request = heapq.heappop(heap)
            engine = self._engines.get(request.engine_id)
            if engine is None or engine.requests.get(request.request_id) is not request:
                continue  # released, or its engine went away
            if request.expires_at > now:
                heapq.heappush(heap, (request.expires_at, next(self._tie), request))
                continue
            del engine.requests[request.request_id]
            if request.doomed or request.released is not None:  # a release deferred until now (release)
                self._end(engine, request, RequestStatus.RELEASED, request.released or Outcome.ABANDONED, now)
                continue
            self._end(engine, request, RequestStatus.EXPIRED, Outcome.EXPIRED, now)
            self.stats.expired += 1
        self._trim(self._tombstones, now)
        self._trim(self._transfer_tombstones, now)
        return now

    def _end(
        self, engine: _Engine, request: _Request, status: RequestStatus, outcome: Outcome | None, now: float
    ) -> None:
        """Forget a request that has already left ``engine.requests``: tombstone it, queue its outcome. Its
        block lists go at once: the expiry heap keeps the object until its lease would have ended."""
        request.block_ids = []
        self._bury(self._tombstones, (request.engine_id, request.request_id), status, now)
        if request.transfer_id is not None and self._transfers.get(request.transfer_id) is request:
            del self._transfers[request.transfer_id]
            self._bury(self._transfer_tombstones, request.transfer_id, status, now)
        if outcome is not None:
            engine.outcomes.append(ReleasedRequest(seq=next(self._seq), request_id=request.request_id,
                                                   outcome=outcome))
            if len(engine.outcomes) > self.limits.max_pending_outcomes:
                engine.outcomes.popleft()
                self.stats.outcomes_dropped += 1

    def _drop_requests(self, engine: _Engine, now: float) -> None:
        streamed = self.streams.end_engine(engine.engine_id, now)
        requests, engine.requests = engine.requests, {}
        for request in requests.values():
            self._end(engine, request, RequestStatus.EXPIRED, None, now)
        self.stats.expired += len(requests)
        # Streams the gone process never published: no process will (a new one refuses the id, 410), so
        # decode waiting for the record hears "expired" now, not at its long poll's end.
        for tid in streamed:
            if tid not in self._transfers and tid not in self._transfer_tombstones:
                self._bury(self._transfer_tombstones, tid, RequestStatus.EXPIRED, now)
                if self.on_transfer_end is not None:
                    self.on_transfer_end(tid)

    def _drop_engine(self, engine: _Engine, now: float) -> None:
        self._drop_requests(engine, now)
        del self._engines[engine.engine_id]

    def _bury(self, tombs: collections.OrderedDict, key: object, status: RequestStatus, now: float) -> None:
        tombs[key] = (status, now)
        tombs.move_to_end(key)
        if len(tombs) > self.limits.max_tombstones:
            tombs.popitem(last=False)

    def _trim(self, tombs: collections.OrderedDict, now: float) -> None:
        horizon = now - self.limits.tombstone_ttl_s
        while tombs:
            key, (_, at) = next(iter(tombs.items()))
            if at > horizon:
                break
            del tombs[key]


def _hand(request: _Request, reader: str | None) -> None:
    """``reader`` may be reading the request's blocks from now on (release); not one that released it."""
    if reader is not None and reader in request.done:
        return
    request.handed = True
    request.readers.add(reader if reader in request.readers or len(request.readers) < MAX_READERS else None)


def _done(request: _Request, reader: str | None) -> None:
    """``reader`` released the request: no longer counted, and not handed it again."""
    request.readers.discard(reader)
    if reader is not None and len(request.done) < MAX_READERS:
        request.done.add(reader)


def _other_readers(request: _Request, reader: str | None) -> bool:
    """Whether a reader other than ``reader`` was handed the request and has not released it."""
    return any(r != reader for r in request.readers)


def _check_blocks(engine: _Engine, block_ids: list[list[int]], field: str) -> None:
    """InvalidField when a block id is not below the most blocks any live rank registered a layer with, or a
    group names more real blocks than that (positions out of a sliding window or a state group's are the
    null block, 0, and may be many): no process holds such a block, and a list of them only costs memory."""
    bound = max((layer.num_blocks for rank in engine.ranks.values() for layer in rank.registration.layers),
                default=0)
    if not bound:
        return  # (ranks registered without layers: nothing to check against)
    for g, ids in enumerate(block_ids):
        if len(ids) > bound and len(ids) - ids.count(0) > bound:
            raise InvalidField(f"group {g} names {len(ids) - ids.count(0)} blocks; engine {engine.engine_id!r} "
                               f"registered at most {bound}", field=f"{field}[{g}]")
        if ids and max(ids) >= bound:
            raise InvalidField(f"block {max(ids)} of group {g} is not below the {bound} blocks engine "
                               f"{engine.engine_id!r} registered", field=f"{field}[{g}]")


def _gone(status: RequestStatus, what: str, field: str) -> RequestGone:
    """The refusal of a publish of an id that already ended."""
    if status is RequestStatus.EXPIRED:
        return RequestExpired(f"{what} expired; its blocks may have been reused, so it cannot be published again "
                              "(nothing stored)", field=field)
    return RequestReleased(f"{what} was already released; it cannot be published again (nothing stored)",
                           field=field)


def _launch_of(engine: _Engine) -> str | None:
    """The launch every live rank of ``engine`` registered with; None if none names one or they differ. Pieces
    from another launch are refused and a new process's registration drops the old one's streams, so an
    engine's progress comes from its ranks' launch."""
    launches = {rank.registration.launch for rank in engine.ranks.values()}
    return launches.pop() if len(launches) == 1 else None


def _partial(transfer_id: str, progress: Progress, layers: bool, launch: str | None) -> RequestRecord:
    step = dict(step_block_ids=[list(g) for g in progress.step_block_ids], layers=progress.layers) \
        if layers and progress.layers else {}
    return RequestRecord(engine_id=progress.engine_id, request_id=progress.request_id, transfer_id=transfer_id,
                         block_ids=[list(g) for g in progress.block_ids], num_tokens=progress.num_tokens,
                         lease_remaining_s=0.0, partial=True, epoch=progress.epoch,
                         version=progress.version if layers else progress.block_version,
                         prompt_sha=progress.prompt_sha, prompt_tokens=progress.prompt_tokens, launch=launch, **step)
