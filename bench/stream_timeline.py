"""Where streamed PD's time to first token goes, request by request, against a single server.

    PYTHONPATH=. .venv/bin/python bench/stream_timeline.py [--sizes 1024,2048] [--reps 5] [--link-mbps R]

One single server and one streamed PD stack (``bench_stream.py``'s emulation: ``--device-core``, the
relay at ``R`` MB/s or, without it, at the rate where a 2k transfer takes 40% of the single server's 2k
TTFT), every process with ``KVLINK_TRACE`` on (docs/connector.md "Observability"). Each round sends one
prompt to the single server, then a fresh prompt of the same length through the proxy; the client's send
and first token go into the same trace. Per request the timeline is cut into the legs below (medians
over the rounds, ms); the legs add up to the PD TTFT.

    client->proxy      the client's request reaches the proxy
    proxy->prefill     ... reaches prefill's scheduler (engine_new)
    prefill compute    prefill's scheduler has it until vLLM finishes it (its forward, chunks, sampling)
    finish->publish    request_finished until the record is out
    publish->decode    decode's long poll answers with the record
    tail+done          what was left to read after the record, and the pull handed to the worker
    collect            vLLM's decode scheduler takes the finished pull from a step's output
    schedule           ... and schedules the request (the next step with tokens)
    decode step        decode's own step: the last prompt token's forward, the sample, the output
    out->client        decode's API server and the proxy pass the token on

vLLM's decode computes the last prompt token again before its first token, on every connector: "decode
step" is that step, and it is as long as one decode step of the model at that context.

``--lockstep``: decode with ``stream_lockstep`` (its first step runs beside prefill's last layers), cut into

    client->proxy, proxy->prefill, prefill compute, finish->publish   as above
    publish->step end  from the record out until decode's scheduler runs again after the armed step (the
                       step waited for the record; its output is out)
    out->client        decode's API server and the proxy pass the token on
and, not a leg, "step start": when decode's armed step began, against prefill's end (below 0: before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench.bench_stream as bs
from bench.bench_connector import ttft
from kvlink.demo.servers import Stack, VLLMServer
from kvlink.demo.tiny_model import ensure_model

LEGS = ("client->proxy", "proxy->prefill", "prefill compute", "finish->publish", "publish->decode", "tail+done",
        "collect", "schedule", "decode step", "out->client")


def legs(evs: list[dict], t_send: float, t_first: float) -> dict[str, float] | None:
    """The legs (ms) of the PD request sent at ``t_send`` whose first token came at ``t_first``; ``evs``
    holds the trace's events from the send on. None when an event is missing (the request did not stream
    through the expected path)."""
    def one(pred):
        return next((e for e in evs if pred(e)), None)

    px = one(lambda e: e["ev"] == "proxy_request")
    pub = one(lambda e: e["ev"] == "publish")
    if px is None or pub is None:
        return None
    new = one(lambda e: e["ev"] == "engine_new" and e["rid"] == pub["rid"])
    fin = one(lambda e: e["ev"] == "finished" and e["rid"] == pub["rid"])
    rec = one(lambda e: e["ev"] == "answer" and e.get("transfer_id") == pub["transfer_id"] and not e["partial"])
    if None in (new, fin, rec):
        return None
    done = one(lambda e: e["ev"] == "pull_done" and e["rid"] == rec["rid"])
    coll = one(lambda e: e["ev"] == "recv_collected" and rec["rid"] in e["rids"])
    if done is None or coll is None:
        return None
    steps = [e["t"] for e in evs if e["ev"] == "step" and e["pid"] == coll["pid"] and e["t"] > coll["t"]]
    sched = next((e["t"] for e in evs if e["ev"] == "step" and e["pid"] == coll["pid"] and e["t"] > coll["t"]
                  and e["tokens"]), None)
    after = next((t for t in steps if sched is not None and t > sched), None)
    if after is None:
        return None
    points = (t_send, px["t"], new["t"], fin["t"], pub["t"], rec["t"], done["t"], coll["t"], sched, after, t_first)
    return {name: 1e3 * (b - a) for name, a, b in zip(LEGS, points, points[1:])}


LOCKSTEP_LEGS = ("client->proxy", "proxy->prefill", "prefill compute", "finish->publish", "publish->step end",
                 "out->client")


def legs_lockstep(evs: list[dict], t_send: float, t_first: float) -> dict[str, float] | None:
    """``legs`` for decode in lock-step (module docstring), plus "step start" (not a leg)."""
    px = next((e for e in evs if e["ev"] == "proxy_request"), None)
    pub = next((e for e in evs if e["ev"] == "publish"), None)
    if px is None or pub is None:
        return None
    new = next((e for e in evs if e["ev"] == "engine_new" and e["rid"] == pub["rid"]), None)
    fin = next((e for e in evs if e["ev"] == "finished" and e["rid"] == pub["rid"]), None)
    armed = next((e for e in evs if e["ev"] == "recv_collected"), None)
    if None in (new, fin, armed):
        return None
    dpid = armed["pid"]
    start = next((e["t"] for e in evs if e["ev"] == "step" and e["pid"] == dpid and e["t"] > armed["t"]
                  and e["tokens"]), None)
    end = next((e["t"] for e in evs if e["ev"] == "step" and e["pid"] == dpid and start is not None
                and e["t"] > max(start, pub["t"])), None)
    if end is None:
        return None
    points = (t_send, px["t"], new["t"], fin["t"], pub["t"], end, t_first)
    out = {name: 1e3 * (b - a) for name, a, b in zip(LOCKSTEP_LEGS, points, points[1:])}
    out["step start"] = 1e3 * (start - fin["t"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="rounds per size")
    ap.add_argument("--link-mbps", type=float, default=None, help="emulated link rate in MB/s")
    ap.add_argument("--gap-s", type=float, default=0.0, help="pause before each measured request, so every "
                    "server's vLLM queue pollers (awake for 1 s after each message) are asleep when it starts")
    ap.add_argument("--lockstep", action="store_true", help="decode with stream_lockstep (module docstring)")
    args = ap.parse_args()
    cut_legs, names = (legs_lockstep, LOCKSTEP_LEGS + ("step start",)) if args.lockstep else (legs, LEGS)
    sizes = [int(x) for x in args.sizes.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="kvlink-stream-timeline-"))
    trace = logs / "trace.jsonl"
    os.environ["KVLINK_TRACE"] = str(trace)  # every server started from here on
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (bs.NOSPIN, os.environ.get("PYTHONPATH"))))
    model = str(ensure_model("kvheavy"))
    print(f"kvheavy model, chunk {bs.CHUNK[1]}, --device-core emulation; trace {trace}", flush=True)
    rows: dict[int, list[tuple[float, float, dict]]] = {s: [] for s in sizes}
    with Stack() as stack:
        single = stack.add(VLLMServer("single", model, logs, cpu=0, kv_bytes=1 << 30, extra_args=bs.CHUNK))
        single.wait_ready()
        pinner = bs.DeviceCore([single.proc.pid])
        ttft(single.url, bs.prompts(1, 200, 1)[0])
        rate = args.link_mbps * 1e6 if args.link_mbps else (
            2048 * bs.KV_PER_TOKEN / (0.4 * ttft(single.url, bs.prompts(1, 2048, 7)[0])))
        pinner.close()
        print(f"emulated link: {rate / 1e6:.0f} MB/s", flush=True)
        pre, dec, proxy, relay = bs.pd_stack(stack, "pd-stream-lockstep" if args.lockstep else "pd-stream", model,
                                             logs, rate, 1 << 30)
        pinner = bs.DeviceCore([single.proc.pid, pre.proc.pid, dec.proc.pid, proxy.proc.pid])
        try:
            ttft(proxy.url, bs.prompts(1, 200, 2)[0])
            for size in sizes:
                ttft(single.url, bs.prompts(1, size, 3 + size)[0])  # a new length runs slower once
                ttft(proxy.url, bs.prompts(1, size, 4 + size)[0])
                for r in range(args.reps):
                    time.sleep(args.gap_s)
                    s = ttft(single.url, bs.prompts(1, size, 1000 * r + size)[0])
                    time.sleep(args.gap_s)
                    t0 = time.monotonic()
                    d = ttft(proxy.url, bs.prompts(1, size, 5000 * r + size + 1)[0])
                    rows[size].append((t0, d, {"single_ms": 1e3 * s}))
                    print(f"    {size:5d} tokens: single {1e3 * s:6.1f} ms, PD streamed {1e3 * d:6.1f} ms", flush=True)
        finally:
            pinner.close()
            relay.close()
    evs = sorted((json.loads(line) for line in trace.read_text().splitlines()), key=lambda e: e["t"])
    med = statistics.median
    print(f"\n| tokens | single ms | PD streamed ms (x single) | {' | '.join(names)} |")
    print("|---|---|---|" + "---|" * len(names))
    for size in sizes:
        cut = []
        for t0, d, extra in rows[size]:
            got = cut_legs([e for e in evs if t0 <= e["t"]], t0, t0 + d)
            if got is not None:
                cut.append((d * 1e3, extra["single_ms"], got))
        if not cut:
            print(f"| {size} | (no complete timeline) |")
            continue
        s, p = med(c[1] for c in cut), med(c[0] for c in cut)
        print(f"| {size} | {s:.0f} | {p:.0f} ({med(c[0] / c[1] for c in cut):.2f}) | "
              + " | ".join(f"{med(c[2][k] for c in cut):.1f}" for k in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
