"""The cap on open client connections (``max_connections``): a protocol factory in front of aiohttp's.

The event loop asks the listener's protocol factory for a protocol each time it accepts a socket. The gate is
that factory: under the cap it hands out aiohttp's own handler (wrapped, to count the connection until its
``connection_lost``); at the cap it hands out :class:`_Refusal`, which writes one canned 503 and closes the
socket without reading it. The count is taken in the factory, not in ``connection_made``, because the loop
accepts a burst of sockets (up to the backlog) before any of them is connected.

A refused connection never reaches aiohttp: whatever it sent is unread, so no route ran and nothing was
applied (a client that reads the 503 may say so; one that lost it to the reset of the unread bytes cannot
tell, and must assume the worst). Connections already open are not touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Callable

from kvlink.bootstrap.metrics import ServerCounters
from kvlink.fdlimit import fd_room

log = logging.getLogger(__name__)

# Descriptors a server needs beyond its connections: the listener, refused sockets accepted in one burst and
# not yet closed, and whatever else the process holds (the embedding engine's own files and sockets).
FD_HEADROOM = 256
BACKLOG = 1024  # the listener's: asyncio accepts up to this many sockets in one go, before any is refused


class ConnectionGate:
    """The listener's protocol factory: aiohttp's handler below ``limit`` open connections, a refusal at it.

    Counts into ``counters.connections`` (open now) and ``counters.connections_refused``. Loop thread only.
    """

    def __init__(self, limit: int, handler_factory: Callable[[], asyncio.Protocol], counters: ServerCounters) -> None:
        self._limit = limit
        self._handler_factory = handler_factory
        self._counters = counters
        body = json.dumps({"error": f"the bootstrap server has max_connections ({limit}) connections open; "
                           "retry later", "code": "unavailable", "field": "max_connections"}).encode()
        self._refusal = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s" % (len(body), body))

    def __call__(self) -> asyncio.Protocol:
        c = self._counters
        if c.connections >= self._limit:
            c.connections_refused += 1
            return _Refusal(self._refusal)
        counted = _Counted(self._handler_factory(), self._closed)  # (a factory that raises counted nothing)
        c.connections += 1
        return counted

    def _closed(self) -> None:
        self._counters.connections -= 1


class _Refusal(asyncio.Protocol):
    """Answers the canned 503 and closes: nothing the client sent is read."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (Not an isinstance check: uvloop's transports write but are no asyncio.WriteTransport.)
        transport.write(self._answer)  # type: ignore[attr-defined]  # a few hundred bytes: sent at once
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's handler, unchanged, with ``on_lost`` called once its connection is gone: at
    ``connection_lost``, or, where the loop failed to make the socket's transport after the factory ran (and
    so never calls the protocol), when the wrapper is collected."""

    __slots__ = ("_inner", "_lost", "__weakref__")

    def __init__(self, inner: asyncio.Protocol, on_lost: Callable[[], None]) -> None:
        self._inner = inner
        self._lost = weakref.finalize(self, on_lost)  # calling it runs on_lost once, and never again

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._lost()


def check_fd_limit(max_connections: int, *, raise_soft: bool = False) -> str | None:
    """None if this process may open ``max_connections`` sockets and ``FD_HEADROOM`` more, else why not.
    ``raise_soft``: first raise the soft RLIMIT_NOFILE as far as needed and the hard limit allows (the
    standalone server does; an embedding process owns its limits)."""
    need = max_connections + BACKLOG + FD_HEADROOM  # a burst: BACKLOG sockets accepted before the gate counts
    soft = fd_room(need, raise_soft=raise_soft)
    if soft is None:
        return None
    return (f"max_connections={max_connections} needs about {need} file descriptors but this process may open "
            f"{soft} (RLIMIT_NOFILE): raise it (ulimit -n) or lower max_connections")
