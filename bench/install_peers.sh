#!/usr/bin/env bash
# Install the systems `kvlink bench --compare mooncake,nixl,nixl-tcp` measures against, and matplotlib
# for bench/report.py, into bench/.peers/ (git-ignored). Idempotent: each part is skipped when its
# stamp exists. Nothing here touches .venv, and nothing pulls CUDA torch:
#   bench/.peers/nixl      nixl + nixl-cu12 1.5.1, --no-deps (UCX bundled; with deps it pulls ~3 GB of CUDA)
#   bench/.peers/mooncake  mooncake-transfer-engine-non-cuda, --no-deps (needs Debian libibverbs1 librdmacm1)
#   bench/.peers/venv      a small venv with matplotlib (and its own numpy) for the chart
# Usage: bash bench/install_peers.sh [PYTHON]   (PYTHON: the interpreter the bench runs with, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PEERS=bench/.peers
NIXL_VERSION=1.5.1
MOONCAKE_VERSION=0.3.13.post1
mkdir -p "$PEERS"

if [ -f bench/install_nixl.sh ]; then
    PYTHON="$PY" bash bench/install_nixl.sh "$PEERS/nixl"   # the connector bench's installer: one way to do it
elif [ ! -f "$PEERS/nixl/.kvlink-nixl-$NIXL_VERSION" ]; then
    rm -rf "$PEERS/nixl"
    "$PY" -m pip install -q --no-deps --target "$PEERS/nixl" "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
    touch "$PEERS/nixl/.kvlink-nixl-$NIXL_VERSION"
fi

if ! "$PY" -c "import ctypes.util, sys; sys.exit(not (ctypes.util.find_library('ibverbs') and ctypes.util.find_library('rdmacm')))"; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libibverbs1 librdmacm1 >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 librdmacm1 >/dev/null; }
    else
        echo "install_peers: Mooncake needs Debian's libibverbs1 and librdmacm1 (apt-get install libibverbs1 librdmacm1)" >&2
    fi
fi
if [ ! -f "$PEERS/mooncake/.stamp-$MOONCAKE_VERSION" ]; then
    rm -rf "$PEERS/mooncake"
    "$PY" -m pip install -q --no-deps --target "$PEERS/mooncake" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
    touch "$PEERS/mooncake/.stamp-$MOONCAKE_VERSION"
fi

if [ ! -x "$PEERS/venv/bin/python" ] || ! "$PEERS/venv/bin/python" -c "import matplotlib" 2>/dev/null; then
    rm -rf "$PEERS/venv"
    python3 -m venv "$PEERS/venv"
    "$PEERS/venv/bin/python" -m pip install -q matplotlib
fi
echo "install_peers: ok ($PEERS: nixl $NIXL_VERSION, mooncake $MOONCAKE_VERSION, matplotlib)"
