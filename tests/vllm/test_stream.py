"""Streamed KV, pure parts: prefill's StreamPlanner over vLLM-shaped scheduler outputs, and decode's pull
table reading pieces (kvlink/vllm/pulls.py ``piece``): no threads, no sockets, an injected clock."""

from __future__ import annotations

import threading
import time

import pytest

from kvlink.vllm.plan import PairingError, layer_indices, ready_pairs, step_pairs
from kvlink.vllm.pulls import ALL_LAYERS, CancelBatch, Lease, Post, PullTable, Resolve, State
from kvlink.vllm.stream import (LAYER_SLOTS, LayerClock, Piece, PieceSender, PrefillStream, StagedCopies, StreamPlanner,
                                StreamSpec, layer_pieces, step_pieces)
from tests.fakes import CudaLikeStager, HandFence, RecordingSender, RecordingStager

pytest.importorskip("vllm")  # PullSpec is vLLM metadata

URL, ENGINE, REMOTE = "http://boot", "pre", "remote-A"


# ----- prefill: which blocks each step finishes ----------------------------------------------------------


def test_each_chunk_announces_its_full_blocks_and_the_last_chunk_none():
    sp = StreamPlanner(block_size=32)
    sp.track("r", "t", prompt_tokens=300)
    out = sp.step([("r", [1, 2], 0)], [], {"r": 64})
    assert [(p.index, p.num_tokens, p.block_ids) for p in out] == [(1, 64, (1, 2))]
    out = sp.step([], [("r", [3, 4, 5], False, 64)], {"r": 100})  # 164 done: 5 full blocks
    assert [(p.index, p.num_tokens, p.block_ids) for p in out] == [(2, 160, (1, 2, 3, 4, 5))]
    out = sp.step([], [("r", None, False, 164)], {"r": 20})  # 184: still 5 full blocks, nothing new
    assert out == []
    assert sp.step([], [("r", [6, 7, 8, 9, 10], False, 184)], {"r": 116}) == []  # completes the prompt
    assert sp.finished("r") == 0 and "r" not in sp


def test_a_restart_after_preemption_is_a_new_epoch_with_the_new_table():
    sp = StreamPlanner(block_size=32)
    sp.track("r", "t", prompt_tokens=300)
    (p1,) = sp.step([("r", [1, 2], 0)], [], {"r": 64})
    sp.track("r", "t", prompt_tokens=300)  # vLLM allocated it again (preempted, resumed)
    (p2,) = sp.step([], [("r", [7, 8], True, 0)], {"r": 64})
    assert (p2.epoch, p2.index, p2.block_ids) == (1, p1.index + 1, (7, 8))
    # a resume vLLM reports without a new allocation call is a restart all the same
    (p3,) = sp.step([], [("r", [9, 10, 11], True, 0)], {"r": 96})
    assert (p3.epoch, p3.block_ids) == (2, (9, 10, 11))
    assert sp.finished("r") == 2


def test_requests_not_tracked_are_ignored():
    sp = StreamPlanner(block_size=32)
    assert sp.step([("x", [1, 2], 0)], [("y", [3], False, 0)], {"x": 64, "y": 64}) == []


# ----- prefill, layer-wise -----------------------------------------------------------------------------------


def test_layer_wise_every_step_with_new_full_blocks_is_planned_the_last_chunk_too():
    sp = StreamPlanner(block_size=32, layer_wise=True)
    sp.track("r", "t", prompt_tokens=300)
    (a,) = sp.step([("r", [1, 2], 0)], [], {"r": 64})
    assert (a.index, a.num_tokens, a.block_ids, a.whole, a.last) == (1, 64, (1, 2), 0, False)
    assert sp.step([], [("r", [3], False, 64)], {"r": 20}) == []  # 84 done: no new full block
    (b,) = sp.step([], [("r", [4, 5, 6, 7, 8, 9, 10], False, 84)], {"r": 216})  # completes the prompt
    # 300 tokens: 9 full blocks and the partial 10th, whose prompt positions no later forward writes; 2 were
    # whole before this step
    assert (b.index, b.num_tokens, b.block_ids, b.whole, b.last) == (2, 300, tuple(range(1, 11)), 2, True)


