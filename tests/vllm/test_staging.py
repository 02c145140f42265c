"""Host staging (kvlink.vllm.staging, stager.py): the pure pieces, then real KVLinkWorkers over the native TCP
transport and a real bootstrap server, with tensors shaped like each GPU backend's KV cache (on CPU, staging
forced): every pulled block of every layer lands where decode's table says, through prefill's pool, decode's
landing pool, or both."""

from __future__ import annotations

import time

import pytest

from kvlink.vllm.layout import Geometry, block_layout, pool_geometry
from kvlink.vllm.plan import LayerMap, build_plan
from kvlink.vllm.staging import SlotPool, StagePlanner, pool_slots, staging_wanted
from kvlink.vllm.stream import StagedCopies
from tests.fakes import CudaLikeStager
from tests.vllm.helpers import pull_outcome, submit_pull
from tests.vllm.test_layouts import BS, LAYERS, NB, _block, _views
from tests.vllm.test_stream import staged_spec

torch = pytest.importorskip("torch")

KINDS = ["cpu", "flash_attn_nhd", "flash_attn_hnd", "flashinfer_nhd", "flashinfer_hnd", "mla", "mla_cpu"]


# ----- pure ----------------------------------------------------------------------------------------------------


def test_slot_pool_prefers_a_contiguous_run_and_never_hands_out_slot_zero():
    pool = SlotPool(10)
    a, b = pool.allocate(3), pool.allocate(4)
    assert a == (1, 2, 3) and b == (4, 5, 6, 7)
    pool.free(a)
    assert pool.allocate(3) == (1, 2, 3)  # the first run that fits
    pool.free((1, 2, 3))
    assert pool.allocate(5) == (1, 2, 3, 8, 9)  # no run of 5: scattered slots, still 5 of them
    assert pool.in_use == 9 and pool.allocate(2) is None
    with pytest.raises(ValueError, match="not in use"):
        pool.free((10,))
    with pytest.raises(ValueError, match="not in use"):
        pool.free((0,))


def test_pool_slots_reserve_the_null_slot():
    assert pool_slots(1, 1 << 20) == 0
    assert pool_slots(8, 1 << 20) == 7


def test_planner_first_come_first_staged_then_expiry_and_refusal():
    pl = StagePlanner(SlotPool(6), wait_s=10.0)
    assert "needs 7 staging blocks" in pl.admit("huge", tuple(range(1, 8)), 0.0)
    assert pl.admit("a", (0, 11, 12, 13), 0.0) is None  # a null first position (outside a window)
    assert pl.admit("b", (21, 22, 23, 24), 1.0) is None
    assert pl.admit("c", (31,), 2.0) is None
    start, expired = pl.take_jobs(3.0)
    assert [j.request_id for j in start] == ["a"] and not expired
    assert start[0].slots == (1, 2, 3) and start[0].blocks == (11, 12, 13)
    assert pl.counts["staging_pool_full"] == 1  # b waits, and c behind it
    assert pl.device_blocks() == 3 + 4 + 1 and pl.busy()
    job = pl.staged("a")
    assert job.slot_table == (0, 1, 2, 3)  # the null position stays null
    assert pl.device_blocks() == 5 and pl.pool.in_use == 3
    assert pl.take_jobs(4.0) == ([], [])  # still no room for b; counted once
    assert pl.counts["staging_pool_full"] == 1
    assert pl.release("a") and not pl.release("a")
    start, _ = pl.take_jobs(5.0)
    assert [j.request_id for j in start] == ["b", "c"]
    assert pl.admit("d", (41, 42, 43, 44), 5.0) is None
    start, expired = pl.take_jobs(15.0)
    assert start == [] and [j.request_id for j in expired] == ["d"]
    assert pl.counts["staging_expired"] == 1 and pl.counts["staging_refused"] == 1


