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
worker reports a request, tells prefill the outcome ("pulled" or "abandoned").

Bootstrap HTTP calls never run on the scheduler thread: a small thread pool does them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvlink.vllm.config import ConnectorConfig
from kvlink.vllm.metadata import BadParams, KVLinkMetadata, PullSpec, RemoteSource
from kvlink.vllm.stats import KVLinkStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class _Clients:
    """One BootstrapClient per URL (thread-safe)."""

    def __init__(self, cfg: ConnectorConfig):
        self._cfg, self._lock, self._by_url = cfg, threading.Lock(), {}

    def get(self, url: str):
        from kvlink.bootstrap import BootstrapClient

        with self._lock:
            if url not in self._by_url:
                self._by_url[url] = BootstrapClient(url, token=self._cfg.bootstrap_token,
                                                    timeout_s=self._cfg.bootstrap_timeout_s, retries=1)
            return self._by_url[url]

    def close(self) -> None:
        with self._lock:
            for c in self._by_url.values():
                c.close()
            self._by_url.clear()


class KVLinkScheduler:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, role: str, block_size: int):
        self.cfg, self.engine_id, self.role, self.block_size = cfg, engine_id, role, block_size
        self.is_producer = role in ("kv_producer", "kv_both")
        self.clients = _Clients(cfg)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlink-sched")
        # Reports that first wait for prefill to publish (long polls) get their own threads.
        self._wait_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvlink-sched-wait")
        self._stats = KVLinkStats()
        self._stats_lock = threading.Lock()
        self.totals = KVLinkStats()  # since start, never reset (tests, demo)
        self._closed = threading.Event()
        # Prefill state (scheduler thread only, except the event queue).
        self._server = None
        self.bootstrap_url: str | None = cfg.bootstrap_url
        self._held: dict[str, tuple[float, int]] = {}  # request id -> (local deadline, number of blocks)
        self._released: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # (request id, outcome)
        self._released_seen: set[str] = set()  # held ids the last reconcile lookup found released
        self._bootstrap_ok_at = time.monotonic()  # last successful poll (written by the watcher thread)
        self._gauges_sent: tuple[int, int] | None = None
        # Decode state (scheduler thread only).
        self._pulls: dict[str, RemoteSource] = {}  # handed to the worker, not yet reported back
        self._cancelled: set[str] = set()
        self._processed: set[str] = set()  # do_remote_prefill requests already handled
        self._bad: dict[str, str] = {}  # request id -> why its kv_transfer_params were refused
        self._new_pulls: list[PullSpec] = []
        self._new_cancels: list[str] = []
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
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ----- prefill -----------------------------------------------------------------------------------

    def _watch_releases(self) -> None:
        """Thread: ask the bootstrap server which held requests decode is done with.

        Outcomes are delivered reliably while the server keeps the engine, but a restarted server, or one
        that dropped the engine (heartbeats missed while it was stalled), has lost them. So after any failed
        poll, and every half lease anyway, held requests are looked up (``_reconcile``) and those the server
        no longer holds are freed.
        """
        warned = False
        reconcile_at = time.monotonic() + self.cfg.lease_s / 2
        while not self._closed.wait(self.cfg.release_poll_s):
            if not self._held:
                continue
            try:
                cli = self.clients.get(self.bootstrap_url)
                for rid, outcome in cli.poll_released(self.engine_id):
                    self._released.put((rid, str(getattr(outcome, "value", outcome))))
                if time.monotonic() >= reconcile_at:
                    self._reconcile(cli)
                    reconcile_at = time.monotonic() + self.cfg.lease_s / 2
                self._bootstrap_ok_at = time.monotonic()
                warned = False
            except Exception as e:  # noqa: BLE001 - the local lease deadline still frees blocks
                reconcile_at = 0.0  # as soon as the server answers again
                if not warned:
                    logger.warning("kvlink: cannot poll bootstrap %s for released requests: %s "
                                   "(held blocks will be freed at lease expiry)", self.bootstrap_url, e)
                    warned = True
                self._closed.wait(0.5)

    def _reconcile(self, cli) -> int:
        """Free held requests that the bootstrap server no longer holds: nobody can renew their leases, and
        decode trusts a pull only with a renewal. Returns how many.

        Unknown or expired: freed now. Released: decode reported it, and its outcome is normally on its way
        through the poll (a release can land between a poll and this lookup), so it is freed here only if
        the previous lookup saw it released too: then its outcome was lost with a dropped engine.
        """
        from kvlink.bootstrap import RequestStatus
        from kvlink.bootstrap.errors import UnknownEngine

        held = list(self._held)
        lost, released = [], set()
        for i in range(0, len(held), 1024):
            chunk = held[i:i + 1024]
            try:
                answer = cli.lookup(self.engine_id, chunk)
            except UnknownEngine:  # the server dropped the engine, and its requests with it
                answer = {rid: RequestStatus.UNKNOWN for rid in chunk}
            for rid, rec in answer.items():
                if rec is RequestStatus.RELEASED:
                    released.add(rid)
                elif isinstance(rec, RequestStatus):
                    lost.append(rid)
        gone = [(rid, "expired") for rid in lost]
        gone += [(rid, "released") for rid in released & self._released_seen]
        self._released_seen = released - self._released_seen
        for item in gone:
            self._released.put(item)
        if gone:
            logger.warning("kvlink: bootstrap %s no longer holds %d of this engine's held requests (server "
                           "restarted, or the engine's registration lapsed); freeing their blocks",
                           self.bootstrap_url, len(gone))
        return len(gone)

    def _finished_producer(self, request: "Request", params: dict, block_ids: list[int]):
        from vllm.v1.request import RequestStatus

        if not self.is_producer:
            return self._refuse(request, "do_remote_decode sent to an engine that is not kv_producer")
        transfer_id = params.get("transfer_id")
        if transfer_id is not None and (not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= 256):
            return self._refuse(request, "kv_transfer_params['transfer_id'] must be a non-empty string")
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if transfer_id is not None:
                self._abandon_transfer(request.request_id, transfer_id)
            return False, None  # aborted or failed: nothing to keep
        if not block_ids:
            return False, None
        rid = request.request_id
        num_tokens = request.num_computed_tokens
        try:
            self.clients.get(self.bootstrap_url).publish(self.engine_id, rid, [list(block_ids)], num_tokens,
                                                         self.cfg.lease_s, transfer_id=transfer_id)
        except Exception as e:  # noqa: BLE001 - decode recomputes; never keep blocks nobody can find
            logger.warning("kvlink: publishing request %s to %s failed: %s; not keeping its KV", rid,
                           self.bootstrap_url, e)
            self._count("publish_failures")
            return False, {"do_remote_prefill": False, "kvlink_error": f"publish failed: {e}"}
        # The bootstrap server reports expiry (decode renewals push it back); the local deadline (with
        # slack) only applies while the bootstrap server cannot be reached.
        self._held[rid] = (time.monotonic() + self.cfg.lease_s * 1.5 + 5.0, len(block_ids))
        self._count("published")
        out = {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_request_id": rid,
               "remote_bootstrap_addr": self.bootstrap_url, "remote_block_ids": list(block_ids),
               "remote_num_tokens": num_tokens, "remote_lease_s": self.cfg.lease_s}
        if transfer_id is not None:
            out["transfer_id"] = transfer_id
        return True, out

    def _abandon_transfer(self, rid: str, transfer_id: str) -> None:
        """Aborted before publishing: mark the transfer id abandoned at the bootstrap server, so a decode
        long-polling for it gets 'released' now instead of waiting lookup_wait_s."""
        def work():
            try:
                self.clients.get(self.bootstrap_url).abandon_transfer(self.engine_id, transfer_id)
            except Exception as e:  # noqa: BLE001 - decode's bounded wait still ends it
                logger.warning("kvlink: could not mark transfer %s (request %s) abandoned: %s", transfer_id,
                               rid, e)

        self._count("aborted_transfers")
        if not self._closed.is_set():
            self._pool.submit(work)

    def _take_frees(self, wait_s: float = 0.0) -> list[str]:
        """Requests whose blocks go back to vLLM now; waits up to ``wait_s`` for the first release."""
        frees = []
        while True:
            try:
                rid, outcome = self._released.get(timeout=wait_s) if wait_s else self._released.get_nowait()
            except queue.Empty:
                break
            wait_s = 0.0
            if self._held.pop(rid, None) is not None:
                frees.append(rid)
                self._count({"pulled": "released_pulled", "abandoned": "released_abandoned",
                             "released": "released_unreported"}.get(outcome, "leases_expired"))
        now = time.monotonic()
        if self._held and now - self._bootstrap_ok_at > self.cfg.lease_s:
            for rid in [r for r, (deadline, _) in self._held.items() if deadline < now]:
                del self._held[rid]
                frees.append(rid)
                self._count("leases_expired")
                logger.warning("kvlink: lease of request %s ran out without word from the bootstrap "
                               "server; freeing its blocks", rid)
        return frees

    # ----- decode ------------------------------------------------------------------------------------

    def _source(self, request: "Request") -> RemoteSource | None:
        """The parsed remote source of a do_remote_prefill request not handled yet, else None."""
        params = request.kv_transfer_params
        rid = request.request_id
        if not isinstance(params, dict) or not params.get("do_remote_prefill") or rid in self._processed:
            return None
        if rid in self._bad:
            return None
        try:
            return RemoteSource.from_params(params)
        except BadParams as e:
            self._bad[rid] = str(e)
            self._count("bad_params")
            logger.warning("kvlink: request %s: %s; computing it locally", rid, e)
            return None

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        src = self._source(request)
        if src is None:
            return 0, False
        n = len(request.prompt_token_ids or ())
        if src.num_tokens is not None:
            n = min(n, src.num_tokens)
        count = n - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        src = self._source(request)
        if src is None:
            return
        rid = request.request_id
        self._processed.add(rid)
        if num_external_tokens <= 0:
            # Everything was in the local prefix cache: prefill may free its copy now.
            self._release_async(src, "abandoned")
            return
        group = blocks.blocks[0]
        hit = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        local = tuple(b.block_id for b in group[hit:] if not b.is_null)
        self._pulls[rid] = src
        self._new_pulls.append(PullSpec(rid, local, hit, src))

    def _finished_consumer(self, request: "Request", params: dict):
        rid = request.request_id
        if rid in self._pulls:
            # Aborted while pulling: the worker cancels and reports it; the outcome is sent then.
            self._cancelled.add(rid)
            self._new_cancels.append(rid)
        elif params.get("do_remote_prefill") and rid not in self._processed and rid not in self._bad:
            # Aborted before its pull started: prefill's blocks would wait for their lease otherwise.
            try:
                self._release_async(RemoteSource.from_params(params), "abandoned")
            except BadParams:
                pass
        self._processed.discard(rid)
        bad = self._bad.pop(rid, None)
        return False, ({"kvlink_error": bad} if bad else None)

    def _release_async(self, src: RemoteSource, outcome: str) -> None:
        self._count("released_pulled" if outcome == "pulled" else "released_abandoned")

        def work():
            cli = self.clients.get(src.bootstrap_url)
            engine_id, request_id = src.engine_id, src.request_id
            try:
                if request_id is None or engine_id is None:
                    wait = self.cfg.lookup_wait_s if outcome == "abandoned" else 0.0
                    rec = cli.lookup_transfer(src.transfer_id, wait_s=wait)
                    engine_id, request_id = rec.engine_id, rec.request_id
                cli.release(engine_id, request_id, outcome)
            except Exception as e:  # noqa: BLE001 - prefill's lease frees the blocks anyway
                logger.info("kvlink: could not report %s for %s: %s", outcome, src.key, e)

        if not self._closed.is_set():
            waits = outcome == "abandoned" and (src.request_id is None or src.engine_id is None)
            (self._wait_pool if waits else self._pool).submit(work)

    def update_connector_output(self, output: Any) -> None:
        failed = set(getattr(output, "failed_recving", None) or ())
        for rid in output.finished_recving or ():
            src = self._pulls.pop(rid, None)
            if src is None:
                continue
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
            self._release_async(src, "abandoned" if cancelled or rid in failed else "pulled")

    # ----- both --------------------------------------------------------------------------------------

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        if params.get("do_remote_decode"):
            return self._finished_producer(request, params, block_ids)
        return self._finished_consumer(request, params)

    def _refuse(self, request: "Request", why: str):
        logger.warning("kvlink: request %s: %s", request.request_id, why)
        self._count("bad_params")
        return False, {"do_remote_prefill": False, "kvlink_error": why}

    def build_connector_meta(self, scheduler_output: Any) -> KVLinkMetadata:
        frees = self._take_frees(self._idle_wait(scheduler_output)) if self.is_producer else []
        meta = KVLinkMetadata(pulls=self._new_pulls, cancels=self._new_cancels, frees=frees,
                              bootstrap_url=self.bootstrap_url if self.is_producer else None)
        self._new_pulls, self._new_cancels = [], []
        return meta

    def _idle_wait(self, scheduler_output: Any) -> float:
        """How long this step may wait for a release: only when the engine steps for nothing but held
        blocks (nothing scheduled or just finished, no pull of its own in flight, no free queued)."""
        if (self.cfg.idle_step_wait_ms and self._held and not self._pulls and not self._new_pulls
                and not self._new_cancels and self._released.empty()
                and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
                and not getattr(scheduler_output, "finished_req_ids", None)):
            return self.cfg.idle_step_wait_ms / 1e3
        return 0.0

    def has_pending_work(self) -> bool:
        return bool(self._held)

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.add(key, n)

    def get_kv_connector_stats(self) -> KVLinkStats | None:
        with self._stats_lock:
            stats, self._stats = self._stats, KVLinkStats()
            self.totals.aggregate(stats)
        if self.is_producer:
            gauges = (len(self._held), sum(n for _, n in self._held.values()))
            if gauges != self._gauges_sent:
                self._gauges_sent = gauges
                stats.set_gauge("held_requests", gauges[0])
                stats.set_gauge("held_blocks", gauges[1])
        return None if stats.is_empty() else stats

    @property
    def held_requests(self) -> dict[str, tuple[float, int]]:
        return dict(self._held)
