"""Different TP and PP on prefill and decode: every decode rank pulls exactly the KV heads and layers it owns,
from the prefill ranks that hold them (kvlink.vllm.shard), and nothing else.

Pure tests of the mapping, then synthetic engines: every rank a real KVLinkWorker with its own real TCP
transport engine and port, paired through a real bootstrap server, each rank's cache holding its shard
(heads of its TP rank, layers of its PP stage) of one model-wide KV tensor with distinct values. After a
pull, decode's blocks must equal the model-wide tensor's slice for that rank, and no other block changes.
"""

from __future__ import annotations

import logging
import time

import pytest

from kvlink.vllm.shard import MappingError, RankView, Slice, head_slices, heads_of, plan_legs, route_layers
from tests.vllm.helpers import pull_outcome, submit_pull, wait_for

torch = pytest.importorskip("torch")


# ----- the mapping, as pure functions ------------------------------------------------------------------------


def test_heads_split_and_replicate_as_vllm_shards_them():
    assert [list(heads_of(r, 2, 8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(heads_of(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]  # replicated over 2 ranks
    with pytest.raises(MappingError, match="cannot be split over TP=4"):
        heads_of(0, 4, 6)
    with pytest.raises(MappingError, match="cannot be replicated over TP=3"):
        heads_of(0, 3, 2)


@pytest.mark.parametrize("tp_d, tp_p, total, want", [
    (1, 1, 4, [[Slice(0, 0, 0, 4, True)]]),
    (2, 1, 4, [[Slice(0, 0, 0, 2, False)], [Slice(0, 0, 2, 2, False)]]),  # decode reads half of each block
    (1, 2, 4, [[Slice(0, 0, 0, 2, False), Slice(1, 2, 0, 2, False)]]),  # two prefill ranks, half each
    (2, 4, 4, [[Slice(0, 0, 0, 1, False), Slice(1, 1, 0, 1, False)],
               [Slice(2, 0, 0, 1, False), Slice(3, 1, 0, 1, False)]]),
    (4, 2, 4, [[Slice(0, 0, 0, 1, False)], [Slice(0, 0, 1, 1, False)], [Slice(1, 0, 0, 1, False)],
               [Slice(1, 0, 1, 1, False)]]),
    # 2 heads over prefill TP=4 (each replicated twice): decode TP=1 reads each head once, from one replica
    (1, 4, 2, [[Slice(0, 0, 0, 1, False), Slice(2, 1, 0, 1, False)]]),
    # ... and decode TP=2 holds one head per rank, which two prefill ranks hold whole: the reads spread
    (2, 4, 2, [[Slice(0, 0, 0, 1, True)], [Slice(3, 0, 0, 1, True)]]),
    (4, 2, 2, [[Slice(0, 0, 0, 1, True)], [Slice(0, 0, 0, 1, True)], [Slice(1, 0, 0, 1, True)],
               [Slice(1, 0, 0, 1, True)]]),
    (2, 3, 6, [[Slice(0, 0, 0, 2, False), Slice(1, 2, 0, 1, False)],  # neither divides: still exact
               [Slice(1, 0, 1, 1, False), Slice(2, 1, 0, 2, False)]]),
    (2, 1, 0, [[Slice(0, 0, 0, 0, True)], [Slice(0, 0, 0, 0, True)]]),  # MLA: the latent, once, whole
    (1, 2, 0, [[Slice(0, 0, 0, 0, True)]]),
])
def test_each_decode_rank_reads_each_of_its_heads_once(tp_d, tp_p, total, want):
    assert [head_slices(r, tp_d, tp_p, total) for r in range(tp_d)] == want
    if total:
        for r in range(tp_d):  # every head decode holds, from a prefill rank that holds it, exactly once
            got = [(s.local_first + i, s.remote_tp, s.remote_first + i) for s in want[r] for i in range(s.count)]
            assert [g[0] for g in got] == list(range(len(heads_of(r, tp_d, total))))
            for local, j, remote in got:
                assert heads_of(r, tp_d, total)[local] == heads_of(j, tp_p, total)[remote]


def test_layers_are_routed_to_the_stage_that_holds_them():
    stages = {0: ("l0", "l1"), 1: ("l2",), 2: ("l3", "l4")}
    assert route_layers(("l1", "l2", "l3"), stages) == {"l1": 0, "l2": 1, "l3": 2}
    with pytest.raises(MappingError, match=r"no prefill PP stage holds layer\(s\) \['l9'\]"):
        route_layers(("l0", "l9"), stages)
    with pytest.raises(MappingError, match="registered by prefill PP stages 0 and 1"):
        route_layers(("l0",), {0: ("l0",), 1: ("l0",)})


def test_legs_one_per_remote_rank_and_refusals():
    names = tuple(f"l{i}" for i in range(5))
    pre = [RankView(t, 2, s, 2, names[:3] if s == 0 else names[3:]) for t in range(2) for s in range(2)]
    legs = plan_legs(RankView(0, 1, 0, 1, names), pre, 4)
    assert [(g.remote_tp, g.remote_pp, g.layers) for g in legs] == [
        (0, 0, names[:3]), (0, 1, names[3:]), (1, 0, names[:3]), (1, 1, names[3:])]
    with pytest.raises(MappingError, match=r"prefill rank tp1 pp1 \(of TP=2, PP=2\) is not registered"):
        plan_legs(RankView(0, 1, 0, 1, names), pre[:3], 4)
    with pytest.raises(MappingError, match="disagree"):
        plan_legs(RankView(0, 1, 0, 1, names), [*pre[:3], RankView(1, 2, 1, 3, names[3:])], 4)
    with pytest.raises(MappingError, match="no registered ranks"):
        plan_legs(RankView(0, 1, 0, 1, names), [], 4)


def _reg(tp_rank, tp_size, layers, block_bytes, dp_rank=0, compat_hash="h", compat=None, group=0, protocol=None,
         scales=None, layout=None, head_scales=None):
    from kvlink.bootstrap import EngineRegistration, KVLayerSpec
    from kvlink.vllm.compat import PROTOCOL_VERSION

    layout = layout or _local(0, 1).layout.desc  # (the description names no head count)
    return EngineRegistration(
        engine_id="pre", dp_rank=dp_rank, dp_size=2, tp_rank=tp_rank, tp_size=tp_size,
        transport_addr="127.0.0.1:9", protocol_version=protocol or PROTOCOL_VERSION, compat_hash=compat_hash,
        compat={"protocol_version": PROTOCOL_VERSION} if compat is None else compat,
        layers=[KVLayerSpec(name=n, region_id=1, block_bytes=block_bytes, num_blocks=8, tokens_per_block=16,
                            dtype="bfloat16", layout=layout, group=group,
                            **(dict(zip(("k_scale", "v_scale"), scales[n])) if scales else {}),
                            **(dict(zip(("k_head_scales", "v_head_scales"), head_scales[n])) if head_scales else {}))
                for n in layers])


def _local(tp_rank, tp_size, heads_per_rank=2):
    from kvlink.vllm.compat import PROTOCOL_VERSION
    from kvlink.vllm.contact import LocalKV
    from kvlink.vllm.layout import block_layout

    lay = block_layout((8, heads_per_rank, 16, 64), (heads_per_rank * 1024, 1024, 64, 1), 2)
    return LocalKV(tp_rank, tp_size, 0, 1, ("a", "b"), lay, {"a": lay.geometry(), "b": lay.geometry(lay.span)},
                   heads_per_rank * tp_size, {"protocol_version": PROTOCOL_VERSION}, "h", {"a": 0, "b": 0})


def test_first_contact_maps_head_ranges_and_refuses_what_does_not_fit():
    from kvlink.vllm.contact import PullFailed, legs_for

    per_head = 16 * 64 * 2
    # decode TP=2 (2 heads a rank) from prefill TP=1 (4 heads): rank 1 reads heads 2-3 of each block
    [(reg, maps)] = legs_for("pre", [_reg(0, 1, "ab", 4 * per_head)], _local(1, 2))
    assert [m.name for m in maps] == ["a", "b"]
    assert (maps[0].remote.offset, maps[0].local.offset, maps[0].segment_bytes) == (2 * per_head, 0, 2 * per_head)
    assert maps[0].remote.block_stride == 4 * per_head and maps[0].local.block_stride == 2 * per_head
    with pytest.raises(PullFailed, match="has 4096 B blocks in layer a; its 4 head") as e:
        legs_for("pre", [_reg(0, 1, "ab", 4096)], _local(1, 2))
    assert e.value.reason == "block_bytes"
    with pytest.raises(PullFailed, match="several DP ranks") as e:
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head), _reg(0, 1, "ab", 4 * per_head, dp_rank=1)], _local(0, 2))
    with pytest.raises(PullFailed, match=r"cannot serve decode tp0/2 pp0/1: no prefill PP stage holds") as e:
        legs_for("pre", [_reg(0, 1, "a", 4 * per_head)], _local(0, 2))
    assert e.value.reason == "mapping"
    with pytest.raises(PullFailed, match="compat mismatch") as e:  # another hash, the same fields
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head, compat_hash="other")], _local(0, 2))
    assert e.value.reason == "compat_hash"
    with pytest.raises(PullFailed) as e:  # an older kvlink: no fields, another protocol
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head, compat_hash="other", compat={}, protocol=2)], _local(0, 2))
    assert e.value.reason == "protocol_version" and "prefill sent no compat fields" in e.value.detail
    # every rank is checked: a stale rank of an earlier process with other fields is refused
    stale = _reg(1, 2, "ab", 2 * per_head, compat_hash="old", compat={"protocol_version": 3, "kv_dtype": "f16"})
    with pytest.raises(PullFailed) as e:
        legs_for("pre", [_reg(0, 2, "ab", 2 * per_head), stale], _local(0, 1, heads_per_rank=4))
    assert e.value.reason == "kv_dtype"
    # a layer prefill keeps in another KV cache group: its block ids name other blocks
    with pytest.raises(PullFailed, match="has layer a in KV cache group 1, this engine in group 0") as e:
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head, group=1)], _local(0, 2))
    assert e.value.reason == "groups"
    # a Mamba group's state shapes are per rank: at another TP the groups differ, refused as a mapping
    import dataclasses

    from kvlink.vllm.compat import PROTOCOL_VERSION
    mamba = dataclasses.replace(_local(0, 2), compat={"protocol_version": PROTOCOL_VERSION,
                                                      "groups": "MambaSpec:state:3x768/bfloat16|FullAttentionSpec:16"})
    other = {"protocol_version": PROTOCOL_VERSION, "groups": "MambaSpec:state:3x1536/bfloat16|FullAttentionSpec:16"}
    with pytest.raises(PullFailed) as e:
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head, compat_hash="other", compat=other)], mamba)
    assert e.value.reason == "mapping" and "moves between equal TP only" in e.value.detail
    with pytest.raises(PullFailed) as e:  # at equal TP the same difference is another state: "groups"
        legs_for("pre", [_reg(0, 2, "ab", 2 * per_head, compat_hash="other", compat=other)], mamba)
    assert e.value.reason == "groups"
    # a layer laid out otherwise (the compat hash has the attention layout only; each layer read is compared)
    with pytest.raises(PullFailed, match="lays layer a out as state:64:x, this engine as blocks:") as e:
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head, layout="state:64:x")], _local(0, 2))
    assert e.value.reason == "layout"


