"""The pairing table alone, against a fake clock: leases, expiry, conflicts, grouped lookups, outcomes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.bootstrap import (
    Conflict,
    InvalidField,
    Outcome,
    PairingTable,
    RequestExpired,
    RequestRecord,
    RequestReleased,
    RequestStatus,
    TableFull,
    TableLimits,
    UnknownEngine,
    UnknownRequest,
)
from tests.fakes import FakeClock


@pytest.fixture
def engine(table, make_registration):
    table.register_engine(make_registration("E"), lease_s=600.0)
    return "E"


def outcomes(table: PairingTable, engine_id: str, ack: int = 0) -> list[tuple[str, Outcome]]:
    return [(r.request_id, r.outcome) for r in table.poll_released(engine_id, table.server_id, ack).released]


# ----- engines ----------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_renews(table, clock, make_registration):
    reg = make_registration("E")
    assert table.register_engine(reg, 10.0) is True
    clock.advance(8)
    assert table.register_engine(reg, 10.0) is False  # same layout: a renewal
    clock.advance(8)
    assert table.get_engine("E") == reg
    assert table.num_engine_ranks == 1


def test_register_other_layout_conflicts_and_keeps_the_first(table, make_registration):
    table.register_engine(make_registration("E", num_blocks=1024), 10.0)
    with pytest.raises(Conflict) as err:
        table.register_engine(make_registration("E", num_blocks=2048), 10.0)
    assert err.value.field == "registration.layers"
    assert table.get_engine("E").layers[0].num_blocks == 1024
    with pytest.raises(Conflict) as err:
        table.register_engine(make_registration("E", compat_hash="other"), 10.0)
    assert err.value.field == "registration.compat_hash"


def test_conflicting_layout_is_accepted_after_the_old_lease_ran_out(table, clock, make_registration):
    table.register_engine(make_registration("E", num_blocks=1024), 10.0)
    clock.advance(10)
    assert table.register_engine(make_registration("E", num_blocks=2048), 10.0) is True


def test_ranks_of_one_engine_must_agree_on_sizes(table, make_registration):
    table.register_engine(make_registration("E", tp_rank=0, tp_size=2), 10.0)
    with pytest.raises(Conflict) as err:
        table.register_engine(make_registration("E", tp_rank=1, tp_size=4), 10.0)
    assert err.value.field == "registration.tp_size"
    table.register_engine(make_registration("E", tp_rank=1, tp_size=2, port=5001), 10.0)
    assert [r.tp_rank for r in table.engine_ranks("E")] == [0, 1]


def test_engine_lease_runs_out_without_heartbeat(table, clock, make_registration):
    table.register_engine(make_registration("E"), 10.0)
    for _ in range(5):
        clock.advance(6)
        assert table.heartbeat("E") == 10.0
    clock.advance(10)
    with pytest.raises(UnknownEngine):
        table.heartbeat("E")
    with pytest.raises(UnknownEngine):
        table.get_engine("E")
    assert table.stats.engines_expired == 1


def test_unknown_rank_of_known_engine(table, engine):
    with pytest.raises(UnknownEngine) as err:
        table.get_engine(engine, tp_rank=3)
    assert err.value.field == "engine_id"


def test_engine_death_expires_its_requests(table, clock, make_registration):
    engine = "E"
    table.register_engine(make_registration(engine), 10.0)
    table.publish(engine, "r1", [[1]], 16, lease_s=100.0, transfer_id="t1")
    clock.advance(11)  # the engine's lease (10 s) ran out, the request's (100 s) did not
    with pytest.raises(UnknownEngine):
        table.lookup(engine, ["r1"])
    assert table.lookup_transfer("t1") is RequestStatus.EXPIRED
    table.register_engine(make_registration("E"), 10.0)
    assert table.lookup(engine, ["r1"]).expired == ["r1"]


def test_new_address_drops_the_old_processes_requests(table, engine, make_registration):
    table.publish(engine, "r1", [[1, 2]], 32, lease_s=30.0)
    assert table.register_engine(make_registration("E", port=6000), 10.0) is False
    assert table.get_engine("E").transport_addr == "127.0.0.1:6000"
    assert table.lookup(engine, ["r1"]).expired == ["r1"]


def test_a_restart_at_the_same_address_is_told_by_its_instance_and_drops_the_old_processes_records(
        table, clock, make_registration):
    """A prefill process restarted at a fixed transport port registers an identical rank: only its instance
    (random per process) says the old process's block ids mean nothing any more."""
    table.register_engine(make_registration("E", instance="proc-1"), 15.0)
    table.publish("E", "r1", [[5, 6, 7]], 48, lease_s=30.0, transfer_id="t1")
    clock.advance(3)
    assert table.register_engine(make_registration("E", instance="proc-1"), 15.0) is False  # a renewal
    assert isinstance(table.lookup_transfer("t1"), RequestRecord)
    assert table.register_engine(make_registration("E", instance="proc-2"), 15.0) is False  # a new process
    assert table.lookup_transfer("t1") is RequestStatus.EXPIRED
    assert table.lookup("E", ["r1"]).expired == ["r1"] and outcomes(table, "E") == []
    assert table.get_engine("E").instance == "proc-2"
    table.publish("E", "r2", [[1]], 16, transfer_id="t2")
    assert table.register_engine(make_registration("E"), 15.0) is False  # no instance: as before, a renewal
    assert table.lookup("E", ["r2"]).ready and table.get_engine("E").instance == "proc-2"


