"""CorruptingConnector: a KVLinkConnector that overwrites the KV it pulled with noise (negative controls).

An equality test (decode output == single engine) also passes when decode never reads the pulled KV, for
example because it recomputed the prompt. Decoding from noise written over exactly the blocks a pull filled
must change the output; that proves the blocks decode reads are the ones kvlink wrote.

Load it with ``kv_connector="CorruptingConnector", kv_connector_module_path="tests.fakes_connector"``
(``tests.vllm.helpers.corrupting_kv_config``); the repository root must be importable (pytest's pythonpath
in-process; ``Server`` sets PYTHONPATH for server processes). It exists only in the tests.
"""

from __future__ import annotations

from typing import Any

from kvlink.vllm.connector import KVLinkConnector
from kvlink.vllm.metadata import KVLinkMetadata

SEED = 0


class CorruptingConnector(KVLinkConnector):
    """Worker side: once a pull is reported finished and not failed, its blocks hold seeded noise in every
    layer before vLLM hears of it (and so before decode's first forward pass reads them)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._filled: dict[str, tuple[int, ...]] = {}  # request id -> the local blocks its pull writes

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVLinkMetadata):
            for spec in meta.pulls:
                self._filled[spec.request_id] = tuple(spec.blocks_to_fill)
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        self._corrupt(results.finished_recving or set(), results.failed_recving or set())
        return results

    def _corrupt(self, recving: set[str], failed: set[str]) -> None:
        import torch

        for rid in recving:
            blocks = self._filled.pop(rid, ())
            if rid in failed or not blocks:
                continue
            ids = torch.tensor(blocks, dtype=torch.long)
            gen = torch.Generator().manual_seed(SEED)
            for t in self._worker.kv_caches.values():  # block index is dim 0 in every layer's tensor
                t[ids] = torch.randn(t[ids].shape, generator=gen).to(t.dtype)
