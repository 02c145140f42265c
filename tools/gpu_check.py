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
import sys
import time

BS, HEADS, HEAD = 16, 4, 128  # 2 planes x 16 tokens x 4 heads x 128 x bf16 = 32 KiB per block of a layer


def _kv(device: str, layers: int, num_blocks: int, fill: bool):
    import torch

    out = {}
    for i in range(layers):
        shape = (2, num_blocks, BS, HEADS, HEAD)
        if fill:
            g = torch.Generator().manual_seed(1000 + i)
            t = torch.randn(shape, generator=g).to(torch.bfloat16)
        else:
            t = torch.zeros(shape, dtype=torch.bfloat16)
        out[f"model.layers.{i}.self_attn.attn"] = t.to(device)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _config(staged: bool, pool_mb: int):
    from kvlink.vllm.config import ConnectorConfig

    return ConnectorConfig(transport_backend="tcp", staging="always" if staged else "auto",
                           staging_pool_mb=pool_mb, pull_timeout_s=120.0, transfer_timeout_s=120.0,
                           transport_streams=4)


def prefill(q_out, q_in, boot: str, device: str, staged: bool, layers: int, blocks: int, pool_mb: int) -> None:
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.metadata import KVLinkMetadata
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    num_blocks = blocks + 8
    kv = _kv(device, layers, num_blocks, fill=True)
    w = KVLinkWorker(_config(staged, pool_mb), RankInfo("gpu-check-pre", 0, 1, 0, 1, "check"), "kv_producer")
    w.register_kv_caches(kv)
    w._ensure_registered(boot)
    src = list(range(num_blocks - blocks, num_blocks))  # the request's blocks: the last ones
    table, stage_s = src, 0.0
    if w.staged:
        slots = list(range(1, blocks + 1))
        _sync(device)
        t0 = time.perf_counter()
        w.start_load_kv(KVLinkMetadata(stages=[("req", tuple(src), tuple(slots))]))
        while "req" not in w.transfer_results()[0]:
            time.sleep(0.0002)  # as vLLM's step loop would: never hold the GIL from the copy thread
        stage_s = time.perf_counter() - t0
        table = slots
        for t in kv.values():  # vLLM may reuse the device blocks now: decode must read the staged copy
            t.zero_()
        _sync(device)
    with BootstrapClient(boot) as cli:
        cli.publish("gpu-check-pre", "p-req", [table], num_tokens=BS * blocks, lease_s=120.0)
    q_out.put({"table": table, "stage_s": stage_s, "d2h_gbs": _d2h_gbs(device, layers * blocks * w.block_bytes)})
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


def decode(q_out, boot: str, table: list[int], device: str, staged: bool, layers: int, blocks: int,
           pool_mb: int) -> None:
    import torch

    from kvlink.vllm.metadata import KVLinkMetadata, PullSpec
    from kvlink.vllm.params import RemoteSource
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    kv = _kv(device, layers, blocks + 3, fill=False)
    w = KVLinkWorker(_config(staged, pool_mb), RankInfo("gpu-check-dec", 0, 1, 0, 1, "check"), "kv_consumer")
    w.register_kv_caches(kv)
    local = list(range(2, blocks + 2))  # decode's blocks for the request: shifted, so a mix-up shows
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
    want = _kv(device, layers, blocks + 8, fill=True)
    bad = []
    for name, t in kv.items():
        exp = want[name][:, 8:]  # prefill's request blocks: the last ``blocks`` of its cache
        if not torch.equal(t[:, 2:blocks + 2], exp):
            bad.append(name)
        if t[:, :2].any() or t[:, blocks + 2:].any():
            bad.append(name + " (outside the request)")
    nbytes = layers * blocks * w.block_bytes
    landing_s = sum(stats.get("landing_s", [0.0]))
    # A staged batch ends once its landing copy is done: the READ alone is the rest of transfer_s.
    q_out.put({"outcome": outcome, "bad": bad, "e2e_s": e2e_s, "bytes": nbytes, "landing_s": landing_s,
               "transfer_s": sum(stats.get("transfer_s", [0.0])) - landing_s})
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


def run(device: str, staged: bool, layers: int, blocks: int, pool_mb: int) -> dict:
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    ctx = mp.get_context("spawn")
    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    try:
        pq, pin, dq = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=prefill, args=(pq, pin, srv.url, device, staged, layers, blocks, pool_mb))
        p.start()
        pre = _get(pq, [p])
        d = ctx.Process(target=decode, args=(dq, srv.url, pre["table"], device, staged, layers, blocks, pool_mb))
        d.start()
        dec = _get(dq, [p, d])
        pin.put("done")
        d.join(60)
        p.join(60)
        return {**pre, **dec}
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (staging forced)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=256, help="block positions of the request (x layers)")
    ap.add_argument("--pool-mb", type=int, default=256)
    a = ap.parse_args(argv)
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --device cpu for the host-staged path on CPU)")
            return 2
    gb = lambda n, s: n / s / 1e9 if s else float("nan")  # noqa: E731
    staged = run(a.device, True, a.layers, a.blocks, a.pool_mb)
    host = run("cpu", False, a.layers, a.blocks, a.pool_mb)
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
