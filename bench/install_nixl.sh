#!/usr/bin/env bash
# Install NIXL (vLLM's NixlConnector transport) next to the benchmark, outside the venv:
#   bench/install_nixl.sh [DIR]        (default DIR: bench/.peers/nixl, git-ignored)
# Idempotent: does nothing when DIR already holds nixl 1.5.1. --no-deps keeps CUDA torch and the NVIDIA
# wheels out (about 3 GB); the two wheels carry UCX. Use with: bench_connector.py --nixl-path DIR
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-bench/.peers/nixl}"
PY="${PYTHON:-.venv/bin/python}"
VERSION=1.5.1
if [ -f "$DIR/.kvlink-nixl-$VERSION" ]; then
    echo "nixl $VERSION already in $DIR"
    exit 0
fi
rm -rf "$DIR"
"$PY" -m pip install --no-deps --target "$DIR" "nixl==$VERSION" "nixl-cu12==$VERSION"
PYTHONPATH="$DIR" "$PY" -c "import nixl._api" >/dev/null
touch "$DIR/.kvlink-nixl-$VERSION"
echo "nixl $VERSION installed in $DIR"
