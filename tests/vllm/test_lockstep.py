"""Lock-step (kvlink/vllm/lockstep.py), pure parts: when decode's pull table arms a streamed pull, what a
step that runs it waits for, what it reports once the pull ends, and the refusals. No threads, no sockets,
an injected clock."""

from __future__ import annotations

import pytest

from kvlink.vllm.lockstep import ArmClock, LockstepBook, lead_s, why_not_lockstep
from kvlink.vllm.pulls import ALL_LAYERS, CancelBatch, PullTable, State
from tests.vllm.test_stream import REMOTE, end_batch, lease, posts, spec

pytest.importorskip("vllm")

L = 8  # layers of this rank


def table(lead: float | None = 0.05) -> PullTable:
    t = PullTable(5.0, num_layers=L)
    t.lockstep_lead_s = lead
    return t


def layer_piece(t: PullTable, layers: int, now: float, blocks=(1, 2), epoch: int = 0):
    """Prefill's last step has ``layers`` layers done for every block: a layer-wise piece of it."""
    return t.piece("a", REMOTE, [(0, b, 10 + b, layers) for b in blocks], epoch, now)


def drain(t: PullTable, actions, now: float) -> None:
    """Every READ posted ends well, and what it queues after it too."""
    for p in posts(actions):
        drain(t, end_batch(t, p, now), now)


def test_a_pull_is_armed_once_every_position_is_announced_and_prefill_is_within_decode_lead():
    t = table(lead=0.05)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, t.piece("a", REMOTE, [(0, 1, 11, 1)], 0, 0.01), 0.01)  # block 2 not announced at all yet
    drain(t, layer_piece(t, 1, 0.02), 0.02)  # every position: 1 layer (prefill's last step began)
    drain(t, layer_piece(t, 2, 0.04), 0.04)  # 20 ms a layer: 6 left is 120 ms, more than the lead
    assert t.take_results(0.05).done == set() and not t.is_armed("a")
    drain(t, layer_piece(t, 6, 0.12), 0.12)  # 20 ms a layer: the 6th still computing and 2 more, 60 ms
    assert not t.is_armed("a")
    drain(t, layer_piece(t, 7, 0.14), 0.14)  # 40 ms <= 50 ms
    assert t.is_armed("a") and t.take_results(0.14).done == {"a"}  # to vLLM now, its KV still landing
    armed, settled, freed = t.take_lockstep()
    assert armed == {"a"} and settled == {} and freed == set()
    assert t.state("a") is State.RESOLVING  # the pull goes on


def test_without_lockstep_nothing_is_armed_and_all_layers_announced_arms_at_once():
    t = table(lead=None)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, L, 0.1), 0.1)
    assert not t.is_armed("a") and t.take_results(0.2).done == set()
    t2 = table(lead=0.0)
    t2.submit(spec("a", (1, 2)), 0.0)
    drain(t2, layer_piece(t2, L, 0.1), 0.1)  # every layer announced: no pace needed
    assert t2.is_armed("a")


def test_the_step_waits_per_layer_for_what_landed_then_for_the_record():
    t = table(lead=1.0)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, 1, 0.01), 0.01)
    acts = layer_piece(t, 3, 0.02)  # armed (lead 1 s); layers 1-2 on the wire
    assert t.is_armed("a") and t.take_results(0.02).done == {"a"}
    assert not t.armed_blocking("a", 0) and t.armed_blocking("a", 1) and t.armed_blocking("a", 2)
    drain(t, acts, 0.03)
    assert not t.armed_blocking("a", 2) and t.armed_blocking("a", 3)
    assert t.armed_blocking("a", None)  # the outcome: prefill's record not published yet
    acts = t.resolved("a", REMOTE, [(0, 1, 11), (0, 2, 12)], lease("a"), 30.0, 99.0, 0.04)
    (tail,) = posts(acts)
    assert sorted(tail.pulls[0].pairs) == [(0, 1, 11, 3, ALL_LAYERS), (0, 2, 12, 3, ALL_LAYERS)]
    assert t.armed_blocking("a", 7) and t.armed_blocking("a", None)
    drain(t, acts, 0.05)
    assert not t.armed_blocking("a", 7) and not t.armed_blocking("a", None)
    assert t.take_results(0.06).done == set()  # reported once, when it was armed
    assert t.take_lockstep()[1] == {"a": True}
    assert t.take_failed_blocks(["a"]) == set()  # confirmed: its blocks stay in the prefix cache
    assert t.take_step("a") == () and not t.is_armed("a")