# ----- synthetic engines through real transport and bootstrap -------------------------------------------------

BS, D, LAYERS = 16, 32, 5
# Per kind: the allocation of one rank's layer for ``h`` heads and ``nb`` blocks, the dimension of the
# heads in it (None: MLA's latent) and how the backend views it.
KINDS = {
    "cpu": (lambda nb, h: (nb, h, BS, 2 * D), 1, None),
    "flash_attn_hnd": (lambda nb, h: (2, nb, h, BS, D), 2, (0, 1, 3, 2, 4)),
    "flash_attn_nhd": (lambda nb, h: (2, nb, BS, h, D), 3, None),
    "flashinfer_hnd": (lambda nb, h: (nb, 2, h, BS, D), 2, (0, 1, 3, 2, 4)),
    "mla": (lambda nb, h: (nb, BS, 64), None, None),
    "mla_cpu": (lambda nb, h: (nb, 1, BS, 64), None, None),
}


class Model:
    """One model's KV, all heads and all layers, with distinct values; ranks hold shards of it."""

    def __init__(self, kind: str, heads: int, nb: int, seed: int):
        alloc, self.hdim, self.perm = KINDS[kind]
        self.kind, self.heads, self.nb = kind, heads, nb
        gen = torch.Generator().manual_seed(seed)
        self.layers = [torch.randn(*alloc(nb, heads), generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]

    def shard(self, layer: int, tp_rank: int, tp_size: int) -> torch.Tensor:
        """What TP rank ``tp_rank`` holds of ``layer`` (a fresh allocation, viewed as the backend does)."""
        t = self.layers[layer]
        if self.hdim is not None:
            hs = heads_of(tp_rank, tp_size, self.heads)
            t = t.narrow(self.hdim, hs.start, len(hs))
        t = t.contiguous().clone()  # a rank's own memory: never a view of the model-wide tensor
        return t.permute(*self.perm) if self.perm else t

    def block(self, t: torch.Tensor, b: int) -> torch.Tensor:
        return t[:, b] if self.kind.startswith("flash_attn") else t[b]


def _stages(split: list[int]) -> list[list[int]]:
    """Layer indices of each PP stage for a split like [2, 3]."""
    out, i = [], 0
    for n in split:
        out.append(list(range(i, i + n)))
        i += n
    assert i == LAYERS
    return out


def _engine(name, role, model, tp, split, cfg, heads_total, groups=None):
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    mla = model.hdim is None
    ranks = []
    for s, layers in enumerate(_stages(split)):
        for t in range(tp):
            w = KVLinkWorker(cfg, RankInfo(name, t, tp, 0, 1, "m", pp_rank=s, pp_size=len(split),
                                           kv_heads=0 if mla else heads_total, mla=mla, num_layers=LAYERS), role,
                             layer_groups=groups)
            w.register_kv_caches({f"model.layers.{i}.attn": model.shard(i, t, tp) for i in layers})
            ranks.append((t, s, layers, w))
    return ranks


@pytest.fixture
def boot():
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    yield srv.url
    srv.stop()


PAIRS = [(1, 4), (2, 5), (3, 6), (6, 1)]  # decode block <- prefill block: a run, then a lone block


def _pd(boot, kind, heads, tp_p, split_p, tp_d, split_d, *, staging_p="never", staging_d="never"):
    """Prefill and decode engines of one model; every decode rank pulls request r; returns both, for checks."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig

    truth = Model(kind, heads, 12, seed=11)
    blank = Model(kind, heads, 8, seed=12)  # decode's own cache: other values, fewer blocks
    pre = _engine("pre", "kv_producer", truth, tp_p, split_p,
                  ConnectorConfig(transport_backend="tcp", staging=staging_p, staging_pool_mb=4), heads)
    dec = _engine("dec", "kv_consumer", blank, tp_d, split_d,
                  ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0, staging=staging_d,
                                  staging_pool_mb=4), heads)
    if staging_p != "never":  # prefill stages its blocks; they sit in slots 1.. of its pool
        for *_, w in pre:
            w._stage([("p-r", tuple(rb for _, rb in PAIRS), tuple(range(1, len(PAIRS) + 1)))])
            deadline = time.monotonic() + 20
            while not w._staged_done() and time.monotonic() < deadline:
                time.sleep(0.005)
    for *_, w in pre:
        w._ensure_registered(boot)
    remote = [rb for _, rb in PAIRS] if staging_p == "never" else list(range(1, len(PAIRS) + 1))
    with BootstrapClient(boot) as cli:
        cli.publish("pre", "p-r", [remote], num_tokens=BS * len(PAIRS), lease_s=30.0)
    for *_, w in dec:
        submit_pull(w, boot, "r", [(lb, rb) for (lb, _), rb in zip(PAIRS, remote)])
    return truth, blank, pre, dec


def _close(*engines):
    for ranks in engines:
        for *_, w in ranks:
            w.shutdown()


def _check_landed(truth, blank, dec, tp_d):
    for t, s, layers, w in dec:
        assert pull_outcome(w, "r") == "ok", (t, s)
        for i in layers:
            name = f"model.layers.{i}.attn"
            got, want, before = w.kv_caches[name], truth.shard(i, t, tp_d), blank.shard(i, t, tp_d)
            for lb, rb in PAIRS:
                assert torch.equal(truth.block(got, lb), truth.block(want, rb)), (t, s, name, lb)
            for b in set(range(blank.nb)) - {lb for lb, _ in PAIRS}:
                assert torch.equal(truth.block(got, b), truth.block(before, b)), f"{name}: block {b} was written"


@pytest.mark.parametrize("kind", ["cpu", "flash_attn_hnd", "flashinfer_hnd"])
@pytest.mark.parametrize("tp_p, tp_d, heads", [(1, 2, 4), (2, 1, 4), (4, 2, 4), (2, 4, 4), (4, 2, 2), (1, 4, 2)])
def test_decode_ranks_pull_exactly_their_heads(boot, kind, tp_p, tp_d, heads):
    truth, blank, pre, dec = _pd(boot, kind, heads, tp_p, [LAYERS], tp_d, [LAYERS])
    try:
        _check_landed(truth, blank, dec, tp_d)
        per_head = dec[0][3].block_bytes // dec[0][3].layout.heads
        for t, _, layers, w in dec:
            stats = w.get_stats().data
            # each rank read its heads once: bytes = pairs x layers x its heads, whatever prefill's TP
            assert stats["bytes_pulled"] == len(PAIRS) * len(layers) * per_head * len(heads_of(t, tp_d, heads))
            # one READ leg per distinct head set decode needs: a replicated head is read from one replica
            mine = set(heads_of(t, tp_d, heads))
            sets = {tuple(heads_of(j, tp_p, heads)) for j in range(tp_p) if mine & set(heads_of(j, tp_p, heads))}
            assert len(w._remotes[(boot, "pre")].legs) == len(sets)
    finally:
        _close(pre, dec)


@pytest.mark.parametrize("kind", ["mla", "mla_cpu"])
@pytest.mark.parametrize("tp_p, tp_d", [(1, 2), (2, 1), (4, 2), (2, 4)])
def test_mla_latent_is_read_once_from_one_prefill_rank(boot, kind, tp_p, tp_d):
    truth, blank, pre, dec = _pd(boot, kind, 0, tp_p, [LAYERS], tp_d, [LAYERS])
    try:
        _check_landed(truth, blank, dec, tp_d)
        for t, _, layers, w in dec:
            assert [leg.tp_rank for leg in w._remotes[(boot, "pre")].legs] == [t % tp_p]
            assert w.get_stats().data["bytes_pulled"] == len(PAIRS) * len(layers) * w.block_bytes
    finally:
        _close(pre, dec)


@pytest.mark.parametrize("split_p, split_d, tp_p, tp_d", [
    ([2, 3], [LAYERS], 1, 1),  # 2 prefill stages, uneven, into one decode stage
    ([1, 3, 1], [LAYERS], 1, 1),  # 3 stages
    ([1, 3, 1], [3, 2], 1, 1),  # decode split differently: its stage 0 reads from prefill stages 0 and 1
    ([LAYERS], [2, 3], 1, 1),  # PP on decode only
    ([3, 2], [2, 3], 2, 1),  # PP on both sides and different TP
])
def test_pipeline_stages_route_each_layer_to_its_owner(boot, split_p, split_d, tp_p, tp_d):
    truth, blank, pre, dec = _pd(boot, "cpu", 4, tp_p, split_p, tp_d, split_d)
    try:
        _check_landed(truth, blank, dec, tp_d)
        owner = {i: s for s, layers in enumerate(_stages(split_p)) for i in layers}
        for t, s, layers, w in dec:
            legs = w._remotes[(boot, "pre")].legs
            for leg in legs:  # every layer read from the stage that holds it, one leg per remote rank
                assert {owner[int(m.name.split(".")[2])] for m in leg.layers} == {leg.pp_rank}
            assert len({(g.tp_rank, g.pp_rank) for g in legs}) == len(legs)
            names = [m.name for g in legs for m in g.layers]  # each layer once per prefill TP rank read
            assert sorted(names) == sorted(f"model.layers.{i}.attn" for i in layers
                                           for _ in range(len({g.tp_rank for g in legs})))
    finally:
        _close(pre, dec)


@pytest.mark.parametrize("staging_p, staging_d", [("always", "never"), ("never", "always"), ("always", "always")])
def test_unequal_tp_with_host_staging(boot, staging_p, staging_d):
    truth, blank, pre, dec = _pd(boot, "flash_attn_hnd", 4, 2, [2, 3], 4, [LAYERS], staging_p=staging_p,
                                 staging_d=staging_d)
    try:
        _check_landed(truth, blank, dec, 4)
    finally:
        _close(pre, dec)


def test_nhd_cannot_be_cut_by_heads_and_is_refused_naming_why(boot, caplog):
    truth, blank, pre, dec = _pd(boot, "flash_attn_nhd", 4, 1, [LAYERS], 2, [LAYERS])
    try:
        with caplog.at_level(logging.WARNING, logger="kvlink"):
            for *_, w in dec:
                assert pull_outcome(w, "r") == "failed"
                assert w.take_load_error_blocks() == {lb for lb, _ in PAIRS}
                assert not w._remotes
            # the puller logs why just after it records the failure (outside its lock): wait for the line
            assert wait_for(lambda: "heads are not outermost in a block (NHD)" in caplog.text, 10.0), caplog.text
        assert "run equal TP or a heads-outermost (HND) layout" in caplog.text
        for t, _, layers, w in dec:  # nothing written
            for i in layers:
                assert torch.equal(w.kv_caches[f"model.layers.{i}.attn"], blank.shard(i, t, 2))
    finally:
        _close(pre, dec)


def test_nhd_at_equal_tp_moves_whole_blocks(boot):
    truth, blank, pre, dec = _pd(boot, "flash_attn_nhd", 4, 2, [LAYERS], 2, [LAYERS])
    try:
        _check_landed(truth, blank, dec, 2)
    finally:
        _close(pre, dec)


def test_a_stage_that_never_registered_is_refused_naming_it(boot, caplog):
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig

    pre = _engine("pre", "kv_producer", Model("cpu", 4, 12, seed=3), 1, [2, 3],
                  ConnectorConfig(transport_backend="tcp"), 4)
    dec = _engine("dec", "kv_consumer", Model("cpu", 4, 8, seed=4), 1, [LAYERS],
                  ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0), 4)
    try:
        pre[0][3]._ensure_registered(boot)  # stage 1 never registers
        with BootstrapClient(boot) as cli:
            cli.publish("pre", "p-q", [[4]], num_tokens=BS, lease_s=30.0)
        with caplog.at_level(logging.WARNING, logger="kvlink"):
            submit_pull(dec[0][3], boot, "q", [(1, 4)])
            assert pull_outcome(dec[0][3], "q") == "failed"
            assert wait_for(lambda: "prefill rank tp0 pp1 (of TP=1, PP=2) is not registered" in caplog.text,
                            10.0), caplog.text  # logged just after the failure is recorded
        assert not dec[0][3]._remotes
    finally:
        _close(pre, dec)


def test_hybrid_groups_across_unequal_tp_and_pp(boot):
    """Two KV cache groups with their own block ids (layers 0, 2 in group 0; 1, 3, 4 in group 1), prefill
    TP=2 in stages [2, 3], decode TP=1 in stages [4, 1]: decode's second stage holds no layer of group 0,
    and every group's blocks land in that group's layers only."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.metadata import GroupTable, PullSpec
    from kvlink.vllm.params import RemoteSource

    groups = {f"model.layers.{i}.attn": (0 if i in (0, 2) else 1) for i in range(LAYERS)}
    truth, blank = Model("cpu", 4, 12, seed=21), Model("cpu", 4, 8, seed=22)
    pre = _engine("pre", "kv_producer", truth, 2, [2, 3], ConnectorConfig(transport_backend="tcp"), 4, groups)
    dec = _engine("dec", "kv_consumer", blank, 1, [4, 1],
                  ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0), 4, groups)
    pairs = {0: [(1, 4), (2, 5)], 1: [(3, 9), (5, 2), (6, 3)]}  # per group: decode block <- prefill block
    try:
        for *_, w in pre:
            w._ensure_registered(boot)
        remote = tuple(tuple(rb for _, rb in pairs[g]) for g in (0, 1))
        with BootstrapClient(boot) as cli:
            cli.publish("pre", "p-h", [list(r) for r in remote], num_tokens=3 * BS, lease_s=30.0)
        for *_, w in dec:
            src = RemoteSource(bootstrap_url=boot, engine_id="pre", request_id="p-h", block_ids=remote, lease_s=30.0)
            w._submit(PullSpec("h", tuple(lb for lb, _ in pairs[0]), 0, src,
                               others=(GroupTable(1, tuple(lb for lb, _ in pairs[1]), 0),)))
        for t, s, layers, w in dec:
            assert pull_outcome(w, "h") == "ok", s
            for i in layers:
                name = f"model.layers.{i}.attn"
                g = groups[name]
                got, want, before = w.kv_caches[name], truth.shard(i, t, 1), blank.shard(i, t, 1)
                for lb, rb in pairs[g]:
                    assert torch.equal(got[lb], want[rb]), (name, lb)
                for b in set(range(blank.nb)) - {lb for lb, _ in pairs[g]}:  # the other group's ids untouched
                    assert torch.equal(got[b], before[b]), f"{name}: block {b} was written"
            moved = sum(len(pairs[groups[f"model.layers.{i}.attn"]]) for i in layers)
            assert w.get_stats().data["blocks_pulled"] == moved
    finally:
        _close(pre, dec)


