"""Test connectors: KVLinkConnector subclasses that only the tests load.

RecordingConnector keeps every statistic its side hands vLLM, since start: tests read what a pull or a
prefill did from there, and the production classes keep no totals nobody but a test reads.

CorruptingConnector (a RecordingConnector) overwrites the KV it pulled with noise (negative controls). An
equality test (decode output == single engine) also passes when decode never reads the pulled KV, for
example because it recomputed the prompt. Decoding from noise written over exactly the blocks a pull filled
must change the output; that proves the blocks decode reads are the ones kvlink wrote.

LockstepCorruptingConnector (a RecordingConnector, decode with stream_lockstep) does the same to each layer of
an armed request's blocks in its step, once that layer has landed. CorruptGroup0Connector and
CorruptGroup1Connector corrupt one KV cache group of a model with several (each group's bytes must matter);
DraftCorruptingConnector, the layers of a speculative-decoding draft model only; EagleCorruptingConnector, an
EAGLE head's layer only; SwitchedCorruptingConnector, everything, but only while a file the test creates
exists.

DyingLayersConnector (a SlowLayersConnector) makes its process exit right after announcing the last layer of
the step that ends a streamed prompt.

SlowLayersConnector (a RecordingConnector, prefill) sleeps after each attention layer of a step that streams
KV: a forward as slow, next to the transfer, as a GPU's over a real link, so layer-wise streaming overlaps
every time instead of when the host's timing allows.

Load one with ``kv_connector="RecordingConnector"`` (or ``"CorruptingConnector"``) and
``kv_connector_module_path="tests.fakes_connector"`` (``tests.vllm.helpers.recording_kv_config`` and
``corrupting_kv_config``); the repository root must be importable (pytest's pythonpath in-process;
``Server`` sets PYTHONPATH for server processes).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from kvlink.vllm.connector import KVLinkConnector
from kvlink.vllm.metadata import KVLinkMetadata
from kvlink.vllm.plan import layer_indices
from kvlink.vllm.stats import KVLinkStats

SEED = 0


class RecordingConnector(KVLinkConnector):
    """A KVLinkConnector that also adds up, in ``recorded``, every KVLinkStats its side hands vLLM."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.recorded = KVLinkStats()  # since start, never reset; under _recorded_lock
        self._recorded_lock = threading.Lock()  # vLLM's thread hands stats out while a test reads them
        self.pulls: dict[str, Any] = {}  # worker side: request id -> the PullSpec it was handed

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVLinkMetadata):
            for spec in meta.pulls:
                self.pulls[spec.request_id] = spec
        super().start_load_kv(forward_context, **kwargs)

    def get_kv_connector_stats(self) -> KVLinkStats | None:
        stats = super().get_kv_connector_stats()
        if stats is not None:
            # A copy: vLLM keeps the object it is handed and aggregates the other side's stats into it.
            with self._recorded_lock:
                self.recorded.aggregate(KVLinkStats(data=copy.deepcopy(stats.data)))
        return stats

    def recorded_now(self) -> dict[str, Any]:
        """What ``recorded`` holds plus what the side has not handed out yet (a poll between engine steps).

        The side's pending stats are taken here, so they are recorded but vLLM never sees them (its log
        line and /metrics miss them): fine in a test, which reads them from here."""
        self.get_kv_connector_stats()
        with self._recorded_lock:
            return copy.deepcopy(self.recorded.data)


def _noise(t: Any, blocks) -> None:
    """Seeded noise over ``blocks`` of one layer's KV tensor (the block index is dim 0 in every layer's)."""
    import torch

    ids = torch.tensor(tuple(blocks), dtype=torch.long)
    gen = torch.Generator().manual_seed(SEED)
    t[ids] = torch.randn(t[ids].shape, generator=gen).to(t.dtype)


