"""Head-sliced pulls (prefill TP=1 into decode TP=2) against the equal-TP pull of the same bytes.

    .venv/bin/python bench/bench_tp.py                 # 2,048 blocks x 4 layers, 5 alternated rounds
    .venv/bin/python bench/bench_tp.py --blocks 512 --rounds 3 --layout flash_attn_hnd

Real KVLinkWorkers (kvlink's TCP transport, C core, over loopback) and a real bootstrap server in this
process. One prompt of ``--blocks`` blocks; each layer's block holds 8 KV heads x 16 tokens x 128 (K and
V), bf16: 64 KiB per layer per block on the TP=1 side. Per round, alternated:

- equal TP: one TP=1 decode rank pulls the whole prompt from the TP=1 prefill;
- TP 1 -> 2: two decode ranks, each holding 4 heads, pull their half of every block (one head range of each
  block, a descriptor each: heads-outermost layouts cannot merge a head range across blocks), at once.

Reported: descriptors per request (all decode ranks), bytes, and the medians of the pull's wall time (submit
to every rank's KV in place) and of the READ batches' ``transfer_s``. Same bytes both ways.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer
from kvlink.vllm.config import ConnectorConfig
from kvlink.vllm.metadata import PullSpec
from kvlink.vllm.params import RemoteSource
from kvlink.vllm.worker import KVLinkWorker, RankInfo

HEADS, BS, D = 8, 16, 128


def cache(layout: str, nb: int, heads: int, layers: int) -> dict:
    if layout == "cpu":
        make = lambda: torch.empty(nb, heads, BS, 2 * D, dtype=torch.bfloat16)  # noqa: E731
    else:  # FlashAttention HND: [2, nb, heads, BS, D] viewed as [2, nb, BS, heads, D]
        make = lambda: torch.empty(2, nb, heads, BS, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)  # noqa: E731
    return {f"model.layers.{i}.attn": make() for i in range(layers)}


def pull(workers: list[KVLinkWorker], url: str, rid: str, blocks: list[int]) -> float:
    t0 = time.perf_counter()
    for w in workers:
        src = RemoteSource(bootstrap_url=url, engine_id="pre", request_id="p", block_ids=tuple(blocks),
                           lease_s=300.0)
        w._submit(PullSpec(request_id=rid, local_block_ids=tuple(blocks), first_block=0, source=src))
    pending = set(range(len(workers)))
    while pending:
        for i in list(pending):
            _, done, failed = workers[i].transfer_results()
            if rid in failed:
                raise RuntimeError(f"pull {rid} failed on decode rank {i}")
            if rid in done:
                pending.discard(i)
        time.sleep(0.0002)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layout", choices=("cpu", "flash_attn_hnd"), default="cpu")
    ap.add_argument("--streams", type=int, default=4)
    a = ap.parse_args()

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    cfg = ConnectorConfig(transport_backend="tcp", transport_streams=a.streams, pull_timeout_s=300.0,
                          transfer_timeout_s=300.0)
    nb = a.blocks + 1
    pre = KVLinkWorker(cfg, RankInfo("pre", 0, 1, 0, 1, "m", kv_heads=HEADS), "kv_producer")
    eq = KVLinkWorker(cfg, RankInfo("eq", 0, 1, 0, 1, "m", kv_heads=HEADS), "kv_consumer")
    half = [KVLinkWorker(cfg, RankInfo("tp2", r, 2, 0, 1, "m", kv_heads=HEADS), "kv_consumer") for r in range(2)]
    try:
        pre.register_kv_caches(cache(a.layout, nb, HEADS, a.layers))
        eq.register_kv_caches(cache(a.layout, nb, HEADS, a.layers))
        for w in half:
            w.register_kv_caches(cache(a.layout, nb, HEADS // 2, a.layers))
        pre._ensure_registered(srv.url)
        blocks = list(range(1, nb))
        with BootstrapClient(srv.url) as cli:
            cli.publish("pre", "p", [blocks], num_tokens=BS * a.blocks, lease_s=300.0)
        walls = {"equal TP (1 -> 1)": [], "TP 1 -> 2": []}
        transfer = {k: [] for k in walls}
        desc, nbytes = {}, {}
        for r in range(a.rounds + 1):  # round 0 warms up (first contact, page faults)
            for name, ws in (("equal TP (1 -> 1)", [eq]), ("TP 1 -> 2", half)):
                for w in ws:
                    w.get_stats()
                wall = pull(ws, srv.url, f"{name}-{r}", blocks)
                stats = [w.get_stats().data for w in ws]
                if r:
                    walls[name].append(wall)
                    transfer[name].append(max(max(s["transfer_s"]) for s in stats))
                desc[name] = sum(s["descriptors"] for s in stats)
                nbytes[name] = sum(s["bytes_pulled"] for s in stats)
        print(f"prompt: {a.blocks} blocks x {a.layers} layers, {HEADS} KV heads x {BS} tokens x {D} (K and V), "
              f"bf16, layout {a.layout}; TCP transport, {a.streams} streams, loopback; {a.rounds} rounds")
        print("| pull | decode ranks | descriptors per request | MiB | pull wall ms (median) "
              "| READ ms (median, slowest rank) | GB/s |")
        print("|---|---|---|---|---|---|---|")
        for name, ws in (("equal TP (1 -> 1)", [eq]), ("TP 1 -> 2", half)):
            w_ms = 1e3 * statistics.median(walls[name])
            print(f"| {name} | {len(ws)} | {desc[name]} | {nbytes[name] / 2**20:.0f} | {w_ms:.1f} | "
                  f"{1e3 * statistics.median(transfer[name]):.1f} | {nbytes[name] / w_ms / 1e6:.2f} |")
        print(f"ratio (TP 1 -> 2 / equal TP), wall: "
              f"{statistics.median(walls['TP 1 -> 2']) / statistics.median(walls['equal TP (1 -> 1)']):.2f}")
    finally:
        for w in (pre, eq, *half):
            w.shutdown()
        srv.stop()


if __name__ == "__main__":
    main()