def _pull_lands_after_one_failed_call(boot, monkeypatch, error: Exception) -> list:
    """A pull whose first call for the prefill engine's ranks fails with ``error`` lands all the same (decode
    asked again); the calls made."""
    from kvlink.bootstrap import BootstrapClient
    from tests.fakes import failing_once

    flaky, calls = failing_once(BootstrapClient.engine_ranks, error)
    monkeypatch.setattr(BootstrapClient, "engine_ranks", flaky)
    truth, blank, pre, dec = _pd(boot, "cpu", 4, 1, [LAYERS], 1, [LAYERS])
    try:
        _check_landed(truth, blank, dec, 1)
        assert len(calls) == 2
    finally:
        _close(pre, dec)
    return calls


def test_a_bootstrap_server_busy_with_long_polls_is_asked_again_later(boot, monkeypatch):
    """429 too_many_waiters is back-pressure, not a failure: decode asks again after a jittered pause instead
    of computing the prompt itself (it did, at once, until session 28)."""
    from kvlink.bootstrap import TooManyWaiters

    _pull_lands_after_one_failed_call(boot, monkeypatch, TooManyWaiters("the server already holds 3072 long polls"))


def test_a_bootstrap_call_that_timed_out_is_asked_again(boot, monkeypatch):
    """A bootstrap server that stalls once (seen: 5 s in a loaded CI run) costs decode a retry, not a recompute;
    one that never answers fails the pull after three tries, well before its deadline."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.bootstrap.errors import BootstrapUnavailable

    calls = _pull_lands_after_one_failed_call(
        boot, monkeypatch, BootstrapUnavailable("bootstrap server unavailable for /v1/engine/ranks: timed out"))

    def dead(self, engine_id):
        calls.append(engine_id)
        raise BootstrapUnavailable("bootstrap server unavailable for /v1/engine/ranks: timed out")

    monkeypatch.setattr(BootstrapClient, "engine_ranks", dead)
    calls.clear()
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    fresh = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()  # (request p-r ended at the first)
    t0 = time.monotonic()
    truth, blank, pre, dec = _pd(fresh.url, "cpu", 4, 1, [LAYERS], 1, [LAYERS])
    try:
        assert pull_outcome(dec[0][3], "r") == "failed"
        assert len(calls) == 3 and time.monotonic() - t0 < 20  # the pull's deadline is 30 s
    finally:
        _close(pre, dec)
        fresh.stop()


def test_first_contact_refuses_fp8_layers_whose_scales_differ_naming_the_layer():
    """fp8 bytes are value / scale: read with other scales they decode to other values (tests/vllm/test_fp8.py
    shows the wrong tokens). Every layer decode reads must carry prefill's scales equal to its own."""
    import dataclasses

    from kvlink.vllm.contact import PullFailed, legs_for

    per_head = 16 * 64 * 2
    local = dataclasses.replace(_local(0, 1, heads_per_rank=4), scales={"a": (0.5, 0.25), "b": (1.0, 2.0)})
    same = {"a": (0.5, 0.25), "b": (1.0, 2.0)}
    [(_, maps)] = legs_for("pre", [_reg(0, 1, "ab", 4 * per_head, scales=same)], local)
    assert [m.name for m in maps] == ["a", "b"]
    with pytest.raises(PullFailed, match=r"K/V scales 1.0/2.5 in layer b, this engine 1.0/2.0") as e:
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head, scales={"a": (0.5, 0.25), "b": (1.0, 2.5)})], local)
    assert e.value.reason == "kv_scales"
    with pytest.raises(PullFailed, match="scales None/None in layer a") as e:  # a prefill that sent none
        legs_for("pre", [_reg(0, 1, "ab", 4 * per_head)], local)
    assert e.value.reason == "kv_scales"
    legs_for("pre", [_reg(0, 1, "ab", 4 * per_head)], _local(0, 1, heads_per_rank=4))  # not fp8: no scales


