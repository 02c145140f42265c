"""Decode's pulls as a pure table: events in, actions out. No threads, no transport, no vLLM.

Every pull is in exactly one state:

    RESOLVING --resolved--> READY --posted--> READING --batch ok--> CONFIRMING --lease held--> DONE
        |                     |                  |  \\--batch ok, lease already proven-------------> DONE
        |                     |                  |--batch failed------------------------------------> FAILED
        |                     |                  '--cancel / lease lost / deadline--> SETTLING --settled--> (either)
        '---------------------'--cancel / lease lost / deadline / resolve failed--------------------> CANCELLED|FAILED

READY means paired and waiting to be posted; it is left at once by ``take_posts`` (the adapter posts what
it returns, then reports ``posted`` or ``post_failed``). SETTLING is a pull whose outcome is decided
(cancelled by vLLM, or failed) while its batch may still write into its blocks: it is reported to vLLM
only when that batch has settled, because vLLM reuses the blocks of a reported request at once. A
backend whose cancel stops a batch settles it when ``cancel`` returns; one that cannot (Mooncake) is
asked again on every tick until it says the batch is settled, or the batch ends by itself.

The other pulls of a batch that had to be cancelled for one of them are posted again; if the batch
ended by itself meanwhile, their bytes arrived and they go on to the lease check.

Streamed KV (concurrent pairing, prefill still computing): before the published record (``resolved``)
arrives, ``piece`` hands the table the pairs of the blocks prefill has finished so far. A RESOLVING pull
with such pairs goes READY -> READING like any other and, when that batch ends, back to RESOLVING to
wait for more (one batch per pull at a time, so cancel works exactly as above). A position read once is
not read again (the first arrival wins), unless prefill restarted the request (a higher ``epoch``: what
was read may be stale). The published record is the end of the stream: only positions not read yet at
its epoch are read (the tail), and a read of a piece counts only if its epoch is the record's: a running
request's blocks are prefill's until the record is published (then the lease holds them), so a READ that
ended before ``held_until`` read what the record names.

Layer-wise pieces name a position with the count of (this rank's) layers prefill has finished for it:
the table keeps, per position, how many layers were read, and reads the next range ``[read, finished)``;
``ALL_LAYERS`` is the whole block (whole-block pieces and the published record). A pair on the wire is
(group, local block, remote block, first layer, end layer).

A READ is trusted only with proof that prefill held the blocks when it ended: it ended before
``held_until``, the bound given by the last lease renewal (or the concurrent lookup). Renewals are
scheduled here too: one call in flight per (bootstrap server, prefill engine) group, a new pull's
first at once, then every third of its lease.

The adapter (worker.py) holds one lock around the table, feeds it events from its threads, and carries
out the actions it returns (``Resolve``, ``Post``, ``CancelBatch``, ``Renew``) outside that lock.
Outcomes are collected with ``take_results`` on vLLM's thread.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlink.vllm.lockstep import ArmClock, Armed

if TYPE_CHECKING:  # metadata imports vLLM; this module must not
    from kvlink.vllm.metadata import PullSpec

ALL_LAYERS = 1 << 30  # a layer range's end that means every layer of the block
MAX_RENEW_IDS = 512  # request ids per renew call (a bootstrap server takes max_lookup_ids, 4096 by default)
CANCEL_RETRY_S = (0.1, 5.0)  # a cancel that did not settle is asked again after this, doubling up to the max
UNSETTLED_WARN_S = 30.0  # a batch still unsettled this long after its first cancel is reported in the log


class State(enum.Enum):
    RESOLVING = "resolving"  # lookup, first contact and pairing (I/O in the adapter)
    READY = "ready"  # paired; waiting to be posted
    READING = "reading"  # in a batch on the wire
    CONFIRMING = "confirming"  # READ done; waiting for proof that the lease held
    SETTLING = "settling"  # outcome decided; its batch may still write: waiting for it to settle
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = (State.DONE, State.FAILED, State.CANCELLED)


@dataclass(frozen=True)
class Lease:
    """Prefill's lease on one request's blocks: renewed at ``url`` for ``engine_id``/``request_id``."""

    url: str
    engine_id: str
    request_id: str  # prefill's id
    lease_s: float

    @property
    def group(self) -> tuple[str, str]:
        return self.url, self.engine_id


@dataclass
class Pull:
    spec: PullSpec
    submitted: float
    deadline: float
    state: State = State.RESOLVING
    remote: Hashable | None = None  # the adapter's key of the remote engine (set when resolved)
    # (group, local block, remote block, first layer, end layer) of the batch on the wire
    pairs: tuple[tuple[int, int, int, int, int], ...] = ()
    lease: Lease | None = None
    held_until: float = 0.0  # prefill provably holds the blocks until then
    next_renew: float = 0.0
    read_at: float = 0.0  # when its READ ended (0: not yet)
    batch: int | None = None  # the batch carrying it (READING, SETTLING)
    pending: tuple[State, str] | None = None  # SETTLING: the outcome to report once settled
    # (group, local block) -> (remote block, first layer, end layer): to read next, in the batch on the wire;
    # (remote block, layers read) read (at ``epoch``)
    queued: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    inflight: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    got: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    epoch: int = 0
    inflight_epoch: int = 0
    final: bool = False  # the published record arrived (resolved): nothing more to wait for
    final_at: float = 0.0
    streamed: int = 0  # blocks read before the published record arrived
    armed: bool = False  # lock-step: reported to vLLM before its outcome (lockstep.py)
    clock: ArmClock | None = None
    expect: frozenset | None = None  # lock-step: the (group, local block) positions it fills
    # Sequential pairing: what the params claimed (decode's client sent them: lease.RecordCheck), until the
    # first lease proof also showed prefill's record backs it (lease.py); None: nothing to check
    check: Any = None

    @property
    def rid(self) -> str:
        return self.spec.request_id


@dataclass
class Batch:
    id: int
    remote: Hashable
    rids: list[str]
    started: float
    handle: Any = None  # the transport's batch, once posted (opaque here)
    cancel_wanted: bool = False
    cancel_since: float = 0.0  # when the cancel was first wanted
    next_cancel_at: float = 0.0  # when to ask the backend again (it could not settle)
    cancel_retry_s: float = CANCEL_RETRY_S[0]
    warned: bool = False
    nbytes: int = 0
    nblocks: int = 0
    ndesc: int = 0


# ----- actions: what the adapter does outside the lock ------------------------------------------------


@dataclass(frozen=True)
class Resolve:
    """Look up, connect, pair; then report ``resolved`` or ``resolve_failed``."""

    pull: Pull


@dataclass(frozen=True)
class Post:
    """Post one READ of these pulls' pairs from ``remote``; then report ``posted`` or ``post_failed``."""

    batch: int
    remote: Hashable
    pulls: tuple[Pull, ...]


