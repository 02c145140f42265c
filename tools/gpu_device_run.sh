#!/usr/bin/env bash
# The GPU checks in one command, for a lent GPU host that has CUDA PyTorch but neither vLLM nor kvlink's
# other needs, and no network (the device tool: bench/results/gpu.md). Beforehand, here, in the repository
# root (wheels for the host's Python 3.12, carried as .whl):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .whl cffi pycparser msgspec
# Then run ``bash tools/gpu_device_run.sh [OUT [CHECKS]]`` there, with .whl carried (CHECKS: some of
# stager_bench,stager_mla,cold_probe,stream_check,gpu_check,stream_<layout>; all by default; stager_mla times
# the copies in MLA's layout, wide elements against byte-wise; gpu_check also checks every
# layout staged, stream_<layout> streams in one of gpu_check.py's other layouts).
# It installs the wheels, builds the C core in place, stands in the two vLLM base classes the worker imports
# (empty ones, in /tmp: the worker side needs nothing else of vLLM) and runs the GPU tools; each tool's output
# goes to OUT/<tool>.txt.
set -u
out=${1:-/tmp/gpu-out}
checks=${2:-stager_bench,stager_mla,cold_probe,stream_check,gpu_check,stream_fa-hnd,stream_flashinfer,stream_flashinfer-hnd,stream_mla,stream_fp8}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:/tmp/standin:$PWD
v1=/tmp/standin/vllm/distributed/kv_transfer/kv_connector/v1
mkdir -p $v1
for d in vllm vllm/distributed vllm/distributed/kv_transfer vllm/distributed/kv_transfer/kv_connector; do
  touch /tmp/standin/$d/__init__.py
done
touch $v1/__init__.py
printf 'class KVConnectorMetadata: pass\n\n\nclass KVConnectorWorkerMetadata: pass\n' > $v1/base.py
cat > $v1/metrics.py <<'PY'
from dataclasses import dataclass, field


@dataclass
class KVConnectorStats:
    data: dict = field(default_factory=dict)


class KVConnectorPromMetrics:
    def __init__(self, *args, **kwargs):
        pass
PY
python3 setup.py -q build_ext --inplace > "$out/build.txt" 2>&1 || { tail -30 "$out/build.txt"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__)' | tee -a "$out/gpu.txt"
cd tools
run() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  [[ ",$checks," == *",$name,"* ]] || return 0
  echo "=== $name $*"
  timeout "$t" python3 "$@" 2>&1 | tee "$out/$name.txt" | grep -v "^INFO\|^WARNING" | tail -40
  echo "=== $name exit ${PIPESTATUS[0]}"
}
run stager_bench 120 gpu_stager_bench.py
run stager_mla 120 gpu_stager_bench.py --layout mla --profile
run cold_probe 120 gpu_stager_bench.py --cold-probe
run stream_check 240 gpu_stream_check.py --modes stream,plain,cold --runs 3
run gpu_check 240 gpu_check.py --layouts all
for l in fa-hnd flashinfer flashinfer-hnd mla fp8; do  # streamed in each other layout, with the fence control
  run stream_$l 120 gpu_stream_check.py --modes stream,plain --runs 1 --layout $l
done
