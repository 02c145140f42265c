"""First contact with a prefill engine: is it compatible, and what does this rank read from which of its
ranks. Pure functions over the engine's registrations (no I/O; the worker asks the bootstrap server and
connects), unit-tested directly.

- Compatibility: prefill's compat hash must equal ours. A mismatch names every differing field with both
  sides' values (``compat_diff``) and the first one is the refusal's reason (counted per reason).
- Mapping: shard.py says which prefill rank serves which of our layers and heads; here each becomes a
  ``LayerMap`` per layer (whole blocks, or a head range of each block: layout.head_geometry) with
  prefill's block sizes checked against what its heads of our layout must take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlink.transport.config import MAX_NAME, check_name
from kvlink.vllm.compat import PROTOCOL_VERSION, compat_diff, layer_layout
from kvlink.vllm.layout import BlockLayout, Geometry, LayoutError, head_geometry
from kvlink.vllm.plan import LayerMap
from kvlink.vllm.shard import Leg, MappingError, RankView, heads_of, plan_legs


class PullFailed(Exception):
    """A pull cannot complete; the message says why (logged once per request). ``reason``: the engine is
    refused at first contact, counted in ``compat_refused`` by this reason; ``detail``: what to log once
    per engine (both sides' values)."""

    def __init__(self, message: str, reason: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class LocalKV:
    """This decode rank as first contact needs it: its coordinates, layers, layout and compatibility."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layers: tuple[str, ...]
    layout: BlockLayout
    geoms: dict[str, Geometry]  # where each layer's blocks sit in the destination region
    total_heads: int  # the model's KV heads over all TP ranks (0: MLA's latent)
    compat: dict
    compat_hash: str
    groups: dict[str, int]  # layer name -> KV cache group
    layouts: dict[str, BlockLayout] | None = None  # per layer where they differ (state layers); else ``layout``
    scales: dict[str, tuple[float, float]] | None = None  # quantized caches (fp8, nvfp4, ...): each layer's (K, V) scale (compat.kv_scales)
    head_scales: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] | None = None  # per-head (compat.kv_head_scales)


def engine_name(engine_id: str, tp_rank: int, instance: str) -> str:
    """A connector rank's transport engine name: the engine, the rank and the process (its registration's
    ``instance``). A peer that reconnects and hears another name refuses it (a restarted process at the same
    address: the region ids it knows name other memory there, KVL_EPEERCHANGED); decode's first contact
    connects to the name the registration implies and no other (``expected_name``). The engine id is cut to
    fit the transport's limit."""
    tail = f"/tp{tp_rank}/{instance}"
    return engine_id[:MAX_NAME - len(tail)] + tail


def expected_name(reg: Any) -> str | None:
    """The transport name a prefill rank's engine answers with, by its registration (None: a registration
    without ``instance``, from a kvlink that predates it). PullFailed for an instance no kvlink engine name
    carries (not a kvlink worker's registration)."""
    if not reg.instance:
        return None
    name = engine_name(reg.engine_id, reg.tp_rank, reg.instance)
    try:
        check_name(name, "engine name", empty=False)
    except ValueError:
        name = ""
    if not name.endswith(f"/{reg.instance}"):
        raise PullFailed(f"prefill engine {reg.engine_id} tp{reg.tp_rank}: its registration names its process "
                         f"{reg.instance!r}, which no kvlink engine name carries", "engine_changed")
    return name


def check_compat(engine_id: str, reg: Any, local: LocalKV) -> None:
    """Refuse a prefill engine whose compat hash or protocol differs, naming what differs."""
    if reg.compat_hash == local.compat_hash and reg.protocol_version == PROTOCOL_VERSION:
        return
    if reg.protocol_version != PROTOCOL_VERSION or not reg.compat:
        diff = {"protocol_version": (reg.protocol_version, PROTOCOL_VERSION)}
        reason = "protocol_version"
        what = f"{diff}{'' if reg.compat else ' (prefill sent no compat fields: an older kvlink?)'}"
    else:
        diff = compat_diff(local.compat, dict(reg.compat))
        reason = next(iter(diff), "compat_hash")
        what = str(diff or "(the same fields, another hash)")
        if set(diff) == {"groups"} and reg.tp_size != local.tp_size and "MambaSpec" in str(local.compat.get("groups")):
            reason = "mapping"  # (a Mamba group's state shapes are per rank)
            what += (f"; prefill runs TP={reg.tp_size}, this engine TP={local.tp_size}: a Mamba state is sharded by "
                     "TP, which kvlink moves between equal TP only")
    detail = (f"kvlink: prefill engine {engine_id} is not compatible with this decode engine ({reason}); "
              f"differing (prefill, decode): {what}; prefill compat {reg.compat_hash}, decode compat "
              f"{local.compat_hash}")
    raise PullFailed(f"compat mismatch with {engine_id} ({', '.join(diff) or 'compat_hash'}): remote "
                     f"{reg.compat_hash}, local {local.compat_hash}", reason, detail)


def legs_for(engine_id: str, regs: list, local: LocalKV) -> list[tuple[Any, list[LayerMap]]]:
    """[(prefill rank's registration, the LayerMaps read from it)]: one per prefill rank this rank reads."""
    if len({r.dp_rank for r in regs}) > 1:
        raise PullFailed(f"prefill engine {engine_id} has ranks of several DP ranks; each DP rank must "
                         "register under its own engine id", "mapping")
    for reg in regs:  # every rank: a stale rank of an earlier process must not slip through
        check_compat(engine_id, reg, local)
    me = f"decode tp{local.tp_rank}/{local.tp_size} pp{local.pp_rank}/{local.pp_size}"
    shape = f"TP={regs[0].tp_size}, PP={regs[0].pp_size}" if regs else "no ranks"
    try:
        legs = plan_legs(RankView(local.tp_rank, local.tp_size, local.pp_rank, local.pp_size, local.layers),
                         [RankView(r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, tuple(x.name for x in r.layers))
                          for r in regs], local.total_heads)
    except MappingError as e:
        raise PullFailed(f"prefill engine {engine_id} ({shape}) cannot serve {me}: {e}", "mapping") from None
    by_rank = {(r.tp_rank, r.pp_rank): r for r in regs}
    try:
        return [(by_rank[(g.remote_tp, g.remote_pp)], _layer_maps(engine_id, by_rank[(g.remote_tp, g.remote_pp)],
                                                                  g, local)) for g in legs]
    except LayoutError as e:
        raise PullFailed(f"prefill engine {engine_id} ({shape}) cannot serve {me}: {e}; run equal TP or a "
                         "heads-outermost (HND) layout", "layout") from None


def _check_head_scales(engine_id: str, n: str, spec: Any, scalars: tuple, local: tuple[tuple[float, ...], ...],
                       sl: Any, local_heads: int) -> None:
    """Per-head K/V scales (compat.kv_head_scales) of the heads this leg reads, prefill's against decode's: a
    kernel that scales per head decodes a head's bytes by its own scale. A side without per-head scales
    scales every head by its one scale (``scalars``: decode's; the scalar check before this compared them
    with prefill's)."""
    remote = (tuple(spec.k_head_scales or ()), tuple(spec.v_head_scales or ()))
    if not any(remote) and not any(local):
        return
    first_r, first_l, count = (0, 0, local_heads) if sl.whole else (sl.remote_first, sl.local_first, sl.count)
    for their_one, ours_one, theirs, ours, k_or_v in ((spec.k_scale, scalars[0], remote[0], local[0], "K"),
                                                      (spec.v_scale, scalars[1], remote[1], local[1], "V")):
        got = theirs[first_r:first_r + count] if theirs else (their_one,) * count
        want = ours[first_l:first_l + count] if ours else (ours_one,) * count
        if got != want:
            raise PullFailed(f"prefill engine {engine_id} has {k_or_v} scales {list(got)} in layer {n} for the heads "
                             f"this engine reads, this engine {list(want)}: its KV bytes would decode to other "
                             "values here (load both engines from the same checkpoint and quantization config)",
                             "kv_scales")


def _layer_maps(engine_id: str, reg: Any, leg: Leg, local: LocalKV) -> list[LayerMap]:
    """The LayerMaps of one leg: whole blocks, or the leg's head range of each block."""
    by_name = {layer.name: layer for layer in reg.layers}
    sl = leg.slice
    remote_heads = len(heads_of(leg.remote_tp, reg.tp_size, local.total_heads)) if local.total_heads else 0
    out = []
    for n in leg.layers:
        spec, lay = by_name[n], (local.layouts or {}).get(n, local.layout)
        if lay.desc.startswith("state") and reg.tp_size != local.tp_size:
            raise PullFailed(f"prefill engine {engine_id} runs TP={reg.tp_size}, this engine TP={local.tp_size}: "
                             f"layer {n} holds a per-request state (Mamba) sharded by TP, which kvlink moves "
                             "between equal TP only", "mapping")
        want = lay.block_bytes // lay.heads * remote_heads if lay.heads else lay.block_bytes
        if spec.group != local.groups.get(n, 0):
            raise PullFailed(f"prefill engine {engine_id} has layer {n} in KV cache group {spec.group}, this "
                             f"engine in group {local.groups.get(n, 0)}: their block ids mean other blocks",
                             "groups")
        if spec.layout != layer_layout(lay.desc):  # (the compat hash has the attention layout only: PP stages)
            raise PullFailed(f"prefill engine {engine_id} tp{leg.remote_tp} pp{leg.remote_pp} lays layer {n} out as "
                             f"{spec.layout}, this engine as {layer_layout(lay.desc)}: its bytes would mean other "
                             "values here", "layout")
        if spec.block_bytes != want:
            raise PullFailed(f"prefill engine {engine_id} tp{leg.remote_tp} pp{leg.remote_pp} has "
                             f"{spec.block_bytes} B blocks in layer {n}; its {remote_heads or 'latent'} "
                             f"head(s) of this model's layout take {want} B", "block_bytes")
        if local.scales and n in local.scales and (spec.k_scale, spec.v_scale) != local.scales[n]:
            k, v = local.scales[n]
            raise PullFailed(f"prefill engine {engine_id} has K/V scales {spec.k_scale}/{spec.v_scale} in layer "
                             f"{n}, this engine {k}/{v}: its KV bytes would decode to other values here (load "
                             "both engines from the same checkpoint and quantization config)", "kv_scales")
        _check_head_scales(engine_id, n, spec, (local.scales or {}).get(n, (None, None)),
                           (local.head_scales or {}).get(n, ((), ())), sl, lay.heads)
        remote = Geometry(spec.offset, spec.block_stride or spec.block_bytes, spec.segment_stride)
        if sl.whole:
            out.append(LayerMap(n, local.geoms[n], spec.region_id, remote, lay.segments, lay.segment_bytes))
        else:
            out.append(LayerMap(n, head_geometry(local.geoms[n], lay, sl.local_first, lay.heads), spec.region_id,
                                head_geometry(remote, lay, sl.remote_first, remote_heads),
                                lay.segments * lay.parts, sl.count * lay.head_bytes))
    return out
