"""KVLinkConnector: the class vLLM instantiates; a thin facade over the scheduler and worker sides.

    --kv-transfer-config '{"kv_connector":"KVLinkConnector","kv_connector_module_path":"kvlink.vllm",
                           "kv_role":"kv_producer","kv_connector_extra_config":{...}}'

vLLM builds one instance with role SCHEDULER in the EngineCore process (-> KVLinkScheduler) and one with
role WORKER per worker (-> KVLinkWorker). Every call below forwards to the side that exists.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvlink.vllm.compat import check_vllm_api, kv_format, rope_desc, weights_desc

check_vllm_api()  # a clear message at start-up instead of an AttributeError mid-request

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvlink import trace  # noqa: E402
from kvlink.vllm.config import ROLES, ConnectorConfig, ConnectorConfigError  # noqa: E402
from kvlink.vllm.lockstep import why_not_lockstep  # noqa: E402
from kvlink.vllm.metadata import KVLinkMetadata  # noqa: E402
from kvlink.vllm.plugin import attach_vllm_log_handlers  # noqa: E402
from kvlink.vllm.scheduler import KVLinkScheduler  # noqa: E402
from kvlink.vllm.staging import pool_slots, pp_slot_bytes, staging_wanted  # noqa: E402
from kvlink.vllm.stats import KVLinkPromMetrics, KVLinkStats  # noqa: E402
from kvlink.vllm.worker import KVLinkWorker, RankInfo  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _platform_fp8() -> str:
    """vLLM's fp8 dtype on this platform (compat.kv_format: ROCm's may be the fnuz variant)."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.fp8_dtype())
    except Exception:  # noqa: BLE001 - a platform without fp8: no fp8 cache either
        return ""


def engine_id_of(vllm_config: "VllmConfig") -> str:
    """This engine's id, unique per DP rank. vLLM's engine core appends ``_dp<rank>`` to the configured id
    under data parallelism (each rank of a dense model is then told it is DP rank 0 of 1; a MoE model's ranks
    keep the DP size); a vLLM that did not would give every rank one id, so the rank is appended here then."""
    kv = vllm_config.kv_transfer_config
    pc = vllm_config.parallel_config
    eid, rank = str(kv.engine_id), pc.data_parallel_rank
    if pc.data_parallel_size <= 1 or eid.endswith(f"_dp{rank}"):
        return eid
    return f"{eid}-dp{rank}"