def test_an_armed_pull_that_fails_reports_its_blocks_to_its_step_never_to_finished_recving():
    t = table(lead=1.0)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, 1, 0.01), 0.01)
    drain(t, layer_piece(t, 2, 0.02), 0.02)
    assert t.take_results(0.03).done == {"a"}
    t.tick(6.0)  # prefill died: no record before the pull's deadline
    r = t.take_results(6.1)
    assert r.done == set() and r.failed == {} and t.take_error_blocks() == set()
    assert not t.armed_blocking("a", None)
    assert t.take_lockstep()[1] == {"a": False}
    assert t.take_failed_blocks(["b"]) == set()
    assert t.take_failed_blocks(["a"]) == {1, 2} and t.take_failed_blocks(["a"]) == set()  # each once
    assert t.take_step("a") == (1, 2)  # the step that ran it fails it (invalid_block_ids)


def test_prefill_restarting_an_armed_request_fails_it():
    t = table(lead=1.0)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, 1, 0.01), 0.01)
    drain(t, layer_piece(t, 2, 0.02), 0.02)
    assert t.is_armed("a")
    drain(t, layer_piece(t, 1, 0.03, epoch=1), 0.03)  # the step may have used epoch 0's bytes already
    assert t.take_lockstep()[1] == {"a": False} and t.take_step("a") == (1, 2)


def test_a_record_naming_other_blocks_than_an_armed_step_read_fails_it():
    """Another request published under the transfer id (a retried prefill leg: same prompt, same id) with
    other blocks: the step already computed over the streamed request's bytes, which may have been reused
    since. Read again after the fact would confirm the pull with nothing exact behind it."""
    t = table(lead=1.0)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, L, 0.01), 0.01)  # every layer of blocks 11, 12 read
    assert t.is_armed("a")
    assert t.resolved("a", REMOTE, [(0, 1, 21), (0, 2, 22)], lease("a"), 30.0, 99.0, 0.02) == []
    assert t.take_lockstep()[1] == {"a": False} and t.take_step("a") == (1, 2)
    t2 = table(lead=1.0)  # the same record naming the blocks it read confirms it
    t2.submit(spec("a", (1, 2)), 0.0)
    drain(t2, layer_piece(t2, L, 0.01), 0.01)
    drain(t2, t2.resolved("a", REMOTE, [(0, 1, 11), (0, 2, 12)], lease("a"), 30.0, 99.0, 0.02), 0.02)
    assert t2.take_lockstep()[1] == {"a": True}


def test_an_aborted_armed_request_is_freed_only_once_its_read_on_the_wire_settled():
    t = table(lead=1.0)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, 1, 0.01), 0.01)
    (post,) = posts(layer_piece(t, 2, 0.02))
    t.posted(post.batch, "h", 1, 1, 1, 0.02)
    assert t.is_armed("a") and t.take_results(0.02).done == {"a"}
    assert t.free_armed("a", 0.03) == [CancelBatch(post.batch, "h")]
    assert t.take_lockstep()[2] == set()  # the READ may still write into its blocks
    t.cancel_settled(post.batch, 0.04)
    armed, settled, freed = t.take_lockstep()
    assert freed == {"a"} and settled == {"a": False} and not t.is_armed("a")
    # aborted before it settled: vLLM had not taken it (a step that takes one waits for its outcome), so
    # nothing of it is in the prefix cache and no step reports its blocks
    assert t.take_failed_blocks(["a"]) == set()
    assert t.take_results(0.05).done == set()  # never a second report to finished_recving


def test_an_armed_request_freed_after_its_outcome_is_freed_at_once():
    t = table(lead=1.0)
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, L, 0.01), 0.01)
    t.tick(6.0)
    assert t.free_armed("a", 6.1) == [] and t.take_lockstep()[2] == {"a"}
    assert t.free_armed("b", 6.2) == [] and t.take_lockstep()[2] == {"b"}  # outcome already handed to its step


