"""KV cache layouts of vLLM's attention backends (tensors shaped like each, on CPU), moved block by block.

Unit tests of ``kvlink.vllm.layout`` and pulls between real KVLinkWorkers over the native TCP transport
with a real bootstrap server: every pulled block of every layer, in every plane, lands where decode's
block table says, and nothing else is written.
"""

from __future__ import annotations

import pytest

from kvlink.vllm.layout import LayoutError, block_layout, tokens_per_block
from tests.vllm.helpers import pull_outcome, submit_pull

torch = pytest.importorskip("torch")

NB, H, BS, D, LAYERS = 8, 2, 16, 32, 3


def _views(kind: str, layers: int, one_allocation: bool, fill: bool, nb: int = NB) -> dict:
    """Per-layer tensors as each backend hands them to a connector (HND: a permuted view of NHD's shape)."""
    shapes = {  # the allocation of one layer, and how the backend views it
        "cpu": ((nb, H, BS, 2 * D), None),
        "flash_attn_nhd": ((2, nb, BS, H, D), None),
        "flash_attn_hnd": ((2, nb, H, BS, D), (0, 1, 3, 2, 4)),
        "flashinfer_nhd": ((nb, 2, BS, H, D), None),
        "flashinfer_hnd": ((nb, 2, H, BS, D), (0, 1, 3, 2, 4)),
        "mla": ((nb, BS, 576), None),
        "mla_cpu": ((nb, 1, BS, 576), None),
    }
    shape, perm = shapes[kind]
    gen = torch.Generator().manual_seed(7)

    def make(n):
        t = torch.randn(n, *shape, generator=gen) if fill else torch.zeros(n, *shape)
        return t.to(torch.bfloat16)

    if one_allocation:
        whole = make(layers)
        per_layer = [whole[i] for i in range(layers)]
    else:
        per_layer = [make(1)[0] for _ in range(layers)]
    return {f"model.layers.{i}.attn": (t.permute(*perm) if perm else t) for i, t in enumerate(per_layer)}


def _block(kind: str, t, b: int):
    return t[:, b] if kind.startswith("flash_attn") else t[b]


# ----- the layouts, as arithmetic ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind, segments, seg_bytes, coalesce", [
    ("cpu", 1, H * BS * 2 * D * 2, True),
    ("flash_attn_nhd", 2, BS * H * D * 2, True),
    ("flash_attn_hnd", 2, BS * H * D * 2, True),
    ("flashinfer_nhd", 1, 2 * BS * H * D * 2, True),
    ("flashinfer_hnd", 1, 2 * BS * H * D * 2, True),
    ("mla", 1, BS * 576 * 2, True),
    ("mla_cpu", 1, BS * 576 * 2, True),
])
def test_each_backend_layout_is_understood(kind, segments, seg_bytes, coalesce):
    t = next(iter(_views(kind, 1, True, False).values()))
    lay = block_layout(t.shape, t.stride(), t.element_size())
    assert (lay.num_blocks, lay.segments, lay.segment_bytes, lay.runs_coalesce) == (NB, segments, seg_bytes, coalesce)
    assert lay.span == t.untyped_storage().nbytes()  # the region covers the whole layer, nothing more
    assert tokens_per_block(t.shape) == BS
    assert len(lay.desc) <= 128  # it travels in the registration's layout field


def test_nhd_and_hnd_are_different_layouts():
    nhd = next(iter(_views("flash_attn_nhd", 1, True, False).values()))
    hnd = next(iter(_views("flash_attn_hnd", 1, True, False).values()))
    assert nhd.shape == hnd.shape
    assert block_layout(nhd.shape, nhd.stride(), 2).desc != block_layout(hnd.shape, hnd.stride(), 2).desc


@pytest.mark.parametrize("shape, strides, why", [
    ((4, 8), (8, 1), "3- to 5-dimensional"),
    ((4, 2, 8, 2, 2, 2), (128, 64, 8, 4, 2, 1), "3- to 5-dimensional"),
    ((4, 8, 16), (256, 1, 16), "not one contiguous range"),  # a transposed block with gaps
    ((4, 8, 16), (64, 16, 1), "blocks overlap"),
    ((4, 8, 16), (-128, 16, 1), "negative strides"),
    ((2, 4, 8, 2, 4), (32, 64, 8, 4, 1), "planes overlap"),
])
def test_layouts_kvlink_cannot_move_are_refused_naming_shape_and_strides(shape, strides, why):
    with pytest.raises(LayoutError, match=why) as e:
        block_layout(shape, strides, 2)
    assert str(list(shape)) in str(e.value) and str(list(strides)) in str(e.value)


