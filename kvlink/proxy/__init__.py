"""OpenAI-compatible router that pairs a prefill and a decode vLLM server (``kvlink proxy``)."""

from kvlink.proxy.config import ProxyConfig

__all__ = ["ProxyConfig", "build_app"]


def __getattr__(name):
    if name == "build_app":
        from kvlink.proxy.router import build_app
        return build_app
    raise AttributeError(name)