def test_a_replaced_process_can_no_longer_publish_stream_or_keep_the_new_ones_lease(table, clock, make_registration):
    """A rolling restart under one engine id: B (another start, another address) registers while A still
    finishes its requests. A's publishes and pieces would name block ids that decode reads from B's memory
    (its lookup of the engine answers B): refused, nothing stored. A's heartbeat no longer renews B's rank.
    B's own, and senders that name no launch (older ones), pass."""
    from kvlink.bootstrap.schema import StreamPiece

    table.register_engine(make_registration("E", instance="a-0", launch="A"), 15.0)
    table.publish("E", "r1", [[5, 6]], 32, transfer_id="t1", launch="A")
    table.register_engine(make_registration("E", port=6000, instance="b-0", launch="B"), 15.0)
    assert table.lookup_transfer("t1") is RequestStatus.EXPIRED  # B's registration dropped A's record
    with pytest.raises(Conflict) as err:
        table.publish("E", "r2", [[7, 8]], 32, transfer_id="t2", launch="A")
    assert err.value.field == "launch" and "'A'" in err.value.message and "'B'" in err.value.message
    assert table.lookup_transfer("t2") is RequestStatus.UNKNOWN and table.lookup("E", ["r2"]).unknown == ["r2"]
    piece = StreamPiece(transfer_id="t3", request_id="r3", index=1, num_tokens=16, block_ids=[[9]])
    with pytest.raises(Conflict):
        table.stream_pieces("E", 0, 1, [piece], launch="A")
    assert table.lookup_transfer("t3", after=0) is RequestStatus.UNKNOWN
    clock.advance(10)
    with pytest.raises(Conflict) as err:
        table.heartbeat("E", instance="a-0")
    assert err.value.field == "instance"
    clock.advance(6)  # B never renewed: A's refused heartbeat did not keep B's rank alive
    with pytest.raises(UnknownEngine):
        table.get_engine("E")
    table.register_engine(make_registration("E", port=6000, instance="b-0", launch="B"), 15.0)
    assert table.heartbeat("E", instance="b-0") == 15.0 and table.heartbeat("E") == 15.0
    table.publish("E", "r4", [[1]], 16, launch="B")
    table.publish("E", "r5", [[2]], 16)  # no launch named: not fenced
    assert table.stream_pieces("E", 0, 1, [piece], launch="B") == []
    assert {r.request_id for r in table.lookup("E", ["r4", "r5"]).ready} == {"r4", "r5"}
    # Records name the launch whose memory their block ids are in (decode reads them only through its ranks):
    # the publisher's, or for streamed progress the ranks' (pieces of another launch are refused).
    assert {r.request_id: r.launch for r in table.lookup("E", ["r4", "r5"]).ready} == {"r4": "B", "r5": None}
    assert table.lookup_transfer("t3", after=0).launch == "B"


def test_a_replaced_process_polling_takes_none_of_the_new_ones_outcomes(table, clock, make_registration):
    """A rolling restart: A still polls for outcomes under the engine id after B registered. A's poll would
    acknowledge B's outcomes (B would never free those blocks on word from the server) and would count as the
    engine being in touch, so a renewal would promise B's blocks past what a cut-off B holds (_hold_cap).
    Refused, nothing acknowledged and nothing counted; B's own polls and unnamed (older) ones pass."""
    table.register_engine(make_registration("E", instance="a-0", launch="A"), 600.0)
    table.register_engine(make_registration("E", port=6000, instance="b-0", launch="B"), 600.0)
    table.publish("E", "r1", [[1]], 16, lease_s=30.0, launch="B")
    table.publish("E", "r2", [[2]], 16, lease_s=30.0, launch="B")
    table.release("E", "r1", Outcome.PULLED)
    table.poll_released("E", launch="B")  # at 0, then B goes silent; A keeps polling
    clock.advance(25)
    with pytest.raises(Conflict) as err:
        table.poll_released("E", table.server_id, 10**6, launch="A")
    assert err.value.field == "launch" and "nothing acknowledged" in err.value.message
    answer = table.renew("E", ["r2"], lease_s=30.0)
    assert answer.renewed == ["r2"] and answer.lease_s == pytest.approx(20.0)  # until B's hold (45), not 55
    (first,) = table.poll_released("E", launch="B").released
    assert (first.request_id, first.outcome) == ("r1", Outcome.PULLED)  # A acknowledged nothing
    assert [r.request_id for r in table.poll_released("E", table.server_id, 0).released] == ["r1"]  # unnamed


@pytest.mark.parametrize("gone", ["restart", "lapse", "unregister"])
def test_a_stream_whose_process_is_gone_ends_for_its_waiters_at_once(table, clock, make_registration, gone):
    """A prefill streamed request t1 and never published it, then its process went away: restarted (another
    instance registers), its registration lapsed, or it unregistered. No process will publish t1 (a new one
    is refused, 410), so decode's long poll for it is woken and hears "expired", instead of waiting its
    whole poll for nothing. A stream of another engine goes on."""
    from kvlink.bootstrap.schema import StreamPiece

    ended = []
    table.on_transfer_end = ended.append
    table.register_engine(make_registration("E", instance="a-0"), 15.0)
    table.register_engine(make_registration("F"), 60.0)
    piece = StreamPiece(transfer_id="t1", request_id="r1", index=1, num_tokens=16, block_ids=[[9]])
    other = StreamPiece(transfer_id="u1", request_id="q1", index=1, num_tokens=16, block_ids=[[4]])
    assert table.stream_pieces("E", 0, 1, [piece]) == [] and table.stream_pieces("F", 0, 1, [other]) == []
    assert table.lookup_transfer("t1", after=0).partial
    if gone == "restart":
        table.register_engine(make_registration("E", instance="a-1"), 15.0)
    elif gone == "lapse":
        clock.advance(16)
        table.expire()
    else:
        table.unregister_engine("E")
    assert ended == ["t1"]
    assert table.lookup_transfer("t1", after=0) is RequestStatus.EXPIRED
    if gone == "restart":
        with pytest.raises(RequestExpired):
            table.publish("E", "r1", [[9]], 16, transfer_id="t1")
    assert table.lookup_transfer("u1", after=0).block_ids == [[4]]


def test_a_request_cannot_publish_under_a_transfer_id_another_request_streams(table, engine):
    from kvlink.bootstrap.schema import StreamPiece

    x = StreamPiece(transfer_id="t", request_id="X", index=1, num_tokens=32, block_ids=[[11, 12]])
    assert table.stream_pieces(engine, 0, 1, [x]) == []
    with pytest.raises(Conflict) as err:
        table.publish(engine, "Y", [[21, 22]], 32, transfer_id="t")
    assert err.value.field == "transfer_id" and "'X'" in err.value.message
    assert table.lookup(engine, ["Y"]).unknown == ["Y"]
    assert table.lookup_transfer("t", after=0).block_ids == [[11, 12]]  # X's stream goes on
    table.publish(engine, "X", [[11, 12]], 32, transfer_id="t")  # its own request ends it
    assert table.lookup_transfer("t").request_id == "X"


def test_block_ids_no_rank_registered_are_refused_and_cost_nothing(table, engine):
    """The engine registered 1,024 blocks a layer: no process holds block 1,024, and a list longer than the
    blocks that exist only costs the server memory (a publish of 340,000 ids near 1e9 took ~15 MiB)."""
    from kvlink.bootstrap.schema import StreamPiece

    with pytest.raises(InvalidField) as err:
        table.publish(engine, "r1", [[1, 1024]], 32)
    assert err.value.field == "block_ids[0]" and "1024" in err.value.message
    with pytest.raises(InvalidField) as err:
        table.publish(engine, "r1", [[5] * 1025], 32)
    assert "names 1025 blocks" in err.value.message
    table.publish(engine, "sw", [[0] * 3000 + [7, 8]], 32)  # a window's null positions: not blocks held
    bad = StreamPiece(transfer_id="t", request_id="r2", index=1, num_tokens=16, block_ids=[[1]],
                      step_block_ids=[[10**9]], layers=1)
    with pytest.raises(InvalidField) as err:
        table.stream_pieces(engine, 0, 1, [bad])
    assert err.value.field == "pieces[0].step_block_ids[0]"
    assert table.lookup(engine, ["r1"]).unknown == ["r1"] and table.lookup_transfer("t", after=0) is \
        RequestStatus.UNKNOWN
    table.publish(engine, "r1", [[0, 1023]], 32)  # the last block that exists


