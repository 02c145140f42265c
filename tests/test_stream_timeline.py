"""bench/stream_timeline.py: the legs of one streamed PD request, cut from trace events."""

from __future__ import annotations

import pytest

from bench.stream_timeline import LEGS, LOCKSTEP_LEGS, legs, legs_lockstep

PRE, DEC, PROXY = 10, 20, 30  # pids: prefill's engine, decode's engine, the proxy


def events(drop: str | None = None) -> list[dict]:
    evs = [
        dict(t=1.000, pid=PROXY, ev="proxy_request"),
        dict(t=1.004, pid=DEC, ev="engine_new", rid="d1"),
        dict(t=1.005, pid=PRE, ev="engine_new", rid="p1"),
        dict(t=1.006, pid=DEC, ev="step", tokens=0),
        dict(t=1.100, pid=DEC, ev="answer", rid="d1", transfer_id="x", partial=True),
        dict(t=1.180, pid=PRE, ev="finished", rid="p1"),
        dict(t=1.181, pid=DEC, ev="answer", rid="d1", transfer_id="x", partial=False),
        dict(t=1.182, pid=PRE, ev="publish", rid="p1", transfer_id="x"),
        dict(t=1.183, pid=DEC, ev="pull_done", rid="d1", failed=False),
        dict(t=1.184, pid=DEC, ev="step", tokens=0),
        dict(t=1.185, pid=DEC, ev="recv_collected", rids=["d1"]),
        dict(t=1.187, pid=DEC, ev="step", tokens=1),
        dict(t=1.200, pid=DEC, ev="step", tokens=1),
    ]
    return [e for e in evs if e["ev"] != drop]


def test_the_legs_add_up_to_the_ttft_in_order():
    got = legs(events(), 0.998, 1.203)
    assert list(got) == list(LEGS)
    assert sum(got.values()) == pytest.approx(205.0)
    assert got["prefill compute"] == pytest.approx(175.0)
    assert got["publish->decode"] == pytest.approx(-1.0)  # the long poll answered before publish returned
    assert got["schedule"] == pytest.approx(2.0)  # the first step with tokens after the collect
    assert got["decode step"] == pytest.approx(13.0)
    assert got["out->client"] == pytest.approx(3.0)


@pytest.mark.parametrize("drop", ["publish", "recv_collected", "pull_done", "finished", "engine_new"])
def test_a_missing_event_gives_no_timeline(drop):
    assert legs(events(drop), 0.998, 1.203) is None


def lockstep_events(drop: str | None = None) -> list[dict]:
    evs = [
        dict(t=1.000, pid=PROXY, ev="proxy_request"),
        dict(t=1.005, pid=PRE, ev="engine_new", rid="p1"),
        dict(t=1.006, pid=DEC, ev="engine_new", rid="d1"),
        dict(t=1.040, pid=DEC, ev="recv_collected", rids=["d1"]),  # armed while prefill computes
        dict(t=1.042, pid=DEC, ev="step", tokens=1),  # the armed step starts
        dict(t=1.180, pid=PRE, ev="finished", rid="p1"),
        dict(t=1.181, pid=PRE, ev="publish", rid="p1", transfer_id="x"),
        dict(t=1.182, pid=DEC, ev="answer", rid="d1", transfer_id="x", partial=False),
        dict(t=1.186, pid=DEC, ev="step", tokens=1),  # the next step: the armed one is over
    ]
    return [e for e in evs if e["ev"] != drop]


def test_the_lockstep_legs_add_up_to_the_ttft_and_say_when_the_step_began():
    got = legs_lockstep(lockstep_events(), 0.998, 1.190)
    assert list(got) == [*LOCKSTEP_LEGS, "step start"]
    assert sum(got[k] for k in LOCKSTEP_LEGS) == pytest.approx(192.0)
    assert got["publish->step end"] == pytest.approx(5.0)
    assert got["step start"] == pytest.approx(-138.0)  # before prefill's end


@pytest.mark.parametrize("drop", ["publish", "recv_collected", "finished", "engine_new", "step"])
def test_a_missing_lockstep_event_gives_no_timeline(drop):
    assert legs_lockstep(lockstep_events(drop), 0.998, 1.190) is None
