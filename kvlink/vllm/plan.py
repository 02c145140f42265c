"""Turn block pairs into transport descriptors: pure functions, no I/O (unit-tested directly).

A pull copies, for every layer, remote block ``r`` of that layer into local block ``l``. Runs where both
the local and remote block ids advance by one become one descriptor of ``n * block_bytes``, so a
contiguous prompt costs one descriptor per layer instead of one per block and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerMap:
    """Where one layer lives: at ``local_offset`` inside the local region, in ``remote_region_id``."""

    name: str
    local_offset: int
    remote_region_id: int
    block_bytes: int


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
    runs = coalesce(pairs)
    n = len(runs) * len(layers)
    lo = np.empty(n, np.uint64)
    rid = np.empty(n, np.uint32)
    ro = np.empty(n, np.uint64)
    ln = np.empty(n, np.uint64)
    if runs:
        r = np.asarray(runs, dtype=np.uint64)
        k = len(runs)
        for i, layer in enumerate(layers):
            s = slice(i * k, (i + 1) * k)
            bb = np.uint64(layer.block_bytes)
            lo[s] = np.uint64(layer.local_offset) + r[:, 0] * bb
            ro[s] = r[:, 1] * bb
            ln[s] = r[:, 2] * bb
            rid[s] = layer.remote_region_id
    return ReadPlan(lo, rid, ro, ln)
