"""Streamed KV: TTFT of a single server, PD with the KV moved after prefill (non-streamed) and PD with the KV
streamed while prefill computes, over an emulated link and over plain loopback.

    PYTHONPATH=. .venv/bin/python bench/bench_stream.py [--link-mbps R] [--reps 3] [--out FILE]

On this machine a CPU forward is slow and loopback fast, the opposite of a GPU cluster: streaming would
look like nothing. So prefill's transport is reached through a rate-limited relay (tests/relay.py: it
throttles the direction READ data flows) at a rate where the non-streamed transfer of a 2k-token prompt
takes about 40% of prefill's compute, as on GPUs over 25-100 GbE. Unless ``--link-mbps`` is given, the
rate is set from the single server's 2k-token TTFT measured first in the same run; the achieved rate
(bytes over the non-streamed tail) is reported with the figures.

kvheavy model (32 KiB of KV per token, 8 layers), chunked prefill of 256 tokens (``--chunk``) on every server
(the single server too), kvlink's TCP transport (a same-host copy would bypass the relay), concurrent pairing through
``kvlink proxy --mode concurrent``, prompts of 1k, 2k and 4k tokens at concurrency 1 and 4, each prompt
new to every server (no prefix-cache hit). Per cell: median TTFT at the client (first streamed token),
and the exposed transfer: decode's ``kvlink_tail_seconds`` (from decode seeing prefill's published record
to the KV in place; for the non-streamed mode that is the whole transfer).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_connector import ttft
from kvlink.demo.servers import ProxyProc, Stack, VLLMServer, free_port, kvlink_config
from kvlink.demo.tiny_model import ensure_model
from tests.relay import Relay

SIZES = (1024, 2048, 4000)  # "4k": the model allows 4,096 positions, 8 of them for the output
CONCURRENCY = (1, 4)
CHUNK = ("--max-num-batched-tokens", "256")
ISOLATE = False
KV_PER_TOKEN = 32 << 10  # kvheavy: 8 layers x 8 KV heads x 128 x (K, V) x bf16


def prompts(n: int, size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(size)] for _ in range(n)]


def cells(url: str, reps: int, seed: int, dec: VLLMServer | None) -> dict:
    """TTFT per (size, concurrency); decode's tail and bytes per request from /metrics deltas. One request
    of each size first, not counted: the first prompt of a new length after start-up runs slower."""
    out = {}
    for size in SIZES:
        ttft(url, prompts(1, size, seed - size)[0])
        for conc in CONCURRENCY:
            n = reps if conc == 1 else conc * max(1, reps // 2)
            ps = prompts(n, size, seed + size * 10 + conc)
            m0 = dec.metrics() if dec else {}
            with cf.ThreadPoolExecutor(conc) as ex:
                ts = list(ex.map(lambda p: ttft(url, p), ps))
            cell = {"ttft_ms": [t * 1e3 for t in ts]}
            if dec:
                time.sleep(0.5)
                m1 = dec.metrics()
                d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
                pulls = d.get("kvlink_tail_seconds_count", 0) or float("nan")
                cell.update(tail_ms=1e3 * d.get("kvlink_tail_seconds_sum", float("nan")) / pulls,
                            mib=d.get("kvlink_bytes_pulled_total", float("nan")) / pulls / 2**20,
                            streamed_blocks=d.get("kvlink_blocks_streamed_total", 0) / pulls,
                            failed=d.get("kvlink_pulls_failed_total", 0))
            out[(size, conc)] = cell
            print(f"    {size:5d} tokens x{conc}: TTFT median {statistics.median(cell['ttft_ms']):8.1f} ms"
                  + (f"  tail {cell['tail_ms']:7.1f} ms for {cell['mib']:.1f} MiB, streamed blocks "
                     f"{cell['streamed_blocks']:.0f}/request, failed {cell['failed']:.0f}" if dec else ""),
                  flush=True)
    return out


def pin_tree(pid: int, cpus: set[int], children: bool = True) -> int:
    """Every thread of process ``pid`` (and its descendants) onto ``cpus`` (decode's side of an emulated
    second host); returns how many threads were moved."""
    moved, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
            if children:
                todo += [int(c) for t in tids for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
        for t in tids:
            try:
                os.sched_setaffinity(t, cpus)
                moved += 1
            except OSError:
                pass
    return moved


def run(mode: str, model: str, logs: Path, reps: int, seed: int, rate: float | None) -> dict:
    with Stack() as stack:
        if mode == "single":
            srv = stack.add(VLLMServer("single", model, logs, cpu=0, kv_bytes=2 << 30,
                                       extra_args=CHUNK))
            srv.wait_ready()
            ttft(srv.url, prompts(1, 200, 1)[0])
            return cells(srv.url, reps, seed, None)
        bport, tport = free_port(), free_port()
        relay = Relay(f"127.0.0.1:{tport}", rate=rate) if rate else None
        if relay is not None:
            relay.CHUNK = 1 << 16  # paced in 64 KiB steps: the sleep per step stays well above its overhead
        extra = {"transport_backend": "tcp", "stream_kv": mode.startswith("pd-stream")}
        if mode == "pd-stream-step":  # announced after each step's forward instead of after each layer
            extra["stream_granularity"] = "step"
        pre_kv = kvlink_config("kv_producer", "prefill-0", bootstrap_port=bport, transport_port=tport,
                               **({"transport_advertise": relay.address} if relay else {}), **extra)
        # "-nopace": decode steps back to back while it waits for KV (pull_step_wait_ms 0, as before session 10)
        dec_kv = kvlink_config("kv_consumer", **extra, **({"pull_step_wait_ms": 0} if mode.endswith("-nopace") else {}))
        pre = stack.add(VLLMServer("prefill", model, logs, kv=pre_kv, cpu=0, kv_bytes=2 << 30,
                                   extra_args=CHUNK))
        dec = stack.add(VLLMServer("decode", model, logs, kv=dec_kv, cpu=1, kv_bytes=2 << 30))
        try:
            pre.wait_ready()
            dec.wait_ready()
            proxy = stack.add(ProxyProc(pre.url, dec.url, logs, mode="concurrent",
                                        bootstrap=f"http://127.0.0.1:{bport}"))
            proxy.wait_ready()
            if ISOLATE:  # decode's host: decode's engine, the proxy and the relay (this process) on CPU 1 only
                n = sum(pin_tree(pid, {1}) for pid in (dec.proc.pid, proxy.proc.pid))
                n += pin_tree(os.getpid(), {1}, children=False)  # the relay's thread; not prefill, a child too
                print(f"    pinned {n} threads of decode, the proxy and the relay to CPU 1", flush=True)
            ttft(proxy.url, prompts(1, 200, 2)[0])
            return cells(proxy.url, reps, seed, dec)
        finally:
            if relay is not None:
                relay.close()
            if ISOLATE:  # this process's threads back on every CPU: the next run's servers inherit its mask
                for t in os.listdir("/proc/self/task"):
                    os.sched_setaffinity(int(t), range(os.cpu_count()))


def main() -> int:
    global SIZES, CONCURRENCY, CHUNK, ISOLATE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-mbps", type=float, default=None, help="emulated link rate in MB/s (default: from "
                    "the single server's 2k TTFT, so the 2k transfer takes 40%% of prefill's compute)")
    ap.add_argument("--reps", type=int, default=3, help="requests per cell at concurrency 1")
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    ap.add_argument("--pacing-ab", action="store_true", help="also PD streamed over the emulated link with "
                    "decode's pull_step_wait_ms 0 (decode's engine spinning while it waits)")
    ap.add_argument("--granularity-ab", action="store_true", help="also PD streamed over the emulated link "
                    "with stream_granularity \"step\" (the default streams per layer)")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens of every server (GPUs: 2k-16k, "
                    "so most prompts are one chunk)")
    ap.add_argument("--isolate", action="store_true", help="pin decode's engine, the proxy and the relay to CPU 1 "
                    "(prefill's compute is on CPU 0 already): two hosts, roughly, instead of one shared one")
    ap.add_argument("--emulated-only", action="store_true", help="skip the plain loopback runs")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma-separated")
    args = ap.parse_args()
    SIZES = tuple(int(x) for x in args.sizes.split(","))
    CONCURRENCY = tuple(int(x) for x in args.concurrency.split(","))
    CHUNK = ("--max-num-batched-tokens", str(args.chunk))
    ISOLATE = args.isolate
    model = str(ensure_model("kvheavy"))
    logs = Path(tempfile.mkdtemp(prefix="kvlink-bench-stream-"))
    print(f"kvheavy model, chunked prefill of {args.chunk} tokens, kvlink TCP transport; logs {logs}", flush=True)
    med = statistics.median
    results: dict[str, dict] = {}
    print("single server:", flush=True)
    results["single"] = run("single", model, logs, args.reps, 100, None)
    ref = 2048 if 2048 in SIZES else SIZES[0]  # the link is set so this size's transfer is 40% of its compute
    rate = args.link_mbps * 1e6 if args.link_mbps else (
        ref * KV_PER_TOKEN / (0.4 * med(results["single"][(ref, CONCURRENCY[0])]["ttft_ms"]) / 1e3))
    print(f"emulated link: {rate / 1e6:.0f} MB/s ({rate * 8 / 1e9:.2f} Gb/s)", flush=True)
    links = (("emulated", rate),) + (() if args.emulated_only else (("loopback", None),))
    for link, r in links:
        for mode in ("pd", "pd-stream"):
            print(f"{mode} over {link}:", flush=True)
            results[f"{mode}/{link}"] = run(mode, model, logs, args.reps, 100, r)
    if args.granularity_ab:
        print("pd-stream over emulated, stream_granularity step:", flush=True)
        results["pd-stream-step/emulated"] = run("pd-stream-step", model, logs, args.reps, 100, rate)
    if args.pacing_ab:
        print("pd-stream over emulated, pull_step_wait_ms 0:", flush=True)
        results["pd-stream-nopace/emulated"] = run("pd-stream-nopace", model, logs, args.reps, 100, rate)
    print(f"\n| link | size | conc | single TTFT ms | PD TTFT ms (x single) | PD streamed TTFT ms (x single) | "
          f"transfer ms (non-streamed tail) | exposed ms (streamed tail) | exposed / transfer | achieved MB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for link, _ in links:
        for size in SIZES:
            for conc in CONCURRENCY:
                s = med(results["single"][(size, conc)]["ttft_ms"])
                a, b = results[f"pd/{link}"][(size, conc)], results[f"pd-stream/{link}"][(size, conc)]
                ta, tb = med(a["ttft_ms"]), med(b["ttft_ms"])
                achieved = a["mib"] * 2**20 / (a["tail_ms"] / 1e3) / 1e6 if a["tail_ms"] else float("nan")
                print(f"| {link} | {size} | {conc} | {s:.0f} | {ta:.0f} ({ta / s:.2f}) | {tb:.0f} ({tb / s:.2f}) | "
                      f"{a['tail_ms']:.0f} | {b['tail_ms']:.0f} | {b['tail_ms'] / a['tail_ms']:.2f} | {achieved:.0f} |")
    if args.granularity_ab:
        print("\n| size | conc | PD streamed per layer: TTFT ms (x single), exposed ms | per step: TTFT ms (x single), "
              "exposed ms |\n|---|---|---|---|")
        for size in SIZES:
            for conc in CONCURRENCY:
                s = med(results["single"][(size, conc)]["ttft_ms"])
                a, b = results["pd-stream/emulated"][(size, conc)], results["pd-stream-step/emulated"][(size, conc)]
                ta, tb = med(a["ttft_ms"]), med(b["ttft_ms"])
                print(f"| {size} | {conc} | {ta:.0f} ({ta / s:.2f}), {a['tail_ms']:.0f} | {tb:.0f} ({tb / s:.2f}), "
                      f"{b['tail_ms']:.0f} |")
    if args.pacing_ab:
        print("\n| size | conc | PD streamed TTFT ms, pull_step_wait_ms 5 | same, 0 (x of 5) |\n|---|---|---|---|")
        for size in SIZES:
            for conc in CONCURRENCY:
                a = med(results["pd-stream/emulated"][(size, conc)]["ttft_ms"])
                b = med(results["pd-stream-nopace/emulated"][(size, conc)]["ttft_ms"])
                print(f"| {size} | {conc} | {a:.0f} | {b:.0f} ({b / a:.2f}) |")
    if args.out:
        Path(args.out).write_text(json.dumps({k: {f"{s}x{c}": v for (s, c), v in r.items()}
                                              for k, r in results.items()} | {"rate_bytes_s": rate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
