"""Streamed pieces at the pairing table (kvlink/bootstrap/streams.py), against a fake clock: duplicates,
reordering, restarts, several ranks, the end of a stream, and decode's long-poll view of it."""

from __future__ import annotations

import pytest

from kvlink.bootstrap import Conflict, RequestRecord, RequestStatus
from kvlink.bootstrap.schema import StreamPiece
from kvlink.bootstrap.streams import PieceStatus, StreamBook


def piece(index, tokens, blocks, epoch=0, tid="t", rid="r"):
    return StreamPiece(transfer_id=tid, request_id=rid, index=index, epoch=epoch, num_tokens=tokens,
                       block_ids=[list(blocks)])


@pytest.fixture
def engine(table, make_registration):
    table.register_engine(make_registration("E"), lease_s=600.0)
    return "E"


@pytest.fixture
def engine2(table, make_registration):
    """An engine of two TP ranks."""
    for r in range(2):
        table.register_engine(make_registration("E2", tp_rank=r, tp_size=2, port=5000 + r), lease_s=600.0)
    return "E2"


def partial(table, after=0):
    found = table.lookup_transfer("t", after)
    return found if isinstance(found, RequestRecord) else None


def test_a_duplicate_piece_is_applied_once_first_arrival_wins(table, engine):
    assert table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])]) == []
    first = partial(table)
    assert (first.partial, first.version, first.block_ids, first.num_tokens) == (True, 1, [[5]], 32)
    # the same index again, even with other content: ignored, counted
    table.stream_pieces(engine, 0, 1, [piece(1, 64, [5, 9])])
    assert partial(table) == first and table.streams.stats.duplicates == 1


def test_reordered_pieces_never_move_progress_back(table, engine):
    table.stream_pieces(engine, 0, 1, [piece(2, 64, [5, 6])])
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])])  # late: index below the last applied
    rec = partial(table)
    assert (rec.version, rec.num_tokens, rec.block_ids) == (1, 64, [[5, 6]])
    assert partial(table, after=1) is None  # nothing newer than what decode has


def test_indices_keep_growing_across_a_restart_and_an_old_epoch_is_stale(table, engine):
    table.stream_pieces(engine, 0, 1, [piece(1, 64, [5, 6])])
    table.stream_pieces(engine, 0, 1, [piece(2, 32, [8], epoch=1)])  # preempted, restarted in block 8
    rec = partial(table)
    assert (rec.epoch, rec.num_tokens, rec.block_ids) == (1, 32, [[8]])
    table.stream_pieces(engine, 0, 1, [piece(3, 64, [5, 6], epoch=0)])  # a straggler of the old run
    assert partial(table).epoch == 1 and table.streams.stats.stale == 1


def test_every_rank_must_report_and_decode_sees_the_least_progress(table, engine2):
    engine = engine2
    table.stream_pieces(engine, 0, 2, [piece(1, 96, [5, 6, 7])])
    assert partial(table) is None  # rank 1 has not said its KV is in place
    table.stream_pieces(engine, 1, 2, [piece(1, 64, [5, 6])])
    rec = partial(table)
    assert (rec.num_tokens, rec.block_ids) == (64, [[5, 6]])
    table.stream_pieces(engine, 1, 2, [piece(2, 128, [5, 6, 7, 8])])
    assert partial(table).num_tokens == 96


def test_the_published_record_ends_the_stream_and_later_pieces_are_dropped(table, engine):
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])])
    table.publish(engine, "r", [[5, 6]], 50, 30.0, transfer_id="t", epoch=0)
    rec = table.lookup_transfer("t", 1)
    assert not rec.partial and rec.block_ids == [[5, 6]] and rec.lease_remaining_s > 0
    assert table.stream_pieces(engine, 0, 1, [piece(2, 64, [5, 6])]) == ["t"]  # prefill: stop sending
    assert table.streams.stats.dropped == 1
    assert table.lookup_transfer("t", 1).partial is False


def test_decode_stopping_a_stream_tells_prefill_to_stop(table, engine):
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5]), piece(1, 32, [7], tid="u", rid="r2")])
    assert table.stop_stream("t") is False and table.stop_stream("t") is True
    assert table.stream_pieces(engine, 0, 1, [piece(2, 64, [5, 6]), piece(2, 64, [7, 8], tid="u", rid="r2")]) == ["t"]
    assert table.lookup_transfer("t", 0) is RequestStatus.UNKNOWN  # decode waits for the record (or gives up)
    assert table.streams.stats.stopped == 1