def test_a_streamed_request_keeps_the_slots_it_streamed_into_and_is_copied_at_once():
    pl = StagePlanner(SlotPool(6), wait_s=10.0)
    assert pl.admit("q", (1, 2, 3), 0.0) is None
    pl.take_jobs(0.0)  # q holds slots 1-3 while it is copied
    assert pl.reserve("s", 2) == (4, 5)
    assert pl.reserve("s", 2) == (4, 5)  # a restart: the same slots
    assert pl.reserve("t", 2) is None and pl.counts["stream_pool_full"] == 1  # no room: t is not streamed
    assert pl.admit("x", (7,), 0.0) is None  # queued: the pool is full of q and s
    assert pl.admit("s", (21, 22), 1.0) is None  # s finishes: its slots are its job's, no wait
    start, _ = pl.take_jobs(1.0)
    assert [(j.request_id, j.slots) for j in start] == [("s", (4, 5)), ("x", (6,))]
    assert pl.staged("s").slot_table == (4, 5) and pl.pool.in_use == 6
    assert pl.release("s") and pl.pool.in_use == 4


def test_a_streamed_request_that_ends_otherwise_gives_its_slots_back_and_one_that_grew_gets_more():
    pl = StagePlanner(SlotPool(6), wait_s=10.0)
    pl.reserve("a", 2)
    pl.unreserve("a")
    pl.unreserve("a")  # idempotent
    assert pl.pool.in_use == 0
    pl.reserve("b", 2)
    assert pl.admit("b", (11, 12, 13), 0.0) is None  # one block more than it streamed into: one more slot
    (job,), _ = pl.take_jobs(0.0)
    assert job.slots[:2] == (1, 2) and len(job.slots) == 3 and pl.pool.in_use == 3
    pl.reserve("c", 3)
    assert pl.admit("c", (21,), 0.0) is None  # fewer: the rest go back
    (job,), _ = pl.take_jobs(0.0)
    assert job.slots == (4,) and pl.pool.in_use == 4
    pl.reserve("d", 2)
    pl.admit("e", (1,), 0.0)
    assert pl.admit("d", (31, 32, 33), 0.0) is None  # cannot grow in place (full): staged from scratch, queued
    assert pl.pool.in_use == 4 and pl.is_staging("d")
    # its pieces named slots that are free now (another request may get them before decode's READs end):
    # the job says so, and the scheduler publishes it at the next epoch (decode reads it all again)
    assert pl._queued["d"].restaged and not job.restaged
    # the streamed slots given back (a unreserved, d restaged; not b and c, staged in theirs) are named once
    assert pl.take_dropped() == ["a", "d"] and pl.take_dropped() == []


def test_staging_decision():
    assert staging_wanted("auto", "cpu", "tcp")[0] is False
    assert staging_wanted("always", "cpu", "tcp")[0] is True
    assert staging_wanted("auto", "cuda", "tcp") == (True, "host staging: kvlink's tcp transport moves host "
                                                            "memory only")
    with pytest.raises(ValueError, match="staging 'never'"):
        staging_wanted("never", "cuda", "same-host")
    with pytest.raises(ValueError, match="CPU or CUDA"):
        staging_wanted("auto", "xpu", "tcp")
    # This machine has the non-CUDA Mooncake build (or none): GPU-direct is impossible and said so.
    staged, why = staging_wanted("auto", "cuda", "mooncake")
    assert staged and ("non-CUDA" in why or "not installed" in why)


def test_plan_between_two_pools_is_one_descriptor_per_layer_per_run_of_slots():
    lay = block_layout((NB, 2, BS, 64), (2 * BS * 64, BS * 64, 64, 1), 2)
    rows, bb = 9, lay.block_bytes  # layer-major pools of 8 slots (+ slot 0)
    layers = [LayerMap(f"l{i}", pool_geometry(lay, i, rows), 9, pool_geometry(lay, i, rows), lay.segments,
                       lay.segment_bytes) for i in range(3)]
    plan = build_plan(layers, [(1, 5), (2, 6), (3, 7), (7, 1)])
    got = list(zip(plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.lengths.tolist()))
    want = []
    for i in range(3):  # each layer: slots 1-3 <- 5-7 in one range, then slot 7 <- 1
        want += [(i * rows * bb + bb, i * rows * bb + 5 * bb, 3 * bb), (i * rows * bb + 7 * bb, i * rows * bb + bb, bb)]
    assert got == want


