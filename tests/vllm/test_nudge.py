"""A decode worker's nudge ends its scheduler's step wait (kvlink/vllm/nudge.py): real abstract sockets,
a real child process (vLLM's workers are the scheduler process's children), a real KVLinkWorker pull."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid

from kvlink.vllm.nudge import NudgeListener, Nudger


def _engine() -> str:
    return "dec-" + uuid.uuid4().hex[:8]


def _nudge_from_child(engine_id: str) -> None:
    _nudge(engine_id)


def _nudge(engine_id: str) -> None:
    n = Nudger(engine_id)
    n.nudge()
    n.close()


def test_a_child_process_nudge_ends_the_wait_and_a_wait_without_one_times_out():
    eid = _engine()
    listener = NudgeListener(eid)
    try:
        assert listener.listening
        assert listener.wait(0.05) is False
        child = multiprocessing.get_context("fork").Process(target=_nudge_from_child, args=(eid,))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert listener.wait(30.0) is True  # the child's nudge, sent before this wait, ends it at once
        assert listener.wait(0.05) is False  # drained: one nudge ends one wait
    finally:
        listener.close()


def test_nudges_reach_only_their_engine_and_a_taken_name_falls_back_to_sleeping():
    eid = _engine()
    listener, twin = NudgeListener(eid), NudgeListener(eid)
    try:
        assert not twin.listening  # the name is this process's engine's: the second one sleeps it out
        _nudge(_engine())  # another engine's nudge goes nowhere and never raises
        assert listener.wait(0.05) is False
        t0 = time.monotonic()
        assert twin.wait(0.1) is False and time.monotonic() - t0 >= 0.09
        threading.Timer(0.1, _nudge, (eid,)).start()
        t0 = time.monotonic()
        assert listener.wait(30.0) is True and time.monotonic() - t0 < 29
    finally:
        listener.close()
        twin.close()


def test_a_decode_step_waiting_for_pulls_ends_when_a_worker_nudges():
    from types import SimpleNamespace

    from kvlink.vllm.config import ConnectorConfig
    from kvlink.vllm.params import RemoteSource
    from kvlink.vllm.scheduler import KVLinkScheduler

    eid = _engine()
    sched = KVLinkScheduler(ConnectorConfig(pull_step_wait_ms=1000.0), eid, "kv_consumer", 32)
    try:
        sched._pulls["d1"] = RemoteSource(bootstrap_url="http://127.0.0.1:9", transfer_id="t1")
        idle = SimpleNamespace(total_num_scheduled_tokens=0, finished_req_ids=set())
        t0 = time.monotonic()
        sched.build_connector_meta(idle)
        assert time.monotonic() - t0 >= 0.9  # nobody nudged: the whole wait
        threading.Timer(0.05, _nudge, (eid,)).start()
        t0 = time.monotonic()
        sched.build_connector_meta(idle)
        assert time.monotonic() - t0 < 0.9
        assert sched.get_kv_connector_stats().data["pull_waits_nudged"] == 1
    finally:
        sched.shutdown()


def test_closing_a_listener_while_it_waits_ends_nothing_badly():
    """Shutdown closes the listener while vLLM's thread may be in a step's wait: the wait returns, no error."""
    listener = NudgeListener(_engine())
    threading.Timer(0.1, listener.close).start()
    assert listener.wait(0.5) is False
    assert listener.wait(0.01) is False and not listener.listening
