"""Time the stager's copies on a GPU, warm: whole requests device -> pinned pool and back, and one layer at a
time as streamed KV copies them during a forward, against a plain pinned D2H copy of the same bytes.

    python tools/gpu_stager_bench.py            # CUDA
    python tools/gpu_stager_bench.py --device cpu

KV in FlashAttention's layout ([2, num_blocks, 16, heads, 128] bf16 per layer); the request's blocks are
every other block (vLLM's free list is not in order after a while) and its slots a run. For each copy:
the host time of the call (what vLLM's thread pays) and the time until the copy is done on the device,
medians of ``--reps`` after two warm-up rounds, as GB/s of the request's bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=128, help="the request's blocks (16 tokens each)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table of one whole and one "
                                                          "layer-by-layer copy (where the host time goes)")
    a = ap.parse_args(argv)
    import torch

    from kvlink.vllm.layout import block_layout
    from kvlink.vllm.stager import Stager

    cuda = a.device.startswith("cuda")
    nb = 2 * a.blocks + 8
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, nb, 16, a.heads, 128, device=a.device).to(torch.bfloat16)
          for i in range(a.layers)}
    first = next(iter(kv.values()))
    st = Stager(kv, block_layout(first.shape, first.stride(), first.element_size()), a.blocks + 4)
    blocks, slots = list(range(1, 2 * a.blocks + 1, 2)), list(range(1, a.blocks + 1))
    nbytes = a.blocks * st.slot_bytes

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        host, done = [], []
        for r in range(a.reps + 2):
            sync()
            t0 = time.perf_counter()
            p = fn()
            t1 = time.perf_counter()
            p.wait()
            sync()
            t2 = time.perf_counter()
            if r >= 2:
                host.append(t1 - t0)
                done.append(t2 - t0)
        return statistics.median(host), statistics.median(done)

    def per_layer():
        p = None
        for li in range(a.layers):
            p = st.to_pool(blocks, slots, st.fence(), li)
        return p

    src = torch.ones(nbytes, dtype=torch.uint8, device=a.device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

    class _Copy:
        def wait(self):
            pass

    def plain():
        dst.copy_(src, non_blocking=True)
        return _Copy()

    rows = {
        "plain pinned D2H copy": timed(plain),
        "to_pool, whole request": timed(lambda: st.to_pool(blocks, slots, st.fence())),
        "to_pool, layer by layer (sum)": timed(per_layer),
        "from_pool, whole request": timed(lambda: st.from_pool(slots, blocks, st.fence())),
        "from_pool, half the layers": timed(lambda: st.from_pool(slots, blocks, st.fence(),
                                                                  list(range(0, a.layers, 2)))),
    }
    print(f"device {a.device}: {a.layers} layers x {a.blocks} blocks of {st.slot_bytes // a.layers // 1024} KiB "
          f"({nbytes / 2**20:.0f} MiB), medians of {a.reps}")
    for name, (host, done) in rows.items():
        n = nbytes // 2 if "half" in name else nbytes
        print(f"  {name:32s} host {host * 1e3:8.2f} ms   done {done * 1e3:8.2f} ms  {n / done / 1e9:7.2f} GB/s")
    plain_gbs = nbytes / rows["plain pinned D2H copy"][1]
    whole = nbytes / rows["to_pool, whole request"][1]
    print(f"  to_pool whole / plain D2H = {whole / plain_gbs:.2f} (GPU issue's target >= 0.80)")
    print(f"  per layer, host time {rows['to_pool, layer by layer (sum)'][0] / a.layers * 1e6:.0f} us a layer")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for name, fn in (("whole", lambda: st.to_pool(blocks, slots, st.fence())), ("per layer", per_layer)):
            with profile(activities=acts) as prof:
                fn().wait()
                sync()
            print(f"--- profile: to_pool {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
    bi = torch.tensor(blocks, device=a.device)
    want = [v.index_select(0, bi).cpu() for v in st.views]

    def pool_ok() -> bool:
        ok = all(torch.equal(st.pool[li, 1:a.blocks + 1], w) for li, w in enumerate(want))
        st.pool.zero_()
        return ok

    st.pool.zero_()
    checks = {"to_pool whole": (st.to_pool(blocks, slots, st.fence()).wait(), pool_ok())[1],
              "to_pool per layer": (per_layer().wait(), pool_ok())[1]}
    st.to_pool(blocks, slots, st.fence()).wait()
    for v in st.views:
        v.index_fill_(0, bi, 0)
    st.from_pool(slots, blocks, st.fence()).wait()
    sync()
    checks["from_pool"] = all(torch.equal(v.index_select(0, bi).cpu(), w) for v, w in zip(st.views, want))
    bad = [k for k, ok in checks.items() if not ok]
    print("  bytes: " + (f"MISMATCH after {bad}" if bad else "every slot equals its block, and back"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
