"""KVLinkConnector for vLLM: move a request's paged KV cache from a prefill engine to a decode engine.

Reading order (README.md's): config, params, metadata, plan, layout, pulls, held, scheduler, worker, lease,
stats, compat, connector, plugin.
Importing this package does not import vLLM; ``KVLinkConnector`` is loaded on first access.
"""

__all__ = ["KVLinkConnector"]


def __getattr__(name):
    if name == "KVLinkConnector":
        from kvlink.vllm.connector import KVLinkConnector

        return KVLinkConnector
    raise AttributeError(f"module 'kvlink.vllm' has no attribute {name!r}")
