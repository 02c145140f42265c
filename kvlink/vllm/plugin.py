"""vLLM general plugin (entry point ``vllm.general_plugins: kvlink``): registers KVLinkConnector by name,
so ``{"kv_connector": "KVLinkConnector"}`` works without ``kv_connector_module_path``, and routes kvlink's
log lines to vLLM's log."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    attach_vllm_log_handlers()
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


def attach_vllm_log_handlers() -> bool:
    """Give the ``kvlink`` logger vLLM's handlers and level when it has no handlers of its own.

    vLLM configures only its ``vllm`` logger (not the root), so without this kvlink's start-up and
    failure lines never reach a server's log. Left alone: a ``kvlink`` logger the application configured,
    and vLLM with its logging configuration turned off (no handlers to borrow). Idempotent; called in
    every process that builds a connector. Returns True when it attached the handlers.
    """
    ours = logging.getLogger("kvlink")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return False
    for h in theirs.handlers:
        ours.addHandler(h)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # as vLLM's own logger: no second copy through the root's handlers
    return True
