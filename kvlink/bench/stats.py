"""Summaries of repeated measurements, the table and the JSON lines."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Result:
    system: str
    workload: str
    blocks: int
    block_size: int
    bytes: int
    gbps_median: float
    gbps_min: float
    gbps_max: float
    p50_ms: float
    p99_ms: float
    iters: int
    verified: bool
    descriptors: int | None = None

    @classmethod
    def of(cls, system: str, workload: str, blocks: int, block_size: int, seconds: list[float], verified: bool,
           descriptors: int | None = None) -> Result:
        t = np.asarray(seconds)
        nbytes = blocks * block_size
        gbps = nbytes / t / 1e9
        return cls(system, workload, blocks, block_size, nbytes, round(float(np.median(gbps)), 4),
                   round(float(gbps.min()), 4), round(float(gbps.max()), 4),
                   round(float(np.percentile(t, 50) * 1e3), 4), round(float(np.percentile(t, 99) * 1e3), 4),
                   len(seconds), verified, descriptors)

    def json(self) -> str:
        return json.dumps(asdict(self))


def ratios(results: list[Result]) -> list[tuple[str, str, str, float, str]]:
    """Each kvlink system's ratio to each other system per workload: throughput
    for batch workloads, p50 latency (kvlink / other: lower is better) for
    latency ones."""
    out = []
    for k in results:
        if not k.system.startswith("kvlink"):
            continue
        for r in results:
            if r.workload != k.workload or r.system.startswith("kvlink"):
                continue
            if k.workload.startswith("lat-"):
                out.append((k.workload, k.system, r.system, k.p50_ms / r.p50_ms if r.p50_ms else float("nan"),
                            "p50 latency x"))
            else:
                out.append((k.workload, k.system, r.system,
                            k.gbps_median / r.gbps_median if r.gbps_median else float("nan"), "throughput x"))
    return out


def table(results: list[Result]) -> str:
    head = ("workload", "system", "GB/s med", "min", "max", "p50 ms", "p99 ms", "us/desc", "iters", "ok")
    rows = [head]
    for r in results:
        per_desc = f"{r.p50_ms * 1e3 / r.blocks:.2f}" if r.blocks > 1 else "-"
        rows.append((r.workload, r.system, f"{r.gbps_median:.3f}", f"{r.gbps_min:.3f}", f"{r.gbps_max:.3f}",
                     f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", per_desc, str(r.iters), "yes" if r.verified else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    rs = ratios(results)
    if rs:
        lines.append("")
        lines.append("kvlink relative to the yardsticks (same run):")
        for wl, mine, other, v, what in rs:
            lines.append(f"  {wl:<12} {mine:<16} vs {other:<8} {what} {v:.2f}")
    return "\n".join(lines)