def launch_of(vllm_config: "VllmConfig") -> str | None:
    """This engine's start: vLLM's ``instance_id`` (a nanosecond timestamp taken when the config is built),
    which the scheduler and every worker of one start share where one config reaches them all (vLLM's
    multiprocessing and Ray executors on one node, each DP engine). Registrations, publishes and streamed
    pieces carry it, so the bootstrap server refuses those of a process that was replaced under the same
    engine id (table.py ``_check_launch``). None, unfenced: no such field, or an engine whose processes
    build configs of their own (several nodes per engine: the other nodes start headless; one process per
    rank under ``external_launcher``)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None and (getattr(pc, "nnodes_within_dp", 1) > 1
                           or getattr(pc, "distributed_executor_backend", None) == "external_launcher"):
        return None
    iid = getattr(vllm_config, "instance_id", None)
    return str(iid)[-64:] if iid else None


def dp_local_of(vllm_config: "VllmConfig") -> int:
    """This engine's DP rank among the DP ranks on its host (``data_parallel_rank_local``; 0 without data
    parallelism). vLLM runs the DP ranks of a dense model as independent engines, each told DP rank 0 of
    1; the local rank survives that. Local, not global: the ranks that share a host share its ports (a
    second node's ranks, a pod per rank, each count from 0 on their own host)."""
    local = getattr(vllm_config.parallel_config, "data_parallel_rank_local", None)
    return local if isinstance(local, int) and local > 0 else 0


def _check_groups(kv_cache_config: Any, staged: bool) -> tuple[tuple[tuple[int, int] | None, ...], tuple[int, ...], int]:
    """Refuse, at start-up, KV cache groups kvlink cannot move exactly. Returns, per group, its sliding window
    (window, extra retained tokens) or None, and its tokens per block; and the prompt tokens prefill leaves
    to decode (1 with a Mamba group: see KVLinkScheduler.on_new_request)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec):
            # "none": one state block per request, the state after the tokens computed. "align" (prefix
            # caching) keeps a state per block position and spec decode adds scratch blocks: not moved yet.
            if getattr(spec, "mamba_cache_mode", "none") != "none" or getattr(spec, "num_speculative_blocks", 0):
                raise RuntimeError(f"KVLinkConnector moves a Mamba group's state with mamba_cache_mode 'none' and no "
                                   f"speculative blocks; group {i} has mode {spec.mamba_cache_mode!r} and "
                                   f"{spec.num_speculative_blocks} speculative blocks (run without prefix caching)")
        elif not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise RuntimeError(f"KVLinkConnector cannot move KV cache group {i} ({type(spec).__name__}: {spec}); "
                               "supported: full attention (MLA included), sliding window, Mamba state")
    sizes = {g.kv_cache_spec.block_size for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)}
    if len(sizes) > 1:
        raise RuntimeError(f"KVLinkConnector pairs blocks by token position, so every KV cache group needs the "
                           f"same tokens per block; this model's groups have {sorted(sizes)}: "
                           f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
    if staged and len(groups) > 1:
        raise RuntimeError(f"KVLinkConnector: host staging moves one KV cache group; this model has {len(groups)} "
                           f"({[type(g.kv_cache_spec).__name__ for g in groups]}): use a backend that registers "
                           "device memory, or vLLM's --disable-hybrid-kv-cache-manager")
    # Only a SlidingWindowSpec group frees blocks outside the window (a FullAttentionSpec may carry a
    # sliding_window too, for the model runner, with every block kept).
    windows = tuple((g.kv_cache_spec.sliding_window, g.kv_cache_spec.extra_retained_tokens)
                    if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None for g in groups) or (None,)
    backoff = 1 if any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups) else 0
    return windows, tuple(g.kv_cache_spec.block_size for g in groups), backoff


def _state_layers(kv_cache_config: Any) -> set[str]:
    """Layers of the Mamba groups: their blocks hold a per-request state, not per-token KV."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return {n for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ()
            if isinstance(g.kv_cache_spec, MambaSpec) for n in g.layer_names}


def groups_desc(kv_cache_config: Any) -> str:
    """The KV cache groups' specs as the compatibility check compares them: kind, tokens per block, window
    (not the per-rank head count: TP is mapped). A Mamba group's block holds one request's whole state
    (mamba_cache_mode "none", _check_groups); vLLM sizes it by --max-model-len, which may differ between
    prefill and decode, so it is left out; each state's shape and dtype go in (vLLM CPU hands kvlink the
    page as bytes: a conv state stored transposed or an SSM state in float16 against bfloat16 fill a page
    of the same size)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out = []
    for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ():
        spec = g.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        size = "state" if isinstance(spec, MambaSpec) else spec.block_size
        if isinstance(spec, MambaSpec):  # each state's shape (per rank) and dtype: a page's bytes say only its size
            size += ":" + ",".join(f"{'x'.join(map(str, sh))}/{str(dt).replace('torch.', '')}"
                                   for sh, dt in zip(spec.shapes, spec.dtypes))
        out.append(f"{type(spec).__name__}:{size}" + (f":w{window}" if window else ""))
    return "|".join(out)


def _staging_slots(cfg: ConnectorConfig, vllm_config: "VllmConfig", kv_cache_config: Any) -> int | None:
    """The staging pool's slot count when this engine stages (the workers size theirs the same way)."""
    try:
        staged, why = staging_wanted(cfg.staging, vllm_config.device_config.device_type, cfg.transport_backend)
    except ValueError as e:
        raise RuntimeError(f"KVLinkConnector: {e}") from None
    if not staged:
        return None
    if kv_cache_config is None:
        raise RuntimeError(f"KVLinkConnector: {why}, but vLLM gave the scheduler no KV cache config to size the "
                           "staging pool with (vLLM >= 0.32 passes one)")
    try:
        slot_bytes = _slot_bytes(vllm_config, kv_cache_config)
    except ValueError as e:
        raise RuntimeError(f"KVLinkConnector: {e}") from None
    slots = pool_slots(cfg.staging_pool_mb, slot_bytes)
    if slots < 1:
        raise RuntimeError(f"KVLinkConnector: staging_pool_mb={cfg.staging_pool_mb} holds no block of this model "
                           f"({slot_bytes} B for one block of every layer)")
    logger.info("kvlink: %s; staging pool of %d blocks per worker", why, slots)
    return slots