def test_outcome_numbers_never_repeat_when_an_engine_comes_back_under_its_id(table, clock, make_registration):
    """A poller that acknowledged outcomes 1..3, then the engine's lease lapsed and it registered again: its
    next outcomes must not reuse 1..3 (the server would drop them as acknowledged, the poller too)."""
    table.register_engine(make_registration("E"), 10.0)
    for i in range(3):
        table.publish("E", f"a{i}", [[i]], 16)
        table.release("E", f"a{i}", Outcome.PULLED)
    first = table.poll_released("E", table.server_id).released
    assert [r.seq for r in first] == [1, 2, 3]
    clock.advance(11)  # the engine lapsed
    table.register_engine(make_registration("E"), 10.0)
    table.publish("E", "b0", [[1]], 16)
    table.release("E", "b0", Outcome.PULLED)
    assert outcomes(table, "E", ack=3) == [("b0", Outcome.PULLED)]


def test_registrations_without_an_instance_at_the_same_address_are_renewals(table, make_registration):
    table.register_engine(make_registration("E"), 15.0)
    table.publish("E", "r1", [[1]], 16)
    assert table.register_engine(make_registration("E", instance="proc-1"), 15.0) is False  # one that says so
    assert table.lookup("E", ["r1"]).expired == ["r1"]
    table.publish("E", "r2", [[1]], 16)
    assert table.register_engine(make_registration("E"), 15.0) is False
    assert table.lookup("E", ["r2"]).ready


def test_a_restart_at_the_same_address_without_an_instance_is_told_by_its_launch(table, make_registration):
    """A registrant that sends no instance (not a kvlink worker) restarted at a fixed port: its new launch says
    the old records name another process's blocks. They end (a decode's launch check would pass them), and
    the new launch publishes (refused 409 while the old registration stood)."""
    table.register_engine(make_registration("E", launch="L1"), 30.0)
    table.publish("E", "old", [[1, 2]], 32, lease_s=30.0, transfer_id="t-old", launch="L1")
    assert table.register_engine(make_registration("E", launch="L1"), 30.0) is False  # a renewal
    assert isinstance(table.lookup_transfer("t-old", peek=True), RequestRecord)
    table.register_engine(make_registration("E", launch="L2"), 30.0)
    assert table.get_engine("E").launch == "L2"
    assert table.lookup_transfer("t-old", peek=True) is RequestStatus.EXPIRED
    table.publish("E", "new", [[3]], 16, lease_s=30.0, launch="L2")
    assert table.lookup("E", ["new"]).ready


def test_an_engine_registers_at_most_max_ranks_per_engine(clock, make_registration):
    table = PairingTable(TableLimits(max_ranks_per_engine=2), clock=clock)
    for r in range(2):
        table.register_engine(make_registration("E", tp_rank=r, tp_size=4, port=5000 + r), lease_s=10.0)
    with pytest.raises(TableFull) as err:
        table.register_engine(make_registration("E", tp_rank=2, tp_size=4, port=5002), lease_s=10.0)
    assert err.value.status == 429 and err.value.code == "table_full"
    assert err.value.field == "registration.engine_id" and "max_ranks_per_engine" in str(err.value)
    assert table.num_engine_ranks == 2 and table.stats.refused_full == 1
    table.register_engine(make_registration("E", tp_rank=0, tp_size=4, port=5000), lease_s=10.0)  # a renewal
    table.register_engine(make_registration("F"), lease_s=10.0)  # another engine has room of its own
    table.unregister_engine("E", tp_rank=1)
    assert table.register_engine(make_registration("E", tp_rank=2, tp_size=4, port=5002), lease_s=10.0) is True


def test_unregister_last_rank_removes_engine(table, engine):
    table.publish(engine, "r1", [[1]], 16, lease_s=30.0)
    assert table.unregister_engine(engine) is True
    assert table.unregister_engine(engine) is False
    assert table.has_engine(engine) is False


def test_lease_bounds(table, make_registration, engine):
    with pytest.raises(InvalidField) as err:
        table.register_engine(make_registration("F"), 10_000.0)
    assert err.value.field == "lease_s"
    with pytest.raises(InvalidField):
        table.publish(engine, "r", [[1]], 1, lease_s=0.0)


# ----- requests ---------------------------------------------------------------------------------------------


def test_publish_needs_a_registered_engine(table):
    with pytest.raises(UnknownEngine):
        table.publish("nobody", "r1", [[1]], 16)


def test_grouped_lookup_sorts_every_id_into_one_bucket(table, clock, engine):
    table.publish(engine, "ready", [[1, 2], [3]], 40, lease_s=50.0)
    table.publish(engine, "expires", [[4]], 16, lease_s=5.0)
    table.publish(engine, "pulled", [[5]], 16, lease_s=50.0)
    table.release(engine, "pulled", Outcome.PULLED)
    clock.advance(6)
    answer = table.lookup(engine, ["ready", "expires", "pulled", "never", "ready"])
    assert [r.request_id for r in answer.ready] == ["ready"]
    record = answer.ready[0]
    assert isinstance(record, RequestRecord)
    assert record.block_ids == [[1, 2], [3]] and record.num_tokens == 40
    assert record.lease_remaining_s == pytest.approx(44.0)
    assert answer.expired == ["expires"]
    assert answer.released == ["pulled"]
    assert answer.unknown == ["never"]


def test_publish_again_renews_and_other_content_conflicts(table, clock, engine):
    table.publish(engine, "r1", [[1]], 16, lease_s=10.0, transfer_id="t1")
    clock.advance(8)
    table.publish(engine, "r1", [[1]], 16, lease_s=10.0, transfer_id="t1")
    clock.advance(8)
    assert table.lookup(engine, ["r1"]).ready
    with pytest.raises(Conflict) as err:
        table.publish(engine, "r1", [[2]], 16, lease_s=10.0, transfer_id="t1")
    assert err.value.field == "request_id"


