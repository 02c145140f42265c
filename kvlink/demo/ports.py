"""Ports for servers that bind later (the demo's and the benchmarks' vLLM servers, transports, bootstrap
servers; the tests' too).

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, which is also where every
outgoing connection's local port comes from: between closing that socket and a server binding the port,
any connect() on the host may take it, and the server then fails with EADDRINUSE (seen in CI, a prefill
transport's "listen on 127.0.0.1:34901: KVL_ESYS", and in the stream benchmark, a bootstrap server's
bind). So ports are picked below the ephemeral range, at random, checked bindable, and never handed out
twice in one process.
"""

from __future__ import annotations

import random
import socket

_given: set[int] = set()
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A port P with P .. P + span - 1 all free (prefill rank i listens on transport_port + i)."""
    hi = _ephemeral_low() - span
    if hi > 11000:
        for _ in range(200):
            port = _rng.randint(10000, hi)
            ports = range(port, port + span)
            if _given.isdisjoint(ports) and all(_bindable(p) for p in ports):
                _given.update(ports)
                return port
    for _ in range(50):  # no room below the ephemeral range: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span <= 65536 and all(_bindable(p) for p in range(port + 1, port + span)):
            return port
    raise RuntimeError(f"no {span} consecutive free ports")