def test_the_arm_clock_paces_on_the_layers_announced_since_all_positions_had_one():
    c = ArmClock(num_layers=8)
    assert not c.ready(0, 0.0, 1.0)  # some position has nothing yet
    assert not c.ready(2, 0.1, 1.0)  # the first sight: no pace yet
    assert not c.ready(2, 0.2, 1.0)
    assert not c.ready(4, 0.3, 0.1)  # 0.1 s a layer; the 4th and 4 more: 0.5 s
    assert not c.ready(7, 0.6, 0.1)  # the 7th and the 8th: 0.2 s
    assert c.ready(8, 0.7, 0.1)  # the last one only
    slow = ArmClock(num_layers=8)
    assert not slow.ready(7, 0.0, 0.05) and not slow.ready(8, 0.2, 0.05)  # even the last layer outlasts the lead
    assert ArmClock(num_layers=8).ready(8, 0.0, 0.0)  # everything at first sight: the last notice there is
    assert lead_s(0.02, 10) == pytest.approx(0.033)


def test_a_restarted_request_is_paced_from_its_restart_not_from_the_epoch_before():
    """Prefill restarted the request (preempted: epoch 1). Paced against epoch 0's first sight, a pull would
    arm at the first epoch-1 piece that shows half the layers (decode's whole step then waits on a prefill
    that may be far from its last layer), or, with epoch 0 seen long before, never arm at all."""
    early = table(lead=0.05)
    early.submit(spec("a", (1, 2)), 0.0)
    drain(early, layer_piece(early, 1, 0.00), 0.00)
    drain(early, layer_piece(early, 4, 0.01, epoch=1), 0.01)  # first sight of epoch 1: 4 of 8 layers
    assert not early.is_armed("a")
    late = table(lead=0.05)
    late.submit(spec("a", (1, 2)), 0.0)
    drain(late, layer_piece(late, 5, 0.0), 0.0)
    for i, layers in enumerate(range(1, L)):  # epoch 1, 3 s later: 10 ms a layer
        drain(late, layer_piece(late, layers, 3.0 + 0.01 * i, epoch=1), 3.0 + 0.01 * i)
    assert late.is_armed("a")


@pytest.mark.parametrize("args, part", [
    (("recompute", True, False, 1, 1, 1, False, True, "layer"), "async scheduling"),
    (("fail", True, False, 1, 1, 1, False, True, "layer"), "may preempt the armed request"),
    (("fail", True, True, 1, 1, 1, False, True, "layer"), "async scheduling"),
    (("skip", False, False, 1, 1, 1, False, True, "layer"), "kv_load_failure_policy 'skip'"),
    (("recompute", False, True, 1, 1, 1, False, True, "layer"), "prefix caching with kv_load_failure_policy"),
    (("fail", False, False, 2, 1, 1, False, True, "layer"), "TP=2"),
    (("fail", False, False, 1, 2, 1, False, True, "layer"), "PP=2"),
    (("fail", False, False, 1, 1, 2, False, True, "layer"), "KV cache groups"),
    (("fail", False, False, 1, 1, 1, True, True, "layer"), "host staging"),
    (("fail", False, False, 1, 1, 1, False, False, "layer"), "cancel"),
    (("fail", False, False, 1, 1, 1, False, True, "step"), "stream_granularity"),
])
def test_lockstep_is_refused_where_it_could_not_be_exact(args, part):
    assert part in why_not_lockstep(*args)


def test_lockstep_is_allowed_with_fail_or_with_recompute_without_async_scheduling():
    assert why_not_lockstep("fail", False, False, 1, 1, 1, False, True, "layer") is None
    assert why_not_lockstep("recompute", False, False, 1, 1, 1, False, True, "layer") is None
    assert why_not_lockstep("fail", False, True, 1, 1, 1, False, True, "layer") is None  # prefix caching


# ----- decode's scheduler side: what it does with the worker's arm and settle reports ----------------------


def _sched_with_pull(rid: str = "d1", prefix_caching: bool = False):
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.scheduler import KVLinkScheduler
    from tests.vllm.test_scheduler import _blocks, _decode_request

    sched = KVLinkScheduler(ConnectorConfig(stream_lockstep=True), "dec", "kv_consumer", 32)
    sched.lockstep_prefix_caching(prefix_caching)
    releases = []
    sched._release_shared = lambda src, r, pulled: releases.append((r, pulled))
    req = _decode_request(rid, 64, {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:1",
                                    "transfer_id": "t-" + rid})
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
    sched.update_state_after_alloc(req, _blocks((5, 6)), 64)
    assert [s.request_id for s in sched.build_connector_meta(None).pulls] == [rid]
    return sched, req, releases