def test_an_engine_publishes_at_most_max_requests_per_engine_live_requests(clock, make_registration):
    table = PairingTable(TableLimits(max_requests_per_engine=2), clock=clock)
    for e in ("E", "F"):
        table.register_engine(make_registration(e), lease_s=600.0)
    table.publish("E", "r1", [[1]], 16, lease_s=10.0)
    table.publish("E", "r2", [[2]], 16, transfer_id="t2")
    with pytest.raises(TableFull) as err:
        table.publish("E", "r3", [[3]], 16, transfer_id="t3")
    assert err.value.status == 429 and "max_requests_per_engine" in str(err.value)
    assert table.lookup("E", ["r3"]).unknown == ["r3"] and table.lookup_transfer("t3") is RequestStatus.UNKNOWN
    assert table.stats.refused_full == 1
    table.publish("E", "r1", [[1]], 16, lease_s=10.0)  # a renewal of a live one still goes through
    table.publish("F", "r3", [[3]], 16)  # another engine has room of its own
    table.release("E", "r2", Outcome.PULLED)
    table.publish("E", "r3", [[3]], 16)  # room again once one ended
    clock.advance(11)  # r1's lease runs out
    table.publish("E", "r4", [[4]], 16)
    assert {r.request_id for r in table.lookup("E", ["r1", "r3", "r4"]).ready} == {"r3", "r4"}


def test_the_table_keeps_at_most_max_engines(clock, make_registration):
    table = PairingTable(TableLimits(max_engines=1), clock=clock)
    table.register_engine(make_registration("E", tp_size=2), lease_s=10.0)
    table.register_engine(make_registration("E", tp_rank=1, tp_size=2), lease_s=10.0)  # a rank of the same engine
    with pytest.raises(TableFull) as err:
        table.register_engine(make_registration("F"), lease_s=10.0)
    assert err.value.field == "registration.engine_id" and "max_engines" in str(err.value)
    with pytest.raises(UnknownEngine):
        table.publish("F", "r1", [[1]], 16)
    clock.advance(11)  # E's lease runs out: room for F
    table.register_engine(make_registration("F"), lease_s=10.0)
    table.publish("F", "r1", [[1]], 16)


def test_the_prompt_digest_is_kept_returned_and_part_of_the_content(table, engine):
    sha = "0123456789abcdef" * 2
    table.publish(engine, "r1", [[1]], 16, transfer_id="t1", prompt_sha=sha)
    assert table.lookup_transfer("t1").prompt_sha == sha
    assert table.lookup(engine, ["r1"]).ready[0].prompt_sha == sha
    table.publish(engine, "r1", [[1]], 16, transfer_id="t1", prompt_sha=sha)  # a retry renews
    with pytest.raises(Conflict):
        table.publish(engine, "r1", [[1]], 16, transfer_id="t1", prompt_sha="f" * 32)
    table.publish(engine, "r2", [[2]], 16)
    assert table.lookup(engine, ["r2"]).ready[0].prompt_sha is None


def test_transfer_id_is_bound_to_one_live_request(table, engine):
    # n > 1 sampling must not share one pairing key (sglang#26486)
    table.publish(engine, "r1", [[1]], 16, transfer_id="t1")
    with pytest.raises(Conflict) as err:
        table.publish(engine, "r2", [[2]], 16, transfer_id="t1")
    assert err.value.field == "transfer_id"
    table.release(engine, "r1", Outcome.ABANDONED)
    with pytest.raises(RequestReleased) as err:  # ended: a decode asking for it was told released
        table.publish(engine, "r2", [[2]], 16, transfer_id="t1")
    assert err.value.field == "transfer_id" and err.value.status == 410
    assert table.lookup(engine, ["r2"]).unknown == ["r2"] and table.lookup_transfer("t1") is RequestStatus.RELEASED


def test_a_publish_retried_after_its_release_is_refused_and_revives_nothing(table, engine):
    """The client's retry of a publish whose answer was lost lands after decode pulled and released it:
    prefill freed the blocks on that outcome, so the retry must not make them live again."""
    table.publish(engine, "r1", [[1, 2]], 32, lease_s=30.0, transfer_id="t1")
    table.release(engine, "r1", Outcome.PULLED)
    with pytest.raises(RequestReleased) as err:
        table.publish(engine, "r1", [[1, 2]], 32, lease_s=30.0, transfer_id="t1")
    assert err.value.field == "request_id" and "r1" in str(err.value)
    assert table.lookup_transfer("t1") is RequestStatus.RELEASED and table.lookup(engine, ["r1"]).released == ["r1"]
    assert table.num_requests == 0 and outcomes(table, engine) == [("r1", Outcome.PULLED)]
    table.abandon_transfer(engine, "t2")  # prefill aborted before publishing: a late publish under it
    with pytest.raises(RequestReleased) as err:
        table.publish(engine, "r2", [[3]], 16, transfer_id="t2")
    assert err.value.field == "transfer_id" and table.num_requests == 0


def test_a_publish_after_expiry_is_refused_as_expired(table, clock, engine, make_registration):
    table.publish(engine, "r1", [[1]], 16, lease_s=5.0, transfer_id="t1")
    clock.advance(5)
    with pytest.raises(RequestExpired) as err:  # the retry of a publish that was held up a whole lease
        table.publish(engine, "r1", [[1]], 16, lease_s=5.0, transfer_id="t1")
    assert err.value.field == "request_id"
    with pytest.raises(RequestExpired) as err:
        table.publish(engine, "r2", [[1]], 16, transfer_id="t1")
    assert err.value.field == "transfer_id"
    table.publish(engine, "r3", [[3]], 16, transfer_id="t3")
    table.register_engine(make_registration("E", port=6000), 600.0)  # a new process: r3 expired with the old
    with pytest.raises(RequestExpired):
        table.publish(engine, "r3", [[3]], 16, transfer_id="t3")
    assert table.num_requests == 0 and table.stats.published == 2


def test_a_forgotten_tombstone_no_longer_refuses(table, clock, engine, limits):
    table.publish(engine, "r1", [[1]], 16, transfer_id="t1")
    table.release(engine, "r1", Outcome.PULLED)
    clock.advance(limits.tombstone_ttl_s + 1)
    table.publish(engine, "r1", [[1]], 16, transfer_id="t1")  # the memory of ended ids is bounded
    assert table.lookup_transfer("t1").request_id == "r1"


def test_lookup_transfer_statuses(table, clock, engine):
    assert table.lookup_transfer("t") is RequestStatus.UNKNOWN
    table.publish(engine, "r1", [[1]], 16, lease_s=5.0, transfer_id="t")
    assert table.lookup_transfer("t").request_id == "r1"
    clock.advance(5)
    assert table.lookup_transfer("t") is RequestStatus.EXPIRED
    table.publish(engine, "r2", [[1]], 16, lease_s=5.0, transfer_id="u")
    table.release(engine, "r2", Outcome.PULLED)
    assert table.lookup_transfer("u") is RequestStatus.RELEASED


def test_abandon_transfer_leaves_a_released_tombstone(table, clock, engine):
    """Prefill's request was aborted before publishing: the id answers released, idempotently."""
    assert table.abandon_transfer(engine, "t") is False
    assert table.lookup_transfer("t") is RequestStatus.RELEASED
    assert table.abandon_transfer(engine, "t") is True
    assert table.num_requests == 0 and outcomes(table, engine) == []  # no fake request, no outcome
    assert table.stats.transfers_abandoned == 1


