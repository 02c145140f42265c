"""Streamed KV: TTFT of a single server, PD with the KV moved after prefill (non-streamed) and PD with the KV
streamed while prefill computes, over an emulated link and over plain loopback.

    PYTHONPATH=. .venv/bin/python bench/bench_stream.py [--device-core] [--interleave] [--link-mbps R] [--out FILE]

On this machine a CPU forward is slow and loopback fast, the opposite of a GPU cluster: streaming would
look like nothing. So prefill's transport is reached through a rate-limited relay (tests/relay.py: it
throttles the direction READ data flows) at a rate where the non-streamed transfer of a 2k-token prompt
takes about 40% of prefill's compute, as on GPUs over 25-100 GbE. Unless ``--link-mbps`` is given, the
rate is set from the single server's 2k-token TTFT measured first in the same run; the achieved rate
(bytes over the non-streamed tail) is reported with the figures.

On a GPU host the forward runs on the device and the connector's threads, vLLM's engine loops, decode,
the proxy and the link do not take turns with it; on 2 shared cores they do. ``--device-core`` gives
CPU 0 to the forward of prefill (and of the single server) alone and everything else CPU 1 (class
DeviceCore). ``--interleave`` keeps every mode's servers up at once and sends one request to each in
turn, so this VM's slow spells fall on all modes alike (concurrency 1, emulated link).

kvheavy model (32 KiB of KV per token, 8 layers), chunked prefill of 2,048 tokens (``--chunk``; GPUs run
2k-16k) on every server (the single server too), kvlink's TCP transport (a same-host copy would bypass the
relay), concurrent pairing through ``kvlink proxy --mode concurrent``, prompts of 1k, 2k and 4k tokens at
concurrency 1 and 4, each prompt new to every server (no prefix-cache hit). Per cell: median TTFT at the
client (first streamed token), and the exposed transfer: decode's ``kvlink_tail_seconds`` (from decode
seeing prefill's published record to the KV in place; for the non-streamed mode that is the whole
transfer).
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
import threading
import time
from pathlib import Path

from bench.bench_connector import ttft
from kvlink.demo.servers import ProxyProc, Stack, VLLMServer, free_port, kvlink_config
from kvlink.demo.tiny_model import ensure_model
from tests.relay import Relay

SIZES = (1024, 2048, 4000)  # "4k": the model allows 4,096 positions, 8 of them for the output
CONCURRENCY = (1, 4)
CHUNK = ("--max-num-batched-tokens", "2048")
ISOLATE = False
DEVICE_CORE = False
LOCKSTEP_STALL_MS = 200.0  # --lockstep-stall-ms
NOSPIN = str(Path(__file__).resolve().parents[1] / "tools" / "nospin")  # sitecustomize.py: --device-core servers
KV_PER_TOKEN = 32 << 10  # kvheavy: 8 layers x 8 KV heads x 128 x (K, V) x bf16


def prompts(n: int, size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(size)] for _ in range(n)]


def decode_figures(m0: dict, m1: dict) -> dict:
    """Per pull, from decode's /metrics before and after a cell: the tail, MiB, blocks read while streamed,
    and how many pulls failed (recomputed)."""
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    pulls = d.get("kvlink_tail_seconds_count", 0) or float("nan")
    return dict(tail_ms=1e3 * d.get("kvlink_tail_seconds_sum", float("nan")) / pulls,
                mib=d.get("kvlink_bytes_pulled_total", float("nan")) / pulls / 2**20,
                streamed_blocks=d.get("kvlink_blocks_streamed_total", 0) / pulls,
                failed=d.get("kvlink_pulls_failed_total", 0))


def server_ttft_s(srv: VLLMServer) -> float:
    """The sum of vLLM's own TTFT histogram on ``srv`` (arrival to first token, as the server sees it):
    read before and after one request, it gives that request's compute (prefill's, for PD), which the
    client's TTFT contains along with the proxy, decode and the link."""
    return srv.metrics(("vllm:time_to_first_token_seconds_sum",)).get("vllm:time_to_first_token_seconds_sum", 0.0)


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
                cell.update(decode_figures(m0, dec.metrics()))
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


