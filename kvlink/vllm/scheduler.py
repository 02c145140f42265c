"""Scheduler side of KVLinkConnector (runs in the EngineCore process).

Prefill (kv_producer): keeps the blocks of finished ``do_remote_decode`` requests, publishes them to the
bootstrap server (an embedded one by default) and frees each exactly once: when decode reports it pulled
or abandoned, or when its lease expires (reported by the bootstrap server; decode renews the lease while
it pulls). Its own deadline frees them only while the bootstrap server cannot be reached. An aborted
request with a transfer id is marked abandoned at the bootstrap server (`/v1/transfer/abandon`), so a
decode waiting for it fails at once. A step with nothing to run but held blocks waits (up to
``idle_step_wait_ms``) for a release, so an idle prefill engine does not step at ~1 kHz.

Decode (kv_consumer): for ``do_remote_prefill`` requests announces the prompt tokens as an asynchronous
external hit, hands the worker one PullSpec per request, sends cancels for aborted ones and, once the
worker reports a request, tells prefill the outcome (pulled or abandoned).

Bootstrap HTTP calls never run on the scheduler thread: a small thread pool does them. kv_transfer_params
are parsed and built in ``params``; which held request to free when is decided by ``held.HeldTable``, which
this module feeds (under ``_held_lock``) from two threads: the scheduler thread (published, tick) and the
release watcher (outcomes polled, lookup answers, the server reached or not).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvlink import trace
from kvlink.bootstrap.errors import RequestExpired, RequestReleased
from kvlink.bootstrap.pool import ClientPool
from kvlink.bootstrap.schema import Outcome, RequestStatus
from kvlink.vllm import params as kvparams
from kvlink.vllm.config import ConnectorConfig
from kvlink.vllm.held import COUNTER_OF, HeldTable
from kvlink.vllm.lockstep import LockstepBook
from kvlink.vllm.metadata import GroupTable, KVLinkMetadata, PullSpec
from kvlink.vllm.nudge import NudgeListener
from kvlink.vllm.plan import NULL_BLOCK, window_start_lost
from kvlink.vllm.params import BadParams, PrefillRequest, RemoteSource, prompt_digest
from kvlink.vllm.siblings import SIBLING_GRACE_S, Siblings, is_sample
from kvlink.vllm.staging import SlotPool, StagePlanner
from kvlink.vllm.stats import KVLinkStats
from kvlink.vllm.stream import StreamPlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVLinkScheduler:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, role: str, block_size: int,
                 window: int | None = None, window_extra: int = 0, staging_slots: int | None = None,
                 windows: tuple[tuple[int, int] | None, ...] | None = None,
                 block_sizes: tuple[int, ...] | None = None, backoff: int = 0, streamable: str | None = None):
        self.cfg, self.engine_id, self.block_size = cfg, engine_id, block_size
        # Per KV cache group: tokens per block (a state group's block covers the whole request).
        self.block_sizes = block_sizes or (block_size,)
        # Prompt tokens prefill leaves to decode (1 with Mamba layers: decode derives state N from prefill's
        # state N-1 when it recomputes the last prompt token, which it always does after a full load).
        self.backoff = backoff
        # Per KV cache group: (sliding window, extra retained tokens) of a SlidingWindowSpec group, else None.
        self.windows = windows if windows is not None else ((window, window_extra) if window else None,)
        self.is_producer = role in ("kv_producer", "kv_both")
        # Decode: a worker's pull that ends cuts a step's pull_step_wait_ms short (nudge.py)
        self._nudges = (NudgeListener(engine_id) if role in ("kv_consumer", "kv_both") and cfg.pull_step_wait_ms
                        else None)
        self.clients = ClientPool(cfg.bootstrap_token, cfg.bootstrap_timeout_s, retries=1)
        if role in ("kv_consumer", "kv_both") and cfg.bootstrap_token and cfg.bootstrap_allow is None:
            logger.warning("kvlink: bootstrap_token is set and bootstrap_allow is not: this engine sends its token "
                           "to whatever bootstrap server a request's kv_transfer_params name; list the prefill "
                           "bootstrap servers in kv_connector_extra_config['bootstrap_allow']")
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlink-sched")
        # Reports that first wait for prefill to publish (long polls) get their own threads.
        self._wait_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvlink-sched-wait")
        self._stats = KVLinkStats()
        self._stats_lock = threading.Lock()
        self._closed = threading.Event()
        # Prefill state: the held table is shared by the scheduler and release-watcher threads under
        # _held_lock; _freed (same lock) wakes an idle step when the watcher decides a free.
        self._server = None
        self.bootstrap_url: str | None = cfg.bootstrap_url
        self._held = HeldTable(cfg.lease_s)
        self._held_lock = threading.Lock()
        self._freed = threading.Condition(self._held_lock)
        self._gauges_sent: tuple[int, ...] | None = None
        # Host staging (staging.py), prefill only: the staging queue and the pool's slots, under _held_lock.
        self._planner = (StagePlanner(SlotPool(staging_slots), cfg.lease_s)
                         if staging_slots is not None and self.is_producer else None)
        self._device_frees: list[str] = []  # held requests whose device blocks vLLM may free (under _held_lock)
        self._gauges_stale = False  # slots freed off-step: one more step hands the gauges out (under _held_lock)
        self._slots_freed = False  # slots freed since the last step (under _held_lock)
        self._publishing: set[str] = set()  # staged requests held while their publish is in flight (_held_lock)
        # Decode state (scheduler thread only).
        self._pulls: dict[str, RemoteSource] = {}  # handed to the worker, not yet reported back
        self._cancelled: set[str] = set()
        self._processed: set[str] = set()  # do_remote_prefill requests already handled
        self._bad: dict[str, str] = {}  # request id -> why its kv_transfer_params were refused
        self._new_pulls: list[PullSpec] = []
        self._local_hit: dict[str, int] = {}  # request id -> prefix-cache tokens vLLM offered
        self._prompt_ok: dict[str, bool] = {}  # sequential pairing: the prompt digest compared (until allocated)
        self._new_cancels: list[str] = []
        # Lock-step (lockstep.py), the scheduler's thread only: armed requests and, with prefix caching,
        # the pulled blocks vLLM cached before their KV was confirmed.
        self._lockstep = LockstepBook()
        # Decode requests sharing one prefill request (n > 1 samples); the release timers touch it too.
        self._siblings = Siblings()
        self._siblings_lock = threading.Lock()
        self._backed_off: set[str] = set()  # prefill: requests whose last prompt token was left to decode
        # Prefill, streamed KV (stream.py): requests of concurrent pairing whose finished blocks are announced
        # while they compute. ``streamable``: why this engine cannot stream (None: it can).
        self._stream_slots: dict[str, tuple[int, ...]] = {}  # host staging: the slots a streamed request fills
        self._stream = (StreamPlanner(block_size, layer_wise=cfg.stream_granularity == "layer")
                        if self.is_producer and cfg.stream_kv and streamable is None else None)
        if self.is_producer:
            logger.info("kvlink: streamed KV %s", f"on (concurrent pairing, per {cfg.stream_granularity})"
                        if self._stream is not None else
                        f"off ({'stream_kv is false' if not cfg.stream_kv else streamable})")
        if self.is_producer:
            self._start_bootstrap()

    # ----- start-up / shutdown ------------------------------------------------------------------------

    def _start_bootstrap(self) -> None:
        if self.bootstrap_url is None:
            from kvlink.bootstrap import BootstrapConfig, BootstrapServer

            self._server = BootstrapServer(BootstrapConfig(
                host=self.cfg.bootstrap_host, port=self.cfg.bootstrap_port, token=self.cfg.bootstrap_token,
                default_request_lease_s=self.cfg.lease_s, max_wait_s=min(30.0, self.cfg.lookup_wait_s)))
            self._server.start()
            self.bootstrap_url = self._server.url
            logger.info("kvlink: embedded bootstrap server for engine %s at %s", self.engine_id,
                        self.bootstrap_url)
        threading.Thread(target=self._watch_releases, name="kvlink-release-watch", daemon=True).start()

    def shutdown(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._wait_pool.shutdown(wait=False, cancel_futures=True)
        self.clients.close()
        if self._nudges is not None:
            self._nudges.close()
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ----- prefill -----------------------------------------------------------------------------------

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
                outcomes = cli.poll_released(self.engine_id)
                with self._freed:
                    if sum(self._held.released(rid, outcome) for rid, outcome in outcomes):
                        self._freed.notify_all()
                    due = self._held.lookup_due()
                    # Staged requests hold slots, not vLLM blocks: free them here, without waiting for a step.
                    frees = self._collect_frees() if self._planner is not None else []
                self._note_frees(frees)
                if due:
                    self._reconcile(cli)
                with self._held_lock:
                    self._held.reached()
                warned = False
            except Exception as e:  # noqa: BLE001 - the local lease deadline still frees blocks
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
        from kvlink.bootstrap.errors import UnknownEngine

        with self._held_lock:  # not those being published: the server may not know them yet
            held = [rid for rid in self._held.request_ids() if rid not in self._publishing]
        answer: dict[str, object] = {}
        for i in range(0, len(held), 1024):
            chunk = held[i:i + 1024]
            try:
                answer.update(cli.lookup(self.engine_id, chunk))
            except UnknownEngine:  # the server dropped the engine, and its requests with it
                answer.update(dict.fromkeys(chunk, RequestStatus.UNKNOWN))
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
                                                         transfer_id=transfer_id, epoch=epoch, prompt_sha=prompt_sha)
            return
        from kvlink.bootstrap import schema

        body = schema.checked(schema.PublishBody, engine_id=self.engine_id, request_id=rid, transfer_id=transfer_id,
                              block_ids=groups, num_tokens=num_tokens, lease_s=self.cfg.lease_s, epoch=epoch,
                              prompt_sha=prompt_sha)
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
        except (RequestReleased, RequestExpired) as e:
            # An earlier try of this publish was applied and decode is done with it already (a retry after a
            # lost answer): nothing to keep, nothing to give up.
            logger.info("kvlink: request %s: the bootstrap server says it ended already (%s); freeing it", rid, e)
            return self._withdraw(rid), None
        except Exception as e:  # noqa: BLE001 - decode recomputes
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
                self._held.unreachable()
            return True, kvparams.refusal(f"publish failed: {e}")
        with self._held_lock:
            self._publishing.discard(rid)
        self._count("published")
        trace.event("publish", rid=rid, transfer_id=transfer_id)
        return True, RemoteSource(bootstrap_url=self.bootstrap_url, engine_id=self.engine_id, request_id=rid,
                                  block_ids=groups, num_tokens=num_tokens, transfer_id=transfer_id,
                                  lease_s=self.cfg.lease_s, prompt_sha=sha).to_params()

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
                                                         prompt_sha=prompt_sha)
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
        self._count("published")

    def _abandon_transfer(self, rid: str, transfer_id: str) -> None:
        """Aborted before publishing: mark the transfer id abandoned at the bootstrap server, so a decode
        long-polling for it gets 'released' now instead of waiting lookup_wait_s."""
        def work():
            try:
                # (naming the request: an id another request of ours holds, a client's batch, is left alone)
                self.clients.get(self.bootstrap_url).abandon_transfer(self.engine_id, transfer_id, request_id=rid)
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

    # ----- decode ------------------------------------------------------------------------------------

    def _source(self, request: "Request") -> RemoteSource | None:
        """The parsed remote source of a do_remote_prefill request not handled yet, else None."""
        params = request.kv_transfer_params
        rid = request.request_id
        if not isinstance(params, dict) or rid in self._processed or rid in self._bad:
            return None
        try:
            if not kvparams.flag(params, "do_remote_prefill"):
                return None
            if kvparams.flag(params, "do_remote_decode"):
                raise BadParams("do_remote_decode", "kv_transfer_params ask for both do_remote_prefill and "
                                "do_remote_decode: a request is pulled or published, not both")
            return self._allowed(RemoteSource.from_params(params))
        except BadParams as e:
            self._bad[rid] = str(e)
            self._count("bad_params")
            logger.warning("kvlink: request %s: %s; computing it locally", rid, e)
            return None

    def _allowed(self, src: RemoteSource) -> RemoteSource:
        """``src`` if its bootstrap server is one decode may call (with its token), else BadParams."""
        allow = self.cfg.bootstrap_allow
        if allow is not None and src.bootstrap_url not in allow:
            raise BadParams("remote_bootstrap_addr", f"kv_transfer_params['remote_bootstrap_addr'] "
                            f"{src.bootstrap_url!r} is not one of this engine's bootstrap_allow")
        return src

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        src = self._source(request)
        if src is None:
            return 0, False
        with self._siblings_lock:
            verdict = self._siblings.ask(src.key, request.request_id)
        if verdict == "wait":
            return None, False  # a sibling sample pulls this prompt now: asked again next step (siblings.py)
        if verdict == "gone":  # the samples' release of prefill's copy was decided: computed here
            self._count("pull_after_release")
            self._processed.add(request.request_id)  # handled: nothing of it is released again
            return 0, False
        n = len(request.prompt_token_ids or ())
        if src.num_tokens is not None:
            n = min(n, src.num_tokens)
        if self.backoff:
            # Mamba: the pulled state is the one after exactly the tokens prefill computed, which must be
            # short of the prompt (on_new_request) for decode to compute the rest once. Unknown (concurrent
            # pairing): prefill backs off by ``backoff``; the worker checks the published count.
            n = len(request.prompt_token_ids or ()) - self.backoff if src.num_tokens is None else src.num_tokens
            if n >= len(request.prompt_token_ids or ()) or n <= 0:
                logger.info("kvlink: request %s: prefill computed %s of its %d prompt tokens; with Mamba layers "
                            "decode continues a state only from fewer: computing the prompt locally",
                            request.request_id, src.num_tokens, len(request.prompt_token_ids or ()))
                return 0, False
        count = n - num_computed_tokens
        if count <= 0:
            return 0, False
        if src.prompt_sha is not None and src.num_tokens is not None and not self._same_prompt(request, src):
            return 0, False  # (asked again while the request waits: decided once, _prompt_ok)
        for g, w in enumerate(self.windows):
            if w and n == request.num_tokens and window_start_lost(n, self.block_size, w[0], w[1]):
                # vLLM would recompute the last prompt token over a block neither side keeps: compute it here.
                self._count("window_refusals")
                logger.info("kvlink: request %s: %d tokens with a %d-token window (KV cache group %d) and %d-token "
                            "blocks: the last token's window starts in a block vLLM frees on both sides; "
                            "computing the prompt locally", request.request_id, n, w[0], g, self.block_size)
                return 0, False
        self._local_hit[request.request_id] = num_computed_tokens  # block-aligned (vLLM passes it so)
        trace.event("admit", rid=request.request_id, tokens=count)
        return count, True

    def _same_prompt(self, request: "Request", src: RemoteSource) -> bool:
        """Sequential pairing: prefill's params carry the digest of the tokens it computed; decode's first as
        many prompt tokens must give the same (params.prompt_digest), or decode computes the prompt itself."""
        rid = request.request_id
        if rid in self._prompt_ok:
            return self._prompt_ok[rid]
        mine = request_digest(request, src.num_tokens)
        self._prompt_ok[rid] = ok = mine is None or mine == src.prompt_sha  # None: embeddings, no ids to compare
        if ok:
            return True
        self._count("prompt_mismatch")
        logger.warning("kvlink: request %s: its first %d prompt tokens are not the ones prefill computed (another "
                       "prompt, or the same text tokenized otherwise): computing the prompt locally",
                       request.request_id, src.num_tokens)
        return False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if self._stream is not None:
            self._track_stream(request)
        src = self._source(request)
        if src is None:
            return
        rid = request.request_id
        self._processed.add(rid)
        self._prompt_ok.pop(rid, None)
        local_hit = self._local_hit.pop(rid, 0)
        if num_external_tokens <= 0:
            # Everything was in the local prefix cache: prefill may free its copy (unless a sibling needs it).
            self._release_shared(src, rid, pulled=False)
            return
        with self._siblings_lock:
            self._siblings.started(src.key, rid)
        # Decode's block table by position, null blocks (id 0) included: vLLM puts them where the model
        # never reads (outside a sliding window), and prefill's list has them at the same positions.
        # Only the positions covering the tokens loaded belong to the pull.
        tokens = local_hit + num_external_tokens
        tables = []
        for g, group in enumerate(blocks.blocks):
            bs = self.block_sizes[g] if g < len(self.block_sizes) else self.block_size
            end = -(-tokens // bs)
            tables.append(GroupTable(g, tuple(0 if b.is_null else b.block_id for b in group[:end]),
                                     local_hit // bs, end))
        self._pulls[rid] = src
        t0 = tables[0]
        if self.cfg.stream_lockstep:  # (one group: lockstep.why_not_lockstep)
            self._lockstep.track(rid, request, t0.local_block_ids[t0.first_block:])
        # Concurrent pairing: the record prefill publishes carries its digest; the worker compares this one
        # (where the record covers as many tokens: vLLM may load fewer than prefill computed).
        # (Sequential pairing: compared before admitting, _same_prompt.) Also the whole prompt's: prefill's pieces
        # and record cover its whole prompt, and a prompt of another length is another prompt.
        sha = whole = None
        n_whole = request.num_prompt_tokens
        if src.prompt_sha is None:
            sha = request_digest(request, tokens)
            whole = sha if n_whole == tokens else request_digest(request, n_whole)
        self._new_pulls.append(PullSpec(rid, t0.local_block_ids, t0.first_block, src, num_blocks=t0.num_blocks,
                                        others=tuple(tables[1:]), num_tokens=tokens if self.backoff else None,
                                        prompt_sha=sha, prompt_tokens=tokens, whole_sha=whole, whole_tokens=n_whole))

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

    def _finished_consumer(self, request: "Request", params: dict):
        rid = request.request_id
        self._local_hit.pop(rid, None)  # offered a hit but finished before its blocks were allocated
        self._prompt_ok.pop(rid, None)
        armed, cancel = self._lockstep.finish(rid, _aborted(request))
        if armed:
            # Armed (lock-step), and its pull may still write or the worker still keeps its outcome for its
            # step: vLLM frees the blocks once the worker has stopped the pull and reports it in
            # finished_sending.
            if cancel:
                self._cancelled.add(rid)  # (its settle tells prefill: abandoned)
            self._processed.discard(rid)
            return True, None
        if rid in self._pulls:
            # Aborted while pulling: the worker cancels and reports it; the outcome is sent then.
            self._cancelled.add(rid)
            self._new_cancels.append(rid)
        elif rid not in self._processed and rid not in self._bad:
            # Aborted before its pull started: prefill's blocks would wait for their lease otherwise.
            try:
                if kvparams.flag(params, "do_remote_prefill"):
                    self._release_shared(self._allowed(RemoteSource.from_params(params)), rid, pulled=False)
            except BadParams:
                pass
        self._processed.discard(rid)
        bad = self._bad.pop(rid, None)
        return False, (kvparams.refusal(bad) if bad else None)

    def _release_async(self, src: RemoteSource, outcome: Outcome) -> None:
        """Tell prefill (through its bootstrap server) that decode is done with a request."""
        self._count(COUNTER_OF[outcome])
        # Decode may give up a concurrent request before prefill has published it: the report then waits
        # (bounded) for the publish, so prefill's blocks do not wait for their lease.
        # So does one for a staged request (params without block ids): prefill publishes it after its copy.
        waits = outcome is Outcome.ABANDONED and (src.request_id is None or src.engine_id is None
                                                  or src.block_ids is None)

        def work():
            cli = self.clients.get(src.bootstrap_url)
            engine_id, request_id = src.engine_id, src.request_id
            if waits and src.transfer_id is not None:
                try:  # prefill may still be computing it: stop its streamed pieces now
                    cli.stop_stream(src.transfer_id)
                except Exception as e:  # noqa: BLE001 - its pieces are dropped at decode anyway
                    logger.debug("kvlink: could not stop the stream of %s: %s", src.key, e)
            try:
                if request_id is None or engine_id is None or (waits and src.transfer_id is not None):
                    rec = cli.lookup_transfer(src.transfer_id, wait_s=self.cfg.lookup_wait_s if waits else 0.0)
                    engine_id, request_id = rec.engine_id, rec.request_id
                cli.release(engine_id, request_id, outcome)
            except Exception as e:  # noqa: BLE001 - prefill's lease frees the blocks anyway
                logger.info("kvlink: could not report %s for %s: %s", outcome.value, src.key, e)

        if not self._closed.is_set():
            (self._wait_pool if waits else self._pool).submit(work)

    def update_connector_output(self, output: Any) -> None:
        if self._planner is not None:
            for rid in output.finished_sending or ():
                self._staged(rid)  # a staging job the worker finished (other sends are frees)
        armed = (self._lockstep_output(output) if self._lockstep.freeing or getattr(output, "kv_connector_worker_meta",
                                                                                   None) else set())
        failed = set(output.failed_recving or ())
        if output.finished_recving and trace.enabled():
            trace.event("recv_collected", rids=sorted(output.finished_recving))
        for rid in output.finished_recving or ():
            if rid in armed:
                continue  # handed to vLLM, its pull still under way: released to prefill once settled
            src = self._pulls.pop(rid, None)
            if src is None:
                continue
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
            self._release_shared(src, rid, pulled=not (cancelled or rid in failed))

    def lockstep_prefix_caching(self, on: bool) -> None:
        """Decode's vLLM caches prefixes (lock-step then tracks which armed requests vLLM took)."""
        self._lockstep.prefix_caching = on

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._lockstep.bind(manager.evict_blocks)

    def _lockstep_output(self, output: Any) -> set[str]:
        """Lock-step: what the worker armed and settled this step (metadata.KVLinkWorkerMeta). An armed
        request vLLM finished before it heard of the arm (an abort) stays out of finished_recving, which
        would free its blocks under a READ still on the wire: the worker reports it in finished_sending
        once the cancel settled (it got the cancel)."""
        wm = getattr(output, "kv_connector_worker_meta", None)
        armed, settled = set(getattr(wm, "armed", ())), dict(getattr(wm, "settled", {}))
        gone = self._lockstep.worker_output(armed, settled, set(getattr(wm, "evict", ())),
                                            output.finished_sending, self._cancelled)
        for rid in gone:
            output.finished_recving.discard(rid)
        for rid, ok in settled.items():
            src = self._pulls.pop(rid, None)
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
            if src is not None:
                self._release_shared(src, rid, pulled=ok and not cancelled)
        return armed

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

    def _release_shared(self, src: RemoteSource, rid: str, pulled: bool) -> None:
        """Decode request ``rid`` is done with prefill's request: tell prefill once no sibling sample of the
        same prompt still pulls or waits for it (siblings.py)."""
        with self._siblings_lock:
            outcome = self._siblings.ended(src.key, rid, pulled)
            starts = self._siblings.starts(src.key)
            if outcome is not None and not is_sample(rid):
                self._siblings.settle(src.key, starts)
        if outcome is None:
            return
        if not is_sample(rid):
            self._release_async(src, Outcome.PULLED if outcome else Outcome.ABANDONED)
            return

        # A sample (vLLM's child request "<i>_<parent>"): its siblings reach the engine one by one and may
        # not have asked yet. Keep prefill's copy SIBLING_GRACE_S longer; a sibling that asks meanwhile pulls
        # (what its prefix cache lacks) and releases it in turn.
        def later():
            with self._siblings_lock:
                free = self._siblings.settle(src.key, starts)
            if free:
                self._release_async(src, Outcome.PULLED if outcome else Outcome.ABANDONED)

        if not self._closed.is_set():  # a timer of its own: a grace spent on the pool would hold up releases
            timer = threading.Timer(SIBLING_GRACE_S, later)
            timer.daemon = True
            timer.start()

    # ----- both --------------------------------------------------------------------------------------

    def request_finished(self, request: "Request", block_ids) -> tuple[bool, dict | None]:
        """``block_ids``: one group's list (request_finished) or one list per group
        (request_finished_all_groups, hybrid models)."""
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        try:
            to_decode = kvparams.flag(params, "do_remote_decode")
        except BadParams as e:
            self._finished_consumer(request, params)  # ends whatever it began as a decode request
            return self._refuse(request, str(e))
        self._backed_off.discard(request.request_id)
        rid = request.request_id
        if to_decode and (rid in self._bad or rid in self._processed or rid in self._pulls):
            return self._finished_consumer(request, params)  # began as a decode request (refused: both flags)
        if to_decode:
            groups = (tuple(tuple(g) for g in block_ids) if block_ids and isinstance(block_ids[0], (list, tuple))
                      else (tuple(block_ids or ()),))
            return self._finished_producer(request, params, groups)
        return self._finished_consumer(request, params)

    def _refuse(self, request: "Request", why: str):
        logger.warning("kvlink: request %s: %s", request.request_id, why)
        self._count("bad_params")
        return False, kvparams.refusal(why)

    def build_connector_meta(self, scheduler_output: Any) -> KVLinkMetadata:
        frees = self._take_frees(self._idle_wait(scheduler_output)) if self.is_producer else []
        self._pull_wait(scheduler_output)
        if trace.enabled() and not self.is_producer:
            trace.event("step", tokens=getattr(scheduler_output, "total_num_scheduled_tokens", None))
        stages = self._stage_jobs(frees) if self._planner is not None else []
        unstreamed = []
        if self._planner is not None and self._stream is not None:
            with self._held_lock:
                unstreamed = self._planner.take_dropped()
        streams = self._stream_pieces(scheduler_output) if self._stream is not None else []
        meta = KVLinkMetadata(pulls=self._new_pulls, cancels=self._new_cancels, frees=frees, stages=stages,
                              unstreamed=unstreamed,
                              bootstrap_url=self.bootstrap_url if self.is_producer else None, streams=streams)
        self._new_pulls, self._new_cancels = [], []
        book = self._lockstep
        if book.unscheduled or book.new_frees:
            meta.lockstep, meta.lockstep_frees = book.schedule(
                [r.req_id for r in getattr(scheduler_output, "scheduled_new_reqs", ())])
        if book.busy():
            # the step waits for their KV and outcome as the armed request's own step would (lockstep.py)
            meta.lockstep_shared = book.shared(meta.lockstep, self._pulls, _taken)
        return meta

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

    def _pull_wait(self, scheduler_output: Any) -> None:
        """Decode: a step with nothing to run while pulls are under way waits up to ``pull_step_wait_ms``
        first, so waiting for KV does not spin the engine at ~1 kHz: beside prefill (concurrent pairing:
        the whole of prefill's compute), and beside the worker's own threads, which resolve, renew leases
        and land the READs. A worker in the engine's process shares its GIL, and an engine stepping back to
        back starved them: a sequential pull of 64 KiB took seconds (in-process engines, test_hybrid.py).
        A worker whose pull ends nudges the wait short (nudge.py): the step goes on and hands the pull to
        vLLM at once. Without a nudge listener steps are not delayed."""
        if (self._nudges is not None and self._pulls and not self._new_pulls and not self._new_cancels
                and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
                and not getattr(scheduler_output, "finished_req_ids", None)):
            if self._nudges.wait(self.cfg.pull_step_wait_ms / 1e3):
                self._count("pull_waits_nudged")

    def has_pending_work(self) -> bool:
        """vLLM keeps stepping (paced by idle_step_wait_ms): requests held (their frees, and the gauges on
        /metrics, need steps), frees decided, or (staging) copies to start or to hear of."""
        if self._lockstep.freeing:
            return True  # decode, lock-step: an aborted armed request's free is still to be heard of
        with self._held_lock:
            return (bool(self._held) or bool(self._device_frees) or self._gauges_stale
                    or (self._planner is not None and self._planner.busy()))

    def has_pending_block_frees(self) -> bool:
        """vLLM blocks will come back without preempting anyone: held for decode, freed but not handed over,
        or being staged. Staged requests hold no vLLM block, so they do not count (vLLM would stop
        preempting while it waits for frees that never come)."""
        with self._held_lock:
            if self._planner is None:
                return bool(self._held)
            return bool(self._device_frees) or self._held.num_blocks > 0 or self._planner.device_blocks() > 0

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.add(key, n)

    def get_kv_connector_stats(self) -> KVLinkStats | None:
        with self._stats_lock:
            stats, self._stats = self._stats, KVLinkStats()
        if self.is_producer:
            with self._held_lock:
                gauges = (len(self._held), self._held.num_blocks)
                if self._planner is not None:
                    for k, n in self._planner.take_counts().items():
                        stats.add(k, n)
                    gauges = (gauges[0], gauges[1] + self._planner.device_blocks(), self._planner.pool.in_use)
                self._gauges_stale = False
            if gauges != self._gauges_sent:
                self._gauges_sent = gauges
                stats.set_gauge("held_requests", gauges[0])
                stats.set_gauge("held_blocks", gauges[1])  # vLLM blocks kept for decode (not staged ones)
                if len(gauges) > 2:
                    stats.set_gauge("staging_used_blocks", gauges[2])
        return None if stats.is_empty() else stats