def _output(recving=(), sending=(), armed=(), settled=None, evict=()):
    from types import SimpleNamespace

    from kvlink.vllm.metadata import KVLinkWorkerMeta

    wm = KVLinkWorkerMeta(set(armed), dict(settled or {}), set(evict)) if armed or settled or evict else None
    return SimpleNamespace(finished_recving=set(recving), finished_sending=set(sending), failed_recving=set(),
                           kv_connector_worker_meta=wm)


def _step(sched, new=()):
    from types import SimpleNamespace

    return sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
                                                      total_num_scheduled_tokens=len(new),
                                                      finished_req_ids=set()))


def test_an_armed_request_is_released_to_prefill_only_once_settled_and_its_step_is_named():
    sched, req, releases = _sched_with_pull()
    try:
        out = _output(recving={"d1"}, armed={"d1"})
        sched.update_connector_output(out)
        assert out.finished_recving == {"d1"} and releases == []  # vLLM schedules it; prefill still holds it
        meta = _step(sched, new=["d1"])
        assert meta.lockstep == ["d1"]  # its layers wait for their KV, the step's end for the outcome
        assert _step(sched, new=[]).lockstep == []
        sched.update_connector_output(_output(settled={"d1": True}))
        assert releases == [("d1", True)]
        assert sched.request_finished(req, []) == (False, None)  # settled and ran: freed as usual
    finally:
        sched.shutdown()


def test_an_armed_request_finished_before_it_settled_is_freed_by_the_worker():
    """An abort while its KV may still land: vLLM must keep the blocks until the worker stopped the pull."""
    sched, req, releases = _sched_with_pull()
    try:
        sched.update_connector_output(_output(recving={"d1"}, armed={"d1"}))
        assert sched.request_finished(req, []) == (True, None)
        meta = _step(sched)
        assert meta.lockstep_frees == ["d1"] and meta.cancels == []
        assert sched.has_pending_work()  # vLLM steps on until the worker reports the free
        sched.update_connector_output(_output(sending={"d1"}, settled={"d1": False}))
        assert not sched.has_pending_work() and releases == [("d1", False)]
    finally:
        sched.shutdown()


def test_an_arm_report_for_a_request_vllm_already_finished_does_not_free_its_blocks():
    """The abort reached the scheduler before the arm report: that report must not reach vLLM's
    finished_recving (it frees a finished request's blocks at once, under a READ still on the wire)."""
    sched, req, releases = _sched_with_pull()
    try:
        assert sched.request_finished(req, []) == (False, None)  # vLLM delays it itself (waiting for KV)
        assert _step(sched).cancels == ["d1"]
        out = _output(recving={"d1"}, armed={"d1"})
        sched.update_connector_output(out)
        assert out.finished_recving == set() and sched.has_pending_work()
        sched.update_connector_output(_output(sending={"d1"}, settled={"d1": False}))
        assert not sched.has_pending_work() and releases == [("d1", False)]
    finally:
        sched.shutdown()


def test_the_connector_refuses_lockstep_at_start_up_naming_the_setting():
    from types import SimpleNamespace

    from kvlink.vllm.config import ConnectorConfig, ConnectorConfigError
    from kvlink.vllm.connector import _check_lockstep

    def vllm(role="kv_consumer", policy="fail", prefix=False, tp=1, async_scheduling=False):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=role, kv_load_failure_policy=policy),
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
                               scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                               cache_config=SimpleNamespace(enable_prefix_caching=prefix),
                               device_config=SimpleNamespace(device_type="cpu"))

    on = ConnectorConfig(stream_lockstep=True)
    _check_lockstep(on, vllm(), None)  # allowed
    _check_lockstep(ConnectorConfig(), vllm(prefix=True), None)  # off: nothing to check
    _check_lockstep(on, vllm(prefix=True), None)  # allowed with "fail"
    for bad, part in ((vllm(async_scheduling=True), "--no-async-scheduling"),
                      (vllm(prefix=True, policy="recompute"), "fail"),
                      (vllm(tp=2), "TP=2"), (vllm(role="kv_producer"), "decode's")):
        with pytest.raises(ConnectorConfigError, match=part):
            _check_lockstep(on, bad, None)
    with pytest.raises(ConnectorConfigError, match="mooncake|cancel"):
        _check_lockstep(ConnectorConfig(stream_lockstep=True, transport_backend="mooncake"), vllm(), None)
    with pytest.raises(ConnectorConfigError, match="stream_lockstep_stall_ms"):
        ConnectorConfig(stream_lockstep_stall_ms=-1)