def test_layer_wise_a_one_chunk_prompt_is_planned_and_its_cached_prefix_is_claimed_layer_by_layer():
    """vLLM caches a block when it allocates it: a prefix-cache hit may name blocks another request writes in
    this same forward, so the hit is not claimed whole at the first layer but layer by layer."""
    sp = StreamPlanner(block_size=32, layer_wise=True)
    sp.track("r", "t", prompt_tokens=200)
    (a,) = sp.step([("r", [5, 6, 7, 8, 9, 10, 11], 64)], [], {"r": 136})  # 64 tokens from the prefix cache
    assert (a.num_tokens, a.block_ids, a.whole, a.last) == (200, (5, 6, 7, 8, 9, 10, 11), 0, True)
    (p,) = layer_pieces([a], 1)
    f = p.fields()
    assert (f["num_tokens"], f["block_ids"], f["step_block_ids"], f["layers"]) == (0, [[]], [[5, 6, 7, 8, 9, 10, 11]], 1)
    sp.track("s", "u", prompt_tokens=20)
    (b,) = sp.step([("s", [1], 0)], [], {"s": 20})  # shorter than a block: it streams all the same
    assert (b.num_tokens, b.block_ids, b.whole, b.last) == (20, (1,), 0, True)
    sp.track("x", "v", prompt_tokens=64)
    (c,) = sp.step([("x", [2, 3, 4], 0)], [], {"x": 64})  # a prompt of whole blocks: nothing more
    assert (c.num_tokens, c.block_ids) == (64, (2, 3))


def test_the_chunk_that_only_finishes_the_partial_block_streams_it_and_step_wise_never_does():
    sp = StreamPlanner(block_size=32, layer_wise=True)
    sp.track("r", "t", prompt_tokens=70)
    (a,) = sp.step([("r", [1, 2, 3], 0)], [], {"r": 64})
    (b,) = sp.step([], [("r", None, False, 64)], {"r": 6})  # the 3rd block's 6 tokens complete the prompt
    assert (a.block_ids, a.last, b.block_ids, b.whole, b.last) == ((1, 2), False, (1, 2, 3), 2, True)
    (p,) = layer_pieces([b], 1)
    assert p.fields()["num_tokens"] == 64 and p.fields()["step_block_ids"] == [[3]]
    st = StreamPlanner(block_size=32)
    st.track("r", "t", prompt_tokens=70)
    assert [s.block_ids for s in st.step([("r", [1, 2, 3], 0)], [], {"r": 64})] == [(1, 2)]
    assert st.step([], [("r", None, False, 64)], {"r": 6}) == []  # the published record ends the stream


def spec_of(index, blocks, whole, last=False, tid="t"):
    return StreamSpec("r", tid, index, 0, 32 * len(blocks), tuple(blocks), whole, last, block_size=32)


def test_layer_pieces_name_the_step_blocks_and_the_layers_done_in_growing_indices():
    sp = spec_of(3, [1, 2, 3, 4], whole=1)
    (p0,) = layer_pieces([sp], 1)
    (p5,) = layer_pieces([sp], 6)
    (end,) = step_pieces([sp], layer_wise=True)
    assert p0.fields() == dict(transfer_id="t", request_id="r", index=3 * LAYER_SLOTS + 1, epoch=0, num_tokens=32,
                               block_ids=[[1]], step_block_ids=[[2, 3, 4]], layers=1)
    assert p5.fields()["layers"] == 6 and p0.index < p5.index < end.index < 4 * LAYER_SLOTS
    assert end.fields() == dict(transfer_id="t", request_id="r", index=end.index, epoch=0, num_tokens=128,
                                block_ids=[[1, 2, 3, 4]])
    assert step_pieces([spec_of(4, [1, 2], 1, last=True)], layer_wise=True) == []  # the record follows it
    assert layer_pieces([sp], LAYER_SLOTS - 1) == layer_pieces([sp], 0) == []  # the wire cannot order these
    assert [p.index for p in step_pieces([sp], layer_wise=False)] == [3]