def test_the_pool_geometry_names_the_bytes_the_stager_copies_each_block_to():
    """What prefill publishes (pool_geometry) and where the stager's copies put a block agree, byte for byte,
    in every layer (a mismatch would have decode read another layer's or slot's bytes)."""
    from kvlink.vllm.stager import Stager

    kv = {f"model.layers.{i}.attn": torch.randint(0, 100, (2, NB, BS, 2, 8), dtype=torch.int16) for i in range(3)}
    first = next(iter(kv.values()))
    lay = block_layout(first.shape, first.stride(), first.element_size())
    st = Stager(kv, lay, 6)
    st.to_pool([5, 2, 7], [3, 4, 1])
    flat = st.pool.view(-1)
    for li, v in enumerate(st.views):
        g = pool_geometry(lay, li, st.slots + 1)
        for block, slot in ((5, 3), (2, 4), (7, 1)):
            for seg in range(lay.segments):
                at = g.offset + slot * g.block_stride + seg * g.segment_stride
                assert torch.equal(flat[at:at + lay.segment_bytes], v[block, seg])
    assert not st.pool[:, [0, 2, 5, 6]].any()  # the null slot and the unused ones


@pytest.mark.parametrize("dims,skip,element", [((2, 8), 0, 8), ((1, 3), 4, 4), ((1, 3), 2, 2), ((1, 3), 1, 1),
                                                   ((2, 8), 12, 4)])
def test_the_stager_copies_as_the_widest_integer_that_fits_and_moves_the_same_bytes(dims, skip, element):
    """Blocks of ``BS x dims`` uint8 (a multiple of 16 bytes), each layer ``skip`` bytes into its storage: the
    stager picks the widest integer dividing every size, stride and address, and a round trip (blocks -> pool -> other blocks) moves
    exactly the bytes a byte-wise stager does, leaving every other block alone."""
    from kvlink.vllm.stager import Stager

    def kv():
        g = torch.Generator().manual_seed(7)
        out = {}
        for i in range(3):
            raw = torch.randint(0, 256, (skip + NB * BS * dims[0] * dims[1],), dtype=torch.uint8, generator=g)
            out[f"model.layers.{i}.attn"] = raw[skip:].view(NB, BS, *dims)
        return out

    wide_kv, narrow_kv = kv(), kv()
    first = next(iter(wide_kv.values()))
    lay = block_layout(first.shape, first.stride(), first.element_size())
    wide, narrow = Stager(wide_kv, lay, 6), Stager(narrow_kv, lay, 6, wide=False)
    assert (wide.element, narrow.element) == (element, 1)
    for st in (wide, narrow):
        st.to_pool([5, 2, 7], [3, 4, 1])
        st.from_pool([3, 4, 1], [0, 1, 6])
    assert torch.equal(wide.pool, narrow.pool) and wide.pool[:, 3].any()
    for w, n in zip(wide_kv.values(), narrow_kv.values()):
        assert torch.equal(w, n)
        assert torch.equal(w[0], w[5]) and torch.equal(w[1], w[2]) and torch.equal(w[6], w[7])


def test_plan_reads_each_side_with_its_own_geometry():
    # Decode: K/V planes of 8 blocks; prefill: a pool. One block of 2 segments of 100 B.
    local = Geometry(1000, 100, 800)
    layers = [LayerMap("l0", local, 3, Geometry(0, 400, 100), 2, 100),
              LayerMap("l1", Geometry(5000, 100, 800), 3, Geometry(200, 400, 100), 2, 100)]
    plan = build_plan(layers, [(2, 1), (3, 2)])
    got = sorted(zip(plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.lengths.tolist()))
    assert got == sorted([(1200, 400, 100), (1300, 800, 100), (2000, 500, 100), (2100, 900, 100),
                          (5200, 600, 100), (5300, 1000, 100), (6000, 700, 100), (6100, 1100, 100)])


