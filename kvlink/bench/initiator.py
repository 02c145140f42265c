"""The initiator half of `kvlink bench`: runs each workload against kvlink
and the yardsticks on the same random-slot layout, verifying the data."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvlink.bench import baseline
from kvlink.bench.peers import PEER_SYSTEMS, peer_runner
from kvlink.bench.runner import Runner
from kvlink.bench.stats import Result
from kvlink.bench.workloads import MiB, Workload, expected, fill_pattern, gather, random_slots
from kvlink.transport import Engine, EngineConfig
from kvlink.transport.config import split_hostport

SYSTEMS = ("kvlink", "kvlink-same-host", "raw-tcp", "memcpy") + PEER_SYSTEMS


@dataclass
class TargetInfo:
    address: str
    region: int
    buffer_bytes: int
    seed: int
    raw_port: int
    peers: dict = field(default_factory=dict)  # what the target's peer engines publish (kvlink.bench.peers)

    @classmethod
    def fetch(cls, address: str, raw_port: int) -> TargetInfo:
        host, _ = split_hostport(address)
        fd = baseline.rawtcp_connect(host, raw_port)
        try:
            buf = np.zeros(4096, dtype=np.uint8)
            n = baseline.rawtcp_fetch(fd, baseline.RAW_INFO, buf.ctypes.data, buf.nbytes)
        finally:
            baseline.rawtcp_close(fd)
        info = json.loads(bytes(buf[:n]))
        return cls(info["address"], info["region"], info["buffer_bytes"], info["seed"], raw_port,
                   info.get("peers", {}))


class Progress:
    def __init__(self, total: int, quiet: bool):
        self.total, self.done, self.quiet = total, 0, quiet
        self.tty = sys.stderr.isatty()

    def show(self, label: str, i: int, n: int) -> None:
        if self.quiet:
            return
        line = f"[{self.done + 1}/{self.total}] {label}: {i}/{n}"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(70))
        elif i == n:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def step(self) -> None:
        self.done += 1
        if self.tty and not self.quiet:
            sys.stderr.write("\n")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def target_rss(info: TargetInfo, host: str) -> int:
    fd = baseline.rawtcp_connect(host, info.raw_port)
    try:
        out = np.zeros(1, dtype=np.uint64)
        baseline.rawtcp_fetch(fd, baseline.RAW_RSS, out.ctypes.data, 8)
        return int(out[0])
    finally:
        baseline.rawtcp_close(fd)


class Initiator:
    def __init__(self, info: TargetInfo, token: bytes | None, streams: int, crc: bool, iters: int, warmup: int,
                 lat_iters: int, quiet: bool = False):
        self.info, self.iters, self.warmup, self.lat_iters, self.quiet = info, iters, warmup, lat_iters, quiet
        self.host, _ = split_hostport(info.address)
        self.token, self.streams, self.crc = token, streams, crc
        self.dst = np.zeros(info.buffer_bytes, dtype=np.uint8)
        self.src = None  # local pattern copy, only for memcpy
        self.engine = Engine(EngineConfig(listen=None, token=token, name="bench-initiator", streams=streams, crc=crc))
        self.region = self.engine.register(self.dst)
        self.peer = self.engine.connect(info.address)
        self.local = None  # (engine, region, peer) with same_host="require", for kvlink-same-host
        self.rng = np.random.default_rng(1234)
        self.peer_clients = None  # kvlink.bench.peers.PeerClients, created on first use

    def close(self) -> None:
        if self.peer_clients is not None:
            self.peer_clients.close()
        if self.local is not None:
            self.local[0].close()
        self.engine.close()

    def _verify(self, dst_offs: np.ndarray, src_offs: np.ndarray, w: Workload) -> bool:
        got = gather(self.dst, dst_offs, w.block_size)
        return bool(np.array_equal(got, expected(src_offs, w.block_size, self.info.seed)))

    def _clear(self, dst_offs: np.ndarray, w: Workload) -> None:
        gather_idx = (dst_offs // 8)[:, None].astype(np.int64) + np.arange(w.block_size // 8)[None, :]
        self.dst.view(np.uint64)[gather_idx] = 0

    def _checked(self, op: Callable[[], None], dst_offs: np.ndarray, src_offs: np.ndarray,
                 w: Workload) -> Callable[[], bool]:
        def verify() -> bool:
            self._clear(dst_offs, w)
            op()
            return self._verify(dst_offs, src_offs, w)

        return verify

    # -- systems ---------------------------------------------------------------------------
    def _kvlink(self, system: str, w: Workload, r_offs: np.ndarray, l_offs: np.ndarray) -> Runner:
        if system == "kvlink-same-host" and self.local is None:
            eng = Engine(EngineConfig(listen=None, token=self.token, name="bench-initiator-local",
                                      streams=self.streams, same_host="require"))
            self.local = (eng, eng.register(self.dst), eng.connect(self.info.address))
        eng, region, peer = self.local if system == "kvlink-same-host" else (self.engine, self.region, self.peer)
        descs: list[int] = []
        one = w.blocks == 1  # the single-descriptor path takes plain ints
        lo, ro = (int(l_offs[0]), int(r_offs[0])) if one else (l_offs, r_offs)

        def op() -> None:
            b = eng.read(peer, region, lo, self.info.region, ro, w.block_size)
            b.wait()
            if not descs:
                descs.append(b.descriptors)
            b.release()

        return Runner(system, op, self._checked(op, l_offs, r_offs, w), descriptors=lambda: descs[0])

    def _raw(self, w: Workload) -> Runner:
        fd = baseline.rawtcp_connect(self.host, self.info.raw_port)
        zero = np.zeros(1, dtype=np.uint64)
        whole = Workload(w.name, 1, w.nbytes)

        def op() -> None:
            baseline.rawtcp_fetch(fd, w.nbytes, self.dst.ctypes.data, self.dst.nbytes)

        return Runner("raw-tcp", op, self._checked(op, zero, zero, whole), close=lambda: baseline.rawtcp_close(fd))

    def _memcpy(self, w: Workload, r_offs: np.ndarray, l_offs: np.ndarray) -> Runner:
        if self.src is None:
            self.src = np.empty(self.info.buffer_bytes, dtype=np.uint8)
            fill_pattern(self.src, self.info.seed)
        dst_a = l_offs + np.uint64(self.dst.ctypes.data)
        src_a = r_offs + np.uint64(self.src.ctypes.data)

        def op() -> None:
            baseline.memcpy_blocks(dst_a, src_a, w.block_size)

        return Runner("memcpy", op, self._checked(op, l_offs, r_offs, w))

    def runner(self, system: str, w: Workload, r_offs: np.ndarray, l_offs: np.ndarray) -> Runner:
        if system in ("kvlink", "kvlink-same-host"):
            return self._kvlink(system, w, r_offs, l_offs)
        if system == "raw-tcp":
            return self._raw(w)
        if system == "memcpy":
            return self._memcpy(w, r_offs, l_offs)
        return peer_runner(self, system, w, r_offs, l_offs)

    # -- measuring ---------------------------------------------------------------------------
    def run(self, workloads: list[Workload], systems: list[str]) -> list[Result]:
        """Per workload, every system's runs are interleaved round-robin, so the
        noise of a shared machine falls on all of them alike."""
        prog = Progress(len(workloads), self.quiet)
        out = []
        for w in workloads:
            r_offs = random_slots(self.rng, self.info.buffer_bytes, w)
            l_offs = random_slots(self.rng, self.dst.nbytes, w)
            runners = [self.runner(s, w, r_offs, l_offs) for s in systems]
            try:
                n = self.lat_iters if w.latency else self.iters
                for r in runners:
                    for _ in range(self.warmup):
                        r.op()
                times: dict[str, list[float]] = {r.system: [] for r in runners}
                for i in range(n):
                    for r in runners:
                        t0 = time.perf_counter()
                        r.op()
                        times[r.system].append(time.perf_counter() - t0)
                    prog.show(f"{w.name} ({', '.join(systems)})", i + 1, n)
                for r in runners:
                    out.append(Result.of(r.system, w.name, w.blocks, w.block_size, times[r.system], r.verify(),
                                         r.descriptors()))
            finally:
                for r in runners:
                    r.close()
            prog.step()
        return out

    def memory_with_peers(self, peers: int) -> dict[str, float]:
        """Engine memory beyond registered regions with `peers` initiators connected:
        the RSS growth of the target and of this process."""
        before_t, before_i = target_rss(self.info, self.host), rss_bytes()
        engines = []
        buf = np.zeros(32 * 1024, dtype=np.uint8)
        try:
            for k in range(peers):
                e = Engine(EngineConfig(listen=None, token=self.token, name=f"bench-peer-{k}", streams=self.streams))
                engines.append(e)
                reg = e.register(buf)
                p = e.connect(self.info.address)
                e.read(p, reg, [0], self.info.region, [k * 32768], 32768).wait()
            after_t, after_i = target_rss(self.info, self.host), rss_bytes()
        finally:
            for e in engines:
                e.close()
        return {"peers": peers, "target_rss_growth_mib": round((after_t - before_t) / MiB, 2),
                "initiator_rss_growth_mib": round((after_i - before_i) / MiB, 2)}