def test_the_sender_sends_each_layer_once_its_fence_is_done_not_after_the_last_queued():
    """On a GPU vLLM's thread queues a whole forward's layers before the device runs them: each layer's piece
    goes out as its own fence is done (not once the last queued one is), never before it, and layers whose
    fences are done together go in one call. (It used to wait for every queued fence first: on an H200 a
    32-layer forward was read in 2 ranges, most of it after the forward.)"""
    sent = []
    sender = PieceSender(lambda pieces: sent.append([p.index for p in pieces]) or [], lambda key, n: None)
    a = spec_of(1, [1, 2], 0)
    fences = [HandFence() for _ in range(5)]
    for layers, f in enumerate(fences, 1):
        sender.submit(layer_pieces([a], layers), f)

    def settle(n):
        deadline = time.monotonic() + 5
        while len(sent) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # nothing more may follow

    settle(0)
    assert sent == []  # no fence done: nothing announced
    fences[2].set()  # a later layer done before an earlier one: still nothing, order holds
    settle(0)
    assert sent == []
    fences[0].set()
    settle(1)
    assert sent == [[LAYER_SLOTS + 1]]  # layer 1 out while 2..5 still compute
    fences[1].set()
    settle(2)
    assert sent[1] == [LAYER_SLOTS + 3]  # layers 2 and 3 (done together): one call, the newest piece
    fences[4].set()
    fences[3].set()
    settle(3)
    assert sent == [[LAYER_SLOTS + 1], [LAYER_SLOTS + 3], [LAYER_SLOTS + 5]]
    sender.close()
    sender._thread.join(5)
    assert not sender._thread.is_alive()


