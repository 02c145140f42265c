"""A timeline of streamed and pulled KV, for latency work: off unless ``KVLINK_TRACE`` names a file.

With ``KVLINK_TRACE=/path/trace.jsonl`` in the environment of prefill's and decode's servers, each
process appends one JSON line per event: ``{"t": <CLOCK_MONOTONIC seconds>, "pid": ..., "ev": ...,
<fields>}``. CLOCK_MONOTONIC is one clock for every process of a host, so the lines of prefill and decode
on one host merge into one timeline (``sort -n`` on "t"); across hosts only durations within a process
compare. Each line is one ``write`` to an O_APPEND file, so processes do not interleave inside a line.

Events (see the call sites): proxy ``proxy_request``, ``proxy_prefill_sent`` / ``proxy_decode_sent`` (a
backend request's body is written), ``proxy_prefill_answer``, ``proxy_decode_answer``;
both engines ``engine_new`` (the scheduler got the request) and ``finished`` (vLLM finished it); prefill
``layer`` (a streaming step's attention layer saved its KV), ``forward_end`` (a streaming step's
forward ended, before vLLM samples), ``piece_send`` / ``piece_sent`` (the sender
thread's bootstrap call), ``publish`` (the record is out); decode ``admit`` (the scheduler took the
request's external tokens), ``pull_start``, ``resolve``, ``answer`` (a long poll answered: pieces or the
record), ``read_post`` / ``read_end`` (a batch of READs), ``pull_done`` (the worker has the outcome),
``recv_collected`` (vLLM's scheduler took it from a step's output), ``step`` (each scheduler step, with
its scheduled token count: the request's first forward is the first step with tokens after it),
``lockstep_end`` (a lock-step step's worker has its armed requests' outcomes; vLLM's sampling follows).
Off, ``event`` is one global test; call sites that would build a field first ask ``enabled()``.
"""

from __future__ import annotations

import json
import os
import threading
import time

_path: str | None = os.environ.get("KVLINK_TRACE") or None
_fd: int | None = None
_lock = threading.Lock()


def configure(path: str | None) -> None:
    """Trace to ``path`` from now on (None: stop). The environment variable sets it at import."""
    global _path, _fd
    with _lock:
        if _fd is not None:
            os.close(_fd)
        _path, _fd = path, None


def enabled() -> bool:
    """Tracing is on (a call site can skip building its fields when not)."""
    return _path is not None


def event(what: str, **fields) -> None:
    """One line on the timeline, when tracing is on."""
    if _path is None:
        return
    global _fd
    line = (json.dumps({"t": round(time.monotonic(), 6), "pid": os.getpid(), "ev": what, **fields},
                       default=str) + "\n").encode()
    with _lock:
        try:
            if _fd is None:
                _fd = os.open(_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(_fd, line)
        except OSError:  # a trace that cannot be written is no reason to fail a request
            pass