def test_each_layer_lands_before_vllm_writes_the_steps_own_kv_into_it():
    """vLLM CPU writes a layer's new KV (the recomputed last prompt token's) in an op of its own before that
    layer's wait_for_layer_load: the step waits for layer k+1 at the end of layer k (save_kv_layer) and for
    layer 0 when its metadata is bound, so no READ lands over decode's own write."""
    from types import SimpleNamespace

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.connector import KVLinkConnector
    from kvlink.vllm.metadata import KVLinkMetadata
    from kvlink.vllm.puller import Puller

    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    waits = []
    worker = Puller.__new__(Puller)
    worker._layer_rank = {n: i for i, n in enumerate(names)}
    worker.lockstep_wait_place = lambda rids, place: waits.append((tuple(rids), place))
    conn = KVLinkConnector.__new__(KVLinkConnector)
    conn.config, conn._worker, conn._written_first = ConnectorConfig(stream_lockstep=True), worker, {}
    meta = KVLinkMetadata(lockstep=["a"])
    conn.bind_connector_metadata(meta)
    for n in names:
        conn.wait_for_layer_load(n)
        conn.save_kv_layer(n, None, None)
    assert [p for _, p in waits] == [0, 0, 1, 1, 2, 2] and {r for r, _ in waits} == {("a",)}
    waits.clear()
    conn.bind_connector_metadata(KVLinkMetadata())  # a step without armed requests waits for nothing
    conn.save_kv_layer(names[0], None, None)
    assert waits == []


def test_an_arm_and_its_free_in_one_output_leave_nothing_pending():
    """The abort's cancel reached the worker in the step that armed the pull, between pieces: the arm and
    the free come back together; the scheduler must not wait for that free again (vLLM would step forever)."""
    sched, req, releases = _sched_with_pull()
    try:
        assert sched.request_finished(req, []) == (False, None)
        _step(sched)
        out = _output(recving={"d1"}, sending={"d1"}, armed={"d1"}, settled={"d1": False})
        sched.update_connector_output(out)
        assert out.finished_recving == set() and not sched.has_pending_work()
        assert releases == [("d1", False)] and sched._cancelled == set()
    finally:
        sched.shutdown()


def test_an_armed_request_that_finishes_normally_before_its_settle_is_heard_of_is_released_as_pulled():
    from vllm.v1.request import RequestStatus

    sched, req, releases = _sched_with_pull()
    try:
        sched.update_connector_output(_output(recving={"d1"}, armed={"d1"}))
        _step(sched, new=["d1"])
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED  # max_tokens 1: done in its first step
        assert sched.request_finished(req, []) == (True, None)
        assert _step(sched).lockstep_frees == ["d1"]
        sched.update_connector_output(_output(sending={"d1"}, settled={"d1": True}))
        assert releases == [("d1", True)] and sched._cancelled == set() and not sched.has_pending_work()
    finally:
        sched.shutdown()


def test_an_armed_pull_without_an_outcome_fails_after_the_lockstep_bound_not_the_pull_timeout():
    t = table(lead=1.0)
    t.lockstep_max_wait_s = 2.0
    t.submit(spec("a", (1, 2)), 0.0)
    drain(t, layer_piece(t, L, 0.5), 0.5)
    assert t.is_armed("a")
    t.tick(2.4)
    assert t.armed_blocking("a", None)  # 1.9 s: still waiting
    t.tick(2.6)
    assert not t.armed_blocking("a", None) and t.take_lockstep()[1] == {"a": False}
    assert any("stream_lockstep_max_wait_s" in m for m in t.take_messages())


# ----- prefix caching: vLLM caches an armed request's blocks when it takes the request --------------------