def test_an_abandoned_transfer_ends_its_stream(table, engine):
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])])
    table.abandon_transfer(engine, "t")
    assert table.lookup_transfer("t", 0) is RequestStatus.RELEASED
    assert table.stream_pieces(engine, 0, 1, [piece(2, 64, [5, 6])]) == ["t"]


def test_a_piece_under_a_transfer_id_another_request_streams_is_refused_alone(table, engine, make_registration):
    """The conflicting piece is not applied and its transfer is answered ended; the other pieces of the call
    (other requests' progress) still apply."""
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])])
    got = table.stream_pieces(engine, 0, 1, [piece(2, 64, [7], rid="other"), piece(1, 32, [9], tid="u", rid="g")])
    assert got == ["t"] and table.stats.conflicts == 1
    rec = partial(table)
    assert (rec.request_id, rec.version, rec.block_ids) == ("r", 1, [[5]])  # r's stream, untouched
    assert table.lookup_transfer("u", 0).block_ids == [[9]]
    table.register_engine(make_registration("B"), lease_s=600.0)  # another engine: the same
    assert table.stream_pieces("B", 0, 1, [piece(1, 32, [3]), piece(1, 16, [4], tid="v", rid="w")]) == ["t"]
    assert partial(table).engine_id == engine and table.lookup_transfer("v", 0).engine_id == "B"
    assert table.stats.conflicts == 2


def test_abandon_of_a_streamed_transfer_names_its_engine_and_request(table, engine):
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])])
    with pytest.raises(Conflict) as err:
        table.abandon_transfer(engine, "t", request_id="other")  # a sibling under the same id
    assert err.value.field == "request_id"
    with pytest.raises(Conflict) as err:
        table.abandon_transfer(None, "t")  # the proxy, without the engine
    assert err.value.field == "engine_id" and repr(engine) in str(err.value)
    assert partial(table) is not None and not table.streams.ended("t")  # r's stream goes on
    assert table.abandon_transfer(engine, "t", request_id="r") is False and table.streams.ended("t")


def test_pieces_need_a_registered_engine(table):
    from kvlink.bootstrap import UnknownEngine

    with pytest.raises(UnknownEngine):
        table.stream_pieces("nobody", 0, 1, [piece(1, 32, [5])])


def test_a_stream_prefill_stopped_feeding_is_forgotten_and_memory_stays_bounded():
    book = StreamBook(max_streams=3, ttl_s=10.0)
    for i in range(5):
        assert book.piece("E", 0, 1, f"t{i}", f"r{i}", 1, 0, 32, [[i]], now=float(i)) is PieceStatus.APPLIED
    assert len(book) == 3 and book.progress("t0") is None  # oldest forgotten
    book.sweep(20.0)
    assert len(book) == 0
    for i in range(5):
        book.end(f"e{i}", now=30.0)
    assert len(book._ended) == 3


# ----- layer-wise pieces ----------------------------------------------------------------------------------


def layer_piece(index, tokens, blocks, step, layers, epoch=0):
    return StreamPiece(transfer_id="t", request_id="r", index=index, epoch=epoch, num_tokens=tokens,
                       block_ids=[list(blocks)], step_block_ids=[list(step)], layers=layers)


def layered(table, after=0):
    found = table.lookup_transfer("t", after, layers=True)
    return found if isinstance(found, RequestRecord) else None


def test_layer_wise_progress_orders_by_tokens_then_layers_and_the_least_rank_wins(table, engine2):
    engine = engine2
    table.stream_pieces(engine, 0, 2, [layer_piece(1, 16, [5], [6, 7], 3)])
    assert layered(table) is None  # rank 1 has not reported
    table.stream_pieces(engine, 1, 2, [layer_piece(1, 16, [5], [6, 7], 1)])
    got = layered(table)
    assert (got.num_tokens, got.block_ids, got.step_block_ids, got.layers) == (16, [[5]], [[6, 7]], 1)
    # rank 1 finishes the step (all its layers: whole blocks now); rank 0 is still at layer 3 of it
    table.stream_pieces(engine, 1, 2, [piece(2, 48, [5, 6, 7])])
    assert layered(table).layers == 3 and layered(table).num_tokens == 16
    table.stream_pieces(engine, 0, 2, [piece(2, 48, [5, 6, 7])])
    got = layered(table)
    assert (got.num_tokens, got.block_ids, got.step_block_ids, got.layers) == (48, [[5, 6, 7]], [], 0)