def test_the_sender_batches_what_queued_and_is_done_while_it_waited_and_drops_a_failed_fence():
    sent = []
    sender = PieceSender(lambda pieces: sent.append([p.index for p in pieces]) or [], lambda key, n: None)
    a = spec_of(1, [1, 2], 0)
    first, later = HandFence(), HandFence()
    sender.submit(layer_pieces([a], 1), first)
    time.sleep(0.1)  # the sender is waiting for layer 1
    later.set()
    sender.submit(layer_pieces([a], 2), later)
    sender.submit(layer_pieces([a], 3), None)
    first.set()
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert sent == [[LAYER_SLOTS + 3]]  # one call: layers 2 and 3 were in place when layer 1 was

    class Broken:
        def done(self):
            raise RuntimeError("CUDA error: an illegal memory access")

        def wait(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    sender.submit(layer_pieces([a], 4), Broken())  # its device work failed: never announced
    sender.submit(layer_pieces([spec_of(2, [1, 2], 0)], 1), None)
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent[1:] == [[2 * LAYER_SLOTS + 1]] and sender._thread.is_alive()
    sender.close()
    sender._thread.join(5)


def test_the_sender_sends_what_queued_before_close_once_its_fence_is_done():
    sent = []
    sender = PieceSender(lambda pieces: sent.append([p.index for p in pieces]) or [], lambda key, n: None)
    f = HandFence()
    sender.submit(layer_pieces([spec_of(1, [1, 2], 0)], 2), f)
    sender.close()
    time.sleep(0.1)
    assert sent == [] and sender._thread.is_alive()
    f.set()
    sender._thread.join(5)
    assert sent == [[LAYER_SLOTS + 2]]


def test_the_sender_sends_only_the_newest_piece_of_each_transfer_that_queued():
    sent, release = [], threading.Event()

    def send(pieces):
        release.wait(5)
        sent.append(sorted((p.transfer_id, p.index) for p in pieces))
        return ["u"] if any(p.transfer_id == "u" for p in pieces) else []

    sender = PieceSender(send, lambda key, n: None)
    a, b = spec_of(1, [1, 2], 0), spec_of(1, [7, 8], 0, tid="u")
    sender.submit(layer_pieces([a], 1))  # out at once, held in send
    time.sleep(0.1)
    for layers in range(1, 5):  # these queue while the first call is out: one call, the newest of each
        sender.submit(layer_pieces([a, b], layers))
    release.set()
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.submit([Piece(b, 99 * LAYER_SLOTS)])  # after "u" was answered "ended": not sent
    sender.close()
    sender._thread.join(5)
    assert sent[:2] == [[("t", LAYER_SLOTS + 1)], [("t", LAYER_SLOTS + 4), ("u", LAYER_SLOTS + 4)]]
    assert len(sent) == 2


def test_a_piece_the_server_cannot_take_costs_the_other_transfers_nothing():
    """A request id longer than the server takes (vLLM builds ids from the client's): the whole call used to
    be refused, every step, so no other request on the rank streamed while it computed."""
    import msgspec

    from kvlink.bootstrap.schema import StreamPiece, StreamPiecesBody, checked

    sent, counts = [], {}

    def send(pieces):  # validates as BootstrapClient.stream_pieces does
        checked(StreamPiecesBody, engine_id="P",
                pieces=[msgspec.to_builtins(StreamPiece(**p.fields())) for p in pieces])
        sent.append(sorted(p.transfer_id for p in pieces))
        return []

    sender = PieceSender(send, lambda key, n: counts.__setitem__(key, counts.get(key, 0) + n))
    good = spec_of(1, [1, 2], 0)
    bad = StreamSpec("r" * 600, "u", 1, 0, 64, (7, 8), 0, False, block_size=32)
    sender.submit(layer_pieces([good, bad], 1))
    sender.close()
    sender._thread.join(5)
    assert sent == [["t"]] and counts == {"pieces_failed": 1, "pieces_sent": 1}


def test_a_call_refused_as_a_whole_is_not_sent_again_piece_by_piece():
    """A fault of the call (its ranks, say), not of one piece: sending each piece alone would only multiply
    the refused calls, every step."""
    from kvlink.bootstrap import InvalidField

    calls, counts = [], {}

    def send(pieces):
        calls.append(len(pieces))
        raise InvalidField("ranks=2, but engine 'P' registered TP=1 x PP=1 ranks", field="ranks")

    sender = PieceSender(send, lambda key, n: counts.__setitem__(key, counts.get(key, 0) + n))
    sender.submit(layer_pieces([spec_of(1, [1, 2], 0), spec_of(1, [7, 8], 0, tid="u")], 1))
    sender.close()
    sender._thread.join(5)
    assert calls == [2] and counts == {"pieces_failed": 2}


def test_the_sender_ends_when_closed_behind_a_piece_whose_device_work_failed():
    """The close marker is taken with the pieces queued before it; when the last of those turns out never to
    be in place (its device work failed), the sender must end there, not wait for another marker."""
    from kvlink.vllm.stager import Pending

    first, second = HandFence(), HandFence()

    def failed():
        second.wait()
        raise RuntimeError("device error")

    sent = []
    sender = PieceSender(lambda pieces: sent.append([p.index for p in pieces]) or [], lambda key, n: None)
    sender.submit(layer_pieces([spec_of(1, [1, 2], 0)], 1), first)
    sender.submit(layer_pieces([spec_of(1, [1, 2], 0)], 2), Pending(lambda: False, failed))
    sender.close()
    first.set()  # the first piece goes; the close marker is taken with the second
    time.sleep(0.1)
    second.set()  # whose wait fails: the sender has nothing left, and was closed
    sender._thread.join(5)
    assert not sender._thread.is_alive() and sent == [[LAYER_SLOTS + 1]]


def test_the_layer_clock_counts_layers_done_below_the_first_one_missing_whatever_the_order():
    clock = LayerClock({"l.4": 4, "l.5": 5, "l.6": 6})  # a PP stage holding layers 4-6
    assert clock.saved("l.4") == 5  # layers below 5 are done (the earlier stage's, which its input needed)
    assert clock.saved("l.6") is None  # 5 is missing: no progress
    assert clock.saved("l.5") == 7
    assert clock.saved("other") is None
    clock.reset()
    assert clock.saved("l.5") is None and clock.saved("l.4") == 6


def staged_spec(index, slots, devs, whole, epoch=0):
    return StreamSpec("r", "t", index, epoch, 32 * len(slots), tuple(slots), whole, False, tuple(devs), block_size=32)


def test_staged_copies_count_a_step_whole_only_when_every_layer_was_copied():
    c = StagedCopies(["a", "b"])
    s1 = staged_spec(1, [5, 6], [15, 16], 0)
    assert c.start(s1) == 0
    c.layer_copied(s1, "a")
    c.layer_copied(s1, "a")  # twice the same layer is not two layers
    assert c.step_done([s1]) == set()
    assert c.start(s1) == 0  # nothing whole in the pool yet: the next step copies from position 0
    for name in ("a", "b"):
        c.layer_copied(s1, name)
    assert c.step_done([s1]) == {"r"}
    s2 = staged_spec(2, [5, 6, 7], [15, 16, 17], 2)
    assert c.start(s2) == 2
    assert c.start(staged_spec(3, [8, 9, 7], [1, 2, 3], 0, epoch=1)) == 0  # restarted: nothing counts
    assert c.take("r", (5, 6, 7, 4)) == 2 and c.take("r", (5, 6)) == 0  # taken once
    c.step_done([s1])  # (no layer copied this step)
    assert c.take("r", (9, 9)) == 0


def test_a_staged_stream_copies_each_layer_before_its_piece_and_claims_whole_only_what_is_in_the_pool():
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    stager, sender = RecordingStager(), RecordingSender()
    ps = PrefillStream(True, {n: i for i, n in enumerate(names)}, names, False, sender, stager)
    s1 = staged_spec(1, [5, 6], [15, 16], whole=0)
    for n in names:
        ps.layer_done([s1], n)
    ps.step_done([s1])
    assert stager.copies == [((15, 16), (5, 6), 0), ((15, 16), (5, 6), 1)]
    assert [(p["layers"] if "layers" in p else 0, p["block_ids"]) for p in sender.pieces] == [
        (1, [[]]), (2, [[]]), (0, [[5, 6]])]  # layer 0, layers 0-1, then whole
    # next step: prefill had 3 blocks computed (prefix cache) but only 2 are in the pool: copy from 2
    s2 = staged_spec(2, [5, 6, 7, 8], [15, 16, 17, 18], whole=3)
    sender.pieces.clear()
    ps.layer_done([s2], names[0])
    assert stager.copies[-1] == ((17, 18), (7, 8), 0)
    assert sender.pieces[-1]["block_ids"] == [[5, 6]] and sender.pieces[-1]["step_block_ids"] == [[7, 8]]
    ps.step_done([s2])  # layer 1 never saved: the step is not whole, no step-end piece
    assert len(sender.pieces) == 1
    assert ps.copies.take("r", (5, 6, 7, 8, 9)) == 2  # the end copies from position 2


def test_on_cuda_the_step_end_piece_waits_for_the_layer_copies_into_the_pool():
    """CUDA staging: the copies into the pool run on the stager's streams and may trail the forward. Without
    layer ids (no layer pieces) the step-end piece is all there is: its fence must cover those copies, not
    only vLLM's stream. Layer-wise, each layer piece waits for its own copy."""
    names = ["attn_a", "attn_b"]  # no layer number: layer ids unknown
    stager, sender = CudaLikeStager(), RecordingSender()
    ps = PrefillStream(True, None, names, True, sender, stager)
    s1 = staged_spec(1, [5, 6], [15, 16], whole=0)
    for n in names:
        ps.layer_done([s1], n)
    ps.step_done([s1])
    assert len(stager.copies) == 2 and [p["block_ids"] for p in sender.pieces] == [[[5, 6]]]
    fence = sender.fences[-1]
    assert fence is not None and not fence.done()  # the layer copies are not done: the piece must wait
    stager.markers[-1].set()
    assert fence.done()

    stager, sender = CudaLikeStager(), RecordingSender()
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    ps = PrefillStream(True, {n: i for i, n in enumerate(names)}, names, True, sender, stager)
    for n in names:
        ps.layer_done([s1], n)
    assert len(stager.pending) == 2 and sender.fences == stager.pending  # each layer piece: its own copy


def test_an_engine_without_layer_names_sends_step_pieces_only():
    sender = RecordingSender()
    ps = PrefillStream(True, None, ["attn"], False, sender)
    sp = spec_of(1, [1, 2], 0)
    ps.layer_done([sp], "attn")
    assert sender.pieces == []
    ps.step_done([sp])
    assert [p["block_ids"] for p in sender.pieces] == [[[1, 2]]]


def test_layer_indices_are_the_one_number_of_each_name_or_none():
    assert layer_indices(["model.layers.0.self_attn.attn", "model.layers.11.self_attn.attn"]) == {
        "model.layers.0.self_attn.attn": 0, "model.layers.11.self_attn.attn": 11}
    assert layer_indices(["model.layers.0.attn", "model.layers.0.cross_attn"]) is None  # two share 0
    assert layer_indices(["decoder.attn"]) is None
    assert layer_indices(["model.layers.1.experts.3.attn"]) is None


def test_step_pairs_pair_only_the_running_steps_further_blocks():
    from kvlink.vllm.metadata import GroupTable

    tables = (GroupTable(0, (5, 6, 7, 8), 0, 4),)
    assert step_pairs("r", tables, ((11,),), ((12, 13),)) == [(0, 6, 12), (0, 7, 13)]
    with pytest.raises(PairingError, match="KV cache group"):
        step_pairs("r", tables, ((11,),), ((12,), (13,)))


# ----- decode: pieces into the pull table -----------------------------------------------------------------


def spec(rid: str, blocks=(1, 2, 3, 4)):
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    src = RemoteSource(bootstrap_url=URL, transfer_id="t-" + rid)
    return PullSpec(rid, tuple(blocks), 0, src, num_blocks=len(blocks))


def lease(rid: str) -> Lease:
    return Lease(URL, ENGINE, "p-" + rid, 30.0)


def posts(actions) -> list[Post]:
    return [a for a in actions if isinstance(a, Post)]


def pairs_of(post: Post) -> list[tuple[int, int, int]]:
    """(group, local, remote) of a post that reads whole blocks."""
    (p,) = post.pulls
    assert all(pr[3:] == (0, ALL_LAYERS) for pr in p.pairs), p.pairs
    return sorted(pr[:3] for pr in p.pairs)


def end_batch(t: PullTable, post: Post, now: float):
    t.posted(post.batch, "h", 1, 1, 1, now)
    return t.batch_ended(post.batch, None, now)


def test_pieces_are_read_as_they_come_and_the_record_leaves_only_the_tail():
    t = PullTable(60.0)
    assert [type(a) for a in t.submit(spec("a"), 0.0)] == [Resolve]
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11), (0, 2, 12)], 0, 0.1))
    assert pairs_of(post) == [(0, 1, 11), (0, 2, 12)]
    assert t.piece("a", REMOTE, [(0, 1, 11), (0, 2, 12), (0, 3, 13)], 0, 0.15) == []  # one batch at a time
    (post2,) = posts(end_batch(t, post, 0.2))  # ...block 3 goes next, blocks 1-2 are not read again
    assert pairs_of(post2) == [(0, 3, 13)]
    assert posts(end_batch(t, post2, 0.3)) == [] and t.state("a") is State.RESOLVING  # waits for more
    assert posts(t.piece("a", REMOTE, [(0, 1, 11), (0, 2, 12), (0, 3, 13)], 0, 0.35)) == []  # a duplicate
    acts = t.resolved("a", REMOTE, [(0, 1, 11), (0, 2, 12), (0, 3, 13), (0, 4, 14)], lease("a"), 30.4, 99.0,
                      0.4)
    (tail,) = posts(acts)
    assert pairs_of(tail) == [(0, 4, 14)]  # the end of the stream: only the tail moves
    end_batch(t, tail, 0.5)
    r = t.take_results(1.0)
    assert r.done == {"a"} and not r.failed
    counts, samples = t.take_stats()
    assert counts["blocks_streamed"] == 3 and counts["pieces"] == 3 and len(samples["tail_s"]) == 1


