"""Scheduler side of KVLinkConnector (runs in the EngineCore process).

Prefill (kv_producer): the requests kept for decode, from publish to free, are producer.py's (``Producer``,
the prefill half of this class).

Decode (kv_consumer): for ``do_remote_prefill`` requests announces the prompt tokens as an asynchronous
external hit, hands the worker one PullSpec per request, sends cancels for aborted ones and, once the
worker reports a request, tells prefill the outcome (pulled or abandoned).

Bootstrap HTTP calls never run on the scheduler thread: a small thread pool does them. kv_transfer_params
are parsed and built in ``params``. This class owns both halves' state; what is shared with the release
watcher and the pool's threads is under ``_held_lock`` (prefill) and ``_siblings_lock`` (decode).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvlink import trace
from kvlink.bootstrap.pool import ClientPool
from kvlink.bootstrap.schema import Outcome
from kvlink.vllm import params as kvparams
from kvlink.vllm.config import ConnectorConfig
from kvlink.vllm.held import COUNTER_OF, HeldTable
from kvlink.vllm.lease import reader_of
from kvlink.vllm.lockstep import LockstepBook
from kvlink.vllm.metadata import GroupTable, KVLinkMetadata, PullSpec
from kvlink.vllm.nudge import NudgeListener
from kvlink.vllm.plan import window_start_lost
from kvlink.vllm.params import BadParams, RemoteSource, request_digest
from kvlink.vllm.producer import Producer
from kvlink.vllm.siblings import SIBLING_GRACE_S, Siblings, is_sample
from kvlink.vllm.staging import SlotPool, StagePlanner
from kvlink.vllm.stats import KVLinkStats
from kvlink.vllm.stream import StreamPlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Block ids of another group count than this engine's are refused unparsed past this many (see _fits_groups)
MAX_PARSED_IDS = 1 << 16


class KVLinkScheduler(Producer):
    def __init__(self, cfg: ConnectorConfig, engine_id: str, role: str, block_size: int,
                 window: int | None = None, window_extra: int = 0, staging_slots: int | None = None,
                 windows: tuple[tuple[int, int] | None, ...] | None = None,
                 block_sizes: tuple[int, ...] | None = None, backoff: int = 0, streamable: str | None = None,
                 dp_local: int = 0, launch: str | None = None):
        self.cfg, self.engine_id, self.block_size = cfg, engine_id, block_size
        self.launch = launch  # this engine's start (connector.launch_of): every publish names it
        self.dp_local = dp_local  # data parallelism: this engine's DP rank on its host (connector.dp_local_of)
        # Per KV cache group: tokens per block (a state group's block covers the whole request).
        self.block_sizes = block_sizes or (block_size,)
        # Prompt tokens prefill leaves to decode (1 with Mamba layers: decode derives state N from prefill's
        # state N-1 when it recomputes the last prompt token, which it always does after a full load).
        self.backoff = backoff
        # Per KV cache group: (sliding window, extra retained tokens) of a SlidingWindowSpec group, else None.
        self.windows = windows if windows is not None else ((window, window_extra) if window else None,)
        self.is_producer = role in ("kv_producer", "kv_both")
        self.is_consumer = role in ("kv_consumer", "kv_both")
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
        self._lookup_chunk = 512  # ids per reconcile lookup (halved while a server refuses that many)
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
        self._parsed: dict[str, tuple[Any, RemoteSource]] = {}  # request id -> (its params, parsed): _source
        self._new_pulls: list[PullSpec] = []
        self._local_hit: dict[str, int] = {}  # request id -> prefix-cache tokens vLLM offered
        # Sequential pairing, until allocated: whether the prompt digest compared, with the token count and
        # decode's own digest (update_state_after_alloc hashes that many tokens again otherwise)
        self._prompt_ok: dict[str, tuple[bool, int, str | None]] = {}
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
            if not self.is_consumer:
                raise BadParams("do_remote_prefill", "kv_transfer_params ask for do_remote_prefill, but this engine "
                                "is not a kv_consumer (it has nowhere to pull KV into)")
            cached = self._parsed.get(rid)
            if cached is not None and cached[0] is params:  # vLLM asks every step while a request waits
                return cached[1]
            self._fits_groups(params.get("remote_block_ids"))  # (before converting lists it cannot use)
            src = self._allowed(RemoteSource.from_params(params))
            try:
                self._fits(src)
            except BadParams:
                self._release_async(src, Outcome.ABANDONED)  # prefill's copy is nobody's: freed now
                raise
            self._parsed[rid] = (params, src)
            while len(self._parsed) > 4096:  # (requests that never reach allocation nor finish: bounded)
                self._parsed.pop(next(iter(self._parsed)))
            return src
        except BadParams as e:
            self._bad[rid] = str(e)
            self._count("bad_params")
            logger.warning("kvlink: request %s: %s; computing it locally", rid, e)
            return None

    def _fits_groups(self, raw: Any) -> None:
        """BadParams when raw ``remote_block_ids`` hold another number of KV cache groups than this engine's and
        more ids than any prompt here: refused before they are converted (up to 64 groups of 2^20 ids took
        seconds of vLLM's scheduler thread). A smaller list goes on to ``_fits``, whose refusal also gives
        the prefill request back."""
        groups = kvparams.as_groups(raw)
        if not (isinstance(groups, list) and groups and len(groups) != len(self.windows)):
            return
        if sum(len(g) for g in groups if isinstance(g, list)) > MAX_PARSED_IDS:
            raise BadParams("remote_block_ids", f"kv_transfer_params['remote_block_ids'] hold {len(groups)} KV cache "
                            f"group(s); this engine has {len(self.windows)}")

    def _fits(self, src: RemoteSource) -> RemoteSource:
        """``src`` if its block ids can be this engine's (one list per KV cache group, at least as many
        positions as the tokens they claim), else BadParams naming ``remote_block_ids``: refused at
        admission, decode computes the prompt and the client hears why (not a pull that fails later)."""
        if src.block_ids is None:
            return src
        if len(src.block_ids) != len(self.windows):
            raise BadParams("remote_block_ids", f"kv_transfer_params['remote_block_ids'] hold {len(src.block_ids)} "
                            f"KV cache group(s); this engine has {len(self.windows)}")
        if src.num_tokens is not None:
            for g, ids in enumerate(src.block_ids):
                bs = self.block_sizes[g] if g < len(self.block_sizes) else self.block_size
                if len(ids) < -(-src.num_tokens // bs):
                    raise BadParams("remote_block_ids", f"kv_transfer_params['remote_block_ids'] hold {len(ids)} "
                                    f"blocks in group {g}, too few for remote_num_tokens={src.num_tokens} "
                                    f"({bs} tokens a block)")
        return src

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
            return self._prompt_ok[rid][0]
        mine = request_digest(request, src.num_tokens)
        ok = mine is None or mine == src.prompt_sha  # None: embeddings, no ids to compare
        self._prompt_ok[rid] = (ok, src.num_tokens, mine)
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
        compared = self._prompt_ok.pop(rid, None)
        self._parsed.pop(rid, None)
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
        # The record prefill publishes carries its digest; the worker compares this one (where the record covers
        # as many tokens: vLLM may load fewer than prefill computed), in both pairings: the params' own
        # prompt fields (compared before admitting, _same_prompt) come from decode's client. Also the whole
        # prompt's: prefill's pieces and record cover its whole prompt, and a prompt of another length is
        # another prompt.
        n_whole = request.num_prompt_tokens
        known = {compared[1]: compared[2]} if compared is not None else {}
        sha = known[tokens] if tokens in known else request_digest(request, tokens)
        known[tokens] = sha
        whole = known[n_whole] if n_whole in known else request_digest(request, n_whole)
        self._new_pulls.append(PullSpec(rid, t0.local_block_ids, t0.first_block, src, num_blocks=t0.num_blocks,
                                        others=tuple(tables[1:]), num_tokens=tokens if self.backoff else None,
                                        prompt_sha=sha, prompt_tokens=tokens, whole_sha=whole, whole_tokens=n_whole))

    def _finished_consumer(self, request: "Request", params: dict):
        rid = request.request_id
        self._local_hit.pop(rid, None)  # offered a hit but finished before its blocks were allocated
        self._prompt_ok.pop(rid, None)
        self._parsed.pop(rid, None)
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
                    # (peek: decode reports, it does not read; a request the proxy gave up while decode read it
                    # is still answered, so prefill frees it now rather than when decode's lease runs out)
                    rec = cli.lookup_transfer(src.transfer_id, wait_s=self.cfg.lookup_wait_s if waits else 0.0,
                                              peek=True)
                    engine_id, request_id = rec.engine_id, rec.request_id
                cli.release(engine_id, request_id, outcome, reader=reader_of(self.engine_id, self.launch))
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
        or being staged (queued ones only where streamed requests' reserved slots do not stand in their way:
        StagePlanner.freeing_blocks). Staged requests hold no vLLM block, so they do not count (vLLM would stop
        preempting while it waits for frees that never come)."""
        with self._held_lock:
            if self._planner is None:
                return bool(self._held)
            return bool(self._device_frees) or self._held.num_blocks > 0 or self._planner.freeing_blocks() > 0

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


def _taken(request: "Request") -> bool:
    """vLLM took a request that waited for its KV (it cached the request's blocks then)."""
    from vllm.v1.request import RequestStatus as VLLMStatus

    return not request.is_finished() and request.status != VLLMStatus.WAITING_FOR_REMOTE_KVS


def _aborted(request: "Request") -> bool:
    from vllm.v1.request import RequestStatus as VLLMStatus

    return getattr(request, "status", None) == VLLMStatus.FINISHED_ABORTED


