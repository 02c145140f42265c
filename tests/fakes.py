"""Fakes shared by the test suites, each here once: a clock, a bootstrap client and a pull table with
scripted answers, a staging pool and a piece sender that record what they are asked, an HTTP server and
a raw HTTP client, peers that hang or trickle, a call that fails once, a client with one call overridden
(Delegating). The other fakes live
beside this module:
the in-process transport in fakes_transport.py, fake vLLM HTTP servers (the proxy's backends) in
fakes_vllm_server.py, connectors recording their stats or corrupting what they pulled in fakes_connector.py;
the network relay (corrupting, throttling) is relay.py."""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tests import wire


class FakeClock:
    """A monotonic clock that moves only when told to (``advance``). Safe to read from another thread."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        with self._lock:
            self._now += seconds
            return self._now


class FakeBootstrapClient:
    """A bootstrap client with scripted answers, for what decode asks a bootstrap server: lease renewals and
    the prefill engine's registration.

    ``renew`` records each call in ``renewals`` as (engine_id, request_ids, lease_s) and the reader it named in
    ``readers``, then, in this order:
    blocks until ``hang_until`` is set and fails as a client that gave up on a hung server would
    (ConnectionError); sleeps ``delay_s`` (a slow server); raises ``error`` (an unreachable one); hands the
    call to ``then`` (a real client behind the slow server); else answers the leases in ``lost``
    (request id -> RequestStatus) that were asked about, and grants the others ``granted_s`` (None: what
    was asked; a number: prefill published them with a shorter lease). ``get_engine`` answers ``engine`` (an
    EngineRegistration) and refuses when none is scripted; ``engine_ranks`` answers it as the only rank.
    ``lookup`` (how decode checks a sequential pull's block ids) goes to ``then`` if any, else answers
    ``records`` (request id -> RequestRecord or RequestStatus; unknown where none is scripted).
    """

    def __init__(self, lost: dict | None = None, error: Exception | None = None,
                 hang_until: threading.Event | None = None, delay_s: float = 0.0, then: object = None,
                 engine: object = None, granted_s: float | None = None, records: dict | None = None) -> None:
        self.lost, self.error, self.hang_until, self.delay_s = lost or {}, error, hang_until, delay_s
        self.records = records or {}
        self.granted_s = granted_s
        self.then, self.engine = then, engine
        self.renewals: list[tuple[str, list[str], float]] = []
        self.readers: list[str | None] = []

    def renew(self, engine_id: str, request_ids: list[str], lease_s: float, reader: str | None = None) -> dict:
        self.renewals.append((engine_id, list(request_ids), lease_s))
        self.readers.append(reader)
        if self.hang_until is not None:
            self.hang_until.wait(30)
            raise ConnectionError("the bootstrap server never answered")
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        if self.then is not None:
            return self.then.renew(engine_id, request_ids, lease_s, reader=reader)
        granted = lease_s if self.granted_s is None else min(lease_s, self.granted_s)
        return {rid: status for rid, status in self.lost.items() if rid in request_ids}, granted

    def lookup(self, engine_id: str, request_ids: list[str], wait_s: float = 0.0) -> dict:
        if self.then is not None:
            return self.then.lookup(engine_id, request_ids, wait_s)
        from kvlink.bootstrap.schema import RequestStatus

        return {rid: self.records.get(rid, RequestStatus.UNKNOWN) for rid in request_ids}

    def get_engine(self, engine_id: str, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> object:
        if self.engine is None:
            raise ConnectionError(f"no registration of {engine_id} scripted in this fake")
        return self.engine

    def engine_ranks(self, engine_id: str) -> list:
        return [self.get_engine(engine_id)]


class RecordingPullTable:
    """Stands in for decode's pull table (kvlink.vllm.pulls.PullTable) behind an ``apply`` callback: runs
    each event at time ``now`` and records the lease events as tuples: ("held", group, rids, held_until),
    ("lost", group, rid, why), ("retry", group, rids)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.events: list[tuple] = []

    def apply(self, event: Callable[[RecordingPullTable, float], object]) -> None:
        event(self, self.now)

    def lease_held(self, group: tuple, rids: tuple, held_until: float, now: float) -> None:
        self.events.append(("held", group, rids, held_until))

    def lease_lost(self, group: tuple, rid: str, why: str, now: float) -> None:
        self.events.append(("lost", group, rid, why))

    def renew_failed(self, group: tuple, rids: tuple, now: float) -> None:
        self.events.append(("retry", group, rids))


Reply = tuple[int, dict]


class RecordingStager:
    """A host staging pool (stager.Stager's copy interface, on CPU) that records each copy into it:
    (device blocks, slots, layer) with layer None for every layer."""

    cuda = False

    def __init__(self) -> None:
        self.copies: list[tuple[tuple[int, ...], tuple[int, ...], int | None]] = []

    def fence(self) -> None:
        return None

    def to_pool(self, blocks, slots, after=None, layer=None):
        from kvlink.vllm.stager import DONE

        self.copies.append((tuple(blocks), tuple(slots), layer))
        return DONE


class HandFence:
    """A device fence (stager.Pending's ``done``/``wait``) the test completes by hand with ``set``."""

    def __init__(self) -> None:
        self._ev = threading.Event()

    def done(self) -> bool:
        return self._ev.is_set()

    def wait(self) -> None:
        assert self._ev.wait(10), "HandFence never set"

    def set(self) -> None:
        self._ev.set()


class CudaLikeStager(RecordingStager):
    """A RecordingStager that answers as a CUDA one does: its copies and its marker are HandFences the test
    completes (``pending``: each copy's, in order; ``markers``), and its fence (vLLM's stream) is done."""

    cuda = True

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[HandFence] = []
        self.markers: list[HandFence] = []

    def fence(self):
        class _Event:
            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                pass

        return _Event()

    def to_pool(self, blocks, slots, after=None, layer=None):
        super().to_pool(blocks, slots, after, layer)
        if not blocks:
            return self.marker()
        self.pending.append(HandFence())
        return self.pending[-1]

    def marker(self):
        self.markers.append(HandFence())
        return self.markers[-1]


class RecordingSender:
    """A stream.PieceSender that keeps what it is handed, in order, instead of sending it (``fences``: the
    fence each call came with)."""

    def __init__(self) -> None:
        self.pieces: list = []
        self.fences: list = []

    def submit(self, pieces, fence=None) -> None:
        self.pieces += [p.fields() for p in pieces]
        self.fences.append(fence)

    def close(self) -> None:
        pass


class ScriptedHTTPServer:
    """A tiny HTTP/1.1 server on 127.0.0.1 answering POST/GET with scripted (status, JSON) replies.

    ``script`` is called with the request path for every request; it records every request's path and the
    client port (to see connection reuse). ``close_after_each`` closes every connection after answering,
    as a server that drops idle keep-alive connections would.
    """

    def __init__(self, script: Callable[[str], Reply], close_after_each: bool = False) -> None:
        self.script = script
        self.requests: list[tuple[str, int]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.requests.append((self.path, self.client_address[1]))
                status, body = owner.script(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if close_after_each:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedHTTPServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class _OwnToken:
    """RawHTTP.request's default token: the client's own (None is taken: it sends no Authorization header)."""


_OWN_TOKEN = _OwnToken()


class RawHTTP:
    """HTTP requests as they are written, to a server on 127.0.0.1: what a typed client would never send
    (bad bodies, wrong or missing tokens, odd headers). Answers are (status, JSON body, or {"raw": text})."""

    def __init__(self, port: int, token: str | None = None) -> None:
        self.port = port
        self.token = token

    def request(self, method: str, path: str, body: bytes | str | dict | None = None, *,
                token: str | None | _OwnToken = _OWN_TOKEN, headers: dict[str, str] | None = None) -> Reply:
        """``token``: the bearer token to send, None for no Authorization header; this client's own if left out."""
        if isinstance(token, _OwnToken):
            token = self.token
        if isinstance(body, dict):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        all_headers = {"Content-Type": "application/json"}
        if token is not None:
            all_headers["Authorization"] = f"Bearer {token}"
        all_headers.update(headers or {})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(data) if data else {}
        except ValueError:
            parsed = {"raw": data.decode("latin-1")}
        return response.status, parsed

    def post(self, path: str, body: bytes | str | dict | None = None, **kw) -> Reply:
        return self.request("POST", path, body, **kw)


class StalledPeer:
    """Accepts TCP connections and never answers (a hung prefill: bootstrap or transport)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.url = f"http://{self.address}"
        self.accepted = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(c)  # kept open, never read from or written to
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass


class SlowTarget:
    """A fake target speaking the real protocol that answers READ requests by
    trickling bytes (`fill`) slowly, or not at all (stall=True). Used to hold a
    batch in flight while a test cancels it, kills the peer, or times out."""

    def __init__(self, token: bytes | None = None, chunk: int = 1024, interval: float = 0.01, fill: int = 0xAB,
                 stall: bool = False):
        self.token, self.chunk, self.interval, self.fill, self.stall = token, chunk, interval, fill, stall
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.sent_after_request = 0
        self.send_errors = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c: socket.socket) -> None:
        try:
            wire.server_handshake(c, self.token)
            while not self.stop.is_set():
                (_, _, ftype, _, seq, _), body = wire.recv_frame(c)
                if ftype != wire.READ_REQ:
                    return
                n = struct.unpack_from("<I", body)[0]
                total = sum(wire.DESC.unpack_from(body, 8 + 24 * i)[3] for i in range(n))
                c.sendall(wire.frame(wire.READ_RESP, wire.status_body(0, total), seq=seq))
                left = total
                while left > 0 and not self.stop.is_set():
                    if not self.stall:
                        k = min(self.chunk, left)
                        c.sendall(bytes([self.fill]) * k)
                        self.sent_after_request += k
                        left -= k
                    time.sleep(self.interval)
        except OSError:
            self.send_errors += 1
        finally:
            c.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def serve_slow_forever(token: bytes | None = None) -> None:
    """A SlowTarget in its own process (a test kills it): prints its address, then serves."""
    t = SlowTarget(token=token)
    print(t.address, flush=True)
    while True:
        time.sleep(1)


def failing_once(real, error: Exception):
    """``real`` wrapped to raise ``error`` on its first call only; (the wrapper, the list of each call's
    arguments). For monkeypatching a call that a component must retry."""
    calls: list = []

    def wrapper(*args):
        calls.append(args)
        if len(calls) == 1:
            raise error
        return real(*args)

    return wrapper, calls


if __name__ == "__main__":  # python -m tests.fakes TOKEN, from the repository root
    serve_slow_forever(sys.argv[1].encode())


class Delegating:
    """A client (or any object) whose attributes are ``inner``'s except those a subclass defines: a test
    overrides one call (to slow it, record it) and leaves the rest real."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
