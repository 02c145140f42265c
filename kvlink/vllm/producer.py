"""Prefill's half of the connector's scheduler side: the requests kept for decode, from publish to free.

A finished ``do_remote_decode`` request's blocks are held and published to the bootstrap server (into the
embedded server's table directly, over HTTP to a standalone one), and freed exactly once: when decode
reports it pulled or abandoned, or when its lease expires (reported by the bootstrap server; decode renews
the lease while it pulls). Prefill's own deadline frees them only while the server cannot be reached. An
aborted request with a transfer id is marked abandoned at the server, so a decode waiting for it fails at
once. With host staging (staging.py) the blocks are copied into pool slots first and the slots published.
With streamed KV (stream.py) a request of concurrent pairing announces its finished blocks while it
computes. A step with nothing to run but held blocks waits (up to ``idle_step_wait_ms``) for a release.

Which held request to free when is decided by ``held.HeldTable``, which this mixin feeds under
``_held_lock`` from two threads: the scheduler thread (published, tick) and the release watcher (outcomes
polled, lookup answers, the server reached or not). ``Producer`` is mixed into KVLinkScheduler
(scheduler.py), which owns the state it works on (built in its ``__init__``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvlink import trace
from kvlink.bootstrap.errors import RequestExpired, RequestReleased
from kvlink.bootstrap.schema import RequestStatus
from kvlink.vllm import params as kvparams
from kvlink.vllm.config import ConnectorConfigError
from kvlink.vllm.params import BadParams, PrefillRequest, RemoteSource, request_digest
from kvlink.vllm.plan import NULL_BLOCK

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class Producer:
    """The prefill methods of KVLinkScheduler (see the module's docstring)."""

    def _start_bootstrap(self) -> None:
        """The embedded bootstrap server, unless ``bootstrap_url`` names one. Under data parallelism every DP
        rank reads the same ``bootstrap_port``: the first DP rank of each host serves it and the host's other
        ranks publish to it, so one address pairs a host's DP ranks (the concurrent proxy's
        ``--prefill-bootstrap``). With port 0 each DP rank serves its own, on a port of its own (sequential
        pairing: the params name it). DP ranks on several hosts behind one proxy: run a standalone server
        (``kvlink bootstrap``) and name it with ``bootstrap_url``."""
        if self.bootstrap_url is None and self.dp_local > 0 and self.cfg.bootstrap_port:
            from kvlink.bootstrap.server import listen_url

            self.bootstrap_url = listen_url(self.cfg.bootstrap_host, self.cfg.bootstrap_port)
            logger.info("kvlink: engine %s (DP rank %d on this host) publishes to the embedded bootstrap server of "
                        "this host's first DP rank, at %s", self.engine_id, self.dp_local, self.bootstrap_url)
        if self.bootstrap_url is None:
            from kvlink.bootstrap import BootstrapConfig, BootstrapServer

            self._server = BootstrapServer(BootstrapConfig(
                host=self.cfg.bootstrap_host, port=self.cfg.bootstrap_port, token=self.cfg.bootstrap_token,
                default_request_lease_s=self.cfg.lease_s, max_wait_s=min(30.0, self.cfg.lookup_wait_s),
                max_connections=self.cfg.bootstrap_max_connections, allow_insecure=self.cfg.allow_insecure))
            try:
                self._server.start()
            except OSError as e:
                raise ConnectorConfigError(
                    f"KVLinkConnector: the embedded bootstrap server cannot listen on {self.cfg.bootstrap_host}:"
                    f"{self.cfg.bootstrap_port} ({e}); free the port, set another bootstrap_port, or name a "
                    "running server with bootstrap_url") from None
            self.bootstrap_url = self._server.url
            logger.info("kvlink: embedded bootstrap server for engine %s at %s", self.engine_id,
                        self.bootstrap_url)
        threading.Thread(target=self._watch_releases, name="kvlink-release-watch", daemon=True).start()

    def _watch_releases(self) -> None:
        """Thread: ask the bootstrap server which held requests decode is done with.

        Outcomes are delivered reliably while the server keeps the engine, but a restarted server, or one
        that dropped the engine (heartbeats missed while it was stalled), has lost them. So after any failed
        poll, and every half lease anyway, held requests are looked up (``_reconcile``) and those the server
        no longer holds are freed. This thread only does the I/O; the held table decides.
        """
        warned = False
        while not self._closed.wait(self.cfg.release_poll_s):
            with self._held_lock:
                if not self._held:
                    continue
            try:
                cli = self.clients.get(self.bootstrap_url)
                outcomes = cli.poll_released(self.engine_id, self.launch)
                with self._held_lock:
                    self._held.reached()  # it answered (a reconcile refused below is not silence either)
                with self._freed:
                    if sum(self._held.released(rid, outcome) for rid, outcome in outcomes):
                        self._freed.notify_all()
                    due = self._held.lookup_due()
                    # Staged requests hold slots, not vLLM blocks: free them here, without waiting for a step.
                    frees = self._collect_frees() if self._planner is not None else []
                self._note_frees(frees)
                if due:
                    self._reconcile(cli)
                warned = False
            except Exception as e:  # noqa: BLE001 - the local lease deadline still frees blocks
                # (a poll that fails, even with an answer such as 401 after a token rotation, is silence: the
                # deadline frees what the server may no longer report; a reconcile lookup the server refuses
                # for its size shrinks instead, _reconcile)
                with self._held_lock:
                    self._held.unreachable()
                if not warned:
                    logger.warning("kvlink: cannot poll bootstrap %s for released requests: %s "
                                   "(held blocks will be freed at lease expiry)", self.bootstrap_url, e)
                    warned = True
                self._closed.wait(0.5)

    def _reconcile(self, cli) -> int:
        """Look every held request up at the bootstrap server and hand the whole answer to the held table,
        which frees those the server no longer holds (see kvlink.vllm.held). Returns how many."""
        from kvlink.bootstrap.errors import InvalidField, UnknownEngine

        with self._held_lock:  # not those being published: the server may not know them yet
            held = [rid for rid in self._held.request_ids() if rid not in self._publishing]
        answer: dict[str, object] = {}
        i = 0
        while i < len(held):
            chunk = held[i:i + self._lookup_chunk]
            try:
                answer.update(cli.lookup(self.engine_id, chunk))
            except UnknownEngine:  # the server dropped the engine, and its requests with it
                answer.update(dict.fromkeys(chunk, RequestStatus.UNKNOWN))
            except InvalidField as e:  # a server whose max_lookup_ids is below the chunk: smaller ones
                if e.field != "request_ids" or self._lookup_chunk == 1:
                    raise
                self._lookup_chunk = max(1, self._lookup_chunk // 2)
                continue
            i += len(chunk)
        with self._freed:
            freed = self._held.looked_up(answer)
            if freed:
                self._freed.notify_all()
        if freed:
            logger.warning("kvlink: bootstrap %s no longer holds %d of this engine's held requests (server "
                           "restarted, or the engine's registration lapsed); freeing their blocks",
                           self.bootstrap_url, freed)
        return freed

    def _publish(self, rid: str, groups: list[list[int]], num_tokens: int, transfer_id: str | None,
                 epoch: int, prompt_sha: str | None = None) -> None:
        """The record out, on vLLM's thread between the step and its output: into the embedded server's table
        directly when this process runs it (server.py ``BootstrapServer.publish``), else over HTTP."""
        server = self._server  # (None once shut down: the HTTP client then fails as it would)
        if server is None:
            self.clients.get(self.bootstrap_url).publish(self.engine_id, rid, groups, num_tokens, self.cfg.lease_s,
                                                         transfer_id=transfer_id, epoch=epoch, prompt_sha=prompt_sha,
                                                         launch=self.launch)
            return
        from kvlink.bootstrap import schema

        body = schema.checked(schema.PublishBody, engine_id=self.engine_id, request_id=rid, transfer_id=transfer_id,
                              block_ids=groups, num_tokens=num_tokens, lease_s=self.cfg.lease_s, epoch=epoch,
                              prompt_sha=prompt_sha, launch=self.launch)
        server.publish(body, self.cfg.bootstrap_timeout_s)

    def _finished_producer(self, request: "Request", params: dict, groups: tuple[tuple[int, ...], ...]):
        epoch = self._stream.finished(request.request_id) if self._stream is not None else 0  # its stream ends
        if self._stream_slots.pop(request.request_id, None) is not None:
            try:  # streamed into pool slots: staging takes them over, any other outcome gives them back
                return self._finished_producer_inner(request, params, groups, epoch)
            finally:
                with self._held_lock:
                    self._planner.unreserve(request.request_id)  # (a no-op once admitted)
        return self._finished_producer_inner(request, params, groups, epoch)

    def _finished_producer_inner(self, request: "Request", params: dict, groups: tuple[tuple[int, ...], ...],
                                 epoch: int):
        from vllm.v1.request import RequestStatus as VLLMStatus

        if not self.is_producer:
            return self._refuse(request, "do_remote_decode sent to an engine that is not kv_producer")
        try:
            transfer_id = PrefillRequest.from_params(params).transfer_id
        except BadParams as e:
            return self._refuse(request, str(e))
        if request.status not in (VLLMStatus.FINISHED_LENGTH_CAPPED, VLLMStatus.FINISHED_STOPPED):
            if transfer_id is not None:
                self._abandon_transfer(request.request_id, transfer_id)
            return False, None  # aborted or failed: nothing to keep
        if not any(groups):
            return False, None
        rid = request.request_id
        num_tokens = request.num_computed_tokens
        sha = request_digest(request, num_tokens)
        if self._planner is not None:  # one group (connector.py)
            return self._finished_staged(rid, groups[0], num_tokens, transfer_id, epoch, sha)
        nblocks = sum(1 for g in groups for b in g if b != NULL_BLOCK)  # nulls hold nothing
        with self._held_lock:
            # Held before the publish: decode may pull and release it, and the watcher hear that, before the
            # publish call returns (an outcome for a request not held would be dropped). Kept out of
            # reconcile lookups until the publish returns (the server may not know it yet).
            self._held.published(rid, nblocks)
            self._publishing.add(rid)
        try:
            self._publish(rid, [list(g) for g in groups], num_tokens, transfer_id, epoch, sha)
        except Exception as e:  # noqa: BLE001 - decode recomputes
            if isinstance(e, (RequestReleased, RequestExpired)) and not _maybe_applied(e):
                # An earlier try of this publish was applied and decode is done with it already (a retry after
                # a lost answer): nothing to keep, nothing to give up. (Maybe applied, below: an earlier try
                # went out unanswered and the server dropped the engine's requests since, a lapse or another
                # process registered under it; a decode handed that try may still read on its lease.)
                logger.info("kvlink: request %s: the bootstrap server says it ended already (%s); freeing it", rid,
                            e)
                return self._withdraw(rid), None
            self._count("publish_failures")
            if not _maybe_applied(e):  # the server answered no: nobody can find these blocks
                logger.warning("kvlink: publishing request %s to %s failed: %s; not keeping its KV", rid,
                               self.bootstrap_url, e)
                if transfer_id is not None:
                    self._abandon_transfer(rid, transfer_id)  # a decode long-polling it stops now
                return self._withdraw(rid), kvparams.refusal(f"publish failed: {e}")
            # No answer (a timeout): the server may apply it late, and a decode long-polling the transfer id
            # would then read these blocks. They stay held, as if published, until the server's outcome or a
            # lease after lookups stop finding the request (held.py).
            logger.warning("kvlink: publishing request %s to %s got no answer: %s; keeping its blocks until the "
                           "server says what it holds", rid, self.bootstrap_url, e)
            with self._held_lock:
                self._publishing.discard(rid)
                self._held.stamp(rid)
                self._held.unreachable()
            return True, kvparams.refusal(f"publish failed: {e}")
        with self._held_lock:
            self._publishing.discard(rid)
            self._held.stamp(rid)
        self._count("published")
        trace.event("publish", rid=rid, transfer_id=transfer_id)
        return True, RemoteSource(bootstrap_url=self.bootstrap_url, engine_id=self.engine_id, request_id=rid,
                                  block_ids=groups, num_tokens=num_tokens, transfer_id=transfer_id,
                                  lease_s=self.cfg.lease_s, prompt_sha=sha, launch=self.launch).to_params()

    def _withdraw(self, rid: str) -> bool:
        """A publish refused: True when something freed the request meanwhile (vLLM waits for that free, in
        finished_sending), False when vLLM may free its blocks now."""
        with self._held_lock:
            self._publishing.discard(rid)
            return not self._held.withdraw(rid)

    def _finished_staged(self, rid: str, table: tuple[int, ...], num_tokens: int, transfer_id: str | None,
                         epoch: int = 0, prompt_sha: str | None = None):
        """Host staging: keep the device blocks until the worker has copied them into the pool, then publish
        the slots (update_connector_output). Decode learns the slots from the bootstrap server, so its
        params carry a transfer id (one of ours when the router gave none) and no block ids: decode's
        lookup waits for the publish, and nothing reads a slot before its copy is done."""
        import time
        import uuid

        routed = transfer_id is not None  # (a decode may be long-polling the router's id, never one of ours)
        transfer_id = transfer_id or f"kvlink-{uuid.uuid4().hex}"
        try:  # before admitting: what decode cannot be told (a request id too long for the params) is refused
            answer = RemoteSource(bootstrap_url=self.bootstrap_url, engine_id=self.engine_id, request_id=rid,
                                  num_tokens=num_tokens, transfer_id=transfer_id, lease_s=self.cfg.lease_s,
                                  prompt_sha=prompt_sha).to_params()
        except BadParams as e:
            return self._refuse_published(rid, transfer_id, str(e))
        with self._held_lock:
            refused = self._planner.admit(rid, table, time.monotonic(), (transfer_id, num_tokens, epoch, prompt_sha))
        if refused:
            logger.warning("kvlink: request %s: %s; decode will compute it", rid, refused)
            if routed:
                self._abandon_transfer(rid, transfer_id)  # a decode long-polling it computes now
            return False, kvparams.refusal(refused)
        return True, answer

    def _refuse_published(self, rid: str, transfer_id: str, why: str):
        """Nothing is kept for decode (nothing was published): a decode long-polling the id hears it now."""
        logger.warning("kvlink: request %s: %s; decode will compute it", rid, why)
        self._count("bad_params")
        self._abandon_transfer(rid, transfer_id)
        return False, kvparams.refusal(why)

    def _staged(self, rid: str) -> None:
        """The worker copied the request into the pool (vLLM frees its device blocks now): publish its slots."""
        with self._held_lock:
            job = self._planner.staged(rid)
        if job is None:
            return
        transfer_id, num_tokens, epoch, prompt_sha = job.extra
        if job.restaged:  # its streamed slots went back to the pool: what decode read of them is stale
            epoch += 1
        with self._held_lock:
            # Held first, so a release that arrives as soon as the publish lands finds it; kept out of
            # reconcile lookups until the publish returns (the server may not know it yet: "unknown" must not
            # free slots decode is about to read).
            self._held.published(rid, 0)  # no device block held: the slots are the planner's
            self._publishing.add(rid)
        try:
            self.clients.get(self.bootstrap_url).publish(self.engine_id, rid, [list(job.slot_table)], num_tokens,
                                                         self.cfg.lease_s, transfer_id=transfer_id, epoch=epoch,
                                                         prompt_sha=prompt_sha, launch=self.launch)
        except Exception as e:  # noqa: BLE001 - decode's lookup ends with the abandon (or its own wait)
            # The slots stay held until the server says it does not hold the request (lookups, from the next
            # poll on) or its lease ends. Abandoned only when the server answered no: one that may have taken
            # the publish (a timeout) may have handed it to a decode that now reads the slots.
            applied = _maybe_applied(e)
            logger.warning("kvlink: publishing staged request %s to %s failed: %s%s", rid, self.bootstrap_url, e,
                           "" if applied else "; abandoning it")
            self._count("publish_failures")
            with self._held_lock:
                self._publishing.discard(rid)
                if applied:
                    self._held.stamp(rid)
                    self._held.unreachable()  # look the held requests up at the next poll
                elif self._held.withdraw(rid) and self._planner.release(rid):
                    # The server answered no (the id ended, a conflict, full): nobody can find these slots.
                    self._gauges_stale = self._slots_freed = True
                    self._freed.notify_all()
            if not applied:
                self._abandon_transfer(rid, transfer_id)
            return
        with self._held_lock:
            self._publishing.discard(rid)
            self._held.stamp(rid)
        self._count("published")

    def _abandon_transfer(self, rid: str, transfer_id: str) -> None:
        """Aborted before publishing: mark the transfer id abandoned at the bootstrap server, so a decode
        long-polling for it gets 'released' now instead of waiting lookup_wait_s."""
        def work():
            try:
                # (naming the request: an id another request of ours holds, a client's batch, is left alone;
                # a request id the server cannot take is named by no one: abandoned only if nothing holds it)
                if kvparams.wire_id(rid):
                    self.clients.get(self.bootstrap_url).abandon_transfer(self.engine_id, transfer_id, request_id=rid)
                else:
                    self.clients.get(self.bootstrap_url).abandon_transfer(None, transfer_id)
            except Exception as e:  # noqa: BLE001 - decode's bounded wait still ends it
                logger.warning("kvlink: could not mark transfer %s (request %s) abandoned: %s", transfer_id,
                               rid, e)

        self._count("aborted_transfers")
        if not self._closed.is_set():
            self._pool.submit(work)

    def _take_frees(self, wait_s: float = 0.0) -> list[str]:
        """Requests whose blocks go back to vLLM now; waits up to ``wait_s`` for the first free."""
        with self._freed:
            if wait_s:
                self._freed.wait_for(lambda: self._device_frees or self._slots_freed or self._held.has_frees(),
                                     timeout=wait_s)
            self._slots_freed = False
            frees = self._collect_frees()
            device, self._device_frees = self._device_frees, []
        self._note_frees(frees)
        return device

    def _note_frees(self, frees: list) -> None:
        for f in frees:
            self._count(f.counter)
            if f.by_deadline:
                logger.warning("kvlink: lease of request %s ran out without word from the bootstrap "
                               "server; freeing its blocks", f.request_id)

    def _collect_frees(self) -> list:
        """Under _held_lock: requests the held table frees now. A staged one's slots go back to the pool
        here; the others' device blocks wait in _device_frees for the worker (the next step's metadata)."""
        frees = self._held.tick()
        for f in frees:
            if self._planner is None or not self._planner.release(f.request_id):
                self._device_frees.append(f.request_id)
            else:
                self._gauges_stale = True  # one more step reports the pool's occupancy
                self._slots_freed = True  # a waiting request may fit now: no idle wait for the next step
                self._freed.notify_all()
        return frees

    def _track_stream(self, request: "Request") -> None:
        """Prefill: a request of concurrent pairing (a transfer id) was given blocks (again after a
        preemption): stream its finished blocks from now on."""
        params = request.kv_transfer_params
        if not isinstance(params, dict) or request.request_id in self._bad:
            return
        try:
            if not kvparams.flag(params, "do_remote_decode") or kvparams.flag(params, "do_remote_prefill"):
                return  # (both flags: refused, request_finished ends it as a decode request)
            transfer_id = PrefillRequest.from_params(params).transfer_id
        except BadParams:
            return  # request_finished refuses it
        if transfer_id is None or request.prompt_embeds is not None:
            return
        if not kvparams.wire_id(request.request_id):
            return  # never published either (request_finished: the publish is refused), so never streamed
        if self._planner is not None:  # host staging: pieces name the pool slots the request streams into
            with self._held_lock:
                slots = self._planner.reserve(request.request_id, -(-request.num_prompt_tokens // self.block_size))
            if slots is None:
                return  # no room in the pool now: staged at the end, not streamed
            self._stream_slots[request.request_id] = slots
        self._stream.track(request.request_id, transfer_id, request.num_prompt_tokens,
                           request_digest(request, request.num_prompt_tokens))

    def _stream_pieces(self, so: Any) -> list:
        """This step's streamed pieces, from vLLM's scheduler output (blocks of one KV cache group)."""
        new = [(r.req_id, list(r.block_ids[0]) if r.block_ids else [], r.num_computed_tokens)
               for r in getattr(so, "scheduled_new_reqs", ()) or () if r.req_id in self._stream]
        c = getattr(so, "scheduled_cached_reqs", None)
        cached = []
        if c is not None:
            resumed = getattr(c, "resumed_req_ids", set()) or set()
            for i, rid in enumerate(c.req_ids):
                if rid in self._stream:
                    ids = c.new_block_ids[i]
                    cached.append((rid, list(ids[0]) if ids else None, rid in resumed, c.num_computed_tokens[i]))
        if not new and not cached:
            return []
        specs = self._stream.step(new, cached, dict(getattr(so, "num_scheduled_tokens", {}) or {}))
        if not self._stream_slots:
            return specs
        import dataclasses

        return [dataclasses.replace(sp, block_ids=slots[:len(sp.block_ids)], device_ids=sp.block_ids)
                if (slots := self._stream_slots.get(sp.request_id)) is not None else sp for sp in specs]

    def on_new_request(self, request: "Request") -> None:
        """Prefill, a request for decode on a model with state layers (Mamba): compute all but the last
        ``backoff`` prompt tokens and one output token, so the published state is the one decode continues
        from when it recomputes the last prompt token (as vLLM does after loading a whole prompt). Once per
        request (a preempted request comes back here)."""
        params = request.kv_transfer_params
        rid = request.request_id
        if not (self.backoff and self.is_producer and isinstance(params, dict)) or rid in self._backed_off:
            return
        try:
            if not kvparams.flag(params, "do_remote_decode"):
                return
        except BadParams:
            return  # request_finished refuses it
        ids = request.prompt_token_ids
        if ids is None or request.prompt_embeds is not None or request.num_prompt_tokens <= self.backoff:
            return  # a prompt of embeddings: decode, which has no ids of it, computes it
        del ids[-self.backoff:]
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        self._backed_off.add(rid)

    def _stage_jobs(self, frees: list[str]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """Staging jobs that got slots this step; requests that waited a whole lease for room are given up
        (their device blocks freed: appended to ``frees``; decode's lookup answered 'released')."""
        import time

        with self._held_lock:
            start, expired = self._planner.take_jobs(time.monotonic())
        for j in expired:
            logger.warning("kvlink: request %s waited %.0f s for room in the staging pool (staging_pool_mb=%d) "
                           "and is given up; decode will compute it", j.request_id, self._planner.wait_s,
                           self.cfg.staging_pool_mb)
            frees.append(j.request_id)
            self._abandon_transfer(j.request_id, j.extra[0])
        return [(j.request_id, j.blocks, j.slots) for j in start]

    def _idle_wait(self, scheduler_output: Any) -> float:
        """How long this step may wait for a release: only when the engine steps for nothing but held
        blocks (nothing scheduled or just finished, no pull of its own in flight). A free already decided
        ends the wait at once."""
        if not (self.cfg.idle_step_wait_ms and self.has_pending_work() and not self._pulls and not self._new_pulls
                and not self._new_cancels
                and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
                and not getattr(scheduler_output, "finished_req_ids", None)):
            return 0.0
        if self._planner is not None:
            with self._held_lock:
                if self._planner.copying():
                    # A copy's end is heard of at a step: step often, without spinning. (Requests waiting
                    # for room take the normal wait: freed slots end it at once.)
                    return min(0.001, self.cfg.idle_step_wait_ms / 1e3)
        return self.cfg.idle_step_wait_ms / 1e3


def _maybe_applied(e: BaseException) -> bool:
    """Whether a bootstrap call that raised ``e`` may still have been applied by the server: no answer came
    (a timeout, a connection lost after the request went out). An answer (any HTTP error) or a connection
    refused says it was not."""
    from kvlink.bootstrap.errors import BootstrapError, BootstrapUnavailable, UnknownEngine

    if getattr(e, "maybe_applied", False):  # an earlier attempt went out unanswered (client.py), or a 200 unread
        return True
    if isinstance(e, BootstrapError) and (not isinstance(e, BootstrapUnavailable) or isinstance(e, UnknownEngine)):
        return False
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return False
        cause = cause.__cause__ or cause.__context__
    return True
