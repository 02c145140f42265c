"""Prefill's held requests: blocks kept for decode, and when each goes back to vLLM. Pure logic, injected clock.

No threads, no HTTP, no vLLM: the scheduler (the adapter) feeds it events under its own lock and applies
what comes out. Events: a request was ``published``; the bootstrap server ``released`` one with an outcome
(its poll); a reconcile lookup answered (``looked_up``); the server answered (``reached``) or could not be
reached (``unreachable``); the clock moved (``tick``, which hands over the frees decided so far).

Every held request is freed exactly once, for the first of these reasons:

- decode reported it pulled or abandoned, or the server says its lease expired (the poll's outcome);
- lookups find the server no longer holds it (unknown: a restarted server, or one that dropped the
  engine; expired) for a whole lease from the first that did: nobody can renew its lease any more, but a
  renewal the server took before it lost the request promised decode up to one lease from then, and decode
  trusts a READ that ends within it;
- two lookups in a row find it released: decode reported it, but its outcome was lost (a dropped engine
  loses its queued outcomes). One sighting is not enough: a release can land between a poll and a lookup,
  and its outcome then arrives with the next poll;
- its local deadline passes while the server has not answered for a whole lease, counted from the first
  call that failed after its last answer (only then: the server tracks decode's renewals, the local
  deadline does not; and until that call failed the server may have taken a renewal, which promised
  decode one more lease from then).

Anything said about a request after its free (a late outcome, a lookup answer) is ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvlink.bootstrap.schema import PREFILL_HOLD_LEASES, Outcome, RequestStatus

# The local deadline's slack over the lease: decode renewals the server saw may have pushed it back.
DEADLINE_FACTOR, DEADLINE_SLACK_S = PREFILL_HOLD_LEASES, 5.0

# How a free is counted (kvlink_* counters); None: released, but the outcome never reached prefill.
COUNTER_OF: dict[Outcome | None, str] = {
    Outcome.PULLED: "released_pulled",
    Outcome.ABANDONED: "released_abandoned",
    Outcome.EXPIRED: "leases_expired",
    None: "released_unreported",
}


@dataclass(frozen=True)
class Freed:
    """A held request whose blocks go back to vLLM now."""

    request_id: str
    outcome: Outcome | None  # None: the server says released, and its outcome was lost
    by_deadline: bool = False  # freed by the local deadline, the server out of reach

    @property
    def counter(self) -> str:
        return COUNTER_OF[self.outcome]


@dataclass
class _Held:
    deadline: float
    num_blocks: int


class HeldTable:
    """Requests whose blocks prefill keeps for decode. Not thread-safe: the adapter holds one lock."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self._held: dict[str, _Held] = {}
        self._released_seen: set[str] = set()  # held ids the last lookup found released
        self._missing: dict[str, float] = {}  # held ids lookups found unknown or expired: since when
        self._frees: list[Freed] = []  # decided, not yet handed over by tick()
        self._freeing: dict[str, int] = {}  # their blocks: vLLM still holds them until tick() hands them over
        self.num_blocks = 0  # held now (vLLM has not been told to free them), over all requests
        now = clock()
        self._silent_since: float | None = None  # the end of the first failed call since the server's last answer
        self._lookup_at = now + lease_s / 2

    # ----- events -----------------------------------------------------------------------------------

    def published(self, request_id: str, num_blocks: int) -> None:
        old = self._held.get(request_id)  # vLLM's ids are unique; the same one again replaces it
        self.num_blocks += num_blocks - (old.num_blocks if old else 0)
        self._held[request_id] = _Held(self.clock() + self.lease_s * DEADLINE_FACTOR + DEADLINE_SLACK_S,
                                       num_blocks)
        self._released_seen.discard(request_id)

    def stamp(self, request_id: str) -> None:
        """Its publish call returned (or gave up): the server applied it by now, if at all (except a publish
        it takes after this client gave up), so the local deadline counts from here. It counted from before
        the call: a publish the server applied more than the slack later had decode renewed past it."""
        held = self._held.get(request_id)
        if held is not None:
            held.deadline = max(held.deadline, self.clock() + self.lease_s * DEADLINE_FACTOR + DEADLINE_SLACK_S)

    def withdraw(self, request_id: str) -> bool:
        """Its publish was refused: vLLM frees the blocks itself. True when it was still held (now forgotten);
        False when something freed it meanwhile (that free is on its way: vLLM must wait for it)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.num_blocks -= held.num_blocks
        self._released_seen.discard(request_id)
        self._missing.pop(request_id, None)
        return True

    def released(self, request_id: str, outcome: Outcome) -> bool:
        """The poll delivered an outcome; True when it freed the request (False: not held, or freed)."""
        return self._free(request_id, outcome)

    def looked_up(self, answer: Mapping[str, object]) -> int:
        """A reconcile lookup answered (the whole of it: the two-sighting rule needs every id at once).

        ``answer`` maps request ids to a record (the server still holds it) or a ``RequestStatus``. Returns
        how many requests it freed. The next lookup is due half a lease later.
        """
        now = self.clock()
        released = {rid for rid, status in answer.items() if status is RequestStatus.RELEASED}
        gone = {rid for rid, status in answer.items()
                if isinstance(status, RequestStatus) and status is not RequestStatus.RELEASED and rid in self._held}
        for rid in answer:
            if rid not in gone:
                self._missing.pop(rid, None)  # held again (a late publish) or released: the lease rules apply
        for rid in gone:
            self._missing.setdefault(rid, now)
        freed = sum(self._free(rid, Outcome.EXPIRED) for rid in sorted(gone)
                    if now - self._missing[rid] >= self.lease_s)
        twice = released & self._released_seen
        freed += sum(self._free(rid, None) for rid in sorted(twice))
        self._released_seen = {rid for rid in released - twice if rid in self._held}
        self._lookup_at = self.clock() + self.lease_s / 2
        return freed

    def reached(self) -> None:
        """The server answered."""
        self._silent_since = None

    def unreachable(self) -> None:
        """A call to the server failed: look up as soon as it answers again (it may have lost outcomes). Up to
        now the server may have taken a decode renewal, so a silence counts from here."""
        now = self.clock()
        self._lookup_at = now
        if self._silent_since is None:
            self._silent_since = now

    def tick(self) -> list[Freed]:
        """The frees decided since the last tick, plus local deadlines that passed while the server has
        not answered for a whole lease."""
        now = self.clock()
        if self._held and self._silent_since is not None and now - self._silent_since > self.lease_s:
            for rid in [rid for rid, h in self._held.items() if h.deadline < now]:
                self._free(rid, Outcome.EXPIRED, by_deadline=True)
        frees, self._frees = self._frees, []
        self.num_blocks -= sum(self._freeing.values())
        self._freeing = {}
        return frees

    # ----- questions --------------------------------------------------------------------------------

    def lookup_due(self) -> bool:
        return self.clock() >= self._lookup_at

    def has_frees(self) -> bool:
        return bool(self._frees)

    def request_ids(self) -> list[str]:
        return list(self._held)

    def blocks_by_request(self) -> dict[str, int]:
        """Blocks vLLM keeps for decode now: held, or freed but not yet handed over by tick()."""
        return {**self._freeing, **{rid: h.num_blocks for rid, h in self._held.items()}}

    def __len__(self) -> int:
        return len(self._held) + len(self._freeing)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    # ----- internals --------------------------------------------------------------------------------

    def _free(self, request_id: str, outcome: Outcome | None, by_deadline: bool = False) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._freeing[request_id] = held.num_blocks
        self._released_seen.discard(request_id)
        self._missing.pop(request_id, None)
        self._frees.append(Freed(request_id, outcome, by_deadline))
        return True
