"""Prefill's held-request table driven event by event against a fake clock: no threads, no server, no sleeps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlink.bootstrap.schema import Outcome, RequestRecord, RequestStatus
from kvlink.vllm.held import DEADLINE_FACTOR, DEADLINE_SLACK_S, Freed, HeldTable
from tests.fakes import FakeClock

LEASE = 10.0
DEADLINE = LEASE * DEADLINE_FACTOR + DEADLINE_SLACK_S  # after publishing


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def table(clock):
    return HeldTable(LEASE, clock=clock)


def record(rid: str) -> RequestRecord:
    return RequestRecord(engine_id="pre", request_id=rid, block_ids=[[1]], num_tokens=16, lease_remaining_s=5.0)


def test_an_outcome_frees_once_and_what_follows_is_ignored(table):
    table.published("r1", 3)
    assert (len(table), table.num_blocks) == (1, 3)
    assert table.released("r1", Outcome.PULLED)
    assert (len(table), table.num_blocks) == (1, 3)  # vLLM holds the blocks until the free is handed over
    assert not table.released("r1", Outcome.ABANDONED)  # a late or duplicate outcome
    assert table.looked_up({"r1": RequestStatus.EXPIRED}) == 0  # a late lookup answer
    assert table.tick() == [Freed("r1", Outcome.PULLED)]
    assert (len(table), table.num_blocks, table.blocks_by_request()) == (0, 0, {})
    assert table.tick() == []  # handed over once
    assert not table.released("never-held", Outcome.PULLED)


@pytest.mark.parametrize("outcome,counter", [(Outcome.PULLED, "released_pulled"),
                                             (Outcome.ABANDONED, "released_abandoned"),
                                             (Outcome.EXPIRED, "leases_expired")])
def test_each_polled_outcome_has_its_counter(table, outcome, counter):
    table.published("r", 1)
    table.released("r", outcome)
    (freed,) = table.tick()
    assert freed.outcome is outcome and freed.counter == counter and not freed.by_deadline


def test_lookup_frees_what_the_server_no_longer_holds_a_lease_after_it_first_did(table, clock):
    """A server that lost the request (a restart, a dropped engine) may have renewed it just before: decode
    was promised up to one lease from that renewal, so the blocks stay that long after the first lookup
    that misses it."""
    for rid in ("gone", "expired", "live"):
        table.published(rid, 1)
    answer = {"gone": RequestStatus.UNKNOWN, "expired": RequestStatus.EXPIRED, "live": record("live")}
    assert table.looked_up(answer) == 0
    clock.advance(LEASE / 2)
    assert table.looked_up(answer) == 0 and table.tick() == []
    clock.advance(LEASE / 2)
    assert table.looked_up(answer) == 2
    assert sorted((f.request_id, f.outcome, f.counter) for f in table.tick()) == [
        ("expired", Outcome.EXPIRED, "leases_expired"), ("gone", Outcome.EXPIRED, "leases_expired")]
    assert "live" in table and len(table) == 1


def test_a_request_found_again_starts_its_grace_afresh(table, clock):
    """A publish that timed out may land late: a lookup that finds the record again resets the count."""
    table.published("late", 1)
    assert table.looked_up({"late": RequestStatus.UNKNOWN}) == 0
    clock.advance(LEASE * 0.9)
    assert table.looked_up({"late": record("late")}) == 0
    clock.advance(LEASE * 0.2)
    assert table.looked_up({"late": RequestStatus.UNKNOWN}) == 0  # missing again: a new lease of grace
    clock.advance(LEASE)
    assert table.looked_up({"late": RequestStatus.UNKNOWN}) == 1


def test_released_in_one_lookup_frees_nothing_and_in_the_next_frees_as_unreported(table):
    table.published("r", 2)
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 0  # its outcome may be on its way
    assert table.tick() == [] and "r" in table
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 1  # it was lost (a dropped engine)
    (freed,) = table.tick()
    assert freed == Freed("r", None) and freed.counter == "released_unreported"
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 0


def test_a_release_between_poll_and_lookup_is_counted_as_its_outcome(table):
    table.published("r", 1)
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 0
    assert table.released("r", Outcome.PULLED)  # the next poll brings the outcome
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 0  # second sighting: already freed
    assert [f.counter for f in table.tick()] == ["released_pulled"]


def test_the_two_sightings_must_be_in_a_row(table):
    table.published("r", 1)
    table.looked_up({"r": RequestStatus.RELEASED})
    table.looked_up({"r": record("r")})  # not released in between (or not asked about)
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 0
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 1


def test_local_deadline_frees_only_while_the_server_cannot_be_reached(table, clock):
    table.published("r", 4)
    clock.advance(DEADLINE + 100)
    table.reached()  # the server answers: it tracks decode's renewals, the local deadline does not count
    assert table.tick() == [] and "r" in table
    clock.advance(LEASE)
    assert table.tick() == []  # no failure yet: the server may still be taking decode's renewals
    table.unreachable()  # the next call fails: silent from here
    clock.advance(LEASE)  # silent for exactly a lease: not yet
    assert table.tick() == []
    clock.advance(0.01)
    assert table.tick() == [Freed("r", Outcome.EXPIRED, by_deadline=True)]
    assert table.tick() == [] and table.num_blocks == 0


def test_the_local_deadline_counts_from_when_the_publish_returned(table, clock):
    """Held before its publish call, then the server applied it late (a slow server, a retry): the server
    renews decode for 1.5 leases from when it applied it. The local deadline, stamped when the call
    returned, is no earlier; one stamped before the call was up to the call's time earlier."""
    table.published("r", 4)
    clock.advance(12)  # the publish call returns
    table.stamp("r")
    table.unreachable()
    clock.advance(DEADLINE - 0.5)  # past the first stamp's deadline by 11.5 s, silent for more than a lease
    assert table.tick() == []
    clock.advance(1)
    assert table.tick() == [Freed("r", Outcome.EXPIRED, by_deadline=True)]
    table.stamp("r")  # (no longer held: nothing)
    assert "r" not in table