def test_everything_streamed_before_the_record_is_done_at_once():
    t = PullTable(60.0)
    t.submit(spec("a", (1, 2)), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11), (0, 2, 12)], 0, 0.1))
    end_batch(t, post, 0.2)
    assert posts(t.resolved("a", REMOTE, [(0, 1, 11), (0, 2, 12)], lease("a"), 30.3, 99.0, 0.3)) == []
    assert t.take_results(1.0).done == {"a"}


def test_a_record_of_another_epoch_or_other_blocks_reads_those_again():
    t = PullTable(60.0)
    t.submit(spec("a", (1, 2)), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11), (0, 2, 12)], 0, 0.1))
    end_batch(t, post, 0.2)
    (tail,) = posts(t.resolved("a", REMOTE, [(0, 1, 11), (0, 2, 12)], lease("a"), 30.3, 99.0, 0.3, epoch=1))
    assert pairs_of(tail) == [(0, 1, 11), (0, 2, 12)]  # prefill restarted it: the earlier reads may be stale
    t2 = PullTable(60.0)
    t2.submit(spec("b", (1, 2)), 0.0)
    (post,) = posts(t2.piece("b", REMOTE, [(0, 1, 11), (0, 2, 12)], 0, 0.1))
    end_batch(t2, post, 0.2)
    (tail,) = posts(t2.resolved("b", REMOTE, [(0, 1, 11), (0, 2, 19)], lease("b"), 30.3, 99.0, 0.3))
    assert pairs_of(tail) == [(0, 2, 19)]