# ----- real workers, real transport and bootstrap ---------------------------------------------------------------


@pytest.fixture
def boot():
    from kvlink.bootstrap import BootstrapConfig, BootstrapServer

    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    yield srv.url
    srv.stop()


def _stage(worker, rid: str, blocks: tuple[int, ...], slots: tuple[int, ...], wait_s: float = 10.0) -> None:
    """Hand a prefill worker a staging job as the scheduler would, and step it until it reports the copy."""
    from kvlink.vllm.metadata import KVLinkMetadata

    worker.start_load_kv(KVLinkMetadata(stages=[(rid, blocks, slots)]))
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if rid in worker.transfer_results()[0]:
            return
        time.sleep(0.01)
    raise AssertionError(f"staging of {rid} not reported within {wait_s} s")


@pytest.mark.parametrize("sides", ["prefill", "decode", "both"])
@pytest.mark.parametrize("kind", KINDS)
def test_staged_pull_puts_every_block_of_every_layer_in_place(boot, kind, sides):
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    def cfg(staged: bool):
        return ConnectorConfig(transport_backend="tcp", pull_timeout_s=30.0,
                               staging="always" if staged else "auto", staging_pool_mb=1)

    pre = KVLinkWorker(cfg(sides != "decode"), RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = KVLinkWorker(cfg(sides != "prefill"), RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer")
    try:
        src, dst = _views(kind, LAYERS, True, True, nb=NB + 5), _views(kind, LAYERS, True, False)
        pre.register_kv_caches(src)
        dec.register_kv_caches(dst)
        assert pre.staged == (sides != "decode") and dec.staged == (sides != "prefill")
        pre._ensure_registered(boot)
        pairs = [(1, 4), (2, 5), (3, 6), (6, 1)]
        published = [r for _, r in pairs]
        if pre.staged:
            slots = (7, 8, 9, 2)  # a run, then a lone slot
            _stage(pre, "p-r", tuple(published), slots)
            for name, t in src.items():  # prefill's device blocks are free now: anything may overwrite them
                t.zero_()
            published = list(slots)
        with BootstrapClient(boot) as cli:
            cli.publish("pre", "p-r", [published], num_tokens=BS * len(pairs), lease_s=30.0)
        want = {name: {lb: _block(kind, _views(kind, LAYERS, True, True, nb=NB + 5)[name], rb).clone()
                       for lb, rb in pairs} for name in dst}
        submit_pull(dec, boot, "r", [(lb, p) for (lb, _), p in zip(pairs, published)])
        assert pull_outcome(dec, "r") == "ok"
        for name in dst:
            for lb, _ in pairs:
                assert torch.equal(_block(kind, dst[name], lb), want[name][lb]), (name, lb)
            for b in set(range(NB)) - {lb for lb, _ in pairs}:
                assert not _block(kind, dst[name], b).any(), f"{name}: block {b} was written"
        pstats, dstats = (pre.get_stats() or {}), dec.get_stats().data
        if pre.staged:
            assert pstats.data["bytes_staged"] == len(pairs) * LAYERS * pre.layout.block_bytes
        if dec.staged:
            assert dstats["bytes_landed"] == len(pairs) * LAYERS * dec.layout.block_bytes
            assert dec._landing.in_use == 0  # the landing slots went back
    finally:
        dec.shutdown()
        pre.shutdown()


def test_landing_pool_full_waits_then_pulls_and_too_big_fails(boot):
    """Decode's landing pool holds 3 blocks of every layer. With 2 of them taken (another batch landing), a
    2-block pull waits (READY, counted), and is posted and lands once they come back; a 4-block pull can
    never land and fails."""
    from kvlink.bootstrap import BootstrapClient
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.pulls import State
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    src, dst = _views("cpu", 1, True, True, nb=12), _views("cpu", 1, True, False, nb=12)
    pre = KVLinkWorker(ConnectorConfig(transport_backend="tcp"), RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    dec = KVLinkWorker(ConnectorConfig(transport_backend="tcp", staging="always", staging_pool_mb=1,
                                       pull_timeout_s=30.0),
                       RankInfo("dec", 0, 1, 0, 1, "m"), "kv_consumer", slot_bytes=(1 << 20) // 4)
    try:
        pre.register_kv_caches(src)
        dec.register_kv_caches(dst)
        assert dec._landing.capacity == 3
        pre._ensure_registered(boot)
        with BootstrapClient(boot) as cli:
            for rid, blocks in (("w", [9]), ("a", [1, 2]), ("big", [1, 2, 3, 4])):
                cli.publish("pre", "p-" + rid, [blocks], num_tokens=BS * len(blocks), lease_s=30.0)
        submit_pull(dec, boot, "w", [(9, 9)])  # first contact: the peer is known from here on
        assert pull_outcome(dec, "w") == "ok"
        with dec._lock:
            taken = dec._landing.allocate(2)
        submit_pull(dec, boot, "a", [(1, 1), (2, 2)])
        assert dec._table.state("a") is State.READY  # waiting for room, nothing on the wire
        assert dec.get_stats().data["staging_pool_full"] == 1
        with dec._lock:  # as if a batch the table no longer knows (it ended) held them
            dec._landing_slots[-1] = taken
        dec._apply(lambda t, now: [])  # any event gives its slots back and posts what waited
        assert pull_outcome(dec, "a") == "ok"
        submit_pull(dec, boot, "big", [(4, 1), (5, 2), (6, 3), (7, 4)])
        assert pull_outcome(dec, "big") == "failed"
        d, s = next(iter(dst.values())), next(iter(src.values()))
        assert all(torch.equal(d[b], s[b]) for b in (1, 2, 9))
        assert not d[4:8].any() and dec._landing.in_use == 0
    finally:
        dec.shutdown()
        pre.shutdown()


def test_devices_and_roles_kvlink_cannot_serve_stop_start_up_naming_them():
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.worker import KVLinkWorker, RankInfo

    meta = {"l0": torch.empty(4, 2, 16, 64, dtype=torch.bfloat16, device="meta")}
    w = KVLinkWorker(ConnectorConfig(transport_backend="tcp"), RankInfo("x", 0, 1, 0, 1, "m"), "kv_consumer")
    with pytest.raises(RuntimeError, match=r"CPU or CUDA.*'meta'.*\[4, 2, 16, 64\].*'tcp'"):
        w.register_kv_caches(meta)
    both = KVLinkWorker(ConnectorConfig(transport_backend="tcp", staging="always"), RankInfo("x", 0, 1, 0, 1, "m"),
                        "kv_both")
    with pytest.raises(RuntimeError, match="kv_both engine cannot stage"):
        both.register_kv_caches(_views("cpu", 1, True, False))
    tiny = KVLinkWorker(ConnectorConfig(transport_backend="tcp", staging="always", staging_pool_mb=1),
                        RankInfo("x", 0, 1, 0, 1, "m"), "kv_producer", slot_bytes=1 << 20)
    try:
        with pytest.raises(RuntimeError, match="staging_pool_mb=1 holds no block"):
            tiny.register_kv_caches(_views("cpu", 1, True, False))
    finally:
        tiny.shutdown()


def test_gpu_check_script_passes_on_the_host_staged_path():
    """tools/gpu_check.py (the GPU check) through its CPU mode: two processes, real transport and bootstrap,
    staging forced, every byte compared; then every layout it knows, each with its flipped-byte control."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "tools" / "gpu_check.py"), "--device", "cpu", "--layers", "2",
                        "--blocks", "24", "--pool-mb", "4", "--layouts", "all"], capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every block of every layer equal" in r.stdout and "staging (D2H)" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.lstrip().startswith("layout ")]
    assert [row[1] for row in rows] == ["fa", "fa-hnd", "flashinfer", "flashinfer-hnd", "mla", "fp8"], r.stdout
    assert all("every block equal; control" in line and line.endswith("caught")
               for line in r.stdout.splitlines() if line.lstrip().startswith("layout ")), r.stdout


@pytest.mark.parametrize("layout", ["fa", "mla"])
def test_gpu_stream_check_script_passes_on_the_host_staged_path(layout):
    """tools/gpu_stream_check.py (streamed KV through host staging, for a GPU) through its CPU mode: a stand-in
    forward, layer-wise copies and pieces, a concurrent decode reading each layer range, byte for byte; in
    FlashAttention's layout and MLA's."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "tools" / "gpu_stream_check.py"), "--device", "cpu", "--layers", "3",
                        "--blocks", "16", "--pool-mb", "4", "--layer-ms", "40", "--runs", "1", "--layout", layout],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"layout {layout}:" in r.stdout
    assert "every block of every layer equal" in r.stdout and "read blocks as pieces: yes" in r.stdout


@pytest.mark.parametrize("layout", ["fa", "mla"])
def test_gpu_stager_bench_copies_every_block_both_ways_on_the_host(layout):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "tools" / "gpu_stager_bench.py"), "--device", "cpu", "--layers",
                        "3", "--blocks", "8", "--reps", "1", "--layout", layout], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every slot equals its block, and back" in r.stdout
    assert f"layout {layout} (copies as 8-byte integers)" in r.stdout and "byte-wise" in r.stdout


def test_on_cuda_a_request_streamed_whole_into_the_pool_is_staged_only_once_its_layer_copies_are_done():
    """Nothing is left to copy when it finishes, but its last layers' copies may still be under way on the
    stager's streams: the worker reports it staged (the scheduler publishes its slots, vLLM frees its
    blocks) only once every copy queued before is done."""
    from types import SimpleNamespace

    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig

    w = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp"), W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    stager = CudaLikeStager()
    stager.slot_bytes = 64
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    copies = StagedCopies(names)
    sp = staged_spec(1, [5, 6], [15, 16], whole=0)
    copies.start(sp)
    for n in names:
        copies.layer_copied(sp, n)
    assert copies.step_done([sp]) == {"r"}
    w._stager, w._streamer = stager, SimpleNamespace(copies=copies)
    w._stage([("r", (15, 16), (5, 6))])
    assert stager.copies == [((), (), None)]  # nothing left to copy: the marker of what was queued
    assert w._staged_done() == set()
    stager.markers[-1].set()
    assert w._staged_done() == {"r"}


def test_a_restaged_request_whose_old_slots_came_back_is_copied_whole_not_from_anothers_kv():
    """A streamed request X cannot grow its slots at the end (the pool is full) and is staged from scratch;
    meanwhile another streamed request Y copies its own KV into X's old slots, then ends; X's job gets the
    same slots back. What the worker copied for X into them is Y's now: the scheduler names X as given
    back (metadata ``unstreamed``, before the job), and X is copied whole."""
    from types import SimpleNamespace

    from kvlink.vllm import worker as W
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.stream import StreamSpec

    names = ["model.layers.0.attn", "model.layers.1.attn"]
    pl = StagePlanner(SlotPool(3), wait_s=60.0)
    copies = StagedCopies(names)

    def stream(rid, slots, devs):  # one whole step of a streamed request, copied into its slots layer by layer
        sp = StreamSpec(rid, "t-" + rid, 1, 0, 32 * len(slots), tuple(slots), 0, True, tuple(devs), block_size=32)
        copies.start(sp)
        for n in names:
            copies.layer_copied(sp, n)
        assert copies.step_done([sp]) == {rid}

    stream("X", pl.reserve("X", 2), (100, 101))
    assert pl.admit("Z", (300,), 0.0) is None and pl.take_jobs(0.0)[0]  # Z fills the pool's last slot
    assert pl.admit("X", (100, 101, 102), 0.0) is None  # X needs 3 slots: given back, queued from scratch
    stream("Y", pl.reserve("Y", 2), (200, 201))  # Y streams into X's old slots 1-2
    pl.unreserve("Y")
    pl.staged("Z")
    pl.release("Z")
    (job,), _ = pl.take_jobs(0.0)
    assert job.request_id == "X" and job.slots == (1, 2, 3)
    w = W.KVLinkWorker(ConnectorConfig(transport_backend="tcp"), W.RankInfo("pre", 0, 1, 0, 1, "m"), "kv_producer")
    try:
        stager = CudaLikeStager()
        w._stager, w._streamer = stager, SimpleNamespace(copies=copies)
        w._forget_streamed(pl.take_dropped())  # what start_load_kv does with meta.unstreamed, before the jobs
        w._stage([(job.request_id, job.blocks, job.slots)])
        assert stager.copies[-1][:2] == ((100, 101, 102), (1, 2, 3))  # all of X, not only its third block
    finally:
        w._streamer = None
        w.shutdown()


def test_uneven_pp_stages_count_slots_for_the_largest_so_every_stage_has_the_schedulers():
    """vLLM gives the scheduler stage 0's KV cache config and each worker its own; with 30 layers on PP=4 the
    stages hold 7, 8, 8 and 7 layers. Counted per stage, stage 1 had fewer slots than the scheduler handed
    out (a copy into a slot its pool lacks, mid-forward). Every side counts for the largest stage."""
    from types import SimpleNamespace

    from kvlink.vllm.staging import pp_slot_bytes

    def config(layers, page=1000):
        spec = SimpleNamespace(page_size_bytes=page)
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                                layer_names=[f"l{i}" for i in range(layers)])])

    sizes = [7, 8, 8, 7]
    counts = {pool_slots(1, pp_slot_bytes(config(n), 30, 4, sizes)) for n in sizes}
    assert counts == {pool_slots(1, 8 * 1000)}  # one count, the largest stage's
    assert pp_slot_bytes(config(8), 32, 4, [8, 8, 8, 8]) == 8000  # equal stages: as before
    # equal stages by layers, unequal by KV layers (attention-free layers): one count still
    stage0, stage1 = (pool_slots(64, pp_slot_bytes(config(n), 80, 2, [40, 40])) for n in (30, 35))
    assert stage0 == stage1
    assert pp_slot_bytes(config(8), 8, 1) == 8000
    mixed = config(7)
    mixed.kv_cache_groups.append(SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=64), layer_names=["m"]))
    with pytest.raises(ValueError, match="unequal layer counts"):
        pp_slot_bytes(mixed, 30, 4, sizes)
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:  # vLLM's own split by default
        mp.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
        assert pp_slot_bytes(config(7), 30, 4) == 8000