def test_silence_counts_from_the_first_failed_call_not_the_last_answer(table, clock):
    """The server answered prefill's poll, then took a decode renewal (decode trusts a lease from then), then
    died: prefill's next poll fails a poll interval later. A lease after the last answer is too early; a
    lease after that failure is not, and later failures do not move it."""
    table.published("r", 4)
    clock.advance(DEADLINE + 100)
    table.reached()
    clock.advance(0.02)  # (decode's renewal lands here, just before the server dies)
    table.unreachable()
    clock.advance(LEASE - 0.01)
    table.unreachable()
    assert table.tick() == []  # a lease after the answer has passed, not one after the failure
    clock.advance(0.02)
    assert table.tick() == [Freed("r", Outcome.EXPIRED, by_deadline=True)]


def test_an_unreachable_server_frees_nothing_before_the_deadline(table, clock):
    table.unreachable()
    table.published("early", 1)
    clock.advance(DEADLINE - 1)  # the server has been silent for longer than a lease
    table.published("late", 1)
    assert table.tick() == []
    clock.advance(2)
    assert [f.request_id for f in table.tick()] == ["early"]
    clock.advance(DEADLINE)
    assert [f.request_id for f in table.tick()] == ["late"]


def test_an_outcome_after_a_deadline_free_is_ignored(table, clock):
    table.published("r", 1)
    table.unreachable()
    clock.advance(DEADLINE + 1)
    assert table.tick()[0].by_deadline
    assert not table.released("r", Outcome.PULLED)
    assert table.tick() == []


def test_lookups_are_due_every_half_lease_and_at_once_after_a_failure(table, clock):
    assert not table.lookup_due()
    clock.advance(LEASE / 2)
    assert table.lookup_due()
    table.looked_up({})
    assert not table.lookup_due()
    table.unreachable()
    assert table.lookup_due()  # the server may have restarted and lost outcomes
    table.looked_up({})
    clock.advance(LEASE / 2 - 0.01)
    assert not table.lookup_due()


def test_has_frees_is_what_ends_an_idle_wait(table):
    table.published("r", 1)
    assert not table.has_frees()
    table.released("r", Outcome.PULLED)
    assert table.has_frees()
    table.tick()
    assert not table.has_frees()


def test_publishing_an_id_again_replaces_it(table):
    table.published("r", 3)
    table.looked_up({"r": RequestStatus.RELEASED})
    table.published("r", 5)  # a new life: the old sighting does not count
    assert table.num_blocks == 5 and table.blocks_by_request() == {"r": 5}
    assert table.looked_up({"r": RequestStatus.RELEASED}) == 0


NAMES = [f"r{i}" for i in range(6)] + ["never-published"]
answers = st.sampled_from(list(RequestStatus)) | st.builds(record, st.just("r"))  # a record: still held
events = st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(1, 4)),
    st.tuples(st.just("release"), st.sampled_from(NAMES), st.sampled_from(list(Outcome))),
    st.tuples(st.just("lookup"), st.dictionaries(st.sampled_from(NAMES), answers)),
    st.tuples(st.just("reached")), st.tuples(st.just("unreachable")),
    st.tuples(st.just("advance"), st.floats(0, 2 * DEADLINE)),
    st.tuples(st.just("tick")),
), max_size=60)


@given(events)
def test_every_publish_is_freed_at_most_once_and_the_gauges_add_up(evs):
    """vLLM's request ids are unique: each publish is a new id, freed at most once, never unless held."""
    clock = FakeClock()
    table = HeldTable(LEASE, clock=clock)
    published: list[str] = []
    freed: set[str] = set()

    def take() -> None:
        for f in table.tick():
            assert f.request_id in published and f.request_id not in freed, f"{f.request_id} freed twice"
            freed.add(f.request_id)

    for ev in evs:
        kind = ev[0]
        if kind == "publish" and len(published) < len(NAMES) - 1:
            published.append(NAMES[len(published)])
            table.published(published[-1], ev[1])
        elif kind == "release":
            table.released(ev[1], ev[2])
        elif kind == "lookup":
            table.looked_up(ev[1])
        elif kind == "advance":
            clock.advance(ev[1])
            take()
        elif kind == "tick":
            take()
        elif kind in ("reached", "unreachable"):
            getattr(table, kind)()
        assert set(table.request_ids()) <= set(published) - freed
        assert table.num_blocks == sum(table.blocks_by_request().values())
    take()
    assert set(table.request_ids()) == set(published) - freed  # nothing decided and not handed over