class _CacheManager:
    """What the scheduler side uses of vLLM's KVCacheManager: evictions, recorded."""

    def __init__(self):
        self.evicted: list[set[int]] = []

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted.append(set(block_ids))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_an_armed_request_vllm_takes_leaves_the_prefix_cache_and_the_step_that_took_it_waits(prefix_caching):
    """vLLM puts an armed request's blocks in its prefix cache when it takes the request (out of waiting for
    its KV), and a request of that same step may match them. With prefix caching, the step that took it
    evicts its pulled blocks (no later step can match KV not confirmed) and, if it does not run the armed
    request, names it: it waits for that pull as the request's own step would. Not one vLLM has not taken
    (nothing of it is cached), nor without prefix caching."""
    from vllm.v1.request import RequestStatus

    sched, req, releases = _sched_with_pull(prefix_caching=prefix_caching)
    cache = _CacheManager()
    sched.bind_kv_cache_manager(cache)
    taken = ["d1"] if prefix_caching else []
    try:
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        sched.update_connector_output(_output(recving={"d1"}, armed={"d1"}))
        assert _step(sched, new=["x"]).lockstep_shared == [] and cache.evicted == []  # not taken: not cached
        req.status = RequestStatus.WAITING  # taken, not scheduled (no room in the token budget)
        meta = _step(sched, new=["x"])
        assert meta.lockstep == [] and meta.lockstep_shared == taken  # x may have matched its blocks
        assert cache.evicted == ([{5, 6}] if prefix_caching else [])  # and no later request will
        req.status = RequestStatus.RUNNING
        meta = _step(sched, new=["d1", "y"])
        assert meta.lockstep == ["d1"] and meta.lockstep_shared == []  # its own step waits already
        assert len(cache.evicted) == len(taken)  # once
        assert _step(sched, new=["z"]).lockstep_shared == []  # only the step that took it waits for it
        sched.update_connector_output(_output(settled={"d1": True}))
        assert _step(sched).lockstep_shared == []
        assert sched._lockstep.requests == {} and sched._lockstep.taken == set()  # nothing kept
    finally:
        sched.shutdown()


def test_an_armed_request_aborted_before_vllm_took_it_is_waited_for_by_no_step():
    """Aborted while waiting for its KV: never in the prefix cache, so no step waits for its pull (it may
    be one of a dead prefill, failing only at stream_lockstep_max_wait_s)."""
    from vllm.v1.request import RequestStatus

    sched, req, releases = _sched_with_pull(prefix_caching=True)
    try:
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        sched.update_connector_output(_output(recving={"d1"}, armed={"d1"}))
        req.status = RequestStatus.FINISHED_ABORTED
        assert sched.request_finished(req, [5, 6])[0]
        assert _step(sched, new=["x"]).lockstep_shared == []
    finally:
        sched.shutdown()


def test_a_pull_that_failed_before_vllm_took_its_request_is_named_by_the_step_that_takes_it():
    """The pull failed while vLLM had no room for the request; vLLM then takes it (caching its blocks) but
    does not run it in that step, and the client aborts it before it runs. The step that took it names it
    (the worker reports the failed blocks: whatever matched them fails) and its blocks leave the cache;
    later steps do not name it (nothing can match those blocks any more)."""
    from vllm.v1.request import RequestStatus

    sched, req, releases = _sched_with_pull(prefix_caching=True)
    cache = _CacheManager()
    sched.bind_kv_cache_manager(cache)
    try:
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        sched.update_connector_output(_output(recving={"d1"}, armed={"d1"}))
        sched.update_connector_output(_output(settled={"d1": False}))  # failed: settled before vLLM took it
        assert _step(sched, new=["x"]).lockstep_shared == []
        req.status = RequestStatus.WAITING  # taken (cached), no room to run it
        assert _step(sched, new=["x"]).lockstep_shared == ["d1"] and cache.evicted == [{5, 6}]
        req.status = RequestStatus.FINISHED_ABORTED
        assert sched.request_finished(req, [5, 6])[0]  # its own step never comes
        assert _step(sched).lockstep_shared == []
        sched.update_connector_output(_output(sending={"d1"}))
        assert _step(sched).lockstep_shared == [] and sched._lockstep.requests == {}
    finally:
        sched.shutdown()