def _slot_bytes(vllm_config: "VllmConfig", kv_cache_config: Any) -> int:
    """One staging slot's bytes as the scheduler and every PP stage's worker count them (staging.py)."""
    return pp_slot_bytes(kv_cache_config, vllm_config.model_config.get_total_num_hidden_layers(),
                         vllm_config.parallel_config.pipeline_parallel_size)


def _worker_slot_bytes(vllm_config: "VllmConfig", kv_cache_config: Any) -> int | None:
    """The worker's copy of the slot size (None: no groups, or one the scheduler refuses if it stages)."""
    if not getattr(kv_cache_config, "kv_cache_groups", None):
        return None
    try:
        return _slot_bytes(vllm_config, kv_cache_config)
    except ValueError:
        return None


def why_not_streamable(cfg: ConnectorConfig, staged: bool, backoff: int, windows: tuple,
                       ubatching: bool) -> str | None:
    """Why a prefill engine cannot stream its requests' KV (None: it can): host staging copies per layer;
    a Mamba state exists only at the end; one KV cache group of full attention only; not under vLLM's
    micro-batching (``enable_dbo``, ``ubatch_size``): a layer's hooks run once per micro-batch, so a layer
    would be announced when the first one has written it, and each micro-batch computes on a CUDA stream
    of its own, which the event behind a piece does not cover."""
    layer_wise = cfg.stream_granularity == "layer"
    return ("host staging with stream_granularity \"step\" (the pool copy is made per layer)"
            if staged and not layer_wise
            else "Mamba state" if backoff
            else "several KV cache groups" if len(windows) > 1
            else "sliding window" if windows[0]
            else "micro-batching (enable_dbo or ubatch_size > 1)" if ubatching else None)


def _check_lockstep(cfg: ConnectorConfig, vllm_config: "VllmConfig", kv_cache_config: Any) -> None:
    """Decode's ``stream_lockstep``: refused at start-up, with the reason, where it could not be exact."""
    if not cfg.stream_lockstep:
        return
    kv, pc = vllm_config.kv_transfer_config, vllm_config.parallel_config
    if kv.kv_role == "kv_producer":
        raise ConnectorConfigError("KVLinkConnector: stream_lockstep is decode's (kv_consumer); prefill streams "
                                   "with stream_kv")
    try:
        staged = staging_wanted(cfg.staging, vllm_config.device_config.device_type, cfg.transport_backend)[0]
    except ValueError:
        staged = False  # _staging_slots says why
    why = why_not_lockstep(getattr(kv, "kv_load_failure_policy", "recompute"),
                           bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
                           bool(vllm_config.cache_config.enable_prefix_caching),
                           pc.tensor_parallel_size, pc.pipeline_parallel_size,
                           len(getattr(kv_cache_config, "kv_cache_groups", None) or (None,)), staged,
                           cfg.transport_backend != "mooncake", cfg.stream_granularity)
    if why is None and vllm_config.cache_config.enable_prefix_caching and not hasattr(
            KVConnectorBase_V1, "bind_kv_cache_manager"):
        why = ("prefix caching is on and this vLLM gives connectors no KV cache manager (bind_kv_cache_manager) "
               "to evict unconfirmed blocks with: start decode with --no-enable-prefix-caching")
    if why is not None:
        raise ConnectorConfigError(f"KVLinkConnector: stream_lockstep refused: {why}")


def why_not_context_parallel(parallel_config: Any) -> str | None:
    """Context parallelism (decode's DCP, prefill's PCP) is refused at start-up, with the reason: each of its
    ranks keeps every n-th token of a block (interleaved), and its block manager counts ``block_size`` x n
    tokens per block, so a block paired with one of an engine without it holds other tokens; its ranks also
    share a (DP, TP, PP) index, which kvlink's registrations and ports are keyed by. kvlink does not map
    that: it refuses rather than read the wrong positions."""
    dcp = int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        return (f"context parallelism is not supported (decode_context_parallel_size={dcp}, "
                f"prefill_context_parallel_size={pcp}): its ranks keep interleaved tokens of each block, which "
                "kvlink does not map; run both engines without it")
    return None


