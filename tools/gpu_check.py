"""Check host staging of GPU KV on a real GPU: two processes, real transport and bootstrap, byte for byte.

    python tools/gpu_check.py                 # CUDA: KV on the GPU, kvlink's TCP transport over loopback
    python tools/gpu_check.py --device cpu    # the same path with host KV and staging forced (no GPU needed)

Needs only PyTorch (CUDA build for the GPU run) and kvlink. A prefill process and a decode process each hold
KV tensors on the device in FlashAttention's layout ([2, num_blocks, block_size, kv_heads, head_size] per
layer, separate K and V planes), with a bootstrap server in this process. Prefill stages one request of
``--blocks`` positions x ``--layers`` layers (default 256 x 8 = 2,048 blocks of 32 KiB) into its pinned
pool, publishes it, and decode pulls it into its landing pool and copies it into its device blocks. Every
block of every layer is then compared with what prefill wrote; anything else decode holds must still be
zero. The same batch is then pulled between two host-memory KV caches (no staging) for comparison.

Prints, as GB/s: pinned D2H copy (a plain copy of the batch's size, the yardstick), staging (prefill's
device -> pool), transfer (pool -> pool over the transport), H2D (decode's pool -> device) and end to end
(decode's pull, submit to KV in place), and the two ratios the GPU issue targets. Exit status 1 if a byte
differs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import multiprocessing.dummy
import sys
import time
from dataclasses import dataclass

BS, HEADS, HEAD = 16, 4, 128  # 2 planes x 16 tokens x 4 heads x 128 x bf16 = 32 KiB per block of a layer


# The layouts vLLM's backends hand a connector (kvlink/vllm/layout.py), as (shape allocated, permutation to the
# shape handed over, dtype name, MLA): FlashAttention's NHD (the default) and HND (heads-first, handed over as a
# permuted view), FlashInfer's NHD and HND (K and V of a block adjacent), MLA's latent on GPU backends, and an
# fp8 cache (kept in uint8, FlashAttention's shape).
LAYOUTS = {
    "fa": ((2, None, BS, HEADS, HEAD), None, "bfloat16", False),
    "fa-hnd": ((2, None, HEADS, BS, HEAD), (0, 1, 3, 2, 4), "bfloat16", False),
    "flashinfer": ((None, 2, BS, HEADS, HEAD), None, "bfloat16", False),
    "flashinfer-hnd": ((None, 2, HEADS, BS, HEAD), (0, 1, 3, 2, 4), "bfloat16", False),
    "mla": ((None, BS, 576), None, "bfloat16", True),
    "fp8": ((2, None, BS, HEADS, HEAD), None, "uint8", False),
}


def _kv(device: str, layers: int, num_blocks: int, fill: bool, layout: str = "fa"):
    import torch

    alloc, perm, dtype, _ = LAYOUTS[layout]
    shape = tuple(num_blocks if n is None else n for n in alloc)
    dt = getattr(torch, dtype)
    out = {}
    for i in range(layers):
        if not fill:
            t = torch.zeros(shape, dtype=dt)
        elif dt == torch.uint8:
            t = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(1000 + i), dtype=dt)
        else:
            t = torch.randn(shape, generator=torch.Generator().manual_seed(1000 + i)).to(dt)
        t = t.to(device)
        out[f"model.layers.{i}.self_attn.attn"] = t.permute(perm) if perm else t
    return out


def _blocks(t, lo: int, hi: int | None = None):
    """Blocks ``[lo, hi)`` of a layer's tensor (dimension 1 behind FlashAttention's K/V planes, else 0)."""
    return t[:, lo:hi] if t.dim() == 5 and t.shape[0] == 2 else t[lo:hi]


def _worker(cfg, engine: str, role: str, layout: str, kv: dict):
    """A KVLinkWorker with ``kv`` registered, told what the layout needs (MLA: no heads; fp8: K/V scales)."""
    import types

    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    mla, fp8 = LAYOUTS[layout][3], layout == "fp8"
    w = KVLinkWorker(cfg, RankInfo(engine, 0, 1, 0, 1, "check", mla=mla, kv_format="fp8" if fp8 else ""), role)
    scales = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    w.register_kv_caches(kv, {n: scales for n in kv} if fp8 else None)
    return w


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _config(staged: bool, pool_mb: int):
    from kvlink.vllm.config import ConnectorConfig

    return ConnectorConfig(transport_backend="tcp", staging="always" if staged else "auto",
                           staging_pool_mb=pool_mb, pull_timeout_s=120.0, transfer_timeout_s=120.0,
                           transport_streams=4)


@dataclass(frozen=True)
class Case:
    device: str
    staged: bool
    layers: int
    blocks: int
    pool_mb: int
    layout: str = "fa"
    corrupt: bool = False  # the negative control: prefill flips a byte of its staged copy before publishing


def prefill(q_out, q_in, boot: str, c: Case) -> None:
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.metadata import KVLinkMetadata

    num_blocks = c.blocks + 8
    kv = _kv(c.device, c.layers, num_blocks, True, c.layout)
    w = _worker(_config(c.staged, c.pool_mb), "gpu-check-pre", "kv_producer", c.layout, kv)
    w._ensure_registered(boot)
    src = list(range(num_blocks - c.blocks, num_blocks))  # the request's blocks: the last ones
    table, stage_s = src, 0.0
    if w.staged:
        slots = list(range(1, c.blocks + 1))
        _sync(c.device)
        t0 = time.perf_counter()
        w.start_load_kv(KVLinkMetadata(stages=[("req", tuple(src), tuple(slots))]))
        while "req" not in w.transfer_results()[0]:
            time.sleep(0.0002)  # as vLLM's step loop would: never hold the GIL from the copy thread
        stage_s = time.perf_counter() - t0
        table = slots
        for t in kv.values():  # vLLM may reuse the device blocks now: decode must read the staged copy
            t.zero_()
        _sync(c.device)
        if c.corrupt:  # the last layer's last staged block, one byte
            w._stager.pool[c.layers - 1, slots[-1], 0, 0] ^= 0x5A
    with BootstrapClient(boot) as cli:
        cli.publish("gpu-check-pre", "p-req", [table], num_tokens=BS * c.blocks, lease_s=120.0)
    q_out.put({"table": table, "stage_s": stage_s,
               "d2h_gbs": _d2h_gbs(c.device, c.layers * c.blocks * w.block_bytes)})
    q_in.get()  # decode is done
    w.shutdown()


def _d2h_gbs(device: str, nbytes: int) -> float:
    """A plain device -> pinned host copy of ``nbytes`` (host -> host on CPU), median of 5."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    times = []
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return nbytes / times[len(times) // 2] / 1e9


def decode(q_out, boot: str, table: list[int], c: Case) -> None:
    import torch

    from kvlink.vllm.metadata import KVLinkMetadata, PullSpec
    from kvlink.vllm.params import RemoteSource

    kv = _kv(c.device, c.layers, c.blocks + 3, False, c.layout)
    w = _worker(_config(c.staged, c.pool_mb), "gpu-check-dec", "kv_consumer", c.layout, kv)
    local = list(range(2, c.blocks + 2))  # decode's blocks for the request: shifted, so a mix-up shows
    spec = PullSpec("req", tuple(local), 0, RemoteSource(bootstrap_url=boot, engine_id="gpu-check-pre",
                                                         request_id="p-req", block_ids=tuple(table), lease_s=120.0))
    t0 = time.perf_counter()
    w.start_load_kv(KVLinkMetadata(pulls=[spec]))
    outcome = None
    while outcome is None:
        time.sleep(0.0002)
        _, done, failed = w.transfer_results()
        outcome = "failed" if "req" in failed else "ok" if "req" in done else None
    e2e_s = time.perf_counter() - t0
    stats = w.get_stats().data
    want = _kv(c.device, c.layers, c.blocks + 8, True, c.layout)
    bad = []
    for name, t in kv.items():
        exp = _blocks(want[name], 8)  # prefill's request blocks: the last ``blocks`` of its cache
        if not torch.equal(_blocks(t, 2, c.blocks + 2), exp):
            bad.append(name)
        if _blocks(t, 0, 2).any() or _blocks(t, c.blocks + 2).any():
            bad.append(name + " (outside the request)")
    nbytes = c.layers * c.blocks * w.block_bytes
    landing_s = sum(stats.get("landing_s", [0.0]))
    # A staged batch ends once its landing copy is done: the READ alone is the rest of transfer_s.
    q_out.put({"outcome": outcome, "bad": bad, "e2e_s": e2e_s, "bytes": nbytes, "landing_s": landing_s,
               "transfer_s": sum(stats.get("transfer_s", [0.0])) - landing_s, "desc": w.layout.desc})
    w.shutdown()


def _get(q, procs, timeout: float = 600.0):
    """The next message on ``q``; an error at once if one of ``procs`` died instead of answering."""
    import queue

    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [p.name for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"no answer: {dead or 'timed out'}") from None


def run(c: Case, threads: bool = False) -> dict:
    """Prefill and decode in processes of their own, or (``threads``: the layout checks, which time nothing)
    as two threads of this process, each with its own worker and transport engine."""
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    ctx = mp.dummy if threads else mp.get_context("spawn")
    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    try:
        pq, pin, dq = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=prefill, args=(pq, pin, srv.url, c))
        p.start()
        pre = _get(pq, [p])
        d = ctx.Process(target=decode, args=(dq, srv.url, pre["table"], c))
        d.start()
        dec = _get(dq, [p, d])
        pin.put("done")
        d.join(60)
        p.join(60)
        return {**pre, **dec}
    finally:
        srv.stop()


