"""TTFT and KV transfer time per request: single server vs PD through kvlink vs PD through NixlConnector.

Modes: single; kvlink (transport_backend auto: a same-host copy here); kvlink-tcp (kvlink's TCP transport
forced, the same wire as NIXL's); nixl.

    PYTHONPATH=. .venv/bin/python bench/bench_connector.py --requests 8 [--nixl-path DIR]

Uses the kvheavy model (32 KiB of KV per token) and prompts of 1,000-2,000 tokens, sent one at a time
(streaming, TTFT = first token at the client). Each mode runs its own servers (at most two at once) on
loopback; NIXL runs only when ``--nixl-path`` points at a ``pip install --target`` of nixl (see
docs/connector.md). The VM is noisy: compare modes from the same run only; ``--runs 3`` repeats the
whole set and prints the median of the per-run medians.

KV transfer time, the same definition for both connectors: from the decode worker issuing the pull to
the connector seeing the data in place. kvlink: ``kvlink_pull_seconds`` (the worker receives the pull in
start_load_kv; it ends when the READ completes and the lease proof is in). NIXL:
``vllm:nixl_xfer_time_seconds`` (NIXL's own telemetry: the READ is posted in start_load_kv; it ends when
the worker's completion check sees it done). kvlink also reports the hand-off: from the KV in place to
vLLM's engine step collecting it (``kvlink_handoff_seconds``), time spent waiting on vLLM, not kvlink.
NIXL runs over UCX TCP on loopback (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvlink.demo.servers import ProxyProc, Stack, VLLMServer, free_port, kvlink_config
from kvlink.demo.tiny_model import ensure_model


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randint(1000, 2000))] for _ in range(n)]


def ttft(url: str, prompt: list[int], max_tokens: int = 8) -> float:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


def run_mode(mode: str, model: str, ps: list[list[int]], logs: Path, nixl_path: str | None,
             nixl_threads: int | None = None, kvlink_extra: dict | None = None,
             proxy_mode: str = "sequential") -> dict:
    with Stack() as stack:
        if mode == "single":
            srv = stack.add(VLLMServer("single", model, logs, cpu=0, kv_bytes=1 << 30))
            srv.wait_ready()
            url, dec = srv.url, None
        else:
            if mode.startswith("kvlink"):
                # kvlink-tcp: the TCP transport even on one host, the same wire as NIXL's UCX TCP.
                extra = dict(kvlink_extra or {}, **({"transport_backend": "tcp"} if mode == "kvlink-tcp" else {}))
                bport = free_port()
                pre_kv = kvlink_config("kv_producer", "prefill-0", bootstrap_port=bport, **extra)
                dec_kv = kvlink_config("kv_consumer", **extra)
                env_p = env_d = None
            else:
                pre_kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
                dec_kv = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
                if nixl_threads is not None:
                    for c in (pre_kv, dec_kv):
                        c["kv_connector_extra_config"] = {"num_threads": nixl_threads}
                base = {"PYTHONPATH": nixl_path, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}
                env_p = dict(base, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
                env_d = dict(base, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            pre = stack.add(VLLMServer(f"{mode}-prefill", model, logs, kv=pre_kv, cpu=0, kv_bytes=1 << 30,
                                       env=env_p))
            dec = stack.add(VLLMServer(f"{mode}-decode", model, logs, kv=dec_kv, cpu=1, kv_bytes=1 << 30,
                                       env=env_d))
            pre.wait_ready()
            dec.wait_ready()
            conc = proxy_mode == "concurrent" and mode.startswith("kvlink")  # NIXL pairs sequentially only
            proxy = stack.add(ProxyProc(pre.url, dec.url, logs, mode="concurrent" if conc else "sequential",
                                        bootstrap=f"http://127.0.0.1:{bport}" if conc else None))
            proxy.wait_ready()
            url = proxy.url
        ttft(url, ps[0][:200])  # warm-up
        ttfts, xfers, posts, nbytes, local, handoffs = [], [], [], [], [], []
        load = [os.getloadavg()[0]]
        for p in ps:
            m0 = dec.metrics() if dec else {}
            ttfts.append(ttft(url, p))
            if dec:
                time.sleep(0.3)
                m1 = dec.metrics()
                d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
                # Issue to data in place (see the module docstring); kvlink's post-to-done READ time too.
                xfers.append(d.get("kvlink_pull_seconds_sum", d.get("vllm:nixl_xfer_time_seconds_sum",
                                                                    float("nan"))))
                posts.append(d.get("kvlink_transfer_seconds_sum", float("nan")))
                nbytes.append(d.get("kvlink_bytes_pulled_total", d.get("vllm:nixl_bytes_transferred_sum",
                                                                       float("nan"))))
                local.append(d.get("kvlink_bytes_local_total", float("nan")))
                handoffs.append(d.get("kvlink_handoff_seconds_sum", float("nan")))
        load.append(os.getloadavg()[0])
        return {"mode": mode, "ttft_ms": [t * 1e3 for t in ttfts], "xfer_ms": [x * 1e3 for x in xfers],
                "read_ms": [x * 1e3 for x in posts], "bytes": nbytes, "bytes_local": local,
                "handoff_ms": [x * 1e3 for x in handoffs], "load1": load}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--modes", default="single,kvlink,kvlink-tcp,nixl",
                    help="kvlink: transport_backend auto (same-host copy here); kvlink-tcp: TCP forced")
    ap.add_argument("--nixl-path", default=None, help="directory holding nixl (pip install --target)")
    ap.add_argument("--runs", type=int, default=1, help="repeat every mode this many times")
    ap.add_argument("--nixl-threads", type=int, default=None,
                    help="NixlConnector num_threads (UCX worker threads per agent; vLLM's default 4)")
    ap.add_argument("--kvlink-extra", default="{}", type=json.loads,
                    help='JSON merged into both kvlink configs, e.g. \'{"transport_backend": "tcp"}\'')
    ap.add_argument("--proxy-mode", default="sequential", choices=("sequential", "concurrent"),
                    help="kvlink pairing through the proxy (NIXL always runs sequential)")
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = ap.parse_args()
    model = str(ensure_model("kvheavy"))
    ps = prompts(args.requests)
    logs = Path(tempfile.mkdtemp(prefix="kvlink-bench-"))
    print(f"kvheavy model, {len(ps)} prompts of {min(map(len, ps))}-{max(map(len, ps))} tokens; logs {logs}")
    results = []
    med = statistics.median
    for run in range(1, args.runs + 1):
        for mode in args.modes.split(","):
            if mode == "nixl" and not args.nixl_path:
                print("nixl: skipped (no --nixl-path)")
                continue
            t0 = time.monotonic()
            try:
                r = run_mode(mode, model, ps, logs, args.nixl_path, args.nixl_threads, args.kvlink_extra,
                             args.proxy_mode)
            except Exception as e:  # noqa: BLE001
                print(f"run {run} {mode}: failed: {e}")
                continue
            r["run"] = run
            results.append(r)
            line = (f"run {run} {mode:10s} TTFT median {med(r['ttft_ms']):8.1f} ms  "
                    f"p90 {sorted(r['ttft_ms'])[int(.9 * (len(ps) - 1))]:8.1f} ms")
            if r["xfer_ms"]:
                mib = med(r["bytes"]) / 2**20
                line += (f"  KV transfer median {med(r['xfer_ms']):7.2f} ms "
                         f"({min(r['xfer_ms']):.1f}-{max(r['xfer_ms']):.1f}) for {mib:.1f} MiB")
                if mode.startswith("kvlink"):
                    line += (f"  [READ post-to-done {med(r['read_ms']):.2f} ms, same-host "
                             f"{med(r['bytes_local']) / 2**20:.1f} MiB; hand-off to vLLM "
                             f"{med(r['handoff_ms']):.1f} ms ({max(r['handoff_ms']):.0f} max)]")
            print(line + f"  load1 {r['load1'][0]:.2f}->{r['load1'][1]:.2f} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    if args.runs > 1:
        print("median of the per-run medians:")
        for mode in args.modes.split(","):
            rs = [r for r in results if r["mode"] == mode]
            if rs:
                line = f"  {mode:10s} TTFT {med([med(r['ttft_ms']) for r in rs]):8.1f} ms"
                if rs[0]["xfer_ms"]:
                    line += f"  KV transfer {med([med(r['xfer_ms']) for r in rs]):7.2f} ms"
                print(line + f"  ({len(rs)} runs)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