def kv_written_before_attention(layer_name: str) -> bool:
    """Prefill: vLLM writes this layer's new KV into its cache in an op of its own that runs just before
    the layer's attention op (``unified_kv_cache_update``, ordered before it, on the same CUDA stream): the
    layer is vLLM's ``Attention`` with its forward, its backend's forward does not include that update,
    and the layer has a KV cache of its own. Anything else (MLA, a backend that writes inside its forward,
    an unknown layer): False, the layer is announced when its attention op has returned."""
    try:
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.attention.attention import Attention

        layer = get_forward_context().no_compile_layers.get(layer_name)
    except Exception:  # noqa: BLE001 - another vLLM: the safe answer
        return False
    return (isinstance(layer, Attention) and type(layer).forward is Attention.forward
            and getattr(getattr(layer, "attn_backend", None), "forward_includes_kv_cache_update", True) is False
            and getattr(layer, "kv_sharing_target_layer_name", "") is None)


def loaded_after(me: Any) -> bool:
    """Whether a connector vLLM calls after ``me`` for each layer may still load that layer's KV: ``me`` is a
    child of vLLM's MultiConnector and not its last, or the worker's connector is some other wrapper (the
    safe answer). vLLM calls the children's ``wait_for_layer_load`` in their order, and a child that loads
    layer by layer (an offloader's prefix hit on prefill) puts the layer in place in its own: a piece sent on
    entry to the layer, before that, would tell decode the prefix's blocks hold it."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        group = get_kv_transfer_group() if has_kv_transfer_group() else None
    except Exception:  # noqa: BLE001 - another vLLM: the safe answer
        return True
    if group is None or group is me:
        return False
    children = list(getattr(group, "_connectors", None) or ())
    return not children or children[-1] is not me


class KVLinkConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid KV cache manager on with kvlink (several KV cache groups: models
    mixing full and sliding-window attention); request_finished_all_groups hands every group's blocks."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        attach_vllm_log_handlers()  # before the first line below: kvlink's log goes where vLLM's goes
        kv = vllm_config.kv_transfer_config
        if kv.kv_role not in ROLES:
            raise ConnectorConfigError(f"KVLinkConnector: kv_role must be one of {ROLES}, got {kv.kv_role!r}")
        self.config = ConnectorConfig.from_extra(kv.kv_connector_extra_config)
        why = why_not_context_parallel(vllm_config.parallel_config)
        if why is not None:
            raise ConnectorConfigError(f"KVLinkConnector: {why}")
        _check_lockstep(self.config, vllm_config, kv_cache_config)
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._step_t0 = 0.0  # decode, lock-step: when this step's metadata was bound
        self._forwarded = False  # ... and whether the step ran a forward since
        self.engine_id = engine_id_of(vllm_config)
        self.kv_role = kv.kv_role
        self._written_first: dict[str, bool] = {}  # prefill streaming: layer -> its KV is in place on entry
        self._entry_safe: bool | None = None  # ... no connector after this one may still load a layer (loaded_after)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        # Tokens per block of the group kvlink pairs (a group's spec may differ from cache_config's, e.g. MLA).
        block_size = groups[0].kv_cache_spec.block_size if groups else vllm_config.cache_config.block_size
        self._sched: KVLinkScheduler | None = None
        self._worker: KVLinkWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            slots = _staging_slots(self.config, vllm_config, kv_cache_config)
            windows, sizes, backoff = _check_groups(kv_cache_config, staged=slots is not None)
            from vllm.v1.kv_cache_interface import MambaSpec

            attn_sizes = [g.kv_cache_spec.block_size for g in groups or ()
                          if not isinstance(g.kv_cache_spec, MambaSpec)]
            block_size = min(attn_sizes) if attn_sizes else block_size  # the attention groups' tokens per block
            streamable = why_not_streamable(self.config, slots is not None, backoff, windows,
                                            bool(getattr(vllm_config.parallel_config, "use_ubatching", False)))
            self._sched = KVLinkScheduler(self.config, self.engine_id, kv.kv_role, block_size,
                                          staging_slots=slots, windows=windows, block_sizes=sizes or None,
                                          backoff=backoff, streamable=streamable, dp_local=dp_local_of(vllm_config),
                                          launch=launch_of(vllm_config))
            self._sched.lockstep_prefix_caching(self._prefix_caching)
            if len(windows) > 1:
                logger.info("kvlink: %d KV cache groups (hybrid KV cache manager): %s", len(windows),
                            groups_desc(kv_cache_config))
            logger.info("kvlink: KVLinkConnector %s engine %s (block size %d, lease %.0f s, bootstrap %s, "
                        "transport backend %s on %s)", kv.kv_role, self.engine_id, block_size,
                        self.config.lease_s, self.config.bootstrap_url or (
                            f"embedded on {self.config.bootstrap_host}:{self.config.bootstrap_port or 'any port'}"
                            if kv.kv_role != "kv_consumer" else "from each request's params"),
                        self.config.transport_backend, self.config.transport_host)
        else:
            pc, mc = vllm_config.parallel_config, vllm_config.model_config
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            mla = bool(getattr(mc, "use_mla", False))
            rank = RankInfo(self.engine_id, get_tensor_model_parallel_rank(), pc.tensor_parallel_size,
                            pc.data_parallel_rank, pc.data_parallel_size, str(mc.model),
                            pp_rank=get_pp_group().rank_in_group if pc.pipeline_parallel_size > 1 else 0,
                            pp_size=pc.pipeline_parallel_size, mla=mla,
                            kv_heads=0 if mla else mc.get_total_num_kv_heads(),
                            num_layers=mc.get_total_num_hidden_layers(), groups=groups_desc(kv_cache_config),
                            kv_format=kv_format(getattr(vllm_config.cache_config, "cache_dtype", ""),
                                                _platform_fp8()),
                            rope=rope_desc(getattr(mc, "hf_text_config", None), getattr(mc, "max_model_len", None)),
                            weights=weights_desc(mc),
                            dp_local=dp_local_of(vllm_config), launch=launch_of(vllm_config))
            self._worker = KVLinkWorker(self.config, rank, kv.kv_role,
                                        slot_bytes=_worker_slot_bytes(vllm_config, kv_cache_config),
                                        layer_groups={n: i for i, g in enumerate(groups or ()) for n in g.layer_names},
                                        state_layers=_state_layers(kv_cache_config),
                                        num_groups=len(groups) if groups else None,
                                        num_blocks=getattr(kv_cache_config, "num_blocks", None))

    # ----- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # (fp8: each layer's K/V scales are read from its attention module there: compat.kv_scales)
        self._worker.register_kv_caches(kv_caches, self._vllm_config.compilation_config.static_forward_context)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self._worker.start_load_kv(meta if isinstance(meta, KVLinkMetadata) else None)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and self.config.stream_lockstep:
            import time

            self._step_t0 = time.monotonic()
            if isinstance(connector_metadata, KVLinkMetadata) and connector_metadata.lockstep:
                self._worker.lockstep_wait_next(connector_metadata.lockstep, None)  # the first layer's KV

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Decode: nothing, whole requests load before they are scheduled, except armed ones (lock-step:
        this layer of theirs must have landed). Prefill streaming per layer, on entry to the layer's
        attention op: where vLLM wrote the layer's new KV in an op of its own just before
        (``kv_written_before_attention``), the step's new blocks hold this layer now, while its attention
        still computes."""
        meta = self._connector_metadata
        if isinstance(meta, KVLinkMetadata) and (meta.lockstep or meta.lockstep_shared) and self._worker is not None:
            self._worker.lockstep_wait([*meta.lockstep, *meta.lockstep_shared], layer_name)
        self._forwarded = True
        self._layer_saved(layer_name, on_entry=True)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Pull model: prefill keeps its blocks, decode reads them. Streamed KV per layer, on exit from the
        layer's attention op: the step's new blocks hold this layer (unless that was said on entry). Decode
        in lock-step: the next layer's KV of armed requests lands before vLLM writes the step's own into it."""
        meta = self._connector_metadata
        if isinstance(meta, KVLinkMetadata) and meta.lockstep and self._worker is not None:
            self._worker.lockstep_wait_next(meta.lockstep, layer_name)
        self._layer_saved(layer_name, on_entry=False)

    def _layer_saved(self, layer_name: str, on_entry: bool) -> None:
        if self._worker is None:
            return
        meta = self._connector_metadata
        if not (isinstance(meta, KVLinkMetadata) and meta.streams):
            return
        early = self._written_first.get(layer_name)
        if early is None:
            if self._entry_safe is None:
                self._entry_safe = not loaded_after(self)
                if not self._entry_safe and self.config.stream_layer_on_entry:
                    logger.info("kvlink: another connector runs after kvlink's layer hooks (a MultiConnector child "
                                "after it) and may load a layer there: streamed layers are announced when their "
                                "attention op has returned, not on entry (put kvlink last to keep it)")
            early = self._written_first[layer_name] = (self.config.stream_layer_on_entry and self._entry_safe
                                                       and kv_written_before_attention(layer_name))
        if early == on_entry:
            trace.event("layer", layer=layer_name, on_entry=on_entry)
            self._worker.send_pieces(meta.streams, layer_name)

    def wait_for_save(self) -> None:
        """After the step's forward: prefill sends the step's streamed pieces (stream.py)."""
        if self._worker is not None:
            meta = self._connector_metadata
            if isinstance(meta, KVLinkMetadata) and meta.streams:
                trace.event("forward_end")
                self._worker.send_pieces(meta.streams)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Finished sends and receives plus failed receives per request (``failed_recving``)."""
        meta = self._connector_metadata
        if self.config.stream_lockstep and self._worker is not None and isinstance(meta, KVLinkMetadata):
            if meta.lockstep or meta.lockstep_shared:
                self._worker.lockstep_end(meta.lockstep, meta.lockstep_shared)
            elif self._forwarded:  # a step with a forward (not one vLLM runs for the connector alone)
                import time

                self._worker.lockstep_step_time(time.monotonic() - self._step_t0)
            self._forwarded = False
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_error_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self):
        """Lock-step: the requests armed and settled this step (metadata.KVLinkWorkerMeta), else None."""
        return self._worker.take_lockstep_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVLinkStats | None:
        side = self._worker if self._worker is not None else self._sched
        return side.get_stats() if self._worker is not None else side.get_kv_connector_stats()

    def shutdown(self) -> None:
        for side in (self._worker, self._sched):
            if side is not None:
                side.shutdown()

    # ----- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """Every transfer group: kvlink writes the request's own blocks of each (vLLM must not zero
        them under the READ)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.update_connector_output(connector_output)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Decode in lock-step with prefix caching: the blocks of an armed pull that ended unconfirmed leave
        vLLM's prefix cache (scheduler.py)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.bind_kv_cache_manager(kv_cache_manager)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        trace.event("finished", rid=request.request_id)
        return self._sched.request_finished(request, block_ids)

    def on_new_request(self, request: "Request") -> None:
        trace.event("engine_new", rid=request.request_id)
        if self._sched is not None:
            self._sched.on_new_request(request)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        trace.event("finished", rid=request.request_id)
        return self._sched.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self._sched is not None and self._sched.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """Keeps the engine stepping while kvlink has work no vLLM request stands for: staged copies held
        (their frees and gauges), staging copies to hear of."""
        return self._sched is not None and self._sched.has_pending_work()

    # ----- stats -------------------------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """Heads outermost in each block (HND, vLLM 0.32's LBHNC), as vLLM's NIXL connector asks: a decode rank at
        another TP then reads its heads of a block as one byte range (layout.py); under NHD only equal TP moves.
        vLLM keeps its own choice, with a warning, where a backend cannot lay blocks out so (vLLM CPU has HND
        only). None for MLA, whose latent has no heads, and with ``kv_cache_layout: "any"`` (a MultiConnector
        beside a connector that needs another layout: vLLM refuses two). Named as this vLLM names it: beside
        NIXL, "HND" and "LBHNC" would be two layouts to vLLM."""
        model = getattr(vllm_config, "model_config", None)
        extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None)
        if model is None or getattr(model, "use_mla", False) or (extra or {}).get("kv_cache_layout") == "any":
            return None
        try:
            from vllm.v1.kv_cache_interface import KVCacheLayout

            return KVCacheLayout.LBHNC.name
        except (ImportError, AttributeError):  # a vLLM before the five-letter names
            return "HND"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVLinkStats:
        return KVLinkStats(data=dict(data)) if data is not None else KVLinkStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVLinkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