def layouts(device: str, names: list[str], layers: int, blocks: int, pool_mb: int) -> bool:
    """Each layout staged, byte for byte, then the same with one staged byte flipped (the check must see it)."""
    ok = True
    for name in names:
        good = run(Case(device, True, layers, blocks, pool_mb, name), threads=True)
        bad = run(Case(device, True, layers, blocks, pool_mb, name, corrupt=True), threads=True)
        equal = good["outcome"] == "ok" and not good["bad"]
        caught = bad["outcome"] != "ok" or bad["bad"] == [f"model.layers.{layers - 1}.self_attn.attn"]
        ok = ok and equal and caught
        print(f"  layout {name:15s} {good['desc']:32s} staged: "
              f"{'every block equal' if equal else 'MISMATCH ' + str(good['bad'][:3])}; control (one staged "
              f"byte flipped): {'caught' if caught else 'NOT CAUGHT ' + str(bad['bad'][:3])}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (staging forced)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=256, help="block positions of the request (x layers)")
    ap.add_argument("--pool-mb", type=int, default=256)
    ap.add_argument("--layouts", default="",
                    help=f"also check these layouts staged, smaller (4 layers x 64 blocks), each with a negative "
                         f"control: comma-separated of {','.join(LAYOUTS)}, or all")
    a = ap.parse_args(argv)
    names = list(LAYOUTS) if a.layouts == "all" else [n for n in a.layouts.split(",") if n]
    if unknown := [n for n in names if n not in LAYOUTS]:
        ap.error(f"unknown layout(s) {unknown}; valid: {list(LAYOUTS)}")
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --device cpu for the host-staged path on CPU)")
            return 2
    gb = lambda n, s: n / s / 1e9 if s else float("nan")  # noqa: E731
    staged = run(Case(a.device, True, a.layers, a.blocks, a.pool_mb))
    host = run(Case("cpu", False, a.layers, a.blocks, a.pool_mb))
    n = staged["bytes"]
    print(f"device {a.device}: {a.layers} layers x {a.blocks} blocks = {a.layers * a.blocks} blocks of "
          f"{n // (a.layers * a.blocks) // 1024} KiB ({n / 2**20:.0f} MiB), kvlink tcp over loopback")
    print(f"  pinned D2H copy   {staged['d2h_gbs']:8.2f} GB/s")
    print(f"  staging (D2H)     {gb(n, staged['stage_s']):8.2f} GB/s  ({staged['stage_s'] * 1e3:.1f} ms)")
    print(f"  transfer          {gb(n, staged['transfer_s']):8.2f} GB/s")
    print(f"  H2D (landing)     {gb(n, staged['landing_s']):8.2f} GB/s")
    print(f"  end to end        {gb(n, staged['e2e_s']):8.2f} GB/s  ({staged['e2e_s'] * 1e3:.1f} ms)")
    print(f"  host KV, no staging, end to end {gb(n, host['e2e_s']):8.2f} GB/s")
    print(f"  staging / pinned D2H = {gb(n, staged['stage_s']) / staged['d2h_gbs']:.2f} (target >= 0.80)")
    print(f"  staged end to end / host end to end = {host['e2e_s'] / staged['e2e_s']:.2f} (target >= 0.80)")
    ok = staged["outcome"] == "ok" and not staged["bad"] and host["outcome"] == "ok" and not host["bad"]
    print("  bytes: " + ("every block of every layer equal" if ok else
                         f"MISMATCH staged {staged['outcome']} {staged['bad'][:4]} host {host['outcome']} "
                         f"{host['bad'][:4]}"))
    if names:
        ok = layouts(a.device, names, 4, 64, 64) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
