"""Pair decode's blocks with prefill's and turn the pairs into transport descriptors: pure functions, no
I/O (unit-tested directly).

Pairing is by token position: entry i of either side's block table holds tokens ``[i * B, (i + 1) * B)``.
vLLM's tables hold the null block (id 0) where the model never reads (outside a sliding window) and,
on decode, blocks it already has (prefix cache); only the positions decode needs are moved, and a
position decode needs that prefill no longer holds fails the pull: kvlink never guesses.

A pull copies, for every layer, remote block ``r`` of that layer into local block ``l``. Runs where both
the local and remote block ids advance by one become one descriptor of ``n * block_bytes``, so a
contiguous prompt costs one descriptor per layer instead of one per block and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlink.vllm.layout import BlockLayout


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
    """Where one layer lives: at ``local_offset`` inside the local region, in ``remote_region_id``, its
    blocks laid out as ``layout`` says (the same on both sides: the compatibility hash checks it)."""

    name: str
    local_offset: int
    remote_region_id: int
    layout: BlockLayout

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes


def coalesce(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[(local, remote)] -> [(local_start, remote_start, count)] merging runs that advance together."""
    runs: list[tuple[int, int, int]] = []
    for local, remote in pairs:
        if runs:
            l0, r0, n = runs[-1]
            if local == l0 + n and remote == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((local, remote, 1))
    return runs


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
    """One descriptor per run of blocks (or per block where a plane's blocks are not adjacent), per
    segment (K and V planes), per layer."""
    per_layer = [(layer, coalesce(pairs) if layer.layout.runs_coalesce else [(lb, rb, 1) for lb, rb in pairs])
                 for layer in layers]
    n = sum(len(runs) * layer.layout.segments for layer, runs in per_layer)
    lo = np.empty(n, np.uint64)
    rid = np.empty(n, np.uint32)
    ro = np.empty(n, np.uint64)
    ln = np.empty(n, np.uint64)
    at = 0
    for layer, runs in per_layer:
        if not runs:
            continue
        r = np.asarray(runs, dtype=np.uint64)
        k, lay = len(runs), layer.layout
        stride, seg = np.uint64(lay.block_stride), np.uint64(lay.segment_bytes)
        for plane in range(lay.segments):
            s = slice(at, at + k)
            base = np.uint64(plane * lay.segment_stride)
            lo[s] = np.uint64(layer.local_offset) + base + r[:, 0] * stride
            ro[s] = base + r[:, 1] * stride
            ln[s] = r[:, 2] * seg
            rid[s] = layer.remote_region_id
            at += k
    return ReadPlan(lo, rid, ro, ln)
