"""Decode's pulls carried out: the pull table's actions (resolve, post a READ, wait, cancel, renew) on the
worker's threads, and what happened fed back to the table as events.

The table (pulls.py) is pure logic: events in, actions out. ``Puller`` owns the one lock around it, carries
out its actions outside that lock (a bootstrap long poll, first contact with a prefill engine, a READ
through the transport, a cancel that may block), and feeds each outcome back as an event. It is the decode
half of KVLinkWorker (worker.py), which supplies the state it works on: the configuration and rank, the
transport engine and the KV cache's regions and layouts (register_kv_caches), the thread pools, the
staging pool's stager and landing slots, and the nudger. Which thread runs what is in worker.py's
docstring.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlink import trace
from kvlink.bootstrap.errors import BootstrapUnavailable, LookupTimeout, TooManyWaiters
from kvlink.errors import Canceled, NotSettled, PeerChanged
from kvlink.vllm.contact import LocalKV, PullFailed, expected_name, legs_for
from kvlink.vllm.lease import RecordCheck
from kvlink.vllm.lockstep import DEFAULT_STEP_S, STEP_EMA, lead_s
from kvlink.vllm.metadata import PullSpec
from kvlink.vllm.plan import LayerMap, PairingError, ReadPlan, build_plan, group_pairs, ready_pairs, step_pairs
from kvlink.vllm.pulls import ALL_LAYERS, CancelBatch, Lease, Post, PullTable, Renew, Resolve
from kvlink.vllm.stager import Pending, Stager

logger = logging.getLogger(__name__)

# A bootstrap server answering too_many_waiters (429: as many long polls as it takes) is asked again after
# these pauses (each jittered to 50-100%), while the pull's deadline allows; then the pull fails.
BUSY_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.0, 1.0)
# Concurrent pairing: a pull waiting for prefill's record holds a resolver thread through its long polls. A
# poll lasts at most this long, so a pull that ended meanwhile (abort, timeout) frees its thread this soon.
POLL_SLICE_S = 5.0


@dataclass(eq=False)
class _Leg:
    """One prefill rank a pull reads from: our peer handle and the layers (or head ranges) it serves."""

    peer: Any
    layers: list[LayerMap]
    tp_rank: int
    pp_rank: int


@dataclass(eq=False)
class _Remote:
    """A prefill engine we pull from: one leg per prefill rank we read (shard.py; one with equal TP and no
    PP). Hashed by identity: the table groups READY pulls by it, and a batch is one READ per leg."""

    key: tuple[str, str]  # (bootstrap url, engine id)
    legs: list[_Leg]
    looked_up: float = 0.0  # when the bootstrap server's answer naming its ranks arrived (monotonic)
    launch: str | None = None  # the launch its ranks registered with (None: unfenced, or not one)


class _Batches:
    """Several transport batches (one READ per layer when the destination is not one region) as one.

    It fails only once every part has stopped: a part's error cancels the others first, so nothing
    reports the pulls failed (and vLLM reuses their blocks) while another part still writes into them.
    """

    def __init__(self, parts: list[Any]):
        self.parts = parts

    def poll(self) -> bool:
        """Non-blocking (vLLM's thread polls it): a failed part is reported as NotSettled, so the others are
        stopped by the kvlink-cancel thread (a backend's cancel may block) before the pulls fail."""
        done, error = True, None
        for b in self.parts:
            try:
                done = b.poll() and done
            except Exception as e:  # noqa: BLE001 - poll every part, then report
                error = error or e
        if error is not None:
            raise NotSettled(f"one READ of a batch failed ({type(error).__name__}: {error}); stopping the others")
        return done

    def wait(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for b in self.parts:
            try:
                b.wait(max(0.0, end - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                self._stop_all(e)

    def _stop_all(self, error: BaseException) -> None:
        self.cancel()  # NotSettled from here: the table keeps the pulls until a later cancel settles
        raise error

    def cancel(self) -> bool:
        stopped, unsettled = False, None
        for b in self.parts:
            try:
                stopped = bool(b.cancel()) or stopped
            except NotSettled as e:
                unsettled = unsettled or e
            except Exception:  # noqa: BLE001 - a part that failed by itself has stopped writing
                pass
        if unsettled is not None:
            raise unsettled
        return stopped


class _Landing:
    """Decode with host staging: a READ into landing slots, then the copy of those slots into the pulls'
    blocks, as one batch. It ends (``poll``/``wait``) only once the blocks hold the KV; ``cancel`` returns
    only once nothing writes into them: a copy under way is waited for (and the batch counts as finished),
    one not begun never begins."""

    def __init__(self, read: Any, stager: Stager, moves: list[tuple[int, int, tuple[int, ...] | None]], fence: Any):
        self.read, self.stager, self.moves, self.fence = read, stager, moves, fence
        self._lock = threading.Lock()
        self._copy: Pending | None = None
        self._copied = False
        self._stopped = False
        self.copy_s = 0.0

    def poll(self) -> bool:
        self.read.poll()  # raises the READ's error
        return self._copied

    def wait(self, timeout_s: float) -> None:
        self.read.wait(timeout_s)
        with self._lock:
            if self._stopped:
                raise Canceled("kvlink: batch cancelled before its copy into the KV cache")
            t0 = time.monotonic()
            # (slot, block, layers): None is every layer; a layer-wise streamed read moved only some
            for layers in dict.fromkeys(m[2] for m in self.moves):
                mine = [m for m in self.moves if m[2] == layers]  # (in order: CUDA's last copy ends last)
                self._copy = self.stager.from_pool([m[0] for m in mine], [m[1] for m in mine], self.fence,
                                                   None if layers is None else list(layers))
        self._copy.wait()
        self.copy_s = time.monotonic() - t0
        self._copied = True

    def cancel(self) -> bool:
        with self._lock:
            copy, self._stopped = self._copy, self._copy is None
        if copy is not None:
            copy.wait()  # under way: it finishes, and the batch with it
            self._copied = True
            return False
        self.read.cancel()  # NotSettled propagates: the landing slots stay claimed until it settles
        return True


def _not_settled(e: BaseException) -> bool:
    """The backend's way of saying "cancel asked, but the batch may still write" (Mooncake)."""
    return isinstance(e, NotSettled)



class Puller:
    """Decode's pulls on the worker's threads (the decode half of KVLinkWorker: see the module docstring)."""

    def _apply(self, event: Callable[[PullTable, float], list | None]) -> None:
        """Feed one event to the table under the lock, then carry out what it asks, outside the lock."""
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
            actions = event(self._table, now) or []
            if self._landing_slots:
                actions += self._give_back_landing(now)
            messages = self._table.take_messages()
            nudge = self._nudger is not None and not self._nudged and self._table.has_results()
            self._nudged = self._nudged or nudge
            if self._table.lockstep_lead_s is not None:
                self._landed.notify_all()  # a step waiting in lock-step looks again
        if nudge:
            self._nudger.nudge()
        for m in messages:
            logger.warning("%s", m)
        self._carry_out(actions)

    def _carry_out(self, actions: list) -> None:
        # Posts first: a READ on the wire is what a request waits for; renewals run beside it.
        for a in sorted(actions, key=lambda a: not isinstance(a, Post)):
            try:
                self._execute(a)
            except Exception as e:  # noqa: BLE001 - the table hears of it, so no pull is left waiting
                logger.exception("kvlink: carrying out %s failed", type(a).__name__)
                if isinstance(a, Resolve):
                    self._apply(lambda t, now, rid=a.pull.rid, e=e: t.resolve_failed(rid, _why(e), now))
                elif isinstance(a, Renew):
                    self._apply(lambda t, now, a=a: t.renew_failed(a.group, a.rids, now))
                # A Post reports its own failures (_post); a CancelBatch is asked again by the ticker.

    def _execute(self, a) -> None:
        if isinstance(a, Post):
            self._post(a)
        elif isinstance(a, CancelBatch):
            self._canceller.submit(self._cancel_batch, a)
        elif isinstance(a, Renew):
            self._leases.run(a)
        elif isinstance(a, Resolve):
            self._resolver.submit(self._resolve, a.pull.spec)

    def _submit(self, spec: PullSpec) -> None:
        src = spec.source
        trace.event("pull_start", rid=spec.request_id)
        with self._lock:
            kept = self._remotes.get((src.bootstrap_url, src.engine_id)) if (
                src.block_ids is not None and src.engine_id is not None and src.request_id is not None) else None
            actions = self._table.submit(spec, time.monotonic())
        if actions and self._reusable(kept, src.launch):
            # Sequential pairing with a peer we already talk to: nothing to ask the network, so post the
            # READ now, on vLLM's thread, instead of waking a resolver (a GIL hand-off costs up to the
            # 5 ms switch interval while the worker's idle loop spins; measured ~9 ms per request). A stale
            # peer, or one of another launch than the params name, means asking the bootstrap server again:
            # a resolver does that.
            self._resolve(spec)
        else:
            self._carry_out(actions)

    def _resolve(self, spec: PullSpec, attempt: int = 0) -> None:
        """Find the remote record and engine, check compatibility, connect, pair; then post. On a resolver
        thread, or inline from _submit when everything is known already (no network). A bootstrap server
        that did not answer (a stall, a dropped connection) is asked again, up to twice, on a resolver
        thread while the pull's deadline allows: one slow answer does not cost decode a recompute."""
        src, rid = spec.source, spec.request_id
        trace.event("resolve", rid=rid, attempt=attempt)
        try:
            cli = self._clients_for(src.bootstrap_url)
            engine_id, remote_rid, blocks = src.engine_id, src.request_id, src.block_ids
            # (the params' lease is the client's word: at most this engine's own, so one request cannot make
            # the renewal every pull from that prefill shares ask more than a bootstrap server grants)
            lease_s = min(src.lease_s or self.cfg.lease_s, self.cfg.lease_s)
            now = time.monotonic()
            held_until, renew_at = 0.0, now  # sequential params say nothing of the lease left: renew now
            epoch, check = 0, None  # the params' word is checked against the record (lease.RecordCheck)
            rec = None
            if src.transfer_id is not None and (blocks is None or engine_id is None):
                found = self._await_record(cli, spec, engine_id)
                if found is None:
                    return  # cancelled meanwhile
                rec, now = found
                epoch = rec.epoch
                engine_id, remote_rid, blocks = rec.engine_id, rec.request_id, tuple(map(tuple, rec.block_ids))
                check = None  # (the record's own)
                if spec.num_tokens is not None and rec.num_tokens != spec.num_tokens:
                    raise PairingError(f"request {rid}: prefill computed {rec.num_tokens} tokens, decode loads "
                                       f"{spec.num_tokens}: a Mamba state continues only from the tokens it saw")
                self._check_prompt(spec, rec.prompt_sha, rec.num_tokens)
                held_until = now + rec.lease_remaining_s
                renew_at = time.monotonic() + min(lease_s, rec.lease_remaining_s) / 3
            remote = self._remote(cli, src.bootstrap_url, engine_id, rec.launch if rec is not None else src.launch)
            if remote.looked_up > now:
                # Its ranks were looked up after the record was asked for: a prefill that restarted in between
                # (re-registered, the old process's records dropped) would be read at the old record's block
                # ids. No read is trusted until a renewal proves the record still stands.
                held_until, renew_at = 0.0, time.monotonic()
            if rec is None:  # sequential: the params came from decode's client
                check = RecordCheck(tuple(map(tuple, blocks)),
                                    tuple((n, d) for n, d in ((spec.prompt_tokens, spec.prompt_sha),
                                                              (spec.whole_tokens, spec.whole_sha)) if d is not None),
                                    spec.num_tokens, remote.launch,
                                    (spec.prompt_tokens, spec.whole_tokens) if spec.whole_tokens else ())
            pairs = group_pairs(rid, spec.tables, blocks)
        except Exception as e:  # noqa: BLE001 - any failure means: recompute locally
            if isinstance(e, BootstrapUnavailable) and attempt < 2 and self._may_retry(rid):
                logger.info("kvlink: pull for request %s: %s; asking again", rid, _why(e))
                self._resolver.submit(self._resolve, spec, attempt + 1)
                return
            if isinstance(e, TooManyWaiters) and attempt < len(BUSY_BACKOFF_S) and self._may_retry(rid,
                                                                                                BUSY_BACKOFF_S[attempt]):
                # Back-pressure (the server holds as many long polls as it takes), not a failure: ask again
                # a little later, jittered so that the refused do not come back together, while the deadline
                # allows.
                logger.info("kvlink: pull for request %s: %s; asking again", rid, _why(e))
                self._resolver.submit(self._resolve_later, spec, attempt + 1,
                                      BUSY_BACKOFF_S[attempt] * random.uniform(0.5, 1.0))
                return
            if isinstance(e, PullFailed) and e.reason:
                with self._lock:
                    self._stats.add(f"compat_refused.{e.reason}")
            # fail, not resolve_failed: a streamed piece's READ may be on the wire (it is stopped first)
            why = _why(e)
            self._apply(lambda t, now: t.fail(rid, why, now))
            return
        lease = Lease(src.bootstrap_url, engine_id, remote_rid, lease_s)
        self._apply(lambda t, now: t.resolved(rid, remote, pairs, lease, held_until, renew_at, now, epoch, check))

    def _may_retry(self, rid: str, after_s: float = 0.0) -> bool:
        """The pull still runs and its deadline leaves room for one more bootstrap call (``after_s`` from now)."""
        with self._lock:
            pull = self._table.get(rid)
            return (pull is not None and not self._closed
                    and pull.deadline - time.monotonic() > after_s + self.cfg.bootstrap_timeout_s + 1.0)

    def _resolve_later(self, spec: PullSpec, attempt: int, delay_s: float) -> None:
        time.sleep(delay_s)  # on a resolver thread, as a long poll would be
        self._resolve(spec, attempt)

    def _check_prompt(self, spec: PullSpec, sha: str | None, tokens: int) -> None:
        """Concurrent pairing: prefill's digest of its first ``tokens`` prompt tokens (params.prompt_digest)
        must be decode's own over as many: the tokens decode loads, or its whole prompt. A count that is
        neither is another prompt too. PairingError (the KV is not used) otherwise; nothing to compare where
        either side has no token ids (prompt embeddings). (Sequential pairing: lease.RecordCheck, beside the first
        renewal.)"""
        mine = {n: d for n, d in ((spec.prompt_tokens, spec.prompt_sha), (spec.whole_tokens, spec.whole_sha))
                if d is not None}
        counted = tokens and spec.whole_tokens and tokens not in (spec.prompt_tokens, spec.whole_tokens)
        if not counted and (sha is None or not mine or mine.get(tokens) == sha):
            return  # (no digest on one side, embeddings: the count is still compared; a piece without one has 0)
        with self._lock:
            self._stats.add("prompt_mismatch")
        what = (f"{tokens} prompt tokens that are not decode's" if tokens in mine and not counted else
                f"a prompt of {tokens} tokens, decode's has {spec.whole_tokens}")
        raise PairingError(f"request {spec.request_id}: prefill computes {what} (another prompt under this transfer "
                           "id, or the same text tokenized otherwise): its KV is not used")

    def _await_record(self, cli, spec: PullSpec, engine_id: str | None):
        """Concurrent pairing: long-poll the bootstrap server until prefill publishes the request, and
        meanwhile read the blocks it reports finished (streamed KV: pulls.py, ``piece``). Returns (the
        published record, when it was asked for), or None when the pull ended meanwhile."""
        rid, src = spec.request_id, spec.source
        after = 0 if spec.num_tokens is None else None  # a Mamba state exists only at the end: no pieces
        layers = self._layer_ids is not None
        heard = time.monotonic()  # prefill is waited for up to lookup_wait_s without news
        while True:
            with self._lock:
                pull = self._table.get(rid)
                asked = time.monotonic()
                wait = max(0.0, min(heard + self.cfg.lookup_wait_s, pull.deadline) - asked) if pull else 0.0
            if pull is None:
                return None
            try:
                rec = cli.lookup_transfer(src.transfer_id, wait_s=min(wait, POLL_SLICE_S), engine_id=engine_id,
                                          after=after, layers=layers, reader=self._reader)
            except LookupTimeout:
                if wait <= POLL_SLICE_S:
                    raise
                continue  # a slice ended: the pull is looked at again (ended meanwhile: its thread is free)
            heard = time.monotonic()
            trace.event("answer", rid=rid, transfer_id=src.transfer_id, partial=rec.partial, layers=rec.layers,
                        version=rec.version, asked=round(asked, 6))
            if rec.partial:  # every piece carries the whole prompt's digest: refused before anything is read
                self._check_prompt(spec, rec.prompt_sha, rec.prompt_tokens)
            if not rec.partial:
                return rec, asked
            remote = self._remote(cli, src.bootstrap_url, rec.engine_id, rec.launch)
            if remote.looked_up > asked:
                # Its ranks were looked up after this progress was asked for: a prefill that restarted in
                # between would be read at the old process's block ids. Asked again (``after`` unchanged):
                # what the new lookup's registrations stand behind comes back at once.
                continue
            after = rec.version
            whole = tuple(map(tuple, rec.block_ids))
            pairs: list[tuple[int, ...]] = ready_pairs(rid, spec.tables, whole)
            # layer-wise: the running step's blocks, in this rank's layers below rec.layers (all: whole)
            have = sum(1 for i in (self._layer_ids or {}).values() if i < rec.layers) if rec.step_block_ids else 0
            if have:
                hi = ALL_LAYERS if have == len(self._layer_rank) else have
                pairs += [(*pr, hi) for pr in step_pairs(rid, spec.tables, whole, tuple(map(tuple,
                                                                                          rec.step_block_ids)))]
            self._apply(lambda t, now, rec=rec, pairs=pairs: t.piece(rid, remote, pairs, rec.epoch, now))

    def _reusable(self, kept: _Remote | None, launch: str | None) -> bool:
        """A kept remote serves a pull without asking the bootstrap server: its peers are not stale and it is
        of the launch the pull names (if any)."""
        return kept is not None and not self._stale(kept) and (launch is None or kept.launch == launch)

    def _remote(self, cli, url: str, engine_id: str, launch: str | None = None) -> _Remote:
        """The prefill engine's ranks this rank reads, connected (contact.py decides what, from which). A
        remote kept from an earlier pull is used again unless a rank's peer is stale (transport
        ``peer_stale``: its process closed the connection, as a prefill restarted under the same engine id
        does): then the ranks are asked of the bootstrap server again and connected by the names their
        registrations give now, instead of failing the pull on the old process's name. If they name the
        same processes (a path that dropped idle connections: the next READ reopens them under the same
        names), the kept remote stays, so pulls streaming through it keep their pieces.

        ``launch``: the launch that published (or streams) what is about to be read (RequestRecord.launch).
        Its block ids name memory of that launch's processes only: a kept remote of another launch is
        looked up again, and ranks registered by another launch, or by several (some ranks re-registered,
        others not yet), are refused (``engine_changed``: a rolling restart, the old process still serving
        while the new one is registered under the same id)."""
        key = (url, engine_id)
        with self._lock:
            kept = self._remotes.get(key)
        if self._reusable(kept, launch):
            return kept
        regs = cli.engine_ranks(engine_id)
        looked_up = time.monotonic()  # (after the answer: a registration it names may be that recent)
        launches = {reg.launch for reg in regs}
        if len(launches) > 1:  # some ranks re-registered, others not yet: not one process set to read from
            raise PullFailed(f"prefill engine {engine_id}: its ranks are registered by several launches "
                             f"({', '.join(sorted(str(x) for x in launches))}: replaced under the same engine id, "
                             "the restart under way); nothing read", "engine_changed")
        registered = launches.pop() if launches else None
        if launch is not None and registered != launch:
            raise PullFailed(f"prefill engine {engine_id}: the request comes from launch {launch}, but the engine's "
                             f"ranks are registered by launch {registered} (replaced under the same engine id); "
                             "nothing read", "engine_changed")
        try:
            legs = legs_for(engine_id, regs, LocalKV(
                self.rank.tp_rank, self.rank.tp_size, self.rank.pp_rank, self.rank.pp_size, tuple(self.layer_names),
                self.layout, self._local_geoms, self._total_heads, self.compat, self.compat_hash,
                groups={n: self._layer_group.get(n, 0) for n in self.layer_names}, layouts=self.layouts,
                scales=self.kv_scales, head_scales=self.kv_head_scales))
        except PullFailed as e:
            if e.detail and key not in self._mismatch_logged:
                self._mismatch_logged.add(key)
                logger.error("%s", e.detail)
            raise
        peers = [self._connect(engine_id, reg) for reg, _ in legs]
        if kept is not None and len(peers) == len(kept.legs) and all(
                p is leg.peer or p == leg.peer for p, leg in zip(peers, kept.legs)):
            return kept
        remote = _Remote(key, [_Leg(peer, layers, reg.tp_rank, reg.pp_rank)
                               for peer, (reg, layers) in zip(peers, legs)], looked_up, registered)
        with self._lock:  # two contacts at once: both use the first one's (one batch per engine)
            current = self._remotes.get(key)
            stored = current is None or current is kept
            if stored:
                self._remotes[key] = remote
                if kept is not None:
                    self._stats.add("remote_refreshed")
        if not stored:  # (another contact's, of the same registrations or newer)
            return current
        if kept is not None:
            logger.info("kvlink: prefill engine %s answers as other processes than at the last pull (restarted)",
                        engine_id)
        logger.info("kvlink: connected to prefill engine %s (TP=%d, PP=%d) from tp%d pp%d: %s", engine_id,
                    regs[0].tp_size, regs[0].pp_size, self.rank.tp_rank, self.rank.pp_rank,
                    ", ".join(f"tp{reg.tp_rank} pp{reg.pp_rank} at {reg.transport_addr} ({len(layers)} layers)"
                              for reg, layers in legs))
        return remote

    def _stale(self, remote: _Remote) -> bool:
        """A peer of ``remote`` may no longer be the process it named (transport ``peer_stale``; an engine
        closing is stale too: the pull then fails on a resolver thread, not on vLLM's)."""
        try:
            return any(self.engine.peer_stale(leg.peer) for leg in remote.legs)
        except Exception:  # noqa: BLE001
            return True

    def _connect(self, engine_id: str, reg) -> Any:
        """The transport peer of one prefill rank, the process its registration names and no other: a process
        that took the address since (the registered one died, its registration not yet expired) has other
        memory behind the same region ids, and reading it would hand vLLM another request's KV."""
        try:
            return self.engine.connect(reg.transport_addr, expect=expected_name(reg))
        except PeerChanged as e:
            raise PullFailed(f"prefill engine {engine_id} tp{reg.tp_rank} pp{reg.pp_rank} is gone: another process "
                             f"took its address ({e}); nothing read", "engine_changed") from e

    @property
    def _total_heads(self) -> int:
        """The model's KV heads over all TP ranks (0: MLA's latent)."""
        if not self.layout.heads:
            return 0
        return self.rank.kv_heads or self.layout.heads * self.rank.tp_size

    def _post(self, a: Post) -> None:
        """One READ of every pull in ``a`` from its remote engine (one per layer if the destination is
        not one region); then the table hears it was posted, and a waiter thread blocks on it. With host
        staging the READ lands in slots of the staging pool and the batch copies them into the pulls'
        blocks before it ends (_Landing)."""
        remote: _Remote = a.remote
        pulls, landing = list(a.pulls), None
        if self._landing is not None:
            pulls, landing = self._claim_landing(a)
            if not pulls:
                return
        parts, nbytes, ndesc, nblocks = [], 0, 0, 0
        try:  # whatever raises before a part is on the wire fails the pulls (post_failed), never strands them
            # (group, local block, remote block) per pull; with staging the local block is a landing slot
            pairs = {p.rid: [(0, slot, rb, lo, hi) for slot, rb, _, lo, hi in landing[p.rid]] if landing
                     else list(p.pairs) for p in pulls}
            # layer-blocks written: a group with no layers on this PP stage moves nothing here
            nblocks = sum(min(self._group_layers.get(g, 0), hi) - min(self._group_layers.get(g, 0), lo)
                          for p in pulls for g, _, _, lo, hi in pairs[p.rid])
            dests = [(leg.peer, self._local_region, leg.layers) for leg in remote.legs] \
                if self._local_region is not None else [
                (leg.peer, self._layer_dest[lm.name], [lm]) for leg in remote.legs for lm in leg.layers]
            for peer, region, layers in dests:  # one READ per prefill rank (and per layer without one region)
                plan = ReadPlan.concat([self._plan(layers, pairs[p.rid]) for p in pulls])
                if not len(plan):
                    continue  # a layer range none of this prefill rank's layers are in (PP)
                parts.append(self.engine.read(peer, region, plan.local_offsets, plan.remote_region_ids,
                                              plan.remote_offsets, plan.lengths,
                                              timeout_s=self.cfg.transfer_timeout_s))
                nbytes, ndesc = nbytes + plan.nbytes, ndesc + len(plan)
        except Exception as e:  # noqa: BLE001
            self._drop_remote(remote)
            why = _why(e)
            if not parts:
                self._apply(lambda t, now: t.post_failed(a.batch, why, now))
                return
            # Parts already on the wire may write until they are stopped: the pulls fail once they settle.
            # One event: between two, vLLM's thread could see the posted parts end (_settle_finished) and
            # trust the batch with the missing parts' layers never written.
            handle = _Batches(parts)
            self._apply(lambda t, now: [*t.posted(a.batch, handle, nbytes, 0, ndesc, now),
                                        *t.batch_unsettled(a.batch, why, now)])
            return
        if not parts:  # nothing of these ranges is on any rank this one reads (cannot happen: every layer is)
            self._apply(lambda t, now: t.posted(a.batch, None, 0, 0, 0, now))
            self._apply(lambda t, now: t.batch_ended(a.batch, None, now))
            return
        handle = parts[0] if len(parts) == 1 else _Batches(parts)
        if landing:
            moves = [(slot, lb, self._layer_span(lo, hi)) for p in pulls for slot, _, lb, lo, hi in landing[p.rid]]
            handle = _Landing(handle, self._stager, moves, self._fence)
        self._apply(lambda t, now: t.posted(a.batch, handle, nbytes, nblocks, ndesc, now))
        if trace.enabled():
            trace.event("read_post", batch=a.batch, rids=[p.rid for p in pulls], blocks=nblocks, bytes=nbytes)
        self._waiter.submit(self._await, a.batch, handle, remote)

    def _plan(self, layers: list[LayerMap], pairs: list[tuple[int, int, int, int, int]]) -> ReadPlan:
        """Descriptors of one pull's (group, local, remote, first layer, end layer) pairs over ``layers``:
        each group's blocks in that group's layers only (hybrid models: vLLM's block ids are per group),
        and a layer-wise streamed range in the layers of that range (by place among this rank's layers)."""
        parts = []
        for g, lo, hi in sorted({(g, lo, hi) for g, _, _, lo, hi in pairs}):
            mine = [m for m in layers if self._layer_group.get(m.name, 0) == g] if self._layer_group else layers
            if (lo, hi) != (0, ALL_LAYERS):
                mine = [m for m in mine if lo <= self._layer_rank.get(m.name, -1) < hi]
            parts.append(build_plan(mine, [(lb, rb) for gg, lb, rb, a, b in pairs if (gg, a, b) == (g, lo, hi)]))
        return parts[0] if len(parts) == 1 else ReadPlan.concat(parts) if parts else build_plan([], [])

    def _layer_span(self, lo: int, hi: int) -> tuple[int, ...] | None:
        """The stager's positions of this rank's layers in place range [lo, hi) (pulls.py); None: all."""
        if (lo, hi) == (0, ALL_LAYERS):
            return None
        return tuple(i for i, n in enumerate(self.kv_caches) if lo <= self._layer_rank.get(n, -1) < hi)

    def _claim_landing(self, a: Post) -> tuple[list, dict[str, list[tuple[int, int, int]]]]:
        """Landing slots for the pulls of ``a`` that fit in the staging pool now: (those pulls, rid ->
        [(slot, remote block, local block)]). The others wait (READY again) until a batch gives slots back;
        a pull larger than the whole pool fails. One event, so a batch that gives its slots back meanwhile
        finds the waiting pulls READY and posts them."""
        fit, landing = [], {}

        def claim(t: PullTable, now: float) -> list:
            deferred, refused, claimed = [], {}, []
            for p in a.pulls:
                n = len(p.pairs)
                if n > self._landing.capacity:
                    refused[p.rid] = (f"it needs {n} blocks of the staging pool, which holds "
                                      f"{self._landing.capacity} (raise staging_pool_mb)")
                    continue
                slots = self._landing.allocate(n)
                if slots is None:
                    deferred.append(p.rid)
                    continue
                fit.append(p)
                claimed += slots
                landing[p.rid] = [(s, rb, lb, lo, hi) for s, (_, lb, rb, lo, hi) in zip(slots, p.pairs)]
            if claimed:
                self._landing_slots[a.batch] = tuple(claimed)
            if deferred or refused:
                t.post_split(a.batch, deferred, refused, now)
            return []

        self._apply(claim)
        return fit, landing

    def _give_back_landing(self, now: float) -> list:
        """Under _lock: landing slots of batches the table let go (ended, settled) return to the pool, and
        pulls waiting for room are posted."""
        gone = [b for b in self._landing_slots if self._table.batch(b) is None]
        for b in gone:
            self._landing.free(self._landing_slots.pop(b))
        return self._table.take_posts(now) if gone else []

    def _await(self, batch: int, handle: Any, remote: _Remote) -> None:
        """Waiter thread: block on one batch (the GIL is released meanwhile), then report how it ended.

        A batch that outlives transfer_timeout_s is cancelled by wait() itself; a dropped connection
        (prefill died) fails it at once; one we cancelled ends here with an error the table ignores.
        """
        try:
            handle.wait(self.cfg.transfer_timeout_s + 1.0)
        except Exception as e:  # noqa: BLE001
            self._ended(batch, e, remote)
        else:
            trace.event("read_end", batch=batch)
            if isinstance(handle, _Landing):
                with self._lock:
                    self._stats.add("bytes_landed", sum(self._stager.slot_bytes if m[2] is None else
                                                        len(m[2]) * self.block_bytes for m in handle.moves))
                    self._stats.sample("landing_s", handle.copy_s)
            self._apply(lambda t, now: t.batch_ended(batch, None, now))

    def _settle_finished(self) -> None:
        """vLLM's thread, once a step: report batches that are already done (a non-blocking check), so
        the result goes out in this step even when the waiter thread has not got the GIL back yet."""
        with self._lock:
            posted = [(b.id, b.handle, b.remote) for b in self._table.batches()
                      if b.handle is not None and not b.cancel_wanted]
        for batch, handle, remote in posted:
            try:
                done = handle.poll()
            except Exception as e:  # noqa: BLE001
                self._ended(batch, e, remote)
                continue
            if done:
                self._apply(lambda t, now, batch=batch: t.batch_ended(batch, None, now))

    def _ended(self, batch: int, e: BaseException, remote: _Remote) -> None:
        if _not_settled(e):
            self._apply(lambda t, now: t.batch_unsettled(batch, _why(e), now))
            return
        with self._lock:
            b = self._table.batch(batch)
            ours = b is None or b.cancel_wanted  # the error of a cancel we asked for: the peer is fine
        if not ours:
            self._drop_remote(remote)  # reconnect next time
        self._apply(lambda t, now: t.batch_ended(batch, _why(e), now))

    def _cancel_batch(self, a: CancelBatch) -> None:
        """kvlink-cancel thread: ask the backend to stop a batch. Settled once cancel returns (nothing writes
        into its memory afterwards); a backend that cannot stop it says NotSettled, and the ticker asks
        again. A batch that had already finished (cancel returns False) keeps its outcome: its bytes are
        in place, so the other pulls it carried need no second READ."""
        try:
            stopped = a.handle.cancel()
        except NotSettled:
            return
        except Exception as e:  # noqa: BLE001 - it failed by itself: it writes nothing any more
            logger.debug("kvlink: cancel of batch %d: %s", a.batch, _why(e))
            stopped = True
        if stopped is False:
            try:
                finished_ok = a.handle.poll()
            except Exception:  # noqa: BLE001 - it had failed: settled, nothing to keep
                finished_ok = False
            if finished_ok:
                self._apply(lambda t, now: t.batch_ended(a.batch, None, now))
                return
        self._apply(lambda t, now: t.cancel_settled(a.batch, now))

    # ----- lock-step (lockstep.py): vLLM's thread, inside decode's step --------------------------------------

    def _start_lockstep(self) -> None:
        if not getattr(getattr(self.engine, "capabilities", None), "cancel", False):
            raise RuntimeError(f"kvlink: stream_lockstep refused: the {self.cfg.transport_backend} backend cannot "
                               "stop a READ before its cancel returns")
        if not self._layer_rank:
            logger.warning("kvlink: stream_lockstep: this model's layer names carry no single index, so no "
                           "layer-wise progress can name them; decode's steps start after the whole KV landed")
        self._table.num_layers = len(self._layer_rank)
        self._table.lockstep_lead_s = lead_s(DEFAULT_STEP_S, self.cfg.stream_lockstep_stall_ms)
        self._table.lockstep_max_wait_s = self.cfg.stream_lockstep_max_wait_s

    def lockstep_wait(self, rids: list[str], layer: str | None) -> None:
        """Before attention layer ``layer`` of a step that runs armed requests ``rids``: wait until that
        layer of theirs has landed (None: until their outcome, at the step's end). Bounded by the pulls'
        deadlines (the ticker fails a pull that passes its own)."""
        place = None if layer is None else self._layer_rank.get(layer)
        if layer is not None and place is None:
            return  # a layer kvlink does not move (no KV cache of its own)
        self.lockstep_wait_place(rids, place)

    def lockstep_wait_next(self, rids: list[str], layer: str | None) -> None:
        """Before vLLM writes the step's own KV of the layer after ``layer`` (None: the first layer), which on
        vLLM CPU (and other backends that write it in an op of its own) comes before that layer's
        ``wait_for_layer_load``: a READ landing after that write would overwrite the recomputed token's KV."""
        place = 0 if layer is None else self._layer_rank.get(layer, -2) + 1
        if 0 <= place < len(self._layer_rank):
            self.lockstep_wait_place(rids, place)

    def lockstep_wait_place(self, rids: list[str], place: int | None) -> None:
        t0 = time.monotonic()
        while True:
            with self._lock:
                if self._closed or not any(self._table.armed_blocking(r, place) for r in rids):
                    break
            self._settle_finished()  # a READ that ended is heard of now, not when the waiter gets the GIL
            with self._lock:
                if self._closed or not any(self._table.armed_blocking(r, place) for r in rids):
                    break
                self._landed.wait(0.002)
        waited = time.monotonic() - t0
        if waited > 1e-4:
            with self._lock:
                self._stats.sample("lockstep_wait_s", waited)

    def lockstep_end(self, rids: list[str], shared: list[str] = ()) -> None:
        """The step that ran armed requests ``rids`` ends: wait for their outcomes (and for those of armed
        requests ``shared`` whose blocks another request of the step may have read from the prefix cache);
        the blocks of those that failed are this step's load errors (vLLM then fails the requests)."""
        self.lockstep_wait([*rids, *shared], None)
        trace.event("lockstep_end", rids=rids)
        with self._lock:
            for rid in rids:
                failed = self._table.take_step(rid)
                self._ls_errors.update(failed)
                self._ls_evict.update(failed)  # out of the prefix cache too, whatever vLLM does with them
            if shared:
                self._stats.add("lockstep_shared_steps")
                failed = self._table.take_failed_blocks(shared)
                self._ls_errors |= failed
                self._ls_evict |= failed

    def lockstep_step_time(self, step_s: float) -> None:
        """A step without lock-step waits took ``step_s``: decode's lead for arming follows it."""
        self._ls_step_s = step_s if not self._ls_step_s else (1 - STEP_EMA) * self._ls_step_s + STEP_EMA * step_s
        with self._lock:
            if self._table.lockstep_lead_s is not None:
                self._table.lockstep_lead_s = lead_s(self._ls_step_s, self.cfg.stream_lockstep_stall_ms)

    def take_lockstep_meta(self):
        meta, self._ls_meta = self._ls_meta, None
        return meta

    def _drop_remote(self, remote: _Remote) -> None:
        with self._lock:
            if self._remotes.get(remote.key) is remote:
                del self._remotes[remote.key]

    def _run(self) -> None:
        """kvlink-pulls thread: deadlines, unsettled cancels, renewals due; sleeps until the next one."""
        self._place_thread()
        while True:
            try:
                with self._wake:
                    if self._closed:
                        return
                    now = time.monotonic()
                    cap = 0.1 if self._table.running() else 0.5
                    self._wake.wait(max(0.0, min(self._table.next_wakeup(now) - now, cap)))
                    if self._closed:
                        return
                self._apply(lambda t, now: t.tick(now))
            except Exception:  # noqa: BLE001 - a dead ticker would leave pulls without deadlines
                logger.exception("kvlink: pull ticker round failed")


def _why(e: BaseException) -> str:
    name = getattr(e, "name", None) or type(e).__name__
    return f"{name}: {e}"
