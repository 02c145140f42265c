"""Which prefill ranks a decode rank reads, and which part of each block: tensor and pipeline parallelism as
a mapping. Pure functions, no I/O (unit-tested directly).

- Tensor parallelism shards the KV heads. With ``H`` KV heads over ``T`` ranks, rank ``r`` holds heads
  ``[r * H / T, (r + 1) * H / T)`` when ``H >= T``, else the one head ``r * H // T`` (vLLM replicates a
  head over ``T / H`` ranks). A decode rank reads each head it holds once, from one prefill rank that holds
  it (replicas are spread over decode ranks), as head ranges: a ``Slice``. Prefill and decode TP may be any
  sizes for which vLLM can shard ``H`` (one of ``H`` and ``T`` divides the other).
- MLA's latent cache has no heads and every rank holds it whole: decode rank ``r`` reads it from prefill
  rank ``r % T_prefill``.
- Pipeline parallelism gives each stage a range of layers. Every local layer is read from the prefill stage
  that registered it (by name); a layer no stage holds, or two stages hold, is refused.

One ``Leg`` is one remote rank (a TP rank in a PP stage): the layers it serves and the head range read from
it. The worker turns each leg into one READ batch to that rank (worker.py); layout.py says whether a head
range is one byte range per block (heads outermost) or the layout can only move whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


class MappingError(ValueError):
    """Decode's ranks cannot be mapped onto prefill's exactly; the message says why."""


@dataclass(frozen=True)
class RankView:
    """One rank as the mapping sees it: its TP and PP coordinates and the KV layers it holds."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layers: tuple[str, ...]


@dataclass(frozen=True)
class Slice:
    """Local heads ``[local_first, local_first + count)`` are remote TP rank ``remote_tp``'s heads
    ``[remote_first, remote_first + count)``; ``whole``: both ranks hold exactly these heads (or the
    latent), so whole blocks move."""

    remote_tp: int
    local_first: int
    remote_first: int
    count: int
    whole: bool


@dataclass(frozen=True)
class Leg:
    """What one remote rank serves this rank: ``layers`` (local names, in local order) and the head slice."""

    remote_tp: int
    remote_pp: int
    layers: tuple[str, ...]
    slice: Slice


def heads_of(rank: int, tp_size: int, total: int) -> range:
    """The KV heads (model-wide indices) TP rank ``rank`` of ``tp_size`` holds, as vLLM shards them."""
    if total >= tp_size:
        if total % tp_size:
            raise MappingError(f"{total} KV heads cannot be split over TP={tp_size}")
        n = total // tp_size
        return range(rank * n, (rank + 1) * n)
    if tp_size % total:
        raise MappingError(f"{total} KV heads cannot be replicated over TP={tp_size}")
    h = rank * total // tp_size
    return range(h, h + 1)


def head_slices(tp_rank: int, tp_size: int, remote_tp_size: int, total_heads: int) -> list[Slice]:
    """How local TP rank ``tp_rank`` reads its heads from a prefill of ``remote_tp_size`` ranks.
    ``total_heads`` 0: MLA (no heads, every rank holds the whole latent)."""
    if total_heads == 0:
        return [Slice(tp_rank % remote_tp_size, 0, 0, 0, True)]
    mine = heads_of(tp_rank, tp_size, total_heads)
    out: list[Slice] = []
    for i, h in enumerate(mine):
        owners = [j for j in range(remote_tp_size) if h in heads_of(j, remote_tp_size, total_heads)]
        j = owners[tp_rank % len(owners)]  # a replicated head: decode ranks share the readers out
        theirs = heads_of(j, remote_tp_size, total_heads)
        last = out[-1] if out else None
        if last is not None and last.remote_tp == j and last.remote_first + last.count == h - theirs.start:
            out[-1] = Slice(j, last.local_first, last.remote_first, last.count + 1, False)
        else:
            out.append(Slice(j, i, h - theirs.start, 1, False))
    return [Slice(s.remote_tp, s.local_first, s.remote_first, s.count,
                  s.count == len(mine) == len(heads_of(s.remote_tp, remote_tp_size, total_heads))) for s in out]


def route_layers(layers: tuple[str, ...], stages: dict[int, tuple[str, ...]]) -> dict[str, int]:
    """{local layer: the prefill PP stage that holds it}; refused if one is held by none or by several."""
    owner: dict[str, int] = {}
    for stage, names in sorted(stages.items()):
        for n in names:
            if n in owner:
                raise MappingError(f"layer {n} is registered by prefill PP stages {owner[n]} and {stage}")
            owner[n] = stage
    missing = [n for n in layers if n not in owner]
    if missing:
        raise MappingError(f"no prefill PP stage holds layer(s) {missing[:3]}"
                           f"{' and %d more' % (len(missing) - 3) if len(missing) > 3 else ''}")
    return {n: owner[n] for n in layers}


def plan_legs(local: RankView, remotes: list[RankView], total_heads: int) -> list[Leg]:
    """The remote ranks this rank reads and what from each (see the module docstring). ``remotes``: every
    registered rank of the prefill engine. Refuses (MappingError) what cannot be mapped exactly."""
    if not remotes:
        raise MappingError("the prefill engine has no registered ranks")
    tp, pp = remotes[0].tp_size, remotes[0].pp_size
    if any(r.tp_size != tp or r.pp_size != pp for r in remotes):
        raise MappingError("the prefill engine's ranks disagree on its TP and PP sizes")
    by_rank = {(r.tp_rank, r.pp_rank): r for r in remotes}
    slices = head_slices(local.tp_rank, local.tp_size, tp, total_heads)
    legs = []
    for s in slices:
        stages = {}
        for stage in range(pp):
            r = by_rank.get((s.remote_tp, stage))
            if r is None:
                raise MappingError(f"prefill rank tp{s.remote_tp} pp{stage} (of TP={tp}, PP={pp}) is not "
                                   "registered")
            stages[stage] = r.layers
        route = route_layers(local.layers, stages)
        for stage in range(pp):
            names = tuple(n for n in local.layers if route[n] == stage)
            if names:
                legs.append(Leg(s.remote_tp, stage, names, s))
    return legs
