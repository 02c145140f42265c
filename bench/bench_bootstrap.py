"""Benchmark of the bootstrap server on loopback (not a test: prints numbers, asserts nothing).

1. Grouped lookups: a server in its own process, ``--clients`` client threads (one BootstrapClient each)
   looking up ``--ids`` request ids per call for ``--seconds``; throughput and latency percentiles.
   Target: >= 2,000 lookups/s with p99 < 5 ms for 8 clients.
2. Memory: requests published with a short lease and left to expire (prefill polling its outcomes, as it
   would). Measured twice: the pure table in this process (tracemalloc), and the server process over HTTP
   (RSS from /proc). Each phase first warms up until the bounded memories (tombstones) are full, then
   measures before/after ``--mem-requests`` more.

    PYTHONPATH=. .venv/bin/python bench/bench_bootstrap.py [--json] [--seconds 5] [--mem-requests 100000]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from kvlink.bootstrap import (
    BootstrapClient,
    BootstrapConfig,
    BootstrapServer,
    EngineRegistration,
    KVLayerSpec,
    PairingTable,
    TableLimits,
)

TOKEN = "bench-token"


def registration(engine_id: str) -> EngineRegistration:
    layers = [KVLayerSpec(name=f"layer.{i}", region_id=i, block_bytes=32768, num_blocks=4096, tokens_per_block=16,
                          dtype="bfloat16", layout="NHD") for i in range(32)]
    return EngineRegistration(engine_id=engine_id, transport_addr="127.0.0.1:5000", layers=layers,
                              protocol_version=1, compat_hash="bench")


def serve(args: argparse.Namespace) -> None:
    """``--serve``: run a server with bench limits in this process until stdin closes."""
    config = BootstrapConfig(token=TOKEN, max_tombstones=args.max_tombstones, sweep_interval_s=0.1)
    with BootstrapServer(config) as srv:
        print(srv.url, flush=True)
        sys.stdin.read()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lookup_worker(url: str, k: int, ids_per_lookup: int, total_ids: int, start_at: float, seconds: float,
                  rate: float) -> list[float]:
    """One client process: grouped lookups from ``start_at`` (wall clock) for ``seconds``; closed loop when
    ``rate`` is 0, else paced at ``rate`` lookups/s on a fixed schedule."""
    lat: list[float] = []
    with BootstrapClient(url, token=TOKEN, timeout_s=30.0) as cli:
        ids = [f"req-{(k * 97 + j) % total_ids:08d}" for j in range(ids_per_lookup)]
        cli.lookup("P", ids)  # connect, warm up
        time.sleep(max(0.0, start_at - time.time()))
        t_start = time.perf_counter()
        stop = t_start + seconds
        n = 0
        while True:
            if rate:
                due = t_start + n / rate
                if due > time.perf_counter():
                    time.sleep(due - time.perf_counter())
            t0 = time.perf_counter()
            if t0 >= stop:
                break
            found = cli.lookup("P", ids)
            lat.append(time.perf_counter() - t0)
            n += 1
            assert len(found) == ids_per_lookup
    return lat


def bench_lookups(url: str, server_pid: int, clients: int, ids_per_lookup: int, seconds: float,
                  rate: float = 0.0) -> dict:
    """``clients`` client processes (like vLLM scheduler processes), ``rate`` total lookups/s (0: max)."""
    total_ids = 4096
    with BootstrapClient(url, token=TOKEN, timeout_s=30.0) as setup:
        setup.register_engine(registration("P"), lease_s=600.0)
        if setup.health().requests < total_ids:
            for i in range(total_ids):
                setup.publish("P", f"req-{i:08d}", [[i, i + 1, i + 2, i + 3]], 64, lease_s=600.0)
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(clients, mp_context=ctx) as pool:
        start_at = time.time() + 1.0
        cpu0 = cpu_s(server_pid)
        futures = [pool.submit(lookup_worker, url, k, ids_per_lookup, total_ids, start_at, seconds,
                               rate / clients) for k in range(clients)]
        lats = sorted(x for f in futures for x in f.result())
        cpu1 = cpu_s(server_pid)
    return {
        "clients": clients, "ids_per_lookup": ids_per_lookup, "offered_per_s": rate or None,
        "lookups": len(lats), "lookups_per_s": len(lats) / seconds,
        "ids_per_s": len(lats) * ids_per_lookup / seconds,
        "p50_ms": percentile(lats, 0.50) * 1e3, "p90_ms": percentile(lats, 0.90) * 1e3,
        "p99_ms": percentile(lats, 0.99) * 1e3, "max_ms": lats[-1] * 1e3,
        "server_cpu_us_per_lookup": (cpu1 - cpu0) / len(lats) * 1e6,
    }


def bench_table_memory(warmup: int, n: int) -> dict:
    now = [0.0]
    table = PairingTable(TableLimits(), clock=lambda: now[0])
    table.register_engine(registration("P"), 600.0)
    acked = [0]

    def churn(start: int, count: int) -> None:
        for i in range(start, start + count):
            table.publish("P", f"req-{i:08d}", [[i, i + 1, i + 2, i + 3]], 64, lease_s=1.0, transfer_id=f"t-{i:08d}")
            now[0] += 0.001  # 1,000 publishes per simulated second, leases of 1 s
            if i % 1000 == 999:
                answer = table.poll_released("P", table.server_id, acked[0])
                if answer.released:
                    acked[0] = answer.released[-1].seq
        now[0] += 2.0
        table.expire()
        table.poll_released("P", table.server_id, acked[0])

    tracemalloc.start()
    churn(0, warmup)
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    churn(warmup, n)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"warmup": warmup, "requests": n, "before_kib": before / 1024, "after_kib": after / 1024,
            "growth_kib": (after - before) / 1024, "live_requests": table.num_requests,
            "tombstones": table.num_tombstones, "expired": table.stats.expired}


def bench_server_memory(url: str, pid: int, warmup: int, n: int, clients: int) -> dict:
    with BootstrapClient(url, token=TOKEN, timeout_s=30.0) as cli:
        cli.register_engine(registration("M"), lease_s=600.0)

    def churn(start: int, count: int) -> None:
        def worker(k: int) -> None:
            with BootstrapClient(url, token=TOKEN, timeout_s=30.0) as cli:
                for i in range(start + k, start + count, clients):
                    cli.publish("M", f"req-{i:08d}", [[i, i + 1, i + 2, i + 3]], 64, lease_s=0.2,
                                transfer_id=f"t-{i:08d}")
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(worker, range(clients)))
        time.sleep(0.6)  # every lease runs out and the sweeper expires it
        with BootstrapClient(url, token=TOKEN, timeout_s=30.0) as cli:
            while cli.poll_released("M"):
                pass

    churn(0, warmup)
    before = rss_kib(pid)
    checkpoints = []
    t0 = time.perf_counter()
    step = max(1, n // 4)
    for start in range(warmup, warmup + n, step):
        churn(start, min(step, warmup + n - start))
        checkpoints.append(rss_kib(pid))
    elapsed = time.perf_counter() - t0
    after = checkpoints[-1]
    with BootstrapClient(url, token=TOKEN, timeout_s=30.0) as cli:
        health = cli.health()
    return {"warmup": warmup, "requests": n, "rss_before_kib": before, "rss_after_kib": after,
            "growth_kib": after - before, "rss_checkpoints_kib": checkpoints,
            "publishes_per_s": n / elapsed, "live_requests": health.requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--ids", type=int, default=16, help="request ids per grouped lookup")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=2000.0, help="total lookups/s of the paced run")
    parser.add_argument("--mem-requests", type=int, default=100_000)
    parser.add_argument("--mem-warmup", type=int, default=50_000)
    parser.add_argument("--max-tombstones", type=int, default=10_000, help="server limit for the RSS phase")
    parser.add_argument("--skip-server-memory", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return 0

    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--max-tombstones", str(args.max_tombstones)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        url = proc.stdout.readline().strip()
        lookups = bench_lookups(url, proc.pid, args.clients, args.ids, args.seconds)
        paced = bench_lookups(url, proc.pid, args.clients, args.ids, args.seconds, rate=args.rate)
        server_mem = None
        if not args.skip_server_memory:
            server_mem = bench_server_memory(url, proc.pid, args.mem_warmup, args.mem_requests, args.clients)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    table_mem = bench_table_memory(max(150_000, args.mem_warmup), args.mem_requests)

    result = {"lookups": lookups, "paced": paced, "table_memory": table_mem, "server_memory": server_mem,
              "targets": {"lookups_per_s": 2000, "p99_ms": 5.0},
              "met_closed_loop": lookups["lookups_per_s"] >= 2000 and lookups["p99_ms"] < 5.0,
              "met_paced": paced["lookups_per_s"] >= 0.98 * 2000 and paced["p99_ms"] < 5.0}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"grouped lookups: {args.clients} client processes x {args.ids} ids per lookup, {args.seconds:.0f} s, "
          "loopback, server in its own process")
    print(f"  {'mode':<16} {'lookups/s':>10} {'ids/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}"
          f" {'srv cpu us':>10}")
    for name, lk in (("closed loop", lookups), (f"paced {args.rate:.0f}/s", paced)):
        print(f"  {name:<16} {lk['lookups_per_s']:>10.0f} {lk['ids_per_s']:>10.0f} {lk['p50_ms']:>8.2f} "
              f"{lk['p90_ms']:>8.2f} {lk['p99_ms']:>8.2f} {lk['max_ms']:>8.2f} {lk['server_cpu_us_per_lookup']:>10.0f}")
    verdict = {True: "met", False: "NOT met"}
    print(f"  target >= 2000 lookups/s with p99 < 5 ms: closed loop {verdict[result['met_closed_loop']]}, "
          f"paced {verdict[result['met_paced']]}")
    tm = table_mem
    print(f"memory, table (tracemalloc): {tm['requests']} published+expired after {tm['warmup']} warm-up")
    print(f"  before {tm['before_kib']:.0f} KiB, after {tm['after_kib']:.0f} KiB, growth {tm['growth_kib']:+.0f} KiB"
          f" (live {tm['live_requests']}, tombstones {tm['tombstones']})")
    if server_mem:
        sm = server_mem
        print(f"memory, server process (RSS): {sm['requests']} published+expired over HTTP after {sm['warmup']}")
        print(f"  before {sm['rss_before_kib']} KiB, after {sm['rss_after_kib']} KiB, growth "
              f"{sm['growth_kib']:+d} KiB ({sm['publishes_per_s']:.0f} publishes/s, live {sm['live_requests']})")
        print(f"  RSS after each quarter: {', '.join(f'{c} KiB' for c in sm['rss_checkpoints_kib'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
