"""vLLM general plugin (entry point ``vllm.general_plugins: kvlink``): registers KVLinkConnector by name,
so ``{"kv_connector": "KVLinkConnector"}`` works without ``kv_connector_module_path``."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as e:  # pragma: no cover - vLLM missing or too different
        logger.warning("kvlink: cannot register KVLinkConnector with vLLM: %s", e)
        return
    if "KVLinkConnector" in getattr(KVConnectorFactory, "_registry", {}):
        return
    try:
        KVConnectorFactory.register_connector("KVLinkConnector", "kvlink.vllm", "KVLinkConnector")
    except ValueError:
        pass  # registered meanwhile (plugins load once per process, but be tolerant)
