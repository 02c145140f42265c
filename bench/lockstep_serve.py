"""What decode's lock-step costs the other requests: vLLM's serving benchmark (``vllm bench serve``,
random prompts, several at once) through two streamed PD stacks alive at once, one with decode's
``stream_lockstep`` and one without, in turns, with ``bench_stream.py``'s emulation (``--device-core``, the
emulated link). Prints TTFT and ITL (inter-token latency: an armed request's step holds every request
in it) for each.

    PYTHONPATH=. .venv/bin/python bench/lockstep_serve.py [--link-mbps 312] [--input-len 1024]
        [--output-len 32] [--num-prompts 24] [--concurrency 4] [--turns 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import bench.bench_stream as bs
from kvlink.demo.servers import Stack
from kvlink.demo.tiny_model import ensure_model


def serve(url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main

    p = argparse.ArgumentParser()
    add_cli_args(p)
    ns = p.parse_args(["--base-url", url, "--model", model, "--tokenizer", model, "--served-model-name", "model",
                       "--dataset-name", "random", "--random-input-len", str(args.input_len),
                       "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                       "--max-concurrency", str(args.concurrency), "--seed", str(seed), "--ignore-eos"])
    return main(ns)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-mbps", type=float, default=312.0)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--turns", type=int, default=2, help="runs of each stack, alternating")
    ap.add_argument("--stall-ms", type=float, default=200.0, help="the lock-step decode's stream_lockstep_stall_ms")
    args = ap.parse_args()
    bs.DEVICE_CORE, bs.LOCKSTEP_STALL_MS = True, args.stall_ms
    import os

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (bs.NOSPIN, os.environ.get("PYTHONPATH"))))
    model = str(ensure_model("kvheavy"))
    logs = Path(tempfile.mkdtemp(prefix="kvlink-lockstep-serve-"))
    print(f"logs {logs}; link {args.link_mbps} MB/s; {args.num_prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, {args.concurrency} at once; lock-step stall {args.stall_ms} ms", flush=True)
    out: dict[str, list[dict]] = {"pd-stream": [], "pd-stream-lockstep": []}
    with Stack() as stack:
        urls, pids, relays = {}, [], []
        try:
            for mode in out:
                pre, dec, proxy, relay = bs.pd_stack(stack, mode, model, logs, args.link_mbps * 1e6, 1 << 30,
                                                     name=f"{mode}-")
                relays.append(relay)
                urls[mode] = proxy.url
                pids += [pre.proc.pid, dec.proc.pid, proxy.proc.pid]
            pinner = bs.DeviceCore(pids)
            try:
                for turn in range(args.turns):
                    for mode, url in urls.items():
                        r = serve(url, model, args, seed=100 + turn)
                        out[mode].append(r)
                        print(f"  {mode}: TTFT median {r['median_ttft_ms']:.0f} ms, ITL median "
                              f"{r['median_itl_ms']:.1f} ms, p99 {r['p99_itl_ms']:.1f} ms, "
                              f"{r['completed']} completed", flush=True)
            finally:
                pinner.close()
        finally:
            for relay in relays:
                if relay is not None:
                    relay.close()
    med = statistics.median
    print("\n| stack | TTFT median ms | TTFT p99 ms | ITL median ms | ITL p99 ms | completed |\n|---|---|---|---|---|---|")
    for mode, rs in out.items():
        print(f"| {mode} | {med(r['median_ttft_ms'] for r in rs):.0f} | {med(r['p99_ttft_ms'] for r in rs):.0f} | "
              f"{med(r['median_itl_ms'] for r in rs):.1f} | {med(r['p99_itl_ms'] for r in rs):.1f} | "
              f"{sum(r['completed'] for r in rs)} of {args.num_prompts * len(rs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
