"""`kvlink bench`: argument parsing and the two-process orchestration."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile

from kvlink.bench.initiator import SYSTEMS, Initiator, TargetInfo
from kvlink.bench.peers import PEER_SYSTEMS
from kvlink.bench.stats import table
from kvlink.bench.workloads import STANDARD, custom
from kvlink.transport import EngineConfig
from kvlink.transport.config import split_hostport


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the transport against raw TCP and memcpy on loopback",
                       description="Runs the standard workloads through kvlink and, with --compare, through the "
                                   "yardsticks, in one invocation; verifies the data it moved.")
    p.add_argument("--role", choices=("both", "target", "initiator"), default="both",
                   help="both (default): start a target process and run the initiator here")
    p.add_argument("--listen", default="127.0.0.1:0", help="target: HOST:PORT to serve on")
    p.add_argument("--peer", help="initiator: the target's HOST:PORT")
    p.add_argument("--raw-port", type=int, help="initiator: the target's raw TCP yardstick port (default PORT+1)")
    p.add_argument("--token-file", help="file holding the pre-shared token")
    p.add_argument("--allow-insecure", action="store_true", help="target: listen off loopback without a token")
    p.add_argument("--compare", default="",
                   help="comma list of kvlink's same-host path (kvlink-same-host), yardsticks (raw-tcp,memcpy) "
                        "and peers (mooncake,nixl-tcp,nixl)")
    p.add_argument("--peers", default="", help="target: also serve the buffer through these peers (mooncake,nixl)")
    p.add_argument("--workloads", default="", help="comma list of workload names (default: all standard)")
    p.add_argument("--blocks", type=int, help="custom paged READ: number of blocks")
    p.add_argument("--block-size", type=int, help="custom paged READ: bytes per block")
    p.add_argument("--iters", type=int, default=15, help="timed runs per batch workload (default 15)")
    p.add_argument("--lat-iters", type=int, default=300, help="timed runs per latency workload (default 300)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--streams", type=int, default=EngineConfig.streams, help="TCP connections per peer")
    p.add_argument("--crc", action="store_true", help="verify a CRC32C per descriptor")
    p.add_argument("--buffer-mb", type=int, default=1024, help="registered buffer on each side (MiB)")
    p.add_argument("--mem-peers", type=int, default=8, help="peers connected for the memory check (0: skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object per (workload, system)")
    p.set_defaults(func=run)


def _token(args: argparse.Namespace) -> bytes | None:
    return EngineConfig.read_token_file(args.token_file) if args.token_file else None


def run(args: argparse.Namespace) -> int:
    if args.role == "target":
        from kvlink.bench.target import run_target

        return run_target(args.listen, _token(args), args.buffer_mb, args.streams, args.crc, args.allow_insecure,
                          [s for s in args.peers.split(",") if s])
    systems = ["kvlink"] + [s for s in args.compare.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--compare: unknown system {s!r}; choose from {', '.join(SYSTEMS[1:])}")
    if args.blocks or args.block_size:
        workloads = [custom(args.blocks or 2048, args.block_size or 32768)]
        workloads += [w for w in STANDARD if w.name.startswith("lat-")]
    else:
        workloads = list(STANDARD)
    if args.workloads:
        names = args.workloads.split(",")
        known = {w.name for w in workloads}
        bad = [n for n in names if n not in known]
        if bad:
            raise SystemExit(f"--workloads: unknown {bad}; choose from {sorted(known)}")
        workloads = [w for w in workloads if w.name in names]
    if args.role == "initiator":
        if not args.peer:
            raise SystemExit("--role initiator needs --peer HOST:PORT")
        _, port = split_hostport(args.peer, "--peer")
        info = TargetInfo.fetch(args.peer, args.raw_port or port + 1)
        return _initiate(args, info, _token(args), systems, workloads)
    # both: a target process on loopback with a fresh token
    token = secrets.token_hex(16).encode()
    with tempfile.NamedTemporaryFile("wb", delete=False) as tf:
        tf.write(token)
    try:
        cmd = [sys.executable, "-m", "kvlink", "bench", "--role", "target", "--listen", "127.0.0.1:0",
               "--token-file", tf.name, "--buffer-mb", str(args.buffer_mb), "--streams", str(args.streams)]
        if args.crc:
            cmd.append("--crc")
        hosted = sorted({"nixl" if s.startswith("nixl") else s for s in systems if s in PEER_SYSTEMS})
        if hosted:
            cmd += ["--peers", ",".join(hosted)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                preexec_fn=_terminated_with_parent())
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line:
                raise SystemExit("bench target failed to start")
            d = json.loads(line)
            info = TargetInfo(d["address"], d["region"], d["buffer_bytes"], d["seed"], d["raw_port"],
                              d.get("peers", {}))
            return _initiate(args, info, token, systems, workloads)
        finally:
            proc.terminate()  # the target serves until a signal stops it
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        os.unlink(tf.name)


def _terminated_with_parent():
    """For the target child of `--role both`: the kernel sends it SIGTERM when
    this process dies, even by SIGKILL, so no target is left serving."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def _initiate(args: argparse.Namespace, info: TargetInfo, token: bytes | None, systems: list[str],
              workloads: list) -> int:
    ini = Initiator(info, token, args.streams, args.crc, args.iters, args.warmup, args.lat_iters)
    try:
        results = ini.run(workloads, systems)
        mem = ini.memory_with_peers(args.mem_peers) if args.mem_peers else None
    finally:
        ini.close()
    if args.json:
        for r in results:
            print(r.json())
        if mem:
            print(json.dumps({"system": "kvlink", "workload": "memory", **mem}))
    else:
        print(table(results))
        if mem:
            print(f"\nengine memory with {mem['peers']} peers connected: target +{mem['target_rss_growth_mib']} MiB, "
                  f"initiator +{mem['initiator_rss_growth_mib']} MiB (RSS growth, regions excluded)")
    return 0 if all(r.verified for r in results) else 1
