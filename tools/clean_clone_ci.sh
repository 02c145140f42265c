#!/usr/bin/env bash
# Runs .ci/run on a fresh clone of this checkout's HEAD (with ../shared beside it, as CI has it),
# then deletes the clone: each one holds a ~3.7 GB venv, and clones left behind once filled the disk
# CI shares with us (CI then failed in pip with ENOSPC). Usage: bash tools/clean_clone_ci.sh [log]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
d="$(mktemp -d)"
trap 'rm -rf "$d"' EXIT
chmod 755 "$d"
git clone -q "$here" "$d/main"
ln -s "$(cd "$here/../shared" && pwd)" "$d/shared"
cd "$d/main"
log="${1:-/dev/stdout}"
bash .ci/run >"$log" 2>&1 && echo "clean-clone CI: passed" || { rc=$?; echo "clean-clone CI: failed ($rc)"; exit $rc; }
