"""Pair decode's blocks with prefill's and turn the pairs into transport descriptors: pure functions, no
I/O (unit-tested directly).

Pairing is by token position: entry i of either side's block table holds tokens ``[i * B, (i + 1) * B)``.
vLLM's tables hold the null block (id 0) where the model never reads (outside a sliding window) and,
on decode, blocks it already has (prefix cache); only the positions decode needs are moved, and a
position decode needs that prefill no longer holds fails the pull: kvlink never guesses.

A pull copies, for every layer, remote block ``r`` of that layer into local block ``l``. Byte ranges that
continue each other on both sides become one descriptor, so a contiguous prompt costs one descriptor per
layer and plane instead of one per block, and one per run of slots between two staging pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlink.vllm.layout import Geometry


NULL_BLOCK = 0  # vLLM's null block: a position the model never reads


class PairingError(ValueError):
    """Decode's and prefill's block tables cannot be paired exactly; the message names request and group."""


def pair_blocks(request_id: str, group: int, local: tuple[int, ...], first: int,
                remote: tuple[int, ...], num_blocks: int | None = None) -> list[tuple[int, int]]:
    """[(local block, remote block)] for every position >= ``first`` where decode holds a real block.

    ``local`` is decode's table for the tokens pulled, ``remote`` prefill's published table; both are by
    position, null blocks included. ``num_blocks``: how many positions the tokens pulled cover.
    """
    if num_blocks is not None and len(local) != num_blocks:
        raise PairingError(f"request {request_id} group {group}: decode's table has {len(local)} blocks for "
                           f"tokens that cover {num_blocks}")
    if len(remote) < len(local):
        raise PairingError(f"request {request_id} group {group}: prefill published {len(remote)} blocks, "
                           f"decode's table for the tokens it pulls has {len(local)}")
    if not 0 <= first <= len(local):
        raise PairingError(f"request {request_id} group {group}: first position to pull {first} is outside "
                           f"decode's table of {len(local)} blocks")
    pairs = []
    for pos in range(first, len(local)):
        lb = local[pos]
        if lb == NULL_BLOCK:
            continue  # decode never reads this position (outside its window)
        rb = remote[pos]
        if rb == NULL_BLOCK:
            raise PairingError(f"request {request_id} group {group}: decode needs block position {pos} but "
                               "prefill no longer holds it (null: outside prefill's window)")
        pairs.append((lb, rb))
    return pairs


def group_pairs(request_id: str, tables, remote: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int]]:
    """[(group, local block, remote block)] over every KV cache group of a pull: ``tables`` are decode's
    (metadata.GroupTable), ``remote`` prefill's published tables, one per group in group order."""
    if len(remote) != len(tables):
        raise PairingError(f"request {request_id}: prefill published {len(remote)} KV cache group(s), decode "
                           f"pulls {len(tables)}")
    return [(t.group, lb, rb) for t in tables
            for lb, rb in pair_blocks(request_id, t.group, t.local_block_ids, t.first_block, remote[t.group],
                                      t.num_blocks)]


def ready_pairs(request_id: str, tables, remote: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int]]:
    """Streamed KV: [(group, local block, remote block)] of the positions prefill has finished so far;
    ``remote`` is its partial table per group (full blocks only, by position), shorter than decode's."""
    if len(remote) != len(tables):
        raise PairingError(f"request {request_id}: prefill streamed {len(remote)} KV cache group(s), decode "
                           f"pulls {len(tables)}")
    out = []
    for t in tables:
        have = remote[t.group]
        n = min(len(t.local_block_ids), len(have))
        out += [(t.group, lb, rb) for lb, rb in pair_blocks(request_id, t.group, t.local_block_ids[:n],
                                                             min(t.first_block, n), have[:n])]
    return out


def step_pairs(request_id: str, tables, whole: tuple[tuple[int, ...], ...],
               step: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int]]:
    """Layer-wise streamed KV: [(group, local block, remote block)] of the running step's further blocks
    ``step`` (per group, the positions after ``whole``; the last may be the prompt's partial one)."""
    if len(step) != len(whole):
        raise PairingError(f"request {request_id}: prefill streamed {len(step)} KV cache group(s) of the running "
                           f"step and {len(whole)} of whole blocks")
    done = set(ready_pairs(request_id, tables, whole))
    return [p for p in ready_pairs(request_id, tables, tuple(w + s for w, s in zip(whole, step)))
            if p not in done]


