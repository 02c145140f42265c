"""cffi builders for the C code (API mode, out of line).

setup.py names both in ``cffi_modules``:

- ``ffibuilder``: the engine, every ``csrc/*.c`` but the yardsticks, into the
  extension ``kvlink._kvlink_c`` that ``kvlink._binding`` wraps.
- ``baseline_ffibuilder``: the benchmark yardsticks (``csrc/kvl_baseline.c``
  with the socket and codec helpers it uses) into ``kvlink.bench._baseline_c``,
  which only ``kvlink bench`` imports. The production extension does not
  contain them.

``KVLINK_SANITIZE=1`` builds with AddressSanitizer and UndefinedBehaviorSanitizer
(used by ``make sanitize``).
"""

from __future__ import annotations

import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CSRC = os.path.join(ROOT, "csrc")

BASELINE = "kvl_baseline.c"
BASELINE_SOURCES = [BASELINE, "kvl_sock.c", "kvl_proto.c"]  # what kvl_baseline.c calls, compiled in again

CFLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-format-truncation", "-fvisibility=hidden"]
LDFLAGS: list[str] = []
if os.environ.get("KVLINK_SANITIZE") == "1":
    CFLAGS = ["-std=c11", "-O1", "-g", "-Wno-format-truncation", "-fno-omit-frame-pointer",
              "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    LDFLAGS = ["-fsanitize=address,undefined"]


def _rel(paths: list[str]) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _builder(module: str, header: str, cdef: str, sources: list[str]) -> FFI:
    b = FFI()
    b.cdef(cdef)
    b.set_source(module, f'#include "{header}"', sources=sources, include_dirs=[os.path.relpath(CSRC, ROOT)],
                 define_macros=[("_GNU_SOURCE", "1")], extra_compile_args=CFLAGS, extra_link_args=LDFLAGS,
                 libraries=["pthread"])
    return b


with open(os.path.join(HERE, "_cdef.h"), encoding="utf-8") as f:
    _ENGINE_CDEF = f.read()

ffibuilder = _builder("kvlink._kvlink_c", "kvl.h", _ENGINE_CDEF,
                      _rel([p for p in glob.glob(os.path.join(CSRC, "*.c")) if os.path.basename(p) != BASELINE]))

with open(os.path.join(HERE, "bench", "_baseline_cdef.h"), encoding="utf-8") as f:
    _BASELINE_CDEF = f.read()

baseline_ffibuilder = _builder("kvlink.bench._baseline_c", "kvl_baseline.h", _BASELINE_CDEF,
                               _rel([os.path.join(CSRC, n) for n in BASELINE_SOURCES]))

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    baseline_ffibuilder.compile(verbose=True)