# ----- through real transport engines and a real bootstrap server ---------------------------------------------


@pytest.fixture
def boot():
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    yield srv.url
    srv.stop()


@pytest.mark.parametrize("one_allocation", [True, False], ids=["one-region", "region-per-layer"])
@pytest.mark.parametrize("kind", ["cpu", "flash_attn_nhd", "flash_attn_hnd", "flashinfer_nhd", "flashinfer_hnd",
                                  "mla", "mla_cpu"])
def test_every_block_of_every_layer_lands_in_place(boot, kind, one_allocation):
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    cfg = ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0)
    pre = KVLinkWorker(cfg, RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = KVLinkWorker(cfg, RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        # Prefill's cache has more blocks than decode's: a V plane starts elsewhere on each side.
        src, dst = _views(kind, LAYERS, True, True, nb=NB + 5), _views(kind, LAYERS, one_allocation, False)
        pre.register_kv_caches(src)
        dec.register_kv_caches(dst)
        assert (dec._local_region is not None) == one_allocation
        pre._ensure_registered(boot)
        pairs = [(1, 4), (2, 5), (3, 6), (6, 1)]  # a run that coalesces, then a lone block
        with BootstrapClient(boot) as cli:
            cli.publish("pre", "p-r", [[r for _, r in pairs]], num_tokens=BS * len(pairs), lease_s=30.0)
        submit_pull(dec, boot, "r", pairs)
        assert pull_outcome(dec, "r") == "ok"
        moved = {lb for lb, _ in pairs}
        for name in dst:
            for lb, rb in pairs:
                assert torch.equal(_block(kind, dst[name], lb), _block(kind, src[name], rb)), (name, lb, rb)
            for b in set(range(NB)) - moved:  # not written, in any plane
                assert not _block(kind, dst[name], b).any(), f"{name}: block {b} was written"
        stats = dec.get_stats().data
        assert stats["bytes_pulled"] == len(pairs) * LAYERS * dec.layout.block_bytes
    finally:
        dec.shutdown()
        pre.shutdown()


# ----- KV heads: what another TP size can cut out of a block ---------------------------------------------------


@pytest.mark.parametrize("kind, head_bytes, parts", [
    ("cpu", BS * 2 * D * 2, 1),
    ("flash_attn_nhd", 0, 1),  # heads interleave per token: whole blocks only
    ("flash_attn_hnd", BS * D * 2, 1),
    ("flashinfer_nhd", 0, 2),
    ("flashinfer_hnd", BS * D * 2, 2),
    ("mla", 0, 1),
    ("mla_cpu", 0, 1),
])
def test_heads_and_whether_a_head_range_is_one_byte_range(kind, head_bytes, parts):
    t = next(iter(_views(kind, 1, True, False).values()))
    lay = block_layout(t.shape, t.stride(), t.element_size(), mla=kind.startswith("mla"))
    assert (lay.heads, lay.head_bytes, lay.parts) == (0 if kind.startswith("mla") else H, head_bytes, parts)
    if parts == 2:
        assert lay.part_stride == H * BS * D * 2  # V after every head's K


@pytest.mark.parametrize("alloc, perm", [((NB, 4, BS, 2 * D), None), ((2, NB, 4, BS, D), (0, 1, 3, 2, 4)),
                                         ((2, NB, BS, 4, D), None), ((NB, 2, 4, BS, D), (0, 1, 3, 2, 4))])
def test_the_layout_compared_across_ranks_does_not_depend_on_their_head_count(alloc, perm):
    """TP shards heads: ranks of one model holding 4, 2 or 1 heads describe one layout."""
    descs = set()
    for h in (4, 2, 1):
        shape = tuple(h if n == 4 else n for n in alloc)
        t = torch.zeros(shape)
        t = t.permute(*perm) if perm else t
        descs.add(block_layout(t.shape, t.stride(), 4).desc)
    assert len(descs) == 1