def test_a_request_queued_behind_streamed_reservations_is_not_a_free_vllm_may_wait_for():
    """Streamed requests still computing reserved the whole pool; a finished request queues for room keeping
    its device blocks. Those come back only once the streamed ones finish, which may need vLLM to preempt:
    counted as a pending free, vLLM stopped preempting and stalled until the queued request's wait ran out
    (lease_s). Queued requests that fit once staged ones are released still count."""
    pl = StagePlanner(SlotPool(8), wait_s=30.0)
    assert pl.reserve("s1", 4) and pl.reserve("s2", 3)
    assert pl.admit("j", (10, 11), 0.0) is None  # 2 blocks; 1 slot free and 7 reserved
    assert pl.take_jobs(1.0) == ([], [])
    assert pl.device_blocks() == 2 and pl.freeing_blocks() == 0
    assert pl.admit("k", (12,), 0.0) is None  # fits, but queued behind j: waits as long
    assert pl.freeing_blocks() == 0
    pl.unreserve("s2")  # a streamed request aborted: j fits (then k), in turn, as staged ones are released
    assert pl.freeing_blocks() == 3
    assert pl.admit("m", tuple(range(20, 25)), 0.0) is None  # 5 blocks: more than the 4 that s1 leaves
    assert pl.freeing_blocks() == 3
    start, _ = pl.take_jobs(1.0)
    assert [j.request_id for j in start] == ["j", "k"]
    assert pl.freeing_blocks() == 3  # j and k copying; m still behind s1's reservation
