"""The standard workloads and the data pattern every run verifies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KiB = 1024
MiB = 1024 * KiB
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Workload:
    name: str
    blocks: int
    block_size: int
    latency: bool = False  # one descriptor per batch, many batches: report latency
    models: str = ""

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_size


STANDARD = (
    Workload("paged-32k", 2048, 32 * KiB, models="a step's KV blocks at random slots (32 KiB blocks)"),
    Workload("paged-128k", 512, 128 * KiB, models="the same with 128 KiB blocks"),
    Workload("large-64m", 1, 64 * MiB, models="one large contiguous transfer"),
    Workload("tiny-64b", 2048, 64, models="cost per descriptor"),
    Workload("lat-4k", 1, 4 * KiB, latency=True, models="single 4 KiB READ latency"),
    Workload("lat-32k", 1, 32 * KiB, latency=True, models="single 32 KiB READ latency"),
)


def custom(blocks: int, block_size: int) -> Workload:
    if blocks < 1 or block_size < 64 or block_size % 64:
        raise ValueError("--blocks must be >= 1 and --block-size a positive multiple of 64")
    return Workload(f"paged-{blocks}x{block_size}", blocks, block_size, models="custom paged READ")


def fill_pattern(buf: np.ndarray, seed: int) -> None:
    """Fill a uint8 buffer (length a multiple of 8) with word i = (i * golden) ^ seed."""
    words = buf.view(np.uint64)
    words[:] = np.arange(len(words), dtype=np.uint64)
    words *= GOLDEN
    words ^= np.uint64(seed)


def expected(offsets: np.ndarray, block_size: int, seed: int) -> np.ndarray:
    """The pattern words of the blocks at these byte offsets, block after block."""
    per = block_size // 8
    idx = (offsets // 8)[:, None].astype(np.uint64) + np.arange(per, dtype=np.uint64)[None, :]
    return (idx * GOLDEN) ^ np.uint64(seed)


def gather(buf: np.ndarray, offsets: np.ndarray, block_size: int) -> np.ndarray:
    words = buf.view(np.uint64)
    per = block_size // 8
    idx = (offsets // 8)[:, None].astype(np.int64) + np.arange(per, dtype=np.int64)[None, :]
    return words[idx]


def random_slots(rng: np.random.Generator, buffer_bytes: int, w: Workload) -> np.ndarray:
    """Distinct block-aligned byte offsets in the buffer."""
    slots = buffer_bytes // w.block_size
    if slots < w.blocks:
        raise ValueError(f"{w.name}: {w.blocks} blocks of {w.block_size} B do not fit a {buffer_bytes} B buffer")
    return (rng.choice(slots, size=w.blocks, replace=False).astype(np.uint64) * np.uint64(w.block_size))