def test_first_contact_compares_the_per_head_scales_of_the_heads_it_reads():
    """Per-head scales (compressed-tensors' attention-head strategy): vLLM's scalar scale is their maximum,
    so another checkpoint whose other heads differ passes the scalar check, and kernels that scale per head
    decode those heads' bytes otherwise. The heads a leg reads must carry decode's scales, at equal TP and
    where decode reads a head range of a larger prefill rank."""
    import dataclasses

    from kvlink.vllm.contact import PullFailed, legs_for

    per_head = 16 * 64 * 2
    mine = (0.5, 0.25, 1.0, 0.75)
    scalar = {"a": (1.0, 2.0), "b": (1.0, 2.0)}
    local = dataclasses.replace(_local(0, 1, heads_per_rank=4), scales=scalar,
                                head_scales={"a": (mine, ()), "b": (mine, ())})

    def reg(k_heads, tp_size=1, heads=4):
        return _reg(0, tp_size, "ab", heads * per_head, scales=scalar,
                    head_scales={n: (list(k_heads) if k_heads else None, None) for n in "ab"})

    assert len(legs_for("pre", [reg(mine)], local)) == 1
    with pytest.raises(PullFailed, match=r"K scales \[0.25, 0.5, 1.0, 0.75\] in layer a for the heads this engine "
                                         r"reads, this engine \[0.5, 0.25, 1.0, 0.75\]") as e:
        legs_for("pre", [reg((0.25, 0.5, 1.0, 0.75))], local)  # the same maximum: the scalar check passes
    assert e.value.reason == "kv_scales"
    with pytest.raises(PullFailed, match=r"K scales \[1.0, 1.0, 1.0, 1.0\]"):  # one scale for every head there
        legs_for("pre", [reg(None)], local)
    with pytest.raises(PullFailed, match=r"this engine \[1.0, 1.0, 1.0, 1.0\]"):  # and here
        legs_for("pre", [reg(mine)], dataclasses.replace(local, head_scales=None))
    # decode TP=2, rank 1 (heads 2-3) from prefill TP=1: only the heads it reads are compared
    upper = dataclasses.replace(_local(1, 2), scales=scalar, head_scales={n: ((1.0, 0.75), ()) for n in "ab"})
    assert len(legs_for("pre", [reg(mine)], upper)) == 1
    with pytest.raises(PullFailed, match=r"K scales \[0.75, 1.0\] in layer a"):
        legs_for("pre", [reg((0.5, 0.25, 0.75, 1.0))], upper)