def test_the_blocks_of_an_armed_pull_that_ended_unconfirmed_leave_the_prefix_cache():
    """The worker's step that heard of the failure reported the blocks as load errors (vLLM fails what read
    them); the scheduler evicts them in the same output, before the next step can match them."""
    sched, req, releases = _sched_with_pull(prefix_caching=True)
    cache = _CacheManager()
    sched.bind_kv_cache_manager(cache)
    try:
        sched.update_connector_output(_output(recving={"d1"}, armed={"d1"}))
        sched.update_connector_output(_output(settled={"d1": False}, evict={5, 6}))
        assert cache.evicted == [{5, 6}] and releases == [("d1", False)]
        sched.update_connector_output(_output(settled={}, armed={"d2"}))  # nothing failed: nothing evicted
        assert cache.evicted == [{5, 6}]
    finally:
        sched.shutdown()


def test_worker_meta_of_several_ranks_keeps_every_block_to_evict():
    from kvlink.vllm.metadata import KVLinkWorkerMeta

    a = KVLinkWorkerMeta({"r1"}, {"r0": False}, {1, 2})
    got = a.aggregate(KVLinkWorkerMeta(set(), {"r2": True}, {3}))
    assert (got.armed, got.settled, got.evict) == ({"r1"}, {"r0": False, "r2": True}, {1, 2, 3})


def test_a_step_that_may_read_another_armed_requests_blocks_waits_for_them_before_attention_and_at_its_end():
    """Shared (prefix caching): before each layer's attention the step waits for that layer of the armed
    requests it may read, and at its end for their outcomes; it does not wait before vLLM writes its own KV
    (a request that matched cached blocks writes its new KV into blocks of its own)."""
    from types import SimpleNamespace

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.connector import KVLinkConnector
    from kvlink.vllm.metadata import KVLinkMetadata
    from kvlink.vllm.puller import Puller

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    waits, ends = [], []
    worker = Puller.__new__(Puller)
    worker._layer_rank = {n: i for i, n in enumerate(names)}
    worker.lockstep_wait_place = lambda rids, place: waits.append((tuple(rids), place))
    worker.lockstep_end = lambda rids, shared: ends.append((list(rids), list(shared)))
    worker.transfer_results = lambda: (set(), set(), set())
    conn = KVLinkConnector.__new__(KVLinkConnector)
    conn.config, conn._worker, conn._written_first = ConnectorConfig(stream_lockstep=True), worker, {}
    conn._forwarded = False
    conn.bind_connector_metadata(KVLinkMetadata(lockstep_shared=["s"]))
    for n in names:
        conn.wait_for_layer_load(n)
        conn.save_kv_layer(n, None, None)
    assert waits == [(("s",), 0), (("s",), 1)]
    conn.get_transfer_results(set())
    assert ends == [([], ["s"])]


def test_a_shared_step_that_hears_an_armed_pull_failed_reports_its_blocks_and_asks_for_their_eviction():
    """Through the worker: an armed pull vLLM took ends unconfirmed; the step that waited for it without
    running it reports its blocks as load errors (vLLM fails whatever read them) and sends them to the
    scheduler to evict, once. A step that did not name it reports nothing (vLLM had not taken the request:
    reported then, vLLM would treat it as a failed async load and may give the blocks to another request
    before the armed request's own step names them again); its own step reports them (take_step)."""
    import threading

    from kvlink.vllm.stats import KVLinkStats
    from kvlink.vllm.worker import KVLinkWorker

    worker = KVLinkWorker.__new__(KVLinkWorker)
    worker._table = table(lead=1.0)
    worker._lock, worker._frees, worker._staging, worker._nudged = threading.Lock(), set(), False, False
    worker._ls_errors, worker._ls_evict, worker._ls_meta = set(), set(), None
    worker._num_groups, worker._stats, worker._closed = 1, KVLinkStats(), False
    worker._settle_finished = lambda: None
    t = worker._table
    for rid, blocks in (("a", (1, 2)), ("b", (3, 4))):
        t.submit(spec(rid, blocks), 0.0)
        for n in (1, 2):
            drain(t, t.piece(rid, REMOTE, [(0, b, 10 + b, n) for b in blocks], 0, 0.01 * n), 0.01 * n)
    assert worker.transfer_results()[1] == {"a", "b"}  # armed: to vLLM
    t.tick(6.0)  # no record for either: both failed
    worker.lockstep_end([], ["a"])  # a step that may have read a's blocks (vLLM took a, not b)
    worker.transfer_results()
    assert worker.take_load_error_blocks() == {1, 2}
    meta = worker.take_lockstep_meta()
    assert meta.settled == {"a": False, "b": False} and meta.evict == {1, 2}
    worker.lockstep_end([], ["a"])
    worker.transfer_results()
    assert worker.take_load_error_blocks() == set() and worker.take_lockstep_meta() is None  # once
    worker.lockstep_end(["b"], [])  # b's own step
    assert worker.take_load_error_blocks() == {3, 4}
    worker.transfer_results()
    assert worker.take_lockstep_meta().evict == {3, 4}  # out of the prefix cache whatever vLLM does