def test_a_restart_while_a_piece_is_on_the_wire_does_not_count_that_read():
    t = PullTable(60.0)
    t.submit(spec("a", (1, 2)), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11)], 0, 0.1))
    t.posted(post.batch, "h", 1, 1, 1, 0.1)
    assert t.piece("a", REMOTE, [(0, 1, 11)], 1, 0.15) == []  # same block, new epoch: queued again
    (again,) = posts(t.batch_ended(post.batch, None, 0.2))
    assert pairs_of(again) == [(0, 1, 11)]


def test_cancel_mid_stream_waits_for_the_batch_on_the_wire_then_drops_later_pieces():
    t = PullTable(60.0)
    t.submit(spec("a"), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11)], 0, 0.1))
    t.posted(post.batch, "h", 1, 1, 1, 0.1)
    assert t.cancel("a", 0.2) == [CancelBatch(post.batch, "h")]
    assert t.state("a") is State.SETTLING and t.take_results(0.3).done == set()  # blocks not given back yet
    assert t.piece("a", REMOTE, [(0, 2, 12)], 0, 0.3) == []
    t.cancel_settled(post.batch, 0.4)
    assert t.take_results(0.5).done == {"a"}  # only now: nothing writes into its blocks any more
    assert t.piece("a", REMOTE, [(0, 2, 12)], 0, 0.6) == []
    assert t.take_stats()[0]["pieces_dropped"] == 2