def test_kv_scales_are_read_from_each_attention_module_or_refused():
    from types import SimpleNamespace

    from kvlink.vllm.compat import kv_scales

    ctx = {"a": SimpleNamespace(_k_scale_float=0.5, _v_scale_float=2), "b": SimpleNamespace()}
    assert kv_scales(ctx, ["a"]) == {"a": (0.5, 2.0)}
    with pytest.raises(RuntimeError, match="quantized KV cache layer b has no K/V scales"):
        kv_scales(ctx, ["a", "b"])
    with pytest.raises(RuntimeError, match="layer c"):
        kv_scales(ctx, ["c"])
    # scales an engine computes at its first forward (vLLM before 0.32: --calculate-kv-scales) are 1.0 here
    # on both sides and differ in the bytes: refused, naming why
    ctx["d"] = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, calculate_kv_scales=True)
    with pytest.raises(RuntimeError, match="layer d computes its K/V scales at the engine's first forward"):
        kv_scales(ctx, ["a", "d"])
    ctx["d"].calculate_kv_scales = False  # computed already (by a run before registration): compared as they are
    assert kv_scales(ctx, ["d"]) == {"d": (1.0, 1.0)}


def test_per_head_scales_are_read_in_the_ranks_head_order():
    from types import SimpleNamespace

    from kvlink.vllm.compat import kv_head_scales

    ctx = {"a": SimpleNamespace(_k_scale=torch.tensor([0.5, 0.25]), _v_scale=torch.tensor(2.0)),
           "b": SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0)), "c": SimpleNamespace()}
    assert kv_head_scales(ctx, ["a", "b", "c"]) == {"a": ((0.5, 0.25), ())}


