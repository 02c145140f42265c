#!/usr/bin/env bash
# Build the C engine with AddressSanitizer + UndefinedBehaviorSanitizer into
# build/sanitize/ and run the transport tests against that build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=build/sanitize
rm -rf "$OUT"
mkdir -p "$OUT"
cp -r kvlink csrc "$OUT"/
rm -f "$OUT"/kvlink/_kvlink_c*.so
(cd "$OUT" && KVLINK_SANITIZE=1 "../../$PY" -c \
  "import sys; sys.path.insert(0, '.'); from kvlink._build_ffi import ffibuilder; ffibuilder.compile(tmpdir='.')" \
  >/dev/null)
# Python itself is not instrumented: preload the ASan runtime, and skip leak
# checking of the interpreter (its arenas look like leaks). Any ASan report or
# UBSan runtime error aborts the run.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH="$OUT"
"$PY" -P - <<'PYEOF'
import kvlink._kvlink_c as m, sys
assert "/build/sanitize/" in m.__file__, m.__file__
print("sanitized build:", m.__file__, file=sys.stderr)
PYEOF
exec "$PY" -P -m pytest tests/transport -q -p no:cacheprovider --ignore=tests/transport/test_bench_cli.py "$@"