def layer_indices(names) -> dict[str, int] | None:
    """The model's index of each layer (the one number in its dotted name: ``model.layers.7.self_attn.attn``
    is 7), the same on every rank and PP stage; None when a name has no single number or two layers share
    one: layer-wise progress cannot name such layers, so they move as whole blocks only."""
    out = {}
    for name in names:
        nums = [int(part) for part in name.split(".") if part.isdigit()]
        if len(nums) != 1:
            return None
        out[name] = nums[0]
    return out if len(set(out.values())) == len(out) else None


def window_start_lost(num_tokens: int, block_size: int, window: int, extra: int = 0) -> bool:
    """True when a whole loaded prompt's last token cannot be recomputed from the blocks either side keeps.

    vLLM loads ``num_tokens`` tokens, then recomputes the last one (position ``num_tokens - 1``), whose
    sliding window starts at ``num_tokens - window``. Both tables are sized for ``num_tokens`` computed
    tokens: positions before ``(num_tokens - window + 1 - extra) // block_size`` are null on decode and
    freed on prefill. When the window's first position falls in such a block, no pull can supply it.
    """
    skipped = max(0, num_tokens - window + 1 - extra) // block_size
    return max(0, num_tokens - window) // block_size < skipped


@dataclass(frozen=True)
class LayerMap:
    """One layer of a pull: its blocks in the local region and in ``remote_region_id``, each side's
    geometry, and the segments every block has on both sides (``segments`` of ``segment_bytes``)."""

    name: str
    local: Geometry
    remote_region_id: int
    remote: Geometry
    segments: int
    segment_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.segments * self.segment_bytes


@dataclass
class ReadPlan:
    local_offsets: np.ndarray
    remote_region_ids: np.ndarray
    remote_offsets: np.ndarray
    lengths: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def concat(cls, plans: list["ReadPlan"]) -> "ReadPlan":
        return cls(*(np.concatenate([getattr(p, f) for p in plans]) for f in
                     ("local_offsets", "remote_region_ids", "remote_offsets", "lengths")))


def build_plan(layers: list[LayerMap], pairs: list[tuple[int, int]]) -> ReadPlan:
    """One descriptor per segment of each pair in each layer, then byte ranges that continue each other on
    both sides merged: a run of blocks in one plane is one descriptor, and where both sides hold a block's
    segments together (staging pools) a run of blocks of one layer is one."""
    if not pairs or not layers:
        return ReadPlan(*(np.empty(0, t) for t in (np.uint64, np.uint32, np.uint64, np.uint64)))
    seg = layers[0].segment_bytes
    nseg = layers[0].segments
    if any(m.segment_bytes != seg or m.segments != nseg for m in layers):
        raise ValueError("build_plan: layers with different block shapes in one plan")
    p = np.asarray(pairs, dtype=np.uint64).reshape(-1, 2)

    def side(g: str, col: int):  # byte offsets, shape (layers, segments, pairs)
        off = np.array([getattr(m, g).offset for m in layers], np.uint64)[:, None, None]
        sstr = np.array([getattr(m, g).segment_stride for m in layers], np.uint64)[:, None, None]
        bstr = np.array([getattr(m, g).block_stride for m in layers], np.uint64)[:, None, None]
        s = np.arange(nseg, dtype=np.uint64)[None, :, None]
        return off + s * sstr + p[:, col][None, None, :] * bstr

    lo, ro = side("local", 0), side("remote", 1)
    rid = np.broadcast_to(np.array([m.remote_region_id for m in layers], np.uint32)[:, None, None], lo.shape)
    order = (0, 2, 1) if _segments_adjacent(layers) else (0, 1, 2)  # where a block is one range: block-major
    lo, ro, rid = (a.transpose(order).ravel() for a in (lo, ro, rid))
    step = np.uint64(seg)
    brk = np.ones(len(lo), bool)
    brk[1:] = (lo[1:] != lo[:-1] + step) | (ro[1:] != ro[:-1] + step) | (rid[1:] != rid[:-1])
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, len(lo))).astype(np.uint64) * step
    return ReadPlan(lo[starts], rid[starts].copy(), ro[starts], lengths)


def _segments_adjacent(layers: list[LayerMap]) -> bool:
    """Both sides hold each block's segments back to back (staging pools, and layouts whose planes are
    inside a block): then a run of blocks of one layer is one byte range on each side."""
    seg = layers[0].segment_bytes
    return all(getattr(m, side).segment_stride in (0, seg) for m in layers for side in ("local", "remote"))
