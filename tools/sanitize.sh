#!/usr/bin/env bash
# Build the C engine with AddressSanitizer + UndefinedBehaviorSanitizer into
# build/sanitize/ and run the transport tests against that build.
#
# The tests run from a copy of the tree inside build/sanitize/, in the same
# process that checked which engine it loaded: pytest puts its rootdir first
# on sys.path, so run from the repository root it would import the optimised
# engine there, whatever PYTHONPATH says.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac # absolute, symlink kept (venv)
OUT=build/sanitize
rm -rf "$OUT"
mkdir -p "$OUT"
cp -r kvlink csrc "$OUT"/
find "$OUT" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
(cd "$OUT" && KVLINK_SANITIZE=1 "$PY" -P -c \
  "import sys; sys.path.insert(0, '.'); from kvlink._build_ffi import ffibuilder; ffibuilder.compile(tmpdir='.')" \
  >/dev/null)
cp -r tests pyproject.toml "$OUT"/
find "$OUT/tests" -name __pycache__ -prune -exec rm -rf {} +
# Python itself is not instrumented: preload the ASan runtime, and skip leak
# checking of the interpreter (its arenas look like leaks). Any ASan report or
# UBSan runtime error aborts the run.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cd "$OUT"
exec "$PY" -P - "$@" <<'PYEOF'
import os
import sys

sys.path.insert(0, os.getcwd())
import kvlink._kvlink_c as m  # noqa: E402  (the tests below reuse this very module)

assert m.__file__.startswith(os.path.join(os.getcwd(), "kvlink", "")), m.__file__
print("sanitized build:", m.__file__, file=sys.stderr)
import pytest  # noqa: E402

sys.exit(pytest.main(["tests/transport", "-q", "-p", "no:cacheprovider",
                      "--ignore=tests/transport/test_bench_cli.py", *sys.argv[1:]]))
PYEOF