def test_cancel_between_pieces_is_immediate_and_the_deadline_covers_the_stream():
    t = PullTable(5.0)
    t.submit(spec("a"), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11)], 0, 0.1))
    end_batch(t, post, 0.2)
    t.tick(6.0)  # prefill went silent mid-stream: the pull fails at its deadline
    r = t.take_results(6.1)
    assert "a" in r.failed and r.failed["a"] == (1, 2, 3, 4)


def test_ready_pairs_pairs_only_the_positions_prefill_finished():
    from kvlink.vllm.metadata import GroupTable

    tables = (GroupTable(0, (5, 6, 7, 8), 1, 4),)  # position 0 is in decode's prefix cache
    assert ready_pairs("r", tables, ((11, 12, 13),)) == [(0, 6, 12), (0, 7, 13)]
    assert ready_pairs("r", tables, ((),)) == []
    with pytest.raises(PairingError):
        ready_pairs("r", tables, ((11,), (12,)))


# ----- decode: layer-wise pieces ---------------------------------------------------------------------------


def ranges_of(post: Post):
    (p,) = post.pulls
    return sorted(p.pairs)


def test_layer_wise_pieces_read_each_positions_next_layers_and_the_record_the_rest():
    t = PullTable(60.0)
    t.submit(spec("a"), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11), (0, 2, 12, 1)], 0, 0.1))  # 1 whole, 2: layer 0 done
    assert ranges_of(post) == [(0, 1, 11, 0, ALL_LAYERS), (0, 2, 12, 0, 1)]
    assert t.piece("a", REMOTE, [(0, 1, 11), (0, 2, 12, 3), (0, 3, 13, 3)], 0, 0.15) == []  # batch on the wire
    (post2,) = posts(end_batch(t, post, 0.2))
    assert ranges_of(post2) == [(0, 2, 12, 1, 3), (0, 3, 13, 0, 3)]  # from the first layer not read yet
    assert posts(t.piece("a", REMOTE, [(0, 2, 12, 2)], 0, 0.25)) == []  # older news (all on the wire)
    end_batch(t, post2, 0.3)
    (tail,) = posts(t.resolved("a", REMOTE, [(0, 1, 11), (0, 2, 12), (0, 3, 13), (0, 4, 14)], lease("a"), 30.4,
                               99.0, 0.4))
    assert ranges_of(tail) == [(0, 2, 12, 3, ALL_LAYERS), (0, 3, 13, 3, ALL_LAYERS), (0, 4, 14, 0, ALL_LAYERS)]
    end_batch(t, tail, 0.5)
    assert t.take_results(1.0).done == {"a"}


def test_layer_ranges_of_a_batch_that_did_not_carry_them_are_read_again_with_what_queued_meanwhile():
    """The staging pool had no room for the pull (post_split): what its batch was to read is read again, in one
    range with the layers that were queued meanwhile."""
    t = PullTable(60.0)
    t.submit(spec("a"), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11, 2)], 0, 0.1))
    assert t.piece("a", REMOTE, [(0, 1, 11, 5), (0, 2, 12, 5)], 0, 0.15) == []  # queued: layers 2..5
    t.post_split(post.batch, ["a"], {}, 0.2)
    (again,) = posts(t.take_posts(0.2))
    assert ranges_of(again) == [(0, 1, 11, 0, 5), (0, 2, 12, 0, 5)]