def test_a_failed_armed_pulls_blocks_stay_reportable_however_many_others_failed():
    """The blocks a taking step must report live on the armed entry, not in a capped list: 1,100 armed
    pulls failing (a dead prefill with a long queue) do not push out the first one's."""
    t = table(lead=1.0)
    n = 1100
    for i in range(n):
        rid, blocks = f"r{i}", (2 * i + 1, 2 * i + 2)
        t.submit(spec(rid, blocks), 0.0)
        for k in (1, 2):
            drain(t, t.piece(rid, REMOTE, [(0, b, 10 + b, k) for b in blocks], 0, 0.01 * k), 0.01 * k)
    assert len(t.take_results(0.03).done) == n  # all armed
    t.tick(6.0)  # no record for any: all failed
    assert t.take_failed_blocks(["r0"]) == {1, 2}
    assert t.take_failed_blocks([f"r{n - 1}"]) == {2 * n - 1, 2 * n}


def test_the_book_follows_an_armed_request_from_its_arm_to_its_free():
    book = LockstepBook()
    assert book.worker_output({"a", "b"}, {}, set(), (), cancelled={"b"}) == {"b"}  # b: vLLM already let it go
    assert book.is_armed("a") and not book.is_armed("b") and book.freeing == {"b"}
    assert book.schedule(["x", "a"]) == (["a"], [])  # a's first step: the one that schedules it
    assert book.schedule(["a"]) == ([], [])  # named once
    assert book.finish("a", aborted=True) == (True, True)  # unsettled and aborted: prefill hears abandoned
    assert book.finish("a", aborted=True) == (False, False)  # once
    assert book.schedule([]) == ([], ["a"]) and book.schedule([]) == ([], [])
    book.worker_output(set(), {}, set(), ("a", "b"), cancelled=set())  # the worker freed both
    assert book.freeing == set()


def test_the_book_frees_a_settled_armed_request_without_a_cancel():
    book = LockstepBook()
    book.worker_output({"a"}, {}, set(), (), cancelled=set())
    book.worker_output(set(), {"a": True}, set(), (), cancelled=set())
    assert book.finish("a", aborted=True) == (True, False)  # still unscheduled: its free waits for the worker


def test_the_book_evicts_a_taken_requests_blocks_once_and_names_it_for_that_step_only():
    evicted = []
    book = LockstepBook()
    book.prefix_caching = True
    book.bind(evicted.append)
    book.track("a", "req-a", (0, 5, 6))  # null block 0 is nobody's
    book.track("b", "req-b", (7,))
    book.worker_output({"a", "b"}, {}, {9}, (), cancelled=set())  # 9: a failed pull's block
    assert evicted == [{9}]
    taken = {"req-a"}
    assert book.shared([], pulling={"a", "b"}, is_taken=lambda r: r in taken) == ["a"]
    assert evicted == [{9}, {5, 6}]
    assert book.shared([], pulling={"a", "b"}, is_taken=lambda r: r in taken) == []  # taken once
    taken.add("req-b")
    assert book.shared(["b"], pulling={"a", "b"}, is_taken=lambda r: r in taken) == []  # b runs in its own step
    assert evicted[-1] == {7}
    book.worker_output(set(), {"a": True, "b": True}, set(), (), cancelled=set())
    book.schedule(["a", "b"])
    book.shared([], pulling=set(), is_taken=lambda r: True)
    assert book.requests == {} and book.taken == set() and not book.busy()


def test_the_book_tracks_nothing_without_prefix_caching():
    book = LockstepBook()
    book.track("a", "req-a", (5,))
    book.worker_output({"a"}, {}, {5}, (), cancelled=set())  # nothing bound: nothing to evict from
    assert book.requests == {} and not book.busy()