def test_a_reader_without_layers_sees_whole_blocks_versioned_by_them(table, engine):
    table.stream_pieces(engine, 0, 1, [piece(1, 16, [5])])
    whole = partial(table)
    assert (whole.version, whole.step_block_ids, whole.layers) == (1, [], 0)
    for layers in (1, 2, 3):  # layers of the next step: a new version for the layer-wise reader only
        table.stream_pieces(engine, 0, 1, [layer_piece(1 + layers, 16, [5], [6], layers)])
        assert partial(table, after=whole.version) is None
    assert layered(table).layers == 3 and layered(table).version == 4
    table.stream_pieces(engine, 0, 1, [piece(9, 32, [5, 6])])
    assert (partial(table, after=whole.version).version, partial(table).block_ids) == (2, [[5, 6]])


def test_a_layer_piece_without_step_blocks_or_layers_is_whole_blocks_only(table, engine):
    table.stream_pieces(engine, 0, 1, [layer_piece(1, 16, [5], [], 4)])
    table.stream_pieces(engine, 0, 1, [layer_piece(2, 16, [5], [6], 0)])
    got = layered(table)
    assert (got.num_tokens, got.step_block_ids, got.layers) == (16, [], 0)


def test_a_piece_whose_step_blocks_name_other_groups_is_refused():
    with pytest.raises(ValueError, match="step_block_ids"):
        StreamPiece(transfer_id="t", request_id="r", index=1, num_tokens=16, block_ids=[[5]],
                    step_block_ids=[[6], [7]], layers=1)


def test_pieces_must_count_the_ranks_the_engine_registered(table, engine, engine2):
    """A worker that says its engine has one rank when it has two would make decode read blocks the other
    rank has not written yet: refused, naming the field."""
    from kvlink.bootstrap import InvalidField

    with pytest.raises(InvalidField) as err:
        table.stream_pieces(engine2, 0, 1, [piece(1, 32, [5])])
    assert err.value.field == "ranks" and "TP=2" in str(err.value)
    with pytest.raises(InvalidField) as err:
        table.stream_pieces(engine2, 2, 2, [piece(1, 32, [5])])
    assert err.value.field == "rank"
    assert table.lookup_transfer("t", 0) is not None and partial(table) is None


def test_another_engine_cannot_abandon_a_transfer_it_does_not_stream(table, engine, make_registration):
    table.register_engine(make_registration("B"), lease_s=600.0)
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])])
    with pytest.raises(Conflict):
        table.abandon_transfer("B", "t")
    assert partial(table) is not None and not table.streams.ended("t")  # E's stream goes on
    assert table.abandon_transfer(engine, "t") is False and table.streams.ended("t")


def test_a_rank_re_registered_elsewhere_ends_what_its_old_process_streamed(table, engine, make_registration):
    """The old process's blocks are gone: its progress must not send decode to read them from the new one."""
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [5])])
    assert partial(table) is not None
    table.register_engine(make_registration("E", port=6000), lease_s=600.0)
    assert partial(table) is None and table.streams.ended("t")


def test_the_sweep_forgets_streams_untouched_for_the_ttl_oldest_first_and_a_piece_renews_one():
    """Streams are kept least recently touched first, so the sweep stops at the first recent one (a new
    stream costs no scan of the others)."""
    book = StreamBook(max_streams=1000, ttl_s=10.0)
    for i in range(500):
        book.piece("E", 0, 1, f"t{i}", "r", 1, 0, 16, [[1]], now=float(i) / 100)
    book.piece("E", 0, 1, "t0", "r", 2, 0, 32, [[1, 2]], now=9.0)  # touched: now the most recent
    book.piece("E", 0, 1, "new", "r", 1, 0, 16, [[1]], now=12.0)  # t1..t199 are 10 s old: swept
    assert "t0" in book._live and "t200" not in book._live and "t201" in book._live
    assert list(book._live)[-2:] == ["t0", "new"]


def test_the_prompt_digest_of_a_stream_reaches_decode_with_its_first_progress(table, engine):
    sha = "c0ffee" * 5 + "00"
    first = StreamPiece(transfer_id="t", request_id="r", index=1, num_tokens=32, block_ids=[[5]], prompt_sha=sha,
                        prompt_tokens=500)
    table.stream_pieces(engine, 0, 1, [first])
    rec = partial(table)
    assert (rec.prompt_sha, rec.prompt_tokens) == (sha, 500)
    table.stream_pieces(engine, 0, 1, [piece(2, 64, [5, 9])])  # a later piece without it: kept from the first
    assert (partial(table, 1).prompt_sha, partial(table, 1).prompt_tokens) == (sha, 500)
    table.stream_pieces(engine, 0, 1, [piece(1, 32, [7], tid="u", rid="q")])  # a stream without one: none
    found = table.lookup_transfer("u", 0)
    assert found.prompt_sha is None and found.prompt_tokens == 0
