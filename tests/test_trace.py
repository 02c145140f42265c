"""kvlink.trace: the KVLINK_TRACE timeline. Off it writes nothing; on, one JSON line per event, from any
number of processes into one file, on one clock. Its events through real vLLM servers:
tests/vllm/test_streamed_layers.py; through the proxy: tests/proxy/test_router.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvlink import trace


from tests.conftest import trace_lines as lines


def test_off_writes_nothing(tmp_path):
    trace.configure(None)
    trace.event("anything", n=1)
    assert not trace.enabled() and list(tmp_path.iterdir()) == []


def test_on_appends_one_line_per_event_with_time_pid_and_fields(traced):
    assert trace.enabled()
    t0 = time.monotonic()
    trace.event("first", rid="r1", n=3)
    trace.event("second", pairs=[(1, 2)], obj=object())  # not JSON: written as its str, never raises
    got = lines(traced)
    assert [e["ev"] for e in got] == ["first", "second"]
    assert got[0]["rid"] == "r1" and got[0]["n"] == 3 and got[0]["pid"] == os.getpid()
    assert got[1]["pairs"] == [[1, 2]] and got[1]["obj"].startswith("<object")
    assert t0 <= got[0]["t"] <= got[1]["t"] <= time.monotonic()


def test_an_unwritable_trace_does_not_raise(tmp_path):
    trace.configure(str(tmp_path / "missing-dir" / "trace.jsonl"))
    try:
        trace.event("lost")
    finally:
        trace.configure(None)


def test_processes_share_the_file_and_the_clock(traced):
    trace.event("before")
    code = "from kvlink import trace; [trace.event('child', i=i) for i in range(200)]"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, KVLINK_TRACE=str(traced)))
    trace.event("after")
    got = lines(traced)  # every line parses: no two processes' writes interleaved inside one
    child = [e for e in got if e["ev"] == "child"]
    assert [e["i"] for e in child] == list(range(200)) and {e["pid"] for e in child} != {os.getpid()}
    before, after = got[0]["t"], got[-1]["t"]
    assert all(before <= e["t"] <= after for e in child)  # CLOCK_MONOTONIC is the host's, not the process's