def test_abandon_transfer_of_a_published_request_releases_it(table, engine, make_registration):
    table.publish(engine, "r1", [[1]], 16, transfer_id="t")
    table.register_engine(make_registration("F"), lease_s=600.0)
    with pytest.raises(Conflict) as err:
        table.abandon_transfer("F", "t")  # another engine's transfer: left alone
    assert err.value.field == "transfer_id" and table.lookup_transfer("t", peek=True).request_id == "r1"
    assert table.abandon_transfer(engine, "t") is False
    assert table.lookup_transfer("t") is RequestStatus.RELEASED
    assert outcomes(table, engine) == [("r1", Outcome.ABANDONED)]
    with pytest.raises(UnknownEngine):
        table.abandon_transfer("nobody", "u")


def test_abandon_naming_its_request_never_releases_another_bound_to_the_id(table, engine):
    """A batch of prompts shares one transfer id: the second request's publish is refused (the first holds
    the id) and prefill abandons the id for it. The first, whose blocks a decode may be reading, stays."""
    table.publish(engine, "sub-0", [[5, 6]], 32, lease_s=30.0, transfer_id="T")
    with pytest.raises(Conflict):
        table.publish(engine, "sub-1", [[7, 8]], 32, lease_s=30.0, transfer_id="T")
    with pytest.raises(Conflict) as err:
        table.abandon_transfer(engine, "T", request_id="sub-1")
    assert err.value.field == "request_id" and "sub-0" in str(err.value) and "sub-1" in str(err.value)
    rec = table.lookup_transfer("T", peek=True)  # (a peek hands nothing: the abandon below frees at once)
    assert rec.request_id == "sub-0" and rec.lease_remaining_s == 30.0
    assert outcomes(table, engine) == [] and table.stats.transfers_abandoned == 0
    assert table.abandon_transfer(engine, "T", request_id="sub-0") is False  # its own: released
    assert outcomes(table, engine) == [("sub-0", Outcome.ABANDONED)]
    assert table.abandon_transfer(engine, "T", request_id="sub-1") is True  # ended already: idempotent


def test_abandoning_a_transfer_a_reader_was_handed_defers_its_outcome_as_a_routers_release(table, clock, engine):
    """The proxy's abandon (after a peek found nothing bound) races prefill's publish, which a decode's long
    poll was just handed with a 30 s lease: prefill gets no outcome while that lease runs (the reader hears
    "released" from now on), then "abandoned"; a reader's own release frees it at once."""
    table.publish(engine, "r1", [[1, 2]], 32, lease_s=30.0, transfer_id="t1")
    assert table.lookup_transfer("t1", reader="D@1").lease_remaining_s == 30.0
    assert table.abandon_transfer(engine, "t1") is False
    clock.advance(1)
    assert outcomes(table, engine) == []  # D's READ may run 29 s more
    assert table.lookup_transfer("t1", reader="D@1") is RequestStatus.RELEASED  # trusted no more
    assert table.abandon_transfer(engine, "t1") is True  # idempotent
    clock.advance(30)
    table.expire()
    assert outcomes(table, engine) == [("r1", Outcome.ABANDONED)]
    table.publish(engine, "r2", [[3]], 16, lease_s=30.0, transfer_id="t2")
    table.lookup_transfer("t2", reader="D@1")
    table.abandon_transfer(engine, "t2")
    table.release(engine, "r2", Outcome.PULLED, reader="D@1")  # the reader is done: freed now
    assert [o for o in outcomes(table, engine) if o[0] == "r2"] == [("r2", Outcome.ABANDONED)]


def test_abandon_without_an_engine_ends_only_an_id_nobody_holds(table, engine):
    """The proxy, which may not know prefill's engine, gives up a transfer id prefill never took up."""
    assert table.abandon_transfer(None, "t") is False
    assert table.lookup_transfer("t") is RequestStatus.RELEASED
    assert table.abandon_transfer(None, "t") is True
    table.publish(engine, "r1", [[1]], 16, transfer_id="u")
    with pytest.raises(Conflict) as err:
        table.abandon_transfer(None, "u")
    assert err.value.field == "engine_id" and repr(engine) in str(err.value) and "name" in str(err.value)
    assert table.lookup_transfer("u").request_id == "r1" and outcomes(table, engine) == []
    assert table.stats.transfers_abandoned == 1


def test_abandoned_transfer_tombstone_is_forgotten(table, clock, engine, limits):
    table.abandon_transfer(engine, "t")
    clock.advance(limits.tombstone_ttl_s + 1)
    assert table.lookup_transfer("t") is RequestStatus.UNKNOWN


def test_default_request_lease(table, clock, engine):
    table.publish(engine, "r1", [[1]], 16)
    clock.advance(29.9)
    assert table.lookup(engine, ["r1"]).ready
    clock.advance(0.1)
    assert table.lookup(engine, ["r1"]).expired == ["r1"]


def test_renew_extends_and_reports_what_it_could_not(table, clock, engine):
    table.publish(engine, "a", [[1]], 16, lease_s=20.0)
    table.publish(engine, "b", [[2]], 16, lease_s=20.0)
    table.release(engine, "b", Outcome.ABANDONED)
    clock.advance(10)
    answer = table.renew(engine, ["a", "b", "zzz"], lease_s=20.0)
    assert (answer.renewed, answer.released, answer.unknown, answer.expired) == (["a"], ["b"], ["zzz"], [])
    assert answer.lease_s is None  # all it asked for: nothing said (an older client knows no such field)
    clock.advance(19)
    assert table.lookup(engine, ["a"]).ready
    clock.advance(1)
    assert table.renew(engine, ["a"], lease_s=20.0).expired == ["a"]


def test_a_renewal_promises_no_more_than_prefill_published(table, clock, engine):
    """Prefill holds its blocks on the strength of its own lease (30 s here): decode asking for 120 s gets 30,
    and says so in the answer, so it never trusts a READ past what prefill keeps."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0)
    table.publish(engine, "b", [[2]], 16, lease_s=10.0)
    clock.advance(5)
    assert table.renew(engine, ["a"], lease_s=120.0).lease_s == 30.0
    assert table.renew(engine, ["a", "b"], lease_s=120.0).lease_s == 10.0  # the least of the call
    assert table.renew(engine, ["a"], lease_s=3.0).lease_s is None  # granted as asked
    clock.advance(30.5)
    assert table.lookup(engine, ["a"]).expired == ["a"]


def test_renew_never_shortens_a_lease(table, clock, engine):
    table.publish(engine, "a", [[1]], 16, lease_s=50.0)
    table.renew(engine, ["a"], lease_s=1.0)
    clock.advance(10)
    assert table.lookup(engine, ["a"]).ready


def test_a_publish_retried_after_a_renewal_does_not_shorten_the_lease(table, clock, engine):
    """Prefill's publish answer was lost and it retries after decode renewed the lease: decode was promised
    the blocks until 50 s, so the retry may not bring that back."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0)
    clock.advance(20)
    table.poll_released(engine)  # prefill is in touch: it holds what a renewal now promises
    table.renew(engine, ["a"], lease_s=30.0)  # held until 50
    clock.advance(1)
    table.publish(engine, "a", [[1]], 16, lease_s=10.0)  # a retry asking less: not until 31
    clock.advance(28)
    assert table.lookup(engine, ["a"]).ready


