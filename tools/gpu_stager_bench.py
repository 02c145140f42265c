"""Time the stager's copies on a GPU, warm: whole requests device -> pinned pool and back, and one layer at a
time as streamed KV copies them during a forward, against a plain pinned D2H copy of the same bytes.

    python tools/gpu_stager_bench.py            # CUDA
    python tools/gpu_stager_bench.py --device cpu

KV in FlashAttention's layout ([2, num_blocks, 16, heads, 128] bf16 per layer), or MLA's on GPU backends
with ``--layout mla`` ([num_blocks, 16, 576] bf16); the request's blocks are every other block (vLLM's free
list is not in order after a while) and its slots a run. For each copy: the host time of the call (what
vLLM's thread pays) and the time until the copy is done on the device, medians of ``--reps`` after two
warm-up rounds, as GB/s of the request's bytes. Three stagers over the same KV, timed row by row side by
side: ``overlap`` (the default: gathers and scatters on a stream of their own, the scratch in two halves,
copies over the widest integer that fits), ``one stream`` (everything on the copy stream, as before session
17) and ``byte-wise`` (as ``overlap``, copies one byte per element, as before session 27).

``--cold-probe`` instead runs stand-in forwards (``--layers`` x 5 ms of device work, one layer copy after
each layer, as streamed KV does) in fresh processes: plain (no copies), copies with a stager that skipped
its start-up warm-up, copies with a warmed stager; for the first four forwards of each process it prints
the host time to launch the forward (what vLLM's thread pays) and the forward's time on its stream.
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
    ap.add_argument("--layout", choices=("fa", "mla"), default="fa")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cold-probe", action="store_true", help="first forwards of fresh processes, cold or warm")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table of one whole and one "
                                                          "layer-by-layer copy (where the host time goes)")
    a = ap.parse_args(argv)
    if a.cold_probe:
        return cold_probe(a.device, a.layers, a.blocks, a.heads)
    import torch

    from kvlink.vllm.layout import block_layout
    from kvlink.vllm.stager import Stager

    cuda = a.device.startswith("cuda")
    nb = 3 * a.blocks + 8  # the request's blocks are every other one of the first 2 x blocks; then others
    shape = (2, nb, 16, a.heads, 128) if a.layout == "fa" else (nb, 16, 576)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(*shape, device=a.device).to(torch.bfloat16)
          for i in range(a.layers)}
    first = next(iter(kv.values()))
    lay = block_layout(first.shape, first.stride(), first.element_size())
    stagers = {"overlap": Stager(kv, lay, a.blocks + 4), "one stream": Stager(kv, lay, a.blocks + 4, overlap=False),
               "byte-wise": Stager(kv, lay, a.blocks + 4, wide=False)}
    st = stagers["overlap"]
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

    def per_layer(s=st):
        p = None
        for li in range(a.layers):
            p = s.to_pool(blocks, slots, s.fence(), li)
        return p

    src = torch.ones(nbytes, dtype=torch.uint8, device=a.device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

    class _Copy:
        def wait(self):
            pass

    def plain():
        dst.copy_(src, non_blocking=True)
        return _Copy()

    copies = {
        "to_pool, whole request": lambda s: s.to_pool(blocks, slots, s.fence()),
        "to_pool, layer by layer (sum)": per_layer,
        "from_pool, whole request": lambda s: s.from_pool(slots, blocks, s.fence()),
        "from_pool, half the layers": lambda s: s.from_pool(slots, blocks, s.fence(), list(range(0, a.layers, 2))),
    }
    rows = {("plain pinned D2H copy", ""): timed(plain)}
    for name, fn in copies.items():  # side by side: each copy timed on one stager, then on the other
        for sn, s_ in stagers.items():
            rows[(name, sn)] = timed(lambda s_=s_, fn=fn: fn(s_))
    print(f"device {a.device}, layout {a.layout} (copies as {st.element}-byte integers): {a.layers} layers x "
          f"{a.blocks} blocks of {st.slot_bytes // a.layers // 1024} KiB "
          f"({nbytes / 2**20:.0f} MiB), medians of {a.reps}")
    for (name, sn), (host, done) in rows.items():
        n = nbytes // 2 if "half" in name else nbytes
        print(f"  {name:30s} {sn:10s} host {host * 1e3:8.2f} ms   done {done * 1e3:8.2f} ms  "
              f"{n / done / 1e9:7.2f} GB/s")
    plain_done = rows[("plain pinned D2H copy", "")][1]
    for sn in stagers:
        print(f"  {sn}: to_pool whole / plain D2H = {plain_done / rows[('to_pool, whole request', sn)][1]:.2f} "
              f"(GPU issue's target >= 0.80); per layer, host time "
              f"{rows[('to_pool, layer by layer (sum)', sn)][0] / a.layers * 1e6:.0f} us a layer")
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
    other = list(range(2 * a.blocks + 2, 2 * a.blocks + 2 + a.blocks))  # never in ``blocks``
    checks = {}
    for sn, s_ in stagers.items():
        def pool_ok() -> bool:
            ok = all(torch.equal(s_.pool[li, 1:a.blocks + 1], w) for li, w in enumerate(want))
            s_.pool.zero_()
            return ok

        s_.pool.zero_()
        checks[f"{sn}: to_pool whole"] = (s_.to_pool(blocks, slots, s_.fence()).wait(), pool_ok())[1]
        checks[f"{sn}: to_pool per layer"] = (per_layer(s_).wait(), pool_ok())[1]
        # back to back, nothing waited for in between: a gather into the pool, then a scatter out of it into
        # other blocks (the halves of the scratch pass from one direction to the other)
        s_.to_pool(blocks, slots, s_.fence())
        ev = s_.fence()
        s_.from_pool(slots, other, ev).wait()
        sync()
        bo = torch.tensor(other, device=a.device)
        checks[f"{sn}: to_pool then from_pool"] = all(torch.equal(v.index_select(0, bo).cpu(), w)
                                                      for v, w in zip(s_.views, want))
        for v in s_.views:
            v.index_fill_(0, bo, 0)
        sync()
    bad = [k for k, ok in checks.items() if not ok]
    print("  bytes, every stager: " + (f"MISMATCH after {bad}" if bad else "every slot equals its block, and back"))
    return 1 if bad else 0


def _probe(q, device: str, variant: str, layers: int, blocks: int, heads: int) -> None:
    """One fresh process: build a stager (warmed up or not), then four stand-in forwards."""
    import torch

    from gpu_stream_check import _sleeper

    from kvlink.vllm import stager as S
    from kvlink.vllm.layout import block_layout

    kv = {f"l{i}": torch.zeros(2, blocks + 8, 16, heads, 128, dtype=torch.bfloat16, device=device)
          for i in range(layers)}
    first = next(iter(kv.values()))
    sleep = _sleeper(device, 5.0)
    t0 = time.perf_counter()
    st = S.Stager(kv, block_layout(first.shape, first.stride(), first.element_size()), blocks + 4,
                  warm=variant == "warm")
    torch.cuda.synchronize()
    built = time.perf_counter() - t0
    out = []
    for f in range(4):
        ids = list(range(1 + f % 2, blocks + 1 + f % 2))  # each forward its own blocks, as requests do
        slots = list(range(1, blocks + 1))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        last, calls = None, []
        for li, t in enumerate(kv.values()):
            sleep()
            t[:, ids[0]:ids[-1] + 1].fill_(f + 1)
            if variant != "plain":
                c0 = time.perf_counter()
                last = st.to_pool(ids, slots, st.fence(), li)
                calls.append((time.perf_counter() - c0, li))
        end.record()
        if f == 0:
            slow = sorted(calls, reverse=True)[:3]
        launch = time.perf_counter() - t0
        torch.cuda.synchronize()
        if last is not None:
            last.wait()
        out.append((launch, start.elapsed_time(end) / 1e3))
    q.put({"built": built, "forwards": out, "slow": slow})


def cold_probe(device: str, layers: int, blocks: int, heads: int) -> int:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    res: dict[str, list] = {}
    for variant in ("plain", "cold", "warm", "cold", "warm"):
        q = ctx.Queue()
        p = ctx.Process(target=_probe, args=(q, device, variant, layers, blocks, heads))
        p.start()
        r = q.get(timeout=300)
        p.join(60)
        res.setdefault(variant, []).append(r)
    print(f"cold probe, device {device}: {layers} layers x 5 ms stand-in forward, one layer copy of {blocks} "
          f"blocks after each layer (plain: no copies); fresh process each; launch (host) / forward (stream) ms")
    for variant, rs in res.items():
        for r in rs:
            print(f"  {variant:5s} stager built in {r['built'] * 1e3:7.1f} ms; forwards 1-4: " + ", ".join(
                f"{la * 1e3:.1f} / {fw * 1e3:.1f}" for la, fw in r["forwards"]) + "; forward 1's slowest copies: "
                + ", ".join(f"layer {li} {c * 1e3:.2f} ms" for c, li in r["slow"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
