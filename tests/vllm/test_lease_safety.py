"""What decode trusts against what prefill holds, across the three tables on one clock: the bootstrap
server's (PairingTable), prefill's (HeldTable) and decode's (PullTable). A READ decode trusts must end
before prefill may free the blocks it reads, whoever else speaks in between."""

from __future__ import annotations

import pytest

from kvlink.bootstrap import Outcome, PairingTable, TableLimits
from kvlink.vllm.held import HeldTable
from kvlink.vllm.pulls import Lease, PullTable
from tests.bootstrap.conftest import registration
from tests.fakes import FakeClock

pytest.importorskip("vllm")

LEASE = 30.0
URL, ENG = "http://boot", "prefill-0"


def _world():
    clock = FakeClock(0.0)
    server = PairingTable(TableLimits(default_request_lease_s=LEASE, max_lease_s=600.0), clock=clock)
    server.register_engine(registration(ENG), lease_s=600.0)
    held = HeldTable(LEASE, clock=clock)
    held.published("p-a", 2)
    server.publish(ENG, "p-a", [[7, 8]], 32, LEASE)
    server.poll_released(ENG)
    return clock, server, held, PullTable(120.0)


def _read_posted(clock, pulls):
    """Decode resolved the request (sequential params) and its READ is on the wire."""
    from kvlink.vllm.metadata import PullSpec
    from kvlink.vllm.params import RemoteSource

    src = RemoteSource(bootstrap_url=URL, engine_id=ENG, request_id="p-a", block_ids=((1, 2),))
    now = clock()
    pulls.submit(PullSpec("a", (1, 2), 0, src), now)
    actions = pulls.resolved("a", "remote", [(1, 7), (2, 8)], Lease(URL, ENG, "p-a", LEASE), 0.0, now, now)
    post = next(a for a in actions if type(a).__name__ == "Post")
    pulls.posted(post.batch, "h", 1, 1, 1, now)
    return post.batch


def _reconcile(server):
    """Prefill's reconcile lookup of its held request, as the client hands it to the held table."""
    from kvlink.bootstrap.schema import RequestStatus

    answer = server.lookup(ENG, ["p-a"])
    out = {r.request_id: r for r in answer.ready}
    out.update({rid: RequestStatus.RELEASED for rid in answer.released})
    out.update({rid: RequestStatus.EXPIRED for rid in answer.expired})
    out.update({rid: RequestStatus.UNKNOWN for rid in answer.unknown})
    return out


def _prefill_hears(server, held):
    for o in server.poll_released(ENG).released:
        held.released(o.request_id, o.outcome)
    held.reached()
    return [f.request_id for f in held.tick()]


def test_the_routers_release_does_not_free_blocks_under_a_read_decode_trusts():
    """The client left while decode's READ was on the wire, its lease proven by a renewal: the proxy reports
    the request abandoned (it cannot know decode is reading). Prefill keeps the blocks until that lease has
    run out, so the READ decode trusts read them; decode's own release then frees them at once."""
    clock, server, held, pulls = _world()
    clock.advance(1.0)
    batch = _read_posted(clock, pulls)
    sent = clock()
    assert server.renew(ENG, ["p-a"], LEASE).renewed == ["p-a"]
    pulls.lease_held((URL, ENG), ("a",), sent + LEASE, clock())
    clock.advance(0.05)
    server.release(ENG, "p-a", Outcome.ABANDONED, router=True)  # the proxy's Releaser
    assert _prefill_hears(server, held) == []  # (it freed them here, before the deferral)
    clock.advance(0.5)
    pulls.batch_ended(batch, None, clock())
    assert pulls.take_results(clock()).done == {"a"}  # trusted: and the blocks were prefill's all along
    assert _prefill_hears(server, held) == []
    server.release(ENG, "p-a", Outcome.PULLED)  # decode, its READ settled
    assert _prefill_hears(server, held) == ["p-a"]


def test_the_routers_release_frees_at_the_lease_when_decode_never_releases():
    clock, server, held, pulls = _world()
    clock.advance(1.0)
    _read_posted(clock, pulls)
    assert server.renew(ENG, ["p-a"], LEASE).renewed == ["p-a"]  # until 31
    server.release(ENG, "p-a", Outcome.ABANDONED, router=True)
    for _ in range(2):  # prefill's reconcile, every half lease: two "released" in a row would free it
        clock.advance(14.0)
        assert held.looked_up(_reconcile(server)) == 0
    clock.advance(1.5)
    assert _prefill_hears(server, held) == []
    assert server.renew(ENG, ["p-a"], LEASE).released == ["p-a"]  # decode's next renewal: no more trust
    clock.advance(1.0)
    assert _prefill_hears(server, held) == ["p-a"]


def test_a_prefill_cut_off_from_the_server_frees_nothing_decode_still_trusts():
    """Prefill cannot reach the server (a partition, its own EMFILE) while decode can and keeps renewing.
    Prefill frees by its local deadline (1.5 leases + 5 s after the publish, silent for a lease); the server
    renews no further than that, so the READ that ends after prefill freed the blocks is not trusted."""
    clock, server, held, pulls = _world()
    clock.advance(1.0)
    held.unreachable()  # every poll fails from here on
    clock.advance(24.0)
    batch = _read_posted(clock, pulls)  # t=25, a slow READ; decode renews every 10 s
    proven = 0.0
    for i in range(3):  # at 25, 35, 45
        clock.advance(10.0 if i else 0.0)
        sent = clock()
        answer = server.renew(ENG, ["p-a"], LEASE)
        if answer.renewed:
            proven = sent + (LEASE if answer.lease_s is None else answer.lease_s)
            pulls.lease_held((URL, ENG), ("a",), proven, clock())
        else:
            assert answer.expired == ["p-a"]
            pulls.lease_lost((URL, ENG), "a", "expired", clock())
    assert proven == pytest.approx(45.0)  # (without the cap: 75, beyond prefill's deadline)
    clock.advance(6.0)  # t=51: prefill's local deadline (50) has passed, silent for 50 s
    assert [f.request_id for f in held.tick()] == ["p-a"]
    clock.advance(2.0)
    pulls.batch_ended(batch, None, clock())  # t=53: after what the leases proved
    results = pulls.take_results(clock())
    assert "a" not in results.done and "a" in results.failed