def test_a_released_request_keeps_no_block_lists_while_its_heap_entry_waits(table, make_registration):
    """Release is immediate but the expiry heap drops its entry only at the lease's end (600 s at most): the
    request's block lists (up to a 4 MiB body's worth) must not wait that long."""
    engine = "B"
    table.register_engine(make_registration(engine, num_blocks=100_000), lease_s=600.0)
    table.publish(engine, "big", [list(range(100_000))], 16, lease_s=600.0)
    table.release(engine, "big", Outcome.PULLED)
    (held,) = [r for _, _, r in table._request_heap if r.request_id == "big"]
    assert held.block_ids == []
    assert table.lookup(engine, ["big"]).released == ["big"]


def test_release_is_idempotent_first_outcome_wins(table, engine):
    table.publish(engine, "r1", [[1]], 16)
    assert table.release(engine, "r1", Outcome.PULLED) is False
    assert table.release(engine, "r1", Outcome.ABANDONED) is True
    assert outcomes(table, engine) == [("r1", Outcome.PULLED)]


def test_release_after_expiry_tells_decode(table, clock, engine):
    table.publish(engine, "r1", [[1]], 16, lease_s=5.0)
    clock.advance(5)
    with pytest.raises(RequestExpired) as err:
        table.release(engine, "r1", Outcome.PULLED)
    assert err.value.field == "request_id"
    with pytest.raises(UnknownRequest):
        table.release(engine, "never", Outcome.PULLED)
    with pytest.raises(InvalidField):
        table.release(engine, "r1", Outcome.EXPIRED)
    with pytest.raises(InvalidField):  # "pulled" == Outcome.PULLED, but the table takes the enum only
        table.release(engine, "r1", "pulled")


def test_outcomes_are_reported_until_acknowledged(table, clock, engine):
    table.publish(engine, "p", [[1]], 16, lease_s=5.0)
    table.publish(engine, "a", [[2]], 16, lease_s=5.0)
    table.publish(engine, "e", [[3]], 16, lease_s=5.0)
    table.release(engine, "p", Outcome.PULLED)
    table.release(engine, "a", Outcome.ABANDONED)
    clock.advance(5)
    first = table.poll_released(engine, None, 0).released
    assert [(r.request_id, r.outcome) for r in first] == [
        ("p", Outcome.PULLED), ("a", Outcome.ABANDONED), ("e", Outcome.EXPIRED)]
    # Not acknowledged yet (the answer may have been lost): sent again.
    assert table.poll_released(engine, table.server_id, 0).released == first
    # Acknowledging up to the last seq leaves nothing; an ack for another server acknowledges nothing.
    assert table.poll_released(engine, "other-server", first[-1].seq).released == first
    assert table.poll_released(engine, table.server_id, first[-1].seq).released == []


def test_on_publish_hook(table, engine):
    seen = []
    table.on_publish = seen.append
    table.publish(engine, "r1", [[1]], 16, transfer_id="t")
    table.publish(engine, "r1", [[1]], 16, transfer_id="t")  # renewal: no second wake-up
    assert [(r.request_id, r.transfer_id) for r in seen] == [("r1", "t")]


# ----- bounded memory ---------------------------------------------------------------------------------------


def test_tombstones_are_bounded_and_forgotten(clock, make_registration):
    table = PairingTable(TableLimits(max_tombstones=10, tombstone_ttl_s=100.0), clock=clock)
    table.register_engine(make_registration("E"), 600.0)
    for i in range(100):
        table.publish("E", f"r{i}", [[i]], 16, lease_s=1.0, transfer_id=f"t{i}")
    clock.advance(1)
    table.expire()
    assert table.num_requests == 0
    assert table.num_tombstones == 20  # 10 request ids + 10 transfer ids
    answer = table.lookup("E", ["r0", "r99"])
    assert answer.unknown == ["r0"] and answer.expired == ["r99"]
    clock.advance(100)
    assert table.lookup("E", ["r99"]).unknown == ["r99"]
    assert table.num_tombstones == 0


def test_pending_outcomes_are_bounded(clock, make_registration):
    table = PairingTable(TableLimits(max_pending_outcomes=5), clock=clock)
    table.register_engine(make_registration("E"), 600.0)
    for i in range(8):
        table.publish("E", f"r{i}", [[i]], 16)
        table.release("E", f"r{i}", Outcome.PULLED)
    assert [r.request_id for r in table.poll_released("E").released] == [f"r{i}" for i in range(3, 8)]
    assert table.stats.outcomes_dropped == 3


def test_renewals_do_not_grow_the_lease_heap(table, clock, engine):
    table.publish(engine, "r1", [[1]], 16, lease_s=2.0)
    for _ in range(1000):
        clock.advance(1)
        table.poll_released(engine)  # prefill, holding it, keeps polling
        table.renew(engine, ["r1"], lease_s=2.0)
        table.heartbeat(engine)
    assert len(table._request_heap) == 1
    assert len(table._rank_heap) == 1
    assert table.lookup(engine, ["r1"]).ready


