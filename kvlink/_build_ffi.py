"""cffi builder for the C engine (API mode, out of line).

setup.py names this file in ``cffi_modules``; it compiles every ``csrc/*.c``
into the extension ``kvlink._kvlink_c``. ``KVLINK_SANITIZE=1`` builds with
AddressSanitizer and UndefinedBehaviorSanitizer (used by ``make sanitize``).
"""

from __future__ import annotations

import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CSRC = os.path.join(ROOT, "csrc")

CFLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-format-truncation", "-fvisibility=hidden"]
LDFLAGS: list[str] = []
if os.environ.get("KVLINK_SANITIZE") == "1":
    CFLAGS = ["-std=c11", "-O1", "-g", "-Wno-format-truncation", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
              "-fno-sanitize-recover=undefined"]
    LDFLAGS = ["-fsanitize=address,undefined"]

ffibuilder = FFI()
with open(os.path.join(HERE, "_cdef.h"), encoding="utf-8") as f:
    ffibuilder.cdef(f.read())

ffibuilder.set_source(
    "kvlink._kvlink_c",
    '#include "kvl.h"',
    sources=sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(CSRC, "*.c"))),
    include_dirs=[os.path.relpath(CSRC, ROOT)],
    define_macros=[("_GNU_SOURCE", "1")],
    extra_compile_args=CFLAGS,
    extra_link_args=LDFLAGS,
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