@pytest.mark.parametrize("tp_p, split_p, tp_d, split_d", [
    (2, [LAYERS], 1, [LAYERS]),  # decode reads each head from the prefill rank that computed it
    (1, [LAYERS], 2, [LAYERS]),
    (2, [2, 3], 4, [3, 2]),  # PP on both sides, unequal TP
])
def test_streamed_pieces_are_read_once_every_prefill_rank_reported_them(boot, tp_p, split_p, tp_d, split_d):
    """Streaming with TP/PP > 1: a piece (the first blocks of a request prefill still computes) is readable
    only once every prefill rank (TP x PP) reported it: before, a rank may not have written its heads or
    layers. Then each decode rank reads its shard of the streamed blocks, the record brings the tail, and
    exactly its shard lands."""
    import uuid

    from kvlink.bootstrap import BootstrapClient
    from kvlink.bootstrap.schema import StreamPiece
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    heads = 4
    truth, blank = Model("cpu", heads, 12, seed=11), Model("cpu", heads, 8, seed=12)
    pre = _engine("pre", "kv_producer", truth, tp_p, split_p, ConnectorConfig(transport_backend="tcp"), heads)
    dec = _engine("dec", "kv_consumer", blank, tp_d, split_d,
                  ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0, lookup_wait_s=20.0), heads)
    try:
        for *_, w in pre:
            w._ensure_registered(boot)
        tid, remote = "t-" + uuid.uuid4().hex, [rb for _, rb in PAIRS]
        for *_, w in dec:
            w._submit(PullSpec(request_id="r", local_block_ids=tuple(lb for lb, _ in PAIRS), first_block=0,
                               source=RemoteSource(bootstrap_url=boot, engine_id="pre", transfer_id=tid)))

        seen = [0] * len(dec)

        def streamed():  # (get_stats hands over what was counted since the last call)
            for i, (*_, w) in enumerate(dec):
                seen[i] += ((st := w.get_stats()) and st.data.get("blocks_streamed", 0)) or 0
            return seen

        piece = StreamPiece(transfer_id=tid, request_id="p-r", index=1, num_tokens=BS * 2, block_ids=[remote[:2]])
        with BootstrapClient(boot) as cli:
            for t, s, _, w in pre[:-1]:
                cli.stream_pieces("pre", w.rank.index, len(pre), [piece])
            time.sleep(0.5)
            assert not any(streamed()), "read before every prefill rank reported the piece"
            cli.stream_pieces("pre", pre[-1][3].rank.index, len(pre), [piece])
            deadline = time.monotonic() + 20
            while not all(streamed()) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert all(streamed()), "a decode rank read nothing of the streamed piece"
            cli.publish("pre", "p-r", [remote], num_tokens=BS * len(PAIRS), lease_s=30.0, transfer_id=tid)
        _check_landed(truth, blank, dec, tp_d)
    finally:
        _close(pre, dec)
