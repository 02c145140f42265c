"""The target half of `kvlink bench`: a registered, patterned buffer served by
an engine and by the raw TCP yardstick. Prints one JSON line describing
itself, then serves until it is stopped by SIGTERM or SIGINT (Ctrl-C), and
exits 0. Standard input is not read: started under nohup, systemd or
`ssh -n` (stdin at end of file) it serves all the same."""

from __future__ import annotations

import json
import signal
import threading

import numpy as np

from kvlink.bench import baseline
from kvlink.bench.peers import PeerTargets
from kvlink.bench.workloads import MiB, fill_pattern
from kvlink.transport import Access, Engine, EngineConfig
from kvlink.transport.config import split_hostport

SEED = 0x5EED_0F_CAFE


def run_target(listen: str, token: bytes | None, buffer_mb: int, streams: int, crc: bool,
               allow_insecure: bool = False, peers: list[str] | None = None) -> int:
    host, port = split_hostport(listen, "--listen")
    buf = np.empty(buffer_mb * MiB, dtype=np.uint8)
    fill_pattern(buf, SEED)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # not SIGHUP: nohup's "ignore it" must stand
        signal.signal(sig, lambda *_: stop.set())
    with Engine(EngineConfig(listen=listen, token=token, name="bench-target", streams=streams, crc=crc,
                             allow_insecure=allow_insecure, same_host="auto")) as eng:  # serves kvlink-same-host
        region = eng.register(buf, Access.READ | Access.WRITE)
        info = {"address": eng.address, "region": region.id, "buffer_bytes": buf.nbytes, "seed": SEED}
        hosted = PeerTargets(peers, host, buf) if peers else None  # only when compared
        if hosted:
            info["peers"] = hosted.info
        raw, raw_port = baseline.rawtcp_serve(host, port + 1 if port else 0, region.addr, buf.nbytes, json.dumps(info))
        info["raw_port"] = raw_port
        print(json.dumps(info), flush=True)
        try:
            while not stop.wait(0.5):
                eng.events()  # log refused peers as they happen
        finally:
            baseline.rawtcp_stop(raw)
            if hosted:
                hosted.close()
    return 0