def test_a_record_from_another_engine_object_does_not_trust_the_read_on_the_wire():
    """Streamed from one engine object, the record through another (a reconnect): everything is read again,
    including the layers a batch still on the wire from the first one brings in after the record."""
    t = PullTable(60.0)
    t.submit(spec("a", (1,)), 0.0)
    (post,) = posts(t.piece("a", REMOTE, [(0, 1, 11, 5)], 0, 0.1))
    (post2,) = posts(t.piece("a", REMOTE, [(0, 1, 11, 8)], 0, 0.15) + end_batch(t, post, 0.2))
    assert ranges_of(post2) == [(0, 1, 11, 5, 8)]
    t.posted(post2.batch, "h", 1, 1, 1, 0.2)
    assert posts(t.resolved("a", "remote-B", [(0, 1, 11)], lease("a"), 30.3, 99.0, 0.3)) == []  # one batch
    (again,) = posts(t.batch_ended(post2.batch, None, 0.4))
    assert again.remote == "remote-B" and ranges_of(again) == [(0, 1, 11, 0, ALL_LAYERS)]
    assert t.take_results(0.5).done == set()
    end_batch(t, again, 0.6)
    assert t.take_results(1.0).done == {"a"}


def test_every_piece_of_a_streamed_request_carries_its_whole_prompts_digest():
    from kvlink.vllm.stream import StreamPlanner

    pl = StreamPlanner(32)
    pl.track("r", "t", 100, prompt_sha="ab" * 16)
    pl.track("s", "u", 100)
    specs = pl.step([("r", [1, 2, 3, 4], 0), ("s", [5, 6, 7, 8], 0)], [], {"r": 64, "s": 64})
    assert [(sp.request_id, sp.prompt_sha, sp.prompt_tokens) for sp in specs] == [("r", "ab" * 16, 100),
                                                                                  ("s", None, 100)]
    fields = [Piece(sp, sp.index).fields() for sp in specs]
    assert (fields[0]["prompt_sha"], fields[0]["prompt_tokens"]) == ("ab" * 16, 100)
    assert "prompt_sha" not in fields[1] and "prompt_tokens" not in fields[1]
    pl.track("r", "t", 100)  # restarted (preempted): a new epoch, the same prompt
    specs = pl.step([("r", [9, 10, 11, 12], 0)], [], {"r": 64})
    assert specs[0].prompt_sha == "ab" * 16 and specs[0].epoch == 1


@pytest.mark.parametrize("order", ["kvlink first", "kvlink last", "alone"])
def test_a_layer_is_announced_on_entry_only_where_no_connector_after_kvlink_may_load_it(monkeypatch, order):
    """vLLM's MultiConnector calls its children's layer hooks in their order, and a child that loads a prefix
    hit layer by layer (an offloader on prefill) puts layer k in place in its own ``wait_for_layer_load(k)``.
    Announced on entry (kvlink's wait_for_layer_load), before that child's, a piece would tell decode the
    prefix's blocks hold the layer while they do not: kvlink then announces on exit (after every child's
    wait and the attention op). Last, or alone, it keeps announcing on entry."""
    from types import SimpleNamespace

    import vllm.distributed.kv_transfer as kvt

    from kvlink.vllm import connector as conn_mod
    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.connector import KVLinkConnector
    from kvlink.vllm.metadata import KVLinkMetadata

    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    loaded, announced = set(), []

    class Worker:
        def send_pieces(self, specs, layer_name=None):
            if layer_name is not None:
                announced.append((layer_name, layer_name in loaded))

    class Loader:  # loads layer k in its wait_for_layer_load(k)
        def wait_for_layer_load(self, layer_name):
            loaded.add(layer_name)

        def save_kv_layer(self, *a, **k):
            pass

    monkeypatch.setattr(conn_mod, "kv_written_before_attention", lambda name: True)  # vLLM's Attention
    kvl = KVLinkConnector.__new__(KVLinkConnector)
    kvl.config, kvl._worker, kvl._written_first, kvl._entry_safe = ConnectorConfig(), Worker(), {}, None
    kvl._connector_metadata = None
    spec = StreamSpec("r", "t", 1, 0, 64, (1, 2, 3, 4), whole=0, last=True, block_size=16)
    kvl.bind_connector_metadata(KVLinkMetadata(streams=[spec]))
    children = {"kvlink first": [kvl, Loader()], "kvlink last": [Loader(), kvl], "alone": [kvl]}[order]
    group = kvl if order == "alone" else SimpleNamespace(_connectors=children)
    monkeypatch.setattr(kvt, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kvt, "get_kv_transfer_group", lambda: group)
    for n in names:
        for c in children:
            c.wait_for_layer_load(n)
        entered = len(announced)
        for c in children:
            c.save_kv_layer(n, None, None)
        assert len(announced) == entered + (order == "kvlink first")  # on exit only where a child follows
    assert [n for n, _ in announced] == names
    assert all(ready for _, ready in announced) or order == "alone"  # (alone: nothing else loads)