# ----- a property: every published request ends exactly once ------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(0, 9), st.floats(0.5, 20.0)),
        st.tuples(st.just("release"), st.integers(0, 9), st.sampled_from([Outcome.PULLED, Outcome.ABANDONED])),
        st.tuples(st.just("renew"), st.integers(0, 9), st.floats(0.5, 20.0)),
        st.tuples(st.just("advance"), st.floats(0.0, 10.0)),
        st.tuples(st.just("poll")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_every_published_request_is_reported_exactly_once(make_registration, program):
    clock = FakeClock()
    table = PairingTable(TableLimits(), clock=clock)
    table.register_engine(make_registration("E"), 600.0)
    live: set[str] = set()
    ended: list[str] = []
    acked = 0

    def poll() -> None:
        nonlocal acked
        answer = table.poll_released("E", table.server_id, acked)
        fresh = [r for r in answer.released if r.seq > acked]
        if fresh:
            acked = fresh[-1].seq
        ended.extend(r.request_id for r in fresh)

    gen = 0
    for op in program:
        if op[0] == "publish":
            rid = f"r{op[1]}-{gen}"
            gen += 1
            table.publish("E", rid, [[op[1]]], 16, lease_s=op[2])
            live.add(rid)
        elif op[0] == "release" and live:
            rid = sorted(live)[op[1] % len(live)]
            try:
                table.release("E", rid, op[2])
            except RequestExpired:
                pass
        elif op[0] == "renew" and live:
            table.renew("E", sorted(live), op[2])
        elif op[0] == "advance":
            clock.advance(op[1])
        elif op[0] == "poll":
            poll()
    clock.advance(100)  # every lease has run out (the engine's has not)
    poll()
    poll()
    assert sorted(ended) == sorted(live)  # each exactly once
    assert table.num_requests == 0


# ----- a router's release while a reader may read; what a renewal may promise ----------------------------


def test_a_router_release_of_a_request_no_reader_was_handed_frees_it_at_once(table, clock, engine):
    """Decode refused the connection or never got that far: nothing reads the blocks, prefill frees them now.
    The router's own look at the transfer id, and prefill's reconcile lookups, hand nothing to a reader."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0, transfer_id="t-a")
    assert isinstance(table.lookup_transfer("t-a", peek=True), RequestRecord)
    assert table.lookup(engine, ["a"]).ready
    assert table.release(engine, "a", Outcome.ABANDONED, router=True) is False
    assert [(r.request_id, r.outcome) for r in table.poll_released(engine).released] == [("a", Outcome.ABANDONED)]
    assert table.stats.releases_deferred == 0


@pytest.mark.parametrize("handed_by", ["renew", "lookup_transfer"])
def test_a_router_release_waits_for_the_lease_a_reader_was_given(table, clock, engine, handed_by):
    """The client left while decode's READ, trusted on a lease this table gave it, may still be on the wire
    (decode hears of the abort only later). The router's release must not free the blocks under it: readers
    hear "released" from now on, prefill gets the outcome when that lease has run out."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0, transfer_id="t-a")
    clock.advance(5)
    table.poll_released(engine)
    assert table.lookup(engine, ["a"]).ready  # (prefill's reconcile, or decode checking its params: hands nothing)
    if handed_by == "renew":
        assert table.renew(engine, ["a"], lease_s=30.0).renewed == ["a"]  # held until 35
    else:
        assert isinstance(table.lookup_transfer("t-a"), RequestRecord)  # decode may trust until 30
    until = 35.0 if handed_by == "renew" else 30.0
    clock.advance(1)
    assert table.release(engine, "a", Outcome.ABANDONED, router=True) is False
    assert table.poll_released(engine).released == []  # prefill keeps the blocks
    assert table.lookup(engine, ["a"]).ready  # prefill's reconcile sees it held: two "released" would free it
    assert table.renew(engine, ["a"], lease_s=30.0).released == ["a"]  # no reader is promised more
    assert table.lookup_transfer("t-a") is RequestStatus.RELEASED
    assert table.release(engine, "a", Outcome.ABANDONED, router=True) is True  # idempotent
    clock.advance(until - 6 - 0.5)
    assert table.poll_released(engine).released == []
    clock.advance(1)
    assert [(r.request_id, r.outcome) for r in table.poll_released(engine).released] == [("a", Outcome.ABANDONED)]
    assert table.lookup(engine, ["a"]).released == ["a"] and table.stats.releases_deferred == 1


def test_the_reader_releasing_a_request_the_router_gave_up_frees_it_at_once(table, clock, engine):
    """Decode's own release comes once its READs have settled: prefill need not wait out the lease. In
    concurrent pairing decode finds the request by its transfer id first: a peek still answers it."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0, transfer_id="t-a")
    table.poll_released(engine)
    table.renew(engine, ["a"], lease_s=30.0)
    table.release(engine, "a", Outcome.ABANDONED, router=True)
    assert table.poll_released(engine).released == []
    assert table.lookup_transfer("t-a") is RequestStatus.RELEASED  # to a reader
    assert table.lookup_transfer("t-a", peek=True).request_id == "a"  # to decode about to report it
    assert table.release(engine, "a", Outcome.PULLED) is True  # the router's outcome stands
    assert [(r.request_id, r.outcome) for r in table.poll_released(engine).released] == [("a", Outcome.ABANDONED)]


@pytest.mark.parametrize("second_by", ["renew", "lookup_transfer"])
def test_one_readers_release_waits_for_another_reader_still_reading(table, clock, engine, second_by):
    """Two decode engines read one request (its samples on two data-parallel engines, or a decode leg retried
    on another replica). The first to finish released it and prefill freed the blocks while the other's
    READ, trusted on the lease this table gave it, still ran: that one decoded another request's KV. Now the
    first release waits: the other renews as before, and prefill gets the first outcome once the other
    released too, or when its lease runs out."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0, transfer_id="t-a")
    table.poll_released(engine)
    assert table.renew(engine, ["a"], lease_s=30.0, reader="d0@1").renewed == ["a"]
    if second_by == "renew":
        assert table.renew(engine, ["a"], lease_s=30.0, reader="d1@1").renewed == ["a"]
    else:
        assert isinstance(table.lookup_transfer("t-a", reader="d1@1"), RequestRecord)
    clock.advance(2)
    assert table.release(engine, "a", Outcome.PULLED, reader="d0@1") is False
    assert table.poll_released(engine).released == []  # prefill keeps the blocks for d1
    assert table.lookup(engine, ["a"]).ready
    assert table.renew(engine, ["a"], lease_s=30.0, reader="d1@1").renewed == ["a"]  # d1 reads on
    assert table.release(engine, "a", Outcome.PULLED, reader="d0@1") is True  # (d0 again: nothing changes)
    assert table.poll_released(engine).released == []
    assert table.release(engine, "a", Outcome.ABANDONED, reader="d1@1") is True
    assert [(r.request_id, r.outcome) for r in table.poll_released(engine).released] == [("a", Outcome.PULLED)]
    assert table.stats.releases_deferred == 1


def test_a_reader_that_never_releases_holds_another_readers_release_only_until_its_lease_ends(table, clock,
                                                                                               engine):
    table.publish(engine, "a", [[1]], 16, lease_s=30.0, transfer_id="t-a")
    table.poll_released(engine)
    table.renew(engine, ["a"], lease_s=30.0, reader="d0@1")
    table.renew(engine, ["a"], lease_s=30.0, reader="d1@1")  # then d1's engine dies
    clock.advance(1)
    table.release(engine, "a", Outcome.PULLED, reader="d0@1")
    clock.advance(28.5)
    assert table.poll_released(engine).released == []
    clock.advance(1)
    assert [(r.request_id, r.outcome) for r in table.poll_released(engine).released] == [("a", Outcome.PULLED)]


def test_the_only_readers_release_frees_at_once_named_or_not(table, clock, engine):
    """One reader, named (d0) or naming none (an older decode): its release frees the blocks now. A named
    reader's release waits for one that named none; one that named none, for a named one."""
    for rid, handed, releasing, waits in (("a", ["d0@1"], "d0@1", False), ("b", [None], None, False),
                                          ("c", ["d0@1", None], "d0@1", True), ("d", ["d0@1", None], None, True),
                                          ("e", [], "d0@1", False)):
        table.publish(engine, rid, [[1]], 16, lease_s=30.0)
        for r in handed:
            table.renew(engine, [rid], lease_s=30.0, reader=r)
        table.release(engine, rid, Outcome.PULLED, reader=releasing)
        assert bool(table.lookup(engine, [rid]).ready) is waits, rid


def test_a_reader_that_released_is_not_handed_the_request_again(table, clock, engine):
    """d0 released (deferred for d1); a late renewal of d0's (a retry after a lost answer) is answered
    released and does not count d0 again, so d1's release frees the request at once."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0, transfer_id="t-a")
    table.poll_released(engine)
    table.renew(engine, ["a"], lease_s=30.0, reader="d0@1")
    table.renew(engine, ["a"], lease_s=30.0, reader="d1@1")
    table.release(engine, "a", Outcome.PULLED, reader="d0@1")
    assert table.renew(engine, ["a"], lease_s=30.0, reader="d0@1").released == ["a"]
    assert table.lookup_transfer("t-a", reader="d0@1") is RequestStatus.RELEASED  # (nor trusted on a lookup)
    assert isinstance(table.lookup_transfer("t-a", reader="d0@1", peek=True), RequestRecord)
    table.release(engine, "a", Outcome.PULLED, reader="d1@1")
    assert [(r.request_id, r.outcome) for r in table.poll_released(engine).released] == [("a", Outcome.PULLED)]


def test_a_release_from_an_engine_never_handed_the_request_changes_nothing(table, clock, engine):
    """d2 gave its request up before reading (an abort, a local prefix hit) and reports abandoned while d1
    reads: the request stays as it was, and d1's outcome is prefill's."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0)
    table.poll_released(engine)
    table.renew(engine, ["a"], lease_s=30.0, reader="d1@1")
    assert table.release(engine, "a", Outcome.ABANDONED, reader="d2@1") is False
    assert table.stats.releases_deferred == 0 and table.lookup(engine, ["a"]).ready
    table.release(engine, "a", Outcome.PULLED, reader="d1@1")
    assert [(r.request_id, r.outcome) for r in table.poll_released(engine).released] == [("a", Outcome.PULLED)]


def test_the_readers_of_a_request_are_bounded(table, clock, engine):
    from kvlink.bootstrap.table import MAX_READERS

    table.publish(engine, "a", [[1]], 16, lease_s=30.0)
    for i in range(MAX_READERS * 4):
        table.renew(engine, ["a"], lease_s=30.0, reader=f"d{i}@1")
    request = table._engines[engine].requests["a"]
    assert len(request.readers) == MAX_READERS + 1 and None in request.readers
    for i in range(MAX_READERS * 4):
        table.release(engine, "a", Outcome.PULLED, reader=f"d{i}@1")
    assert table.lookup(engine, ["a"]).ready  # an unnamed one may still read: its lease decides


def test_a_poll_whose_answer_was_lost_does_not_lengthen_what_a_renewal_promises(table, clock, engine):
    """Prefill counts itself in touch as of an answer it got (kvlink.vllm.held: silence begins at its first
    failed call after that). A poll the server took but whose answer was lost (a timeout, a proxy's 504) must
    not count as prefill in touch: a poll says which answer it last got (``seen``, that answer's ``now``), and
    the server counts the engine polled as of then. Else decode, still renewing, would be promised the blocks
    past the time a prefill that has heard nothing since frees them."""
    t0 = clock()
    table.publish(engine, "p", [[1]], 16, lease_s=10.0)
    clock.advance(1)
    answered = table.poll_released(engine, None, 0, seen=0.0).now  # answered: prefill in touch at t0+1
    assert answered == t0 + 1 and table._engines[engine].polled_at is None  # (nothing answered before)
    for at in (9.0, 18.0):  # polls the server takes, their answers lost; prefill silent since ~t0+2
        clock.advance(t0 + at - clock())
        table.poll_released(engine, table.server_id, 0, seen=answered)
        assert table._engines[engine].polled_at == answered
        clock.advance(0.5)
        renewed = table.renew(engine, ["p"], lease_s=10.0)
        if at == 9.0:  # capped at publish + 1.5 leases (15), what prefill holds anyway
            assert renewed.renewed == ["p"] and clock() + renewed.lease_s == pytest.approx(t0 + 15)
        else:
            assert renewed.expired == ["p"]  # (polled as of this poll: renewed to t0 + 28)
    # a poll that says it got the last answer counts as of that answer: a prefill in touch is renewed on
    clock.advance(1)
    now = table.poll_released(engine, table.server_id, 0, seen=answered).now
    table.publish(engine, "q", [[2]], 16, lease_s=10.0)
    clock.advance(1)
    table.poll_released(engine, table.server_id, 0, seen=now)
    assert table._engines[engine].polled_at == now
    assert table.poll_released(engine, "another-server", 0, seen=clock() + 50).now == clock()
    assert table._engines[engine].polled_at == now  # another server's clock counts for nothing here


def test_a_renewal_never_promises_more_than_a_prefill_out_of_touch_holds(table, clock, engine):
    """Prefill frees a request it hears nothing about once 1.5 leases have passed since it published it and
    the server has been silent for a lease (kvlink.vllm.held). A prefill cut off from the server while decode
    is not: renewals end by the later of publish + 1.5 leases and its last poll + a lease, so no READ decode
    trusts outlives what prefill holds. A prefill that keeps polling is renewed a whole lease each time."""
    table.publish(engine, "a", [[1]], 16, lease_s=30.0)
    table.publish(engine, "b", [[2]], 16, lease_s=30.0)
    table.poll_released(engine)  # at 0, then prefill goes silent
    clock.advance(25)
    answer = table.renew(engine, ["a"], lease_s=30.0)
    assert answer.renewed == ["a"] and answer.lease_s == pytest.approx(20.0)  # until 45, not 55
    clock.advance(19)
    assert table.renew(engine, ["a"], lease_s=30.0).lease_s == pytest.approx(1.0)
    clock.advance(1)
    assert table.renew(engine, ["a"], lease_s=30.0).expired == ["a"]  # at 45: what prefill may free now
    table.poll_released(engine)  # prefill is back in touch at 45: it holds a lease from its last poll
    answer = table.renew(engine, ["b"], lease_s=30.0)
    assert answer.expired == ["b"]  # (b's lease ran out at 30: nobody renewed it)
    table.publish(engine, "c", [[3]], 16, lease_s=30.0)
    for _ in range(5):  # polling every 10 s, renewed every 10 s: a whole lease each time, for 50 s
        clock.advance(10)
        table.poll_released(engine)
        answer = table.renew(engine, ["c"], lease_s=30.0)
        assert answer.renewed == ["c"] and answer.lease_s is None
