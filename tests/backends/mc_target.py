"""A Mooncake backend target in its own process (for the fault tests):
argv: token size. Registers a patterned READ|WRITE region, prints one JSON
line, serves until stdin closes."""

import json
import sys

import numpy as np

from kvlink.backends.mooncake import MooncakeBackend
from kvlink.bench.workloads import fill_pattern
from kvlink.transport import Access, EngineConfig

SEED = 0x1234_5678


def main() -> None:
    token, size = sys.argv[1].encode(), int(sys.argv[2])
    buf = np.empty(size, dtype=np.uint8)
    fill_pattern(buf, SEED)
    with MooncakeBackend(EngineConfig(listen="127.0.0.1:0", token=token, name="mc-target")) as b:
        region = b.register(buf, Access.READ | Access.WRITE)
        print(json.dumps({"address": b.address, "region": region.id, "seed": SEED}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
