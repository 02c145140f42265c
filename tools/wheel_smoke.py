"""Checks an installed kvlink wheel (run by `make test-wheel` in a fresh venv, outside the repository).

It must be the installed copy that runs (not the source tree), with its compiled engine and yardsticks:
two authenticated engines READ 256 random blocks and the bytes are compared; the `kvlink` console script
answers; the yardsticks' extension loads. Exits non-zero, saying what failed, otherwise prints one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig


def main() -> int:
    import numpy as np

    import kvlink
    from kvlink import Access, Engine, EngineConfig
    from kvlink.bench import baseline  # noqa: F401 - loads the yardsticks' extension: it must be in the wheel

    site = sysconfig.get_paths()["purelib"]
    if not os.path.realpath(kvlink.__file__).startswith(os.path.realpath(site)):
        print(f"wheel smoke: kvlink imported from {kvlink.__file__}, not from the installed wheel in {site}")
        return 1
    token = b"wheel-smoke-token"
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    with Engine(EngineConfig(listen="127.0.0.1:0", token=token, name="t")) as target, \
            Engine(EngineConfig(listen=None, token=token, name="i")) as init:
        region = target.register(src, Access.READ)
        local = init.register(dst)
        peer = init.connect(target.address)
        offs = rng.permutation(256).astype(np.uint64) * 32768
        init.read(peer, local, offs, region.id, offs, 32768, timeout_s=10).wait()
    if not np.array_equal(src, dst):
        print("wheel smoke: the READ moved wrong bytes")
        return 1
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvlink"), "--help"], capture_output=True,
                         text=True, timeout=60)
    if cli.returncode != 0 or "bench" not in cli.stdout:
        print(f"wheel smoke: `kvlink --help` failed ({cli.returncode}): {cli.stderr[-500:]}")
        return 1
    print(f"wheel smoke: ok ({kvlink.__file__}; 256 x 32 KiB READ verified; kvlink CLI answers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