@dataclass(frozen=True)
class CancelBatch:
    """Cancel the transport batch; report ``cancel_settled`` when the backend says nothing writes any more."""

    batch: int
    handle: Any


@dataclass(frozen=True)
class Renew:
    """Renew these leases (one call); report ``lease_held``, ``lease_lost`` or ``renew_failed``."""

    group: tuple[str, str]
    request_ids: tuple[str, ...]  # prefill's ids
    rids: tuple[str, ...]  # ours, in the same order
    lease_s: float
    # (our id, what its params claimed: lease.RecordCheck) of pulls not yet checked against prefill's record
    verify: tuple[tuple[str, Any], ...] = ()


@dataclass
class Results:
    """Outcomes since the last ``take_results``: done (pulled or cancelled) and failed (with their blocks)."""

    done: set[str] = field(default_factory=set)
    failed: dict[str, tuple[int, ...]] = field(default_factory=dict)


class PullTable:
    """All of decode's running pulls; ``now`` is always passed in (monotonic seconds)."""

    def __init__(self, pull_timeout_s: float, num_layers: int = 0):
        self.pull_timeout_s = pull_timeout_s
        # Lock-step (lockstep.py): None is off; else how long before prefill's last layer ends a pull may be
        # armed (the adapter keeps it current). ``num_layers``: this rank's layers.
        self.lockstep_lead_s: float | None = None
        self.lockstep_max_wait_s = 5.0  # an armed pull fails this long after it was armed, without an outcome
        self.num_layers = num_layers
        self._armed: dict[str, Armed] = {}
        self._new_armed: set[str] = set()  # armed since the last take_lockstep
        self._settled: dict[str, bool] = {}  # armed pulls that left the table since then: confirmed?
        self._freed: set[str] = set()  # finished armed requests whose blocks vLLM may free now
        self._pulls: dict[str, Pull] = {}  # running (not reported yet)
        self._batches: dict[int, Batch] = {}  # posted or being posted, not settled
        self._batch_ids = 0
        self._renewing: set[tuple[str, str]] = set()  # groups with a renew call in flight
        self._results = Results()
        self._settled_at: dict[str, float] = {}  # ok pulls not yet collected: when they settled
        self._error_blocks: set[int] = set()  # local blocks of failed pulls, for vLLM's load-error report
        self.counts: dict[str, int] = {}
        self.samples: dict[str, list[float]] = {}
        self._messages: list[str] = []  # for the log; the adapter writes them after releasing its lock

    # ----- queries ---------------------------------------------------------------------------------------

    def get(self, rid: str) -> Pull | None:
        return self._pulls.get(rid)

    def state(self, rid: str) -> State | None:
        p = self._pulls.get(rid)
        return p.state if p is not None else None

    def running(self) -> int:
        return len(self._pulls)

    def batches(self) -> list[Batch]:
        return list(self._batches.values())

    def batch(self, batch: int) -> Batch | None:
        return self._batches.get(batch)

    def next_wakeup(self, now: float) -> float:
        """The earliest deadline, renewal or cancel retry due (``now + 1`` when none). A SETTLING pull's
        deadline is spent: only its batch's cancel retry wakes the ticker for it."""
        t = now + 1.0
        for p in self._pulls.values():
            if p.state is State.SETTLING:
                continue
            t = min(t, p.deadline)
            if p.lease is not None and p.lease.group not in self._renewing:
                t = min(t, p.next_renew)
        for b in self._batches.values():
            if b.cancel_wanted and b.handle is not None:
                t = min(t, b.next_cancel_at)
        return t

    # ----- events ----------------------------------------------------------------------------------------

    def submit(self, spec: PullSpec, now: float) -> list[Resolve]:
        if spec.request_id in self._pulls:
            self._messages.append(f"kvlink: request {spec.request_id} submitted twice while its pull runs; "
                                  "ignoring the second")
            return []
        pull = Pull(spec, submitted=now, deadline=now + self.pull_timeout_s)
        self._pulls[pull.rid] = pull
        if not spec.blocks_to_fill:
            self._report(pull, State.DONE, now)  # nothing to move (everything in the prefix cache)
            return []
        return [Resolve(pull)]

    def resolved(self, rid: str, remote: Hashable, pairs: list[tuple[int, int, int]], lease: Lease,
                 held_until: float, renew_at: float, now: float, epoch: int = 0,
                 check: Any = None) -> list[Post | Renew]:
        """Paired and connected (the published record: the end of a stream); ``pairs`` are (group, local,
        remote) blocks; ``renew_at``: when its first renewal is due (``now``: at once); ``check``: the block
        ids the (sequential) params named, to be matched against prefill's record before the pull is trusted."""
        pull = self._pulls.get(rid)
        if pull is None or pull.final or pull.state not in (State.RESOLVING, State.READY, State.READING):
            return []  # cancelled or failed meanwhile (already reported)
        if pull.armed and (epoch != pull.epoch or pull.remote != remote):
            return self.fail(rid, "prefill's record is of another epoch or engine than the KV decode's step "
                                  "began with", now)
        if pull.armed and (moved := _moved(pull, pairs)):
            # The step computed over the bytes of the blocks it read; a record naming others (another request
            # published under the transfer id) cannot be read in after the fact.
            g, lb, old, new = moved
            return self.fail(rid, f"prefill's record puts block {lb} (group {g}) in remote block {new}, but decode's "
                                  f"step already read it from remote block {old}", now)
        if pull.remote is not None and pull.remote != remote:
            # streamed from another engine object (reconnected): read it all again, what is on the wire too
            pull.got.clear()
            pull.inflight_epoch = -1
        pull.remote, pull.lease, pull.final, pull.final_at = remote, lease, True, now
        pull.held_until, pull.next_renew = max(pull.held_until, held_until), renew_at
        pull.check = check
        self._want(pull, pairs, epoch)
        if pull.state is State.RESOLVING:
            if pull.queued:
                pull.state = State.READY
            else:
                self._check_lease(pull, now)  # everything was streamed already
        return [*self.take_posts(now), *self._renewals_due(now)]

    def piece(self, rid: str, remote: Hashable, pairs: list[tuple[int, ...]], epoch: int,
              now: float) -> list[Post]:
        """Streamed KV: prefill has finished the blocks of these (group, local, remote) pairs of a request it
        is still computing (or, as (group, local, remote, layers), their first ``layers`` layers). Read
        what was not read yet at this epoch."""
        pull = self._pulls.get(rid)
        if pull is None or pull.final or pull.state not in (State.RESOLVING, State.READY, State.READING):
            self._count("pieces_dropped")  # decode no longer waits for it (cancelled, failed, done)
            return []
        if epoch < pull.epoch or (pull.remote is not None and pull.remote != remote):
            self._count("pieces_dropped")
            return []
        if pull.armed and epoch != pull.epoch:
            return self.fail(rid, f"prefill restarted the request (epoch {pull.epoch} -> {epoch}) after decode's "
                                  "step began with its KV", now)
        pull.remote = remote
        self._count("pieces")
        self._want(pull, pairs, epoch)
        if pull.state is State.RESOLVING and pull.queued:
            pull.state = State.READY
        self._maybe_arm(pull, now)
        return self.take_posts(now)

    def resolve_failed(self, rid: str, why: str, now: float) -> None:
        pull = self._pulls.get(rid)
        if pull is not None and pull.state is State.RESOLVING:
            self._report(pull, State.FAILED, now, why)

    def take_posts(self, now: float) -> list[Post]:
        """Every READY pull into a batch, one per remote engine; they are READING from here on."""
        by_remote: dict[Hashable, list[Pull]] = {}
        for p in self._pulls.values():
            if p.state is State.READY:
                by_remote.setdefault(p.remote, []).append(p)
        posts = []
        for remote, pulls in by_remote.items():
            self._batch_ids += 1
            b = Batch(self._batch_ids, remote, [p.rid for p in pulls], now)
            self._batches[b.id] = b
            for p in pulls:
                p.state, p.batch = State.READING, b.id
                p.inflight, p.queued, p.inflight_epoch = p.queued, {}, p.epoch
                p.pairs = tuple((g, lb, rb, lo, hi) for (g, lb), (rb, lo, hi) in p.inflight.items())
            posts.append(Post(b.id, remote, tuple(pulls)))
        return posts

    def posted(self, batch: int, handle: Any, nbytes: int, nblocks: int, ndesc: int,
               now: float) -> list[CancelBatch]:
        b = self._batches.get(batch)
        if b is None:
            return []
        b.handle, b.nbytes, b.nblocks, b.ndesc, b.started = handle, nbytes, nblocks, ndesc, now
        return [CancelBatch(b.id, handle)] if b.cancel_wanted else []

    def post_split(self, batch: int, deferred: list[str], refused: dict[str, str], now: float) -> None:
        """Before posting, the adapter could not give some pulls of the batch room (host staging's landing
        pool): ``deferred`` ones are READY again (posted when room frees, their deadline still runs),
        ``refused`` ones can never fit and fail. A pull cancelled meanwhile gets its outcome now."""
        b = self._batches.get(batch)
        if b is None:
            return
        for rid in [*deferred, *refused]:
            p = self._pulls.get(rid)
            if rid in b.rids:
                b.rids.remove(rid)
            if p is None or p.batch != batch:
                continue
            if p.pending is not None:
                self._report(p, p.pending[0], now, p.pending[1])
            elif rid in refused:
                self._report(p, State.FAILED, now, refused[rid])
            else:
                p.state, p.batch = State.READY, None
                p.queued, p.inflight = self._requeue(p), {}
                self._count("staging_pool_full")
        if not b.rids:
            del self._batches[batch]

    def post_failed(self, batch: int, why: str, now: float) -> None:
        """Nothing was submitted: its pulls fail (or get the outcome they were waiting to report)."""
        b = self._batches.pop(batch, None)
        if b is None:
            return
        for p in self._members(b):
            state, reason = p.pending or (State.FAILED, why)
            self._report(p, state, now, reason)

    def batch_ended(self, batch: int, error: str | None, now: float) -> list[Post | Renew]:
        """The transport says the batch finished (``error`` None) or failed.

        A failure of a batch we asked to cancel is not proof that it settled (a backend that cannot stop
        a batch reports the cancel before its memory is safe): only ``cancel_settled`` settles it then.
        Completion of a batch already settled (cancelled, duplicate report) is ignored.
        """
        b = self._batches.get(batch)
        if b is None or (error is not None and b.cancel_wanted):
            return []
        del self._batches[batch]
        if error is None:
            self._count("batches")
            self._count("bytes_pulled", b.nbytes)
            self._count("blocks_pulled", b.nblocks)
            self._count("descriptors", b.ndesc)
            self._sample("transfer_s", now - b.started)
        for p in self._members(b):
            if p.pending is not None:
                self._report(p, p.pending[0], now, p.pending[1])
            elif error is not None:
                self._report(p, State.FAILED, now, error)
            else:
                self._read(p, now)
        return [*self.take_posts(now), *self._renewals_due(now)]

    def batch_unsettled(self, batch: int, why: str, now: float) -> list[CancelBatch]:
        """The transport gave up on the batch but its memory may still be written (the wait timed out and
        the backend could not stop it): its pulls fail once it settles; keep asking it to."""
        b = self._batches.get(batch)
        if b is None:
            return []
        for p in self._members(b):
            if p.pending is None:
                p.state, p.pending = State.SETTLING, (State.FAILED, why)
        return self._want_cancel(b, now)

    def cancel_settled(self, batch: int, now: float) -> list[Post]:
        """The backend's cancel returned: nothing writes into the batch's memory any more. Pulls with an
        outcome waiting are reported; the others (its siblings) are posted again."""
        b = self._batches.pop(batch, None)
        if b is None:
            return []
        for p in self._members(b):
            if p.pending is not None:
                self._report(p, p.pending[0], now, p.pending[1])
            else:
                p.state, p.batch = State.READY, None
                p.queued, p.inflight = self._requeue(p), {}
        return self.take_posts(now)

    def cancel(self, rid: str, now: float) -> list[CancelBatch]:
        """vLLM aborted the request: it is reported (finished, not failed) once nothing writes its blocks."""
        return self._stop(rid, State.CANCELLED, "cancelled", now)

    def fail(self, rid: str, why: str, now: float) -> list[CancelBatch]:
        return self._stop(rid, State.FAILED, why, now)

    def lease_held(self, group: tuple[str, str], rids: tuple[str, ...], held_until: float,
                   now: float) -> list[Renew]:
        """A renewal of ``rids`` succeeded: prefill holds their blocks until at least ``held_until``."""
        self._renewing.discard(group)
        self._count("lease_renewals", len(rids))
        for rid in rids:
            p = self._pulls.get(rid)
            if p is None or p.lease is None:
                continue
            p.held_until = max(p.held_until, held_until)
            p.check = None  # (lease.py checked it against the record before it reported the lease held)
            # a third of what this renewal left trusted (the server grants no more than prefill published)
            p.next_renew = now + max(0.05, min(p.lease.lease_s, held_until - now) / 3)
            if p.state is State.CONFIRMING and p.read_at < p.held_until:
                self._report(p, State.DONE, now)
        return self._renewals_due(now)  # pulls of this group that fell due while the call was out

    def lease_lost(self, group: tuple[str, str], rid: str, why: str, now: float) -> list[CancelBatch]:
        """Prefill no longer holds the request (expired, released): its blocks may be reused. The group's
        call is still out until ``lease_held`` (with the ids it did renew) ends it."""
        return self.fail(rid, why, now)

    def renew_failed(self, group: tuple[str, str], rids: tuple[str, ...], now: float) -> None:
        """The bootstrap server did not answer: try again soon (the pull's deadline bounds it)."""
        self._renewing.discard(group)
        for rid in rids:
            p = self._pulls.get(rid)
            if p is not None and p.lease is not None:
                p.next_renew = now + min(0.5, p.lease.lease_s / 6)

    def tick(self, now: float) -> list[CancelBatch | Renew]:
        """Deadlines, cancels still to settle, renewals due."""
        actions: list[CancelBatch | Renew] = []
        for p in [p for p in self._pulls.values() if p.deadline <= now and p.state is not State.SETTLING]:
            actions += self.fail(p.rid, f"no outcome within stream_lockstep_max_wait_s={self.lockstep_max_wait_s:g} "
                                        "s of decode's step beginning with its KV" if p.armed else
                                 f"no KV within pull_timeout_s={self.pull_timeout_s:g} s", now)
        for b in self._batches.values():
            if b.cancel_wanted and b.handle is not None and b.next_cancel_at <= now:
                actions.append(CancelBatch(b.id, b.handle))
                b.next_cancel_at = now + b.cancel_retry_s
                b.cancel_retry_s = min(CANCEL_RETRY_S[1], b.cancel_retry_s * 2)
                if not b.warned and now - b.cancel_since >= UNSETTLED_WARN_S:
                    b.warned = True
                    self._messages.append(
                        f"kvlink: a READ cancelled {now - b.cancel_since:.0f} s ago has still not settled (the "
                        f"backend cannot stop it); requests {sorted(b.rids)} keep their blocks until it does")
        return actions + self._renewals_due(now)

    def close(self) -> list[CancelBatch]:
        """Shutdown: every posted batch is cancelled; nothing is reported any more."""
        actions = [CancelBatch(b.id, b.handle) for b in self._batches.values() if b.handle is not None]
        self._pulls.clear()
        self._batches.clear()
        return actions

    # ----- results ---------------------------------------------------------------------------------------

    def has_results(self) -> bool:
        """Outcomes are waiting for ``take_results``."""
        return bool(self._results.done or self._results.failed)

    def take_results(self, now: float) -> Results:
        out, self._results = self._results, Results()
        for settled in self._settled_at.values():
            self._sample("handoff_s", now - settled)
        self._settled_at = {}
        return out

    def take_messages(self) -> list[str]:
        messages, self._messages = self._messages, []
        return messages

    def take_error_blocks(self) -> set[int]:
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def take_stats(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        counts, samples = self.counts, self.samples
        self.counts, self.samples = {}, {}
        return counts, samples

    # ----- lock-step (lockstep.py) ------------------------------------------------------------------------

    def is_armed(self, rid: str) -> bool:
        return rid in self._armed

    def armed_blocking(self, rid: str, layer: int | None) -> bool:
        """A step that runs armed request ``rid`` must wait before layer place ``layer`` (None: before its
        end, for the outcome)."""
        a = self._armed.get(rid)
        if a is None or a.outcome is not None:
            return False
        p = self._pulls.get(rid)
        if p is None or layer is None:
            return p is not None
        return self._layers_read(p) <= layer

    def take_step(self, rid: str) -> tuple[int, ...]:
        """The step that ran armed request ``rid`` ended (after waiting for its outcome): the blocks to report
        as load errors (none when its pull was confirmed)."""
        a = self._armed.get(rid)
        if a is None:
            return ()
        if a.outcome is None:  # cannot happen after the wait; never trust bytes without an outcome
            return a.blocks
        del self._armed[rid]
        return () if a.outcome else a.blocks

    def free_armed(self, rid: str, now: float) -> list[CancelBatch]:
        """vLLM finished armed request ``rid`` (an abort): its blocks go back once nothing writes into them."""
        a = self._armed.get(rid)
        if a is None or a.outcome is not None:
            self._armed.pop(rid, None)
            self._freed.add(rid)
            return []
        a.free_wanted = True
        return self.cancel(rid, now)

    def take_lockstep(self) -> tuple[set[str], dict[str, bool], set[str]]:
        """(armed, settled: confirmed?, freed) since the last call."""
        out = (self._new_armed, self._settled, self._freed)
        self._new_armed, self._settled, self._freed = set(), {}, set()
        return out

    def take_failed_blocks(self, rids) -> set[int]:
        """The blocks of those armed requests ``rids`` whose pull ended unconfirmed (failed, or stopped by an
        abort), each once. ``rids``: armed requests vLLM took (their blocks are in its prefix cache) that a
        step which did not run them waited for: it reports these as load errors (vLLM fails whatever read
        them) and the scheduler evicts them (lockstep.py, prefix caching)."""
        out: set[int] = set()
        for rid in rids:
            a = self._armed.get(rid)
            if a is not None and a.outcome is False and not a.shared_reported:
                a.shared_reported = True
                out.update(b for b in a.blocks if b)
        return out

    def _maybe_arm(self, p: Pull, now: float) -> None:
        if self.lockstep_lead_s is None or p.armed or p.final or not self.num_layers:
            return
        if p.expect is None:
            p.expect = frozenset((t.group, lb) for t in p.spec.tables for lb in t.local_block_ids[t.first_block:]
                                 if lb != 0)
            p.clock = ArmClock(self.num_layers)
        if not p.expect:
            return
        announced = min(self._announced(p, key) for key in p.expect)
        if not p.clock.ready(min(announced, self.num_layers), now, self.lockstep_lead_s):
            return
        p.armed = True
        p.deadline = min(p.deadline, now + self.lockstep_max_wait_s)  # decode's whole step waits for it
        self._armed[p.rid] = Armed(p.spec.blocks_to_fill)
        self._new_armed.add(p.rid)
        self._results.done.add(p.rid)  # to vLLM now: its step waits per layer (armed_blocking)
        self._count("lockstep_armed")

    def _announced(self, p: Pull, key: tuple[int, int]) -> int:
        got, q = p.got.get(key), p.queued.get(key)
        w = p.inflight.get(key) if p.inflight_epoch == p.epoch else None
        return max(got[1] if got else 0, w[2] if w else 0, q[2] if q else 0)

    def _layers_read(self, p: Pull) -> int:
        return min((p.got[k][1] if k in p.got else 0) for k in p.expect) if p.expect else 0

    # ----- internals -------------------------------------------------------------------------------------

    def _members(self, b: Batch) -> list[Pull]:
        return [p for p in (self._pulls.get(rid) for rid in b.rids) if p is not None and p.batch == b.id]

    def _stop(self, rid: str, state: State, why: str, now: float) -> list[CancelBatch]:
        p = self._pulls.get(rid)
        if p is None or p.state is State.SETTLING:
            return []
        if p.state is not State.READING:
            self._report(p, state, now, why)
            return []
        p.state, p.pending = State.SETTLING, (state, why)
        return self._want_cancel(self._batches[p.batch], now)

    def _want_cancel(self, b: Batch, now: float) -> list[CancelBatch]:
        if b.cancel_wanted:
            return []  # already asked; tick asks again while it has not settled
        b.cancel_wanted, b.cancel_since, b.next_cancel_at = True, now, now + b.cancel_retry_s
        return [CancelBatch(b.id, b.handle)] if b.handle is not None else []

    def _want(self, p: Pull, pairs: list[tuple[int, int, int]], epoch: int) -> None:
        """Queue the pairs not read (nor on the wire) yet at ``epoch``; a higher epoch makes all earlier
        reads stale (prefill restarted the request)."""
        if epoch != p.epoch:
            p.got.clear()
            p.queued.clear()
            p.epoch = epoch
            if p.clock is not None and not p.armed:  # lock-step: the restart's pace is its own
                p.clock = ArmClock(self.num_layers)
        on_wire = p.inflight if p.inflight_epoch == epoch else {}
        for pair in pairs:
            if len(pair) == 2:  # (local, remote): one KV cache group
                g, (lb, rb), hi = 0, pair, ALL_LAYERS
            else:
                g, lb, rb, hi = pair if len(pair) == 4 else (*pair, ALL_LAYERS)
            key = (g, lb)
            have = 0  # layers read or on the wire, from the first
            got, wire = p.got.get(key), on_wire.get(key)
            if got is not None and got[0] == rb:
                have = got[1]
            if wire is not None and wire[0] == rb:
                have = max(have, wire[2])
            if hi <= have:
                continue
            q = p.queued.get(key)
            p.queued[key] = (rb, have, max(hi, q[2]) if q is not None and q[0] == rb else hi)

    @staticmethod
    def _requeue(p: Pull) -> dict[tuple[int, int], tuple[int, int, int]]:
        """Its batch did not carry it after all: what it carried is to read again (unless stale); a position
        with a further range queued reads both as one."""
        if p.inflight_epoch != p.epoch:
            return p.queued
        out = dict(p.inflight)
        for key, (rb, lo, hi) in p.queued.items():
            w = out.get(key)
            out[key] = (rb, min(lo, w[1]), max(hi, w[2])) if w is not None and w[0] == rb else (rb, lo, hi)
        return out

    def _read(self, p: Pull, now: float) -> None:
        """Its batch ended well: more to read (READY), the end of the stream still to come (RESOLVING),
        or the lease check."""
        if p.inflight and not p.final:
            p.streamed += len(p.inflight)
            self._count("blocks_streamed", len(p.inflight))
        if p.inflight_epoch == p.epoch:  # (a read of an earlier epoch is stale: its positions are queued again)
            for key, (rb, _lo, hi) in p.inflight.items():
                got = p.got.get(key)
                p.got[key] = (rb, max(hi, got[1]) if got is not None and got[0] == rb else hi)
        p.inflight = {}
        p.read_at, p.batch = now, None
        if p.queued:
            p.state = State.READY
        elif p.final:
            self._check_lease(p, now)
        else:
            p.state = State.RESOLVING

    def _check_lease(self, p: Pull, now: float) -> None:
        """Its READ ended: done if the lease provably held until then, else wait for a renewal (due now)."""
        if p.read_at < p.held_until:
            self._report(p, State.DONE, now)
            return
        p.state = State.CONFIRMING
        p.next_renew = now
        self._count("lease_proof_waits")

    def _renewals_due(self, now: float) -> list[Renew]:
        groups: dict[tuple[str, str], list[Pull]] = {}
        for p in self._pulls.values():
            if (p.lease is not None and p.next_renew <= now and p.state is not State.SETTLING
                    and p.lease.group not in self._renewing):
                groups.setdefault(p.lease.group, []).append(p)
        actions = []
        for group, pulls in groups.items():
            self._renewing.add(group)
            # at most MAX_RENEW_IDS a call (a bootstrap server's max_lookup_ids refuses more, every time): the
            # most overdue first, the rest are due again as soon as this call returns
            if len(pulls) > MAX_RENEW_IDS:
                pulls = sorted(pulls, key=lambda p: p.next_renew)[:MAX_RENEW_IDS]
            actions.append(Renew(group, tuple(p.lease.request_id for p in pulls), tuple(p.rid for p in pulls),
                                 max(p.lease.lease_s for p in pulls),
                                 tuple((p.rid, p.check) for p in pulls if p.check is not None)))
        return actions

    def _report(self, p: Pull, state: State, now: float, why: str = "") -> None:
        """The one place a pull leaves the table: exactly one outcome per request. An armed pull was
        reported to vLLM already: its outcome goes to the step that runs it (take_step) instead."""
        del self._pulls[p.rid]
        p.state, p.batch, p.pending = state, None, None
        if p.armed:  # never again to vLLM's finished_recving: the request runs (or ran) already
            armed = self._armed[p.rid]
            armed.outcome = state is State.DONE
            self._settled[p.rid] = armed.outcome
            if armed.outcome and p.final_at:
                self._sample("tail_s", now - p.final_at)  # the record to the KV in place, as for any other
            self._count({State.DONE: "lockstep_ok", State.CANCELLED: "lockstep_cancelled"}.get(state, "lockstep_failed"))
            if state is State.FAILED:
                self._messages.append(f"kvlink: pull for request {p.rid} failed after decode's step began with "
                                      f"its KV: {why}; the step reports its blocks as load errors")
            if armed.free_wanted:
                self._freed.add(p.rid)
                del self._armed[p.rid]
            return
        if state is State.DONE:
            self._results.done.add(p.rid)
            self._count("pulls_ok")
            if p.read_at:
                self._sample("pull_s", now - p.submitted)
                self._settled_at[p.rid] = now
            if p.final_at and p.spec.source.transfer_id is not None:
                self._sample("tail_s", now - p.final_at)  # concurrent pairing: after prefill published
        elif state is State.CANCELLED:
            self._results.done.add(p.rid)
            self._count("pulls_cancelled")
        else:
            self._results.failed[p.rid] = p.spec.blocks_to_fill
            self._error_blocks.update(p.spec.blocks_to_fill)
            self._count("pulls_failed")
            self._messages.append(f"kvlink: pull for request {p.rid} failed: {why}; kv_load_failure_policy applies")

    def _count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def _sample(self, key: str, v: float) -> None:
        self.samples.setdefault(key, []).append(v)


def _moved(p: Pull, pairs: list[tuple[int, ...]]) -> tuple[int, int, int, int] | None:
    """(group, local block, remote block read or on the wire, remote block ``pairs`` name) of the first
    position ``pairs`` put in another remote block than the one already read into it, or None."""
    on_wire = p.inflight if p.inflight_epoch == p.epoch else {}
    for pair in pairs:
        g, lb, rb = (0, *pair) if len(pair) == 2 else pair[:3]
        for seen in (p.got.get((g, lb)), on_wire.get((g, lb))):
            if seen is not None and seen[0] != rb:
                return g, lb, seen[0], rb
    return None