class _FillTracking(RecordingConnector):
    """Worker side: remembers the local blocks each pull it was handed writes (``_filled``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._filled: dict[str, tuple[int, ...]] = {}  # request id -> the local blocks its pull writes

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVLinkMetadata):
            for spec in meta.pulls:
                self._filled[spec.request_id] = tuple(spec.blocks_to_fill)
        super().start_load_kv(forward_context, **kwargs)


class CorruptingConnector(_FillTracking):
    """Worker side: once a pull is reported finished and not failed, its blocks hold seeded noise in every
    layer before vLLM hears of it (and so before decode's first forward pass reads them)."""

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
            for name, t in self._worker.kv_caches.items():  # block index is dim 0 in every layer's tensor
                if self.corrupts(name):
                    t[ids] = torch.randn(t[ids].shape, generator=gen).to(t.dtype)

    def corrupts(self, layer_name: str) -> bool:
        return True


class SwitchedCorruptingConnector(CorruptingConnector):
    """CorruptingConnector while the file named by ``KVLINK_TEST_CORRUPT_WHILE`` (the server's environment)
    exists, else a RecordingConnector: one server gives both an equality test and its negative control, where
    starting another is dear (tests/vllm/test_pp.py: pipeline-parallel servers)."""

    def corrupts(self, layer_name: str) -> bool:
        import os

        flag = os.environ.get("KVLINK_TEST_CORRUPT_WHILE")
        return bool(flag) and os.path.exists(flag)


class DraftCorruptingConnector(CorruptingConnector):
    """CorruptingConnector for the draft model's layers only (speculative decoding with vLLM's "draft_model"
    method, whose layers are named ``draft_model.*``): the answers stay the target's (verification is
    lossless), but the drafter proposes from noise, so fewer drafted tokens are accepted."""

    def corrupts(self, layer_name: str) -> bool:
        return layer_name.startswith("draft_model.")


class EagleCorruptingConnector(CorruptingConnector):
    """CorruptingConnector for the EAGLE head's layer only: the one whose index is past the target's layers
    (vLLM names the head's attention ``model.layers.<target layers>.self_attn.attn``). The answers stay the
    target's (verification is lossless); the head drafts from noise, so fewer drafts are accepted."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)

    def corrupts(self, layer_name: str) -> bool:
        return (layer_indices([layer_name]) or {}).get(layer_name, -1) >= self._target_layers


class GroupCorruptingConnector(RecordingConnector):
    """CorruptingConnector for one KV cache group (``GROUP``) of a model with several (hybrid, Mamba): noise
    over the blocks a pull filled in that group, in that group's layers only. Noise over every group at once
    shows that some pulled bytes matter; one group at a time, that each group's do."""

    GROUP = 0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._filled: dict[str, tuple[int, ...]] = {}  # request id -> its pull's blocks of GROUP

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVLinkMetadata):
            for spec in meta.pulls:
                self._filled[spec.request_id] = tuple(b for t in spec.tables if t.group == self.GROUP
                                                      for b in t.local_block_ids[t.first_block:] if b != 0)
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        failed = results.failed_recving or set()
        for rid in results.finished_recving or set():
            blocks = self._filled.pop(rid, ())
            if rid not in failed and blocks:
                for name, t in self._worker.kv_caches.items():
                    if self._worker._layer_group.get(name, 0) == self.GROUP:
                        _noise(t, blocks)
        return results


class CorruptGroup0Connector(GroupCorruptingConnector):
    GROUP = 0


class CorruptGroup1Connector(GroupCorruptingConnector):
    GROUP = 1


class LockstepCorruptingConnector(_FillTracking):
    """Decode with ``stream_lockstep``: in the step that runs an armed request, each layer of the blocks its
    pull writes holds seeded noise once that layer has landed (the step waited for it), before the layer's
    attention reads it. Decoding from that noise must change the output: proof that the step reads the bytes
    kvlink wrote, layer by layer, and that lock-step engaged at all (nothing is overwritten otherwise)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        meta = self._connector_metadata
        if not (isinstance(meta, KVLinkMetadata) and meta.lockstep and layer_name in self._worker.kv_caches):
            return
        blocks = [b for rid in meta.lockstep for b in self._filled.get(rid, ())]
        if blocks:
            _noise(self._worker.kv_caches[layer_name], blocks)


class SlowLayersConnector(RecordingConnector):
    """Prefill: every attention layer of a step with streamed requests takes ``SLOW_LAYER_S`` longer on
    entry to its attention op (before the attention computes) and as long again on exit. A layer whose KV
    vLLM wrote before the op is announced on entry, so decode reads it while the attention has not run."""

    SLOW_LAYER_S = 0.15

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        self._slow()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._slow()

    def _slow(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVLinkMetadata) and meta.streams:
            import time

            time.sleep(self.SLOW_LAYER_S)  # after the layer's piece went to the sender: decode may read it now


class DyingLayersConnector(SlowLayersConnector):
    """Prefill (a server of its own): the process exits in the step that ends a streamed prompt, once the last layer's
    KV was announced and ``SLOW_LAYER_S`` passed (decode read it and began its step in lock-step), before the
    layer's attention, the logits and the publish: prefill dies mid-stream."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        meta = self._connector_metadata
        ranks = getattr(self._worker, "_layer_rank", {})
        if (isinstance(meta, KVLinkMetadata) and any(s.last for s in meta.streams)
                and ranks.get(layer_name) == len(ranks) - 1):
            import os

            os._exit(17)
