"""Turn the JSON lines of `kvlink bench --json` into the published results.

    .venv/bin/python -m kvlink bench --compare raw-tcp,memcpy,mooncake,nixl-tcp,nixl --json > run.jsonl
    bench/.peers/venv/bin/python bench/report.py run.jsonl [--out bench/results/latest] [--note "load 0.4"]

Writes OUT.json (the records plus when and where), OUT.md (a table of
medians per workload and system, kvlink's ratio to each other system) and
OUT.png (throughput per workload and system, and p50 latency of the latency
workloads). Needs only the standard library for .json and .md; matplotlib
for the chart (installed by bench/install_peers.sh into bench/.peers/venv).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def load(path: str) -> tuple[list[dict], dict | None]:
    rows, memory = [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            if d.get("workload") == "memory":
                memory = d
            elif "gbps_median" in d:
                rows.append(d)
    if not rows:
        raise SystemExit(f"{path}: no `kvlink bench --json` records")
    return rows, memory


def order(rows: list[dict]) -> tuple[list[str], list[str]]:
    workloads, systems = [], []
    for r in rows:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
        if r["system"] not in systems:
            systems.append(r["system"])
    return workloads, systems


def markdown(rows: list[dict], memory: dict | None, meta: dict) -> str:
    workloads, systems = order(rows)
    by = {(r["workload"], r["system"]): r for r in rows}
    out = [f"# kvlink bench: {meta['when']}", "",
           f"Host `{meta['host']}`, {meta['cpus']} CPUs, load average (1 min) {meta['load']}. {meta['note']}".rstrip(),
           "", "Medians over the timed runs; every run's data verified (`ok`). GB/s = 1e9 bytes/s. "
           "Latency workloads: p50 of single READs.", "",
           "| workload | system | GB/s median | min | max | p50 ms | p99 ms | us/desc | runs | ok |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for w in workloads:
        for s in systems:
            r = by.get((w, s))
            if not r:
                continue
            per = f"{r['p50_ms'] * 1e3 / r['blocks']:.2f}" if r["blocks"] > 1 else "-"
            out.append(f"| {w} | {s} | {r['gbps_median']:.3f} | {r['gbps_min']:.3f} | {r['gbps_max']:.3f} | "
                       f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {per} | {r['iters']} | "
                       f"{'yes' if r['verified'] else 'NO'} |")
    mine = [s for s in systems if s.startswith("kvlink")]
    others = [s for s in systems if not s.startswith("kvlink")]
    for k_sys in mine if others else []:
        out += ["", f"{k_sys} relative to each system in the same run (throughput: {k_sys} / other, higher is "
                f"better; latency workloads: other p50 / {k_sys} p50, higher is better):", "",
                "| workload | " + " | ".join(others) + " |", "|---|" + "---:|" * len(others)]
        for w in workloads:
            k = by.get((w, k_sys))
            if not k:
                continue
            cells = []
            for s in others:
                r = by.get((w, s))
                if not r:
                    cells.append("-")
                elif w.startswith("lat-"):
                    cells.append(f"{r['p50_ms'] / k['p50_ms']:.2f}x" if k["p50_ms"] else "-")
                else:
                    cells.append(f"{k['gbps_median'] / r['gbps_median']:.2f}x" if r["gbps_median"] else "-")
            out.append(f"| {w} | " + " | ".join(cells) + " |")
    if memory:
        out += ["", f"Engine memory with {memory['peers']} peers connected: target +{memory['target_rss_growth_mib']} "
                f"MiB, initiator +{memory['initiator_rss_growth_mib']} MiB (RSS growth, regions excluded)."]
    return "\n".join(out) + "\n"


def chart(rows: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    workloads, systems = order(rows)
    by = {(r["workload"], r["system"]): r for r in rows}
    batch = [w for w in workloads if not w.startswith("lat-")]
    lat = [w for w in workloads if w.startswith("lat-")]
    fig, axes = plt.subplots(1, 2 if lat else 1, figsize=(13 if lat else 9, 4.8),
                             gridspec_kw={"width_ratios": [3, 1]} if lat else None, squeeze=False)
    width = 0.8 / max(1, len(systems))
    for ax, names, key, label in ((axes[0][0], batch, "gbps_median", "throughput, GB/s (median)"),
                                  (axes[0][-1] if lat else None, lat, "p50_ms", "single READ p50, ms")):
        if ax is None or not names:
            continue
        for i, s in enumerate(systems):
            xs = [k + i * width for k, w in enumerate(names) if (w, s) in by]
            ys = [by[(w, s)][key] for w in names if (w, s) in by]
            bars = ax.bar(xs, ys, width, label=s)
            ax.bar_label(bars, fmt="%.3g", fontsize=6, rotation=90, padding=2)
        ax.set_xticks([k + width * (len(systems) - 1) / 2 for k in range(len(names))], names)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
        if key == "gbps_median" and any(by[(w, s)][key] > 0 for w in names for s in systems if (w, s) in by):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][0].legend(fontsize=8, ncols=min(len(systems), 6), loc="upper left")
    fig.suptitle(f"kvlink bench, {meta['when']} ({meta['cpus']} CPUs, load {meta['load']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", help="output of `kvlink bench --json` ('-' for stdin)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "latest"),
                    help="path prefix of the .json, .md and .png written (default bench/results/latest)")
    ap.add_argument("--note", default="", help="a line for the report (how it was run)")
    ap.add_argument("--load", default=None, help="load average to report (default: read now)")
    ap.add_argument("--no-chart", action="store_true")
    args = ap.parse_args()
    rows, memory = load("/dev/stdin" if args.jsonl == "-" else args.jsonl)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "load": args.load or f"{os.getloadavg()[0]:.2f}",
            "note": args.note}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": rows, "memory": memory}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows, memory, meta))
    if not args.no_chart:
        try:
            chart(rows, meta, args.out + ".png")
        except ImportError:
            print("report: matplotlib missing (bash bench/install_peers.sh); no chart", file=sys.stderr)
    print(f"report: wrote {args.out}.json, {args.out}.md" + ("" if args.no_chart else f", {args.out}.png"))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