class DeviceCore:
    """``--device-core``: CPU 0 plays prefill's (or the single server's) accelerator and runs its forward
    only; every other thread of every process in the run (vLLM's API servers and engine cores, the
    connector's threads, decode, the proxy, the relay) runs on CPU 1, the hosts' CPUs. On a GPU host the
    forward does not share a core with them; on 2 shared cores, without this, they take turns with it.
    The forward thread is a worker's main thread (``VLLM::Worker``) that vLLM's OMP binding put on CPU 0;
    threads started later inherit that binding, so the map is re-applied every 0.2 s while the run lasts.

    vLLM's engine core and worker main threads busy-wait on their shared-memory queues for a second after
    each message (``sched_yield`` in a loop): prefill's engine core while its forward runs, decode's
    worker between steps. On a GPU host each has a core to itself; here both land on CPU 1 with every
    other host thread, and holding the GIL as they spin they also delay the connector's threads in their
    process (prefill's bootstrap server, decode's resolver). A session 15 timeline (``KVLINK_TRACE``)
    showed decode's API server waiting up to 550 ms for CPU 1 before it handed a request to its engine,
    after prefill had published in half the requests. So every server of a ``--device-core`` run starts
    with tools/nospin on its path: vLLM's queue loops nap 0.5 ms between polls instead of spinning
    (up to 0.5 ms per message, paid by the single server alike)."""

    def __init__(self, pids: list[int]):
        self.pids, self.stop = pids, threading.Event()
        self.thread = threading.Thread(target=self._loop, name="device-core", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            for pid in self.pids:
                self.apply(pid)
            for t in os.listdir("/proc/self/task"):  # the relay's thread, this one: hosts' CPU
                self._pin(int(t), {1})

    @staticmethod
    def _pin(tid: int, cpus: set[int]) -> None:
        try:
            if os.sched_getaffinity(tid) != cpus:
                os.sched_setaffinity(tid, cpus)
        except OSError:
            pass

    def apply(self, root: int) -> None:
        todo = [root]
        while todo:
            p = todo.pop()
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
                todo += [int(c) for t in tids for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
                forward = (Path(f"/proc/{p}/comm").read_text().startswith("VLLM::Worker")
                           and os.sched_getaffinity(p) == {0})
            except OSError:
                continue
            for t in tids:
                if not (forward and t == p):
                    self._pin(t, {1})

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for t in os.listdir("/proc/self/task"):  # the next run's servers inherit this process's mask
            self._pin(int(t), set(range(os.cpu_count())))


def pd_stack(stack: Stack, mode: str, model: str, logs: Path, rate: float | None, kv_bytes: int,
             name: str = "", root: str | None = None) -> tuple[VLLMServer, VLLMServer, ProxyProc, Relay | None]:
    """Prefill and decode for ``mode`` (pd, pd-seq, pd-stream, pd-stream-step, pd-stream-exit,
    pd-stream-nopace, pd-stream-lockstep), ready, with the concurrent proxy in front (pd-seq: the sequential
    proxy, decode asked only once prefill has answered); prefill's transport behind a relay at ``rate`` bytes/s (None: plain
    loopback), which the caller closes. ``root``: prefill, decode and the proxy import kvlink from this
    checkout instead (``--ab-root``)."""
    # PYTHONSAFEPATH: ``python -m`` would otherwise put the working directory (this checkout) first
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
           "PYTHONSAFEPATH": "1"} if root else None
    bport, tport = free_port(), free_port()
    relay = Relay(f"127.0.0.1:{tport}", rate=rate, realtime=True) if rate else None
    if relay is not None:
        relay.CHUNK = 1 << 16  # paced in 64 KiB steps: the sleep per step stays well above its overhead
    try:
        extra = {"transport_backend": "tcp", "stream_kv": mode.startswith("pd-stream")}
        if mode == "pd-stream-step":  # announced after each step's forward instead of after each layer
            extra["stream_granularity"] = "step"
        if mode == "pd-stream-exit":  # every layer announced when its attention op returns, not on entry
            extra["stream_layer_on_entry"] = False
        pre_kv = kvlink_config("kv_producer", f"{name}prefill-0", bootstrap_port=bport, transport_port=tport,
                               **({"transport_advertise": relay.address} if relay else {}), **extra)
        # "-nopace": decode steps back to back while it waits for KV (pull_step_wait_ms 0, as before session 10)
        # lookup_wait_s: at concurrency 4 this VM's prefill takes up to a minute to publish (a GPU, seconds at most)
        dec_kv = kvlink_config("kv_consumer", lookup_wait_s=600, **extra,
                               **({"pull_step_wait_ms": 0} if mode.endswith("-nopace") else {}),
                               **({"stream_lockstep": True, "stream_lockstep_stall_ms": LOCKSTEP_STALL_MS}
                                  if mode.endswith("-lockstep") else {}))
        if mode.endswith("-lockstep"):  # decode's first step in lock-step with prefill's last layers
            dec_kv["kv_load_failure_policy"] = "fail"  # (lockstep.why_not_lockstep; prefix caching stays on)
        pre = stack.add(VLLMServer(f"{name}prefill", model, logs, kv=pre_kv, cpu=0, kv_bytes=kv_bytes,
                                   env=env, extra_args=CHUNK))
        dec = stack.add(VLLMServer(f"{name}decode", model, logs, kv=dec_kv, cpu=1, kv_bytes=kv_bytes, env=env))
        pre.wait_ready()
        dec.wait_ready()
        proxy = stack.add(ProxyProc(pre.url, dec.url, logs, mode="sequential" if mode == "pd-seq" else "concurrent",
                                    bootstrap=f"http://127.0.0.1:{bport}", env=env, name=f"{name}proxy"))
        proxy.wait_ready()
    except BaseException:
        if relay is not None:
            relay.close()
        raise
    return pre, dec, proxy, relay


def run(mode: str, model: str, logs: Path, reps: int, seed: int, rate: float | None) -> dict:
    with Stack() as stack:
        if mode == "single":
            srv = stack.add(VLLMServer("single", model, logs, cpu=0, kv_bytes=2 << 30,
                                       extra_args=CHUNK))
            srv.wait_ready()
            pinner = DeviceCore([srv.proc.pid]) if DEVICE_CORE else None
            try:
                ttft(srv.url, prompts(1, 200, 1)[0])
                return cells(srv.url, reps, seed, None)
            finally:
                if pinner:
                    pinner.close()
        pinner = relay = None
        try:
            pre, dec, proxy, relay = pd_stack(stack, mode, model, logs, rate, 2 << 30)
            if ISOLATE:  # decode's host: decode's engine, the proxy and the relay (this process) on CPU 1 only
                n = sum(pin_tree(pid, {1}) for pid in (dec.proc.pid, proxy.proc.pid))
                n += pin_tree(os.getpid(), {1}, children=False)  # the relay's thread; not prefill, a child too
                print(f"    pinned {n} threads of decode, the proxy and the relay to CPU 1", flush=True)
            if DEVICE_CORE:
                pinner = DeviceCore([pre.proc.pid, dec.proc.pid, proxy.proc.pid])
            ttft(proxy.url, prompts(1, 200, 2)[0])
            return cells(proxy.url, reps, seed, dec)
        finally:
            if pinner is not None:
                pinner.close()
            if relay is not None:
                relay.close()
            if ISOLATE:  # this process's threads back on every CPU: the next run's servers inherit its mask
                for t in os.listdir("/proc/self/task"):
                    os.sched_setaffinity(int(t), range(os.cpu_count()))


def interleaved(model: str, logs: Path, reps: int, rate: float | None, more: tuple[str, ...] = (),
                gap_s: float = 0.0, ab_root: str | None = None) -> dict:
    """``--interleave``: the single server and both PD stacks (non-streamed, streamed) alive at once, one
    request to each in turn, ``reps`` rounds per size (concurrency 1): a slow spell of this VM falls on
    every mode alike instead of on whichever ran then. With ``--device-core`` CPU 0 runs whichever forward
    is on (one at a time), everything else CPU 1. Without ``--link-mbps`` the link is set from the single
    server's first 2k request, as in the default run. ``more``: further PD modes beside pd and pd-stream.
    ``gap_s``: a pause before each measured request. vLLM's queue pollers stay awake for a second after each
    message (napping 0.5 ms between polls under tools/nospin); back to back, the last request's servers
    (another stack's) still poll on both CPUs while the next one computes, which no separate host sees.
    ``ab_root``: only two lock-step stacks beside the single server, this checkout's and ``ab_root``'s
    (mode ``pd-stream-lockstep-b``): two versions of kvlink side by side in the same rounds, their order
    swapped every other round."""
    modes = ("pd-stream-lockstep", "pd-stream-lockstep-b") if ab_root else ("pd", "pd-stream", *more)
    out: dict[str, dict] = {m: {} for m in ("single", *(f"{m}/emulated" for m in modes))}
    with Stack() as stack:
        single = stack.add(VLLMServer("single", model, logs, cpu=0, kv_bytes=1 << 30, extra_args=CHUNK))
        single.wait_ready()
        ttft(single.url, prompts(1, 200, 1)[0])
        if rate is None:
            ref = 2048 if 2048 in SIZES else SIZES[0]
            rate = ref * KV_PER_TOKEN / (0.4 * ttft(single.url, prompts(1, ref, 7)[0]))
        print(f"emulated link: {rate / 1e6:.0f} MB/s ({rate * 8 / 1e9:.2f} Gb/s)", flush=True)
        urls, decs, relays, pids = {"single": single.url}, {}, [], [single.proc.pid]
        computes = {"single": single}  # the server whose forward computes the prompt, per mode
        pinner = None
        try:
            for mode in modes:
                b = mode.endswith("-b")
                pre, dec, proxy, relay = pd_stack(stack, mode.removesuffix("-b"), model, logs, rate, 1 << 30,
                                                  name=f"{mode}-", root=ab_root if b else None)
                relays.append(relay)
                ttft(proxy.url, prompts(1, 200, 2)[0])
                urls[f"{mode}/emulated"], decs[f"{mode}/emulated"] = proxy.url, dec
                computes[f"{mode}/emulated"] = pre
                pids += [pre.proc.pid, dec.proc.pid, proxy.proc.pid]
            pinner = DeviceCore(pids) if DEVICE_CORE else None
            for size in SIZES:
                for mode, url in urls.items():  # the first prompt of a new length runs slower: not counted
                    ttft(url, prompts(1, size, 3 + size)[0])
                m0 = {m: d.metrics() for m, d in decs.items()}
                cells_ = {m: {"ttft_ms": [], "compute_ms": []} for m in urls}
                for r in range(reps):
                    order = list(urls.items())
                    if ab_root and r % 2:  # A then B, then B then A: neither always runs right after the single
                        order[-2:] = order[-1:-3:-1]
                    for mode, url in order:
                        c0 = server_ttft_s(computes[mode])
                        time.sleep(gap_s)
                        cells_[mode]["ttft_ms"].append(1e3 * ttft(url, prompts(1, size, 1000 * r + size)[0]))
                        cells_[mode]["compute_ms"].append(1e3 * (server_ttft_s(computes[mode]) - c0))
                time.sleep(0.5)
                for mode, dec in decs.items():
                    cells_[mode].update(decode_figures(m0[mode], dec.metrics()))
                for mode, cell in cells_.items():
                    out[mode][(size, 1)] = cell
                    print(f"    {mode:20s} {size:5d} tokens: TTFT {[round(t) for t in cell['ttft_ms']]} ms, "
                          f"compute server's own TTFT {[round(t) for t in cell['compute_ms']]} ms"
                          + (f", tail {cell['tail_ms']:.1f} ms, failed {cell['failed']:.0f}" if mode in decs else ""),
                          flush=True)
        finally:
            if pinner is not None:
                pinner.close()
            for relay in relays:
                relay.close()
    out["rate"] = rate
    return out


def ab_table(results: dict, other: str, ours: str, theirs: str, paired: bool) -> None:
    """Streamed PD as configured by default (``ours``) against streamed PD with one setting changed (mode
    ``other``, ``theirs``), per cell; ``paired``: the runs were interleaved, so each round's ratio counts."""
    med = statistics.median
    print(f"\n| size | conc | PD streamed, {ours}: TTFT ms (x single), exposed ms | {theirs}: TTFT ms (x single), "
          f"exposed ms | {theirs} / {ours}, paired |\n|---|---|---|---|---|")
    for size in SIZES:
        for conc in CONCURRENCY:
            s = med(results["single"][(size, conc)]["ttft_ms"])
            a, b = results["pd-stream/emulated"][(size, conc)], results[f"{other}/emulated"][(size, conc)]
            ta, tb = med(a["ttft_ms"]), med(b["ttft_ms"])
            ratio = f"{med(y / x for x, y in zip(a['ttft_ms'], b['ttft_ms'])):.3f}" if paired else "-"
            print(f"| {size} | {conc} | {ta:.0f} ({ta / s:.2f}), {a['tail_ms']:.0f} | {tb:.0f} ({tb / s:.2f}), "
                  f"{b['tail_ms']:.0f} | {ratio} |")


def ab_roots(results: dict, root: str, rate: float, out: str | None) -> int:
    """``--ab-root``: lock-step PD of this checkout (A) and of ``root`` (B) against the single server of the
    same round, and B / A per round (medians of rounds)."""
    med = statistics.median
    print(f"\nemulated link {rate / 1e6:.0f} MB/s; A: this checkout, B: {root}\n\n| size | single ms | A (x single) "
          f"| B (x single) | B / A, paired | prefill's own TTFT A / B (x single) |\n|---|---|---|---|---|---|")
    for size in SIZES:
        one = results["single"][(size, 1)]
        a, b = results["pd-stream-lockstep/emulated"][(size, 1)], results["pd-stream-lockstep-b/emulated"][(size, 1)]

        def x(c: dict, k: str = "ttft_ms") -> str:
            return f"{med(t / s for t, s in zip(c[k], one[k])):.3f}"
        print(f"| {size} | {med(one['ttft_ms']):.0f} | {med(a['ttft_ms']):.0f} ({x(a)}) | {med(b['ttft_ms']):.0f} "
              f"({x(b)}) | {med(tb / ta for ta, tb in zip(a['ttft_ms'], b['ttft_ms'])):.3f} | "
              f"{x(a, 'compute_ms')} / {x(b, 'compute_ms')} |")
    if out:
        Path(out).write_text(json.dumps({k: {f"{s}x{c}": v for (s, c), v in r.items()}
                                         for k, r in results.items()} | {"rate_bytes_s": rate, "ab_root": root},
                                        indent=1))
    return 0


def main() -> int:
    global SIZES, CONCURRENCY, CHUNK, ISOLATE, DEVICE_CORE, LOCKSTEP_STALL_MS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-mbps", type=float, default=None, help="emulated link rate in MB/s (default: from "
                    "the single server's 2k TTFT, so the 2k transfer takes 40%% of prefill's compute)")
    ap.add_argument("--reps", type=int, default=3, help="requests per cell at concurrency 1")
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    ap.add_argument("--pacing-ab", action="store_true", help="also PD streamed over the emulated link with "
                    "decode's pull_step_wait_ms 0 (decode's engine spinning while it waits)")
    ap.add_argument("--entry-ab", action="store_true", help="also PD streamed over the emulated link with "
                    "stream_layer_on_entry false (every layer announced when its attention op returns)")
    ap.add_argument("--granularity-ab", action="store_true", help="also PD streamed over the emulated link "
                    "with stream_granularity \"step\" (the default streams per layer)")
    ap.add_argument("--lockstep-ab", action="store_true", help="also PD streamed over the emulated link with "
                    "decode's stream_lockstep on (its first step in lock-step with prefill's last layers)")
    ap.add_argument("--seq-ab", action="store_true", help="--interleave: also non-streamed PD through the "
                    "sequential proxy (decode gets the request once prefill has answered): prefill's own TTFT "
                    "without decode's concurrent work beside it")
    ap.add_argument("--lockstep-stall-ms", type=float, default=200.0, help="stream_lockstep_stall_ms of that "
                    "decode: this CPU's layers take 20-100 ms each (a GPU's 1-5 ms), so the default 10 ms "
                    "would not arm a pull before prefill's record")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens of every server (GPUs: 2k-16k, "
                    "so most prompts are one chunk; sessions 9-10 ran 256)")
    ap.add_argument("--isolate", action="store_true", help="pin decode's engine, the proxy and the relay to CPU 1 "
                    "(prefill's compute is on CPU 0 already): two hosts, roughly, instead of one shared one")
    ap.add_argument("--device-core", action="store_true", help="CPU 0 runs prefill's (and the single server's) "
                    "forward only, every other thread of the run CPU 1: the forward alone on its device, as on a "
                    "GPU host (class DeviceCore)")
    ap.add_argument("--interleave", action="store_true", help="every mode's servers at once, one request to "
                    "each in turn (concurrency 1, emulated link only; function interleaved)")
    ap.add_argument("--gap-s", type=float, default=1.5, help="--interleave: pause before each measured request "
                    "so the other stacks' vLLM queue pollers (awake 1 s after each message) sleep; 0: back to back, "
                    "as in sessions 13-18")
    ap.add_argument("--ab-root", default=None, help="--interleave: only the single server and two lock-step "
                    "stacks, this checkout's and one whose prefill, decode and proxy import kvlink from this "
                    "directory (another version's checkout, its C extension built in place), side by side in "
                    "every round")
    ap.add_argument("--emulated-only", action="store_true", help="skip the plain loopback runs")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma-separated")
    args = ap.parse_args()
    SIZES = tuple(int(x) for x in args.sizes.split(","))
    CONCURRENCY = tuple(int(x) for x in args.concurrency.split(","))
    CHUNK = ("--max-num-batched-tokens", str(args.chunk))
    ISOLATE = args.isolate
    LOCKSTEP_STALL_MS = args.lockstep_stall_ms
    DEVICE_CORE = args.device_core
    if DEVICE_CORE:  # every server started from here on: vLLM's queue readers do not spin (class DeviceCore)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (NOSPIN, os.environ.get("PYTHONPATH"))))
    model = str(ensure_model("kvheavy"))
    logs = Path(tempfile.mkdtemp(prefix="kvlink-bench-stream-"))
    print(f"kvheavy model, chunked prefill of {args.chunk} tokens, kvlink TCP transport; logs {logs}", flush=True)
    med = statistics.median
    results: dict[str, dict] = {}
    if args.interleave:
        CONCURRENCY = (1,)
        results = interleaved(model, logs, args.reps, args.link_mbps * 1e6 if args.link_mbps else None,
                              (("pd-seq",) if args.seq_ab else ()) + (("pd-stream-exit",) if args.entry_ab else ())
                              + (("pd-stream-lockstep",) if args.lockstep_ab else ()), gap_s=args.gap_s,
                              ab_root=args.ab_root)
        rate, links = results.pop("rate"), (("emulated", None),)
        if args.ab_root:
            return ab_roots(results, args.ab_root, rate, args.out)
    else:
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
    if args.entry_ab and not args.interleave:
        print("pd-stream over emulated, stream_layer_on_entry false:", flush=True)
        results["pd-stream-exit/emulated"] = run("pd-stream-exit", model, logs, args.reps, 100, rate)
    if args.lockstep_ab and not args.interleave:
        print("pd-stream over emulated, decode stream_lockstep:", flush=True)
        results["pd-stream-lockstep/emulated"] = run("pd-stream-lockstep", model, logs, args.reps, 100, rate)
    if args.pacing_ab:
        print("pd-stream over emulated, pull_step_wait_ms 0:", flush=True)
        results["pd-stream-nopace/emulated"] = run("pd-stream-nopace", model, logs, args.reps, 100, rate)
    print("\n| link | size | conc | single TTFT ms | PD TTFT ms (x single) | PD streamed TTFT ms (x single) | "
          "transfer ms (non-streamed tail) | exposed ms (streamed tail) | exposed / transfer | achieved MB/s |")
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
    if args.interleave:  # each round's requests ran back to back: its ratios are the paired comparison
        print("\n| size | PD / single, median of rounds (rounds) | PD streamed / single, median of rounds (rounds) |"
              "\n|---|---|---|")
        for size in SIZES:
            one = results["single"][(size, 1)]["ttft_ms"]
            row = []
            for mode in ("pd/emulated", "pd-stream/emulated"):
                rs = [t / s for t, s in zip(results[mode][(size, 1)]["ttft_ms"], one)]
                row.append(f"{med(rs):.2f} ({', '.join(f'{r:.2f}' for r in rs)})")
            print(f"| {size} | {row[0]} | {row[1]} |")
        print("\nThe compute server's own TTFT (prefill's for PD; arrival to first token as vLLM counts it), "
              "paired per round:\n\n| size | single ms | PD prefill ms (x single) | PD streamed prefill ms "
              "(x single) |\n|---|---|---|---|")
        for size in SIZES:
            one = results["single"][(size, 1)]["compute_ms"]
            row = []
            for mode in ("pd/emulated", "pd-stream/emulated"):
                own = results[mode][(size, 1)]["compute_ms"]
                row.append(f"{med(own):.0f} ({med(t / s for t, s in zip(own, one)):.2f})")
            print(f"| {size} | {med(one):.0f} | {row[0]} | {row[1]} |")
    if args.granularity_ab:
        ab_table(results, "pd-stream-step", "per layer", "per step", paired=False)
    if args.entry_ab:
        ab_table(results, "pd-stream-exit", "layers on entry", "on exit", paired=args.interleave)
    if args.lockstep_ab:
        ab_table(results, "pd-stream-lockstep", "decode after the KV", "decode in lock-step", paired=args.interleave)
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