def request_digest(request: "Request", n: int) -> str | None:
    """params.prompt_digest of a request's first ``n`` prompt tokens, with what else decides their KV: the
    LoRA adapter and the multimodal inputs placed among them (identifier, offset, length). None where vLLM
    feeds embeddings (prompt_embeds, also mixed with ids): their bytes are not hashed, nothing is compared."""
    ids = request.prompt_token_ids
    if ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    extras = [f"lora:{lora.lora_name}"] if lora is not None else []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        if pos.offset < n:
            extras.append(f"{f.modality}:{f.identifier}@{pos.offset}+{pos.length}")
    return prompt_digest(ids[:n], tuple(extras))  # fewer than n ids: another prompt, another digest


def _taken(request: "Request") -> bool:
    """vLLM took a request that waited for its KV (it cached the request's blocks then)."""
    from vllm.v1.request import RequestStatus as VLLMStatus

    return not request.is_finished() and request.status != VLLMStatus.WAITING_FOR_REMOTE_KVS


def _aborted(request: "Request") -> bool:
    from vllm.v1.request import RequestStatus as VLLMStatus

    return getattr(request, "status", None) == VLLMStatus.FINISHED_ABORTED


def _maybe_applied(e: BaseException) -> bool:
    """Whether a bootstrap call that raised ``e`` may still have been applied by the server: no answer came
    (a timeout, a connection lost after the request went out). An answer (any HTTP error) or a connection
    refused says it was not."""
    from kvlink.bootstrap.errors import BootstrapError, BootstrapUnavailable, UnknownEngine

    if isinstance(e, BootstrapError) and (not isinstance(e, BootstrapUnavailable) or isinstance(e, UnknownEngine)):
        return False
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return False
        cause = cause.__cause__ or cause.__context__
    return True
