"""HTTP adapter over the pairing table (aiohttp), and the embedded server running it in a thread.

The process that embeds the server (prefill's scheduler) publishes through ``BootstrapServer.publish``: the
same checked body and table call as ``POST /v1/request/publish``, run on the loop thread, without the HTTP
round trip through its own socket (1-2 ms on the engine's thread, between the step and its output).

Every route but ``GET /health`` takes a JSON body (``POST``) decoded into a strict Struct of
:mod:`kvlink.bootstrap.schema`; see ``docs/bootstrap.md`` for the routes. Errors leave as
``{"error", "code", "field"}`` with the status of the matching :mod:`kvlink.bootstrap.errors` class. Long polls
wait on an ``asyncio.Event`` per waiter, woken by the table's ``on_publish`` hook; the table is only touched
from the loop thread. Open connections are capped in front of aiohttp (``max_connections``, :mod:`gate
<kvlink.bootstrap.gate>`), and long polls may hold three quarters of them (``max_long_polls``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import inspect
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from kvlink.bootstrap import schema as s
from kvlink.bootstrap.config import BootstrapConfig
from kvlink.bootstrap.errors import (
    BootstrapError,
    BootstrapUnavailable,
    InvalidField,
    LookupTimeout,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestExpired,
    RequestReleased,
    TooManyWaiters,
    Unauthorized,
    UnknownEngine,
    UnknownRequest,
)
from kvlink.bootstrap.gate import BACKLOG, ConnectionGate, check_fd_limit
from kvlink.bootstrap.metrics import ServerCounters, ServerMetrics
from kvlink.bootstrap.table import PairingTable

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
SMALL_ANSWER = 16 << 10  # bytes: an answer this small is written without a deadline (_answer)
_JSON = "application/json"


class BootstrapApp:
    """The aiohttp application: routes, auth, body limits, long polls. Runs inside one event loop."""

    def __init__(self, config: BootstrapConfig, table: PairingTable) -> None:
        self.config = config
        self.table = table
        self.counters = ServerCounters()
        self.metrics = ServerMetrics(table, self.counters)
        self._token = config.token.encode() if config.token is not None else None
        self._waiters: dict[Hashable, set[asyncio.Event]] = {}
        self._waited_keys = 0  # ids waited on, summed over long polls (bounded by max_waiters)
        self._closing = False
        table.on_publish = self._on_publish
        table.on_transfer_end = self._on_transfer_end
        table.on_progress = self._on_transfer_end  # wakes the same long polls (by transfer id)
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._guard])
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        t = self.table
        self._post("/v1/engine/register", s.RegisterEngineBody, self._register)
        self._post("/v1/engine/heartbeat", s.EngineKeyBody, lambda b: s.LeaseAnswer(
            lease_s=t.heartbeat(b.engine_id, b.dp_rank, b.tp_rank, b.pp_rank, b.instance)))
        self._post("/v1/engine/unregister", s.EngineKeyBody, lambda b: s.OkAnswer(
            ok=t.unregister_engine(b.engine_id, b.dp_rank, b.tp_rank, b.pp_rank)))
        self._post("/v1/engine/get", s.EngineKeyBody, lambda b: t.get_engine(
            b.engine_id, b.dp_rank, b.tp_rank, b.pp_rank))
        self._post("/v1/engine/ranks", s.EngineRanksBody, lambda b: s.EngineRanksAnswer(
            ranks=t.engine_ranks(b.engine_id)))
        self._post("/v1/request/publish", s.PublishBody, self._publish)
        self._post("/v1/request/lookup", s.LookupBody, self._lookup)
        self._post("/v1/request/lookup_transfer", s.LookupTransferBody, self._lookup_transfer)
        self._post("/v1/request/renew", s.RenewBody, self._renew)
        self._post("/v1/request/release", s.ReleaseBody, lambda b: s.ReleaseAnswer(
            already_released=t.release(b.engine_id, b.request_id, b.outcome, b.router, b.reader)))
        self._post("/v1/transfer/abandon", s.AbandonTransferBody, lambda b: s.ReleaseAnswer(
            already_released=t.abandon_transfer(b.engine_id, b.transfer_id, b.request_id)))
        self._post("/v1/stream/pieces", s.StreamPiecesBody, lambda b: s.StreamPiecesAnswer(
            ended=t.stream_pieces(b.engine_id, b.rank, b.ranks, b.pieces, b.launch)))
        self._post("/v1/stream/stop", s.StreamStopBody, lambda b: s.ReleaseAnswer(
            already_released=t.stop_stream(b.transfer_id)))
        self._post("/v1/request/poll_released", s.PollReleasedBody, lambda b: t.poll_released(
            b.engine_id, b.server_id, b.ack, b.launch, b.seen))

    # ----- plumbing ---------------------------------------------------------------------------------------

    def _post(self, path: str, body_type: type, fn: Callable[[Any], Any]) -> None:
        decode = msgspec.json.Decoder(body_type).decode
        is_async = inspect.iscoroutinefunction(fn)

        async def handler(request: web.Request) -> web.Response:
            length = request.content_length
            if length is not None and length > self.config.max_body_bytes:
                raise PayloadTooLarge(f"body of {length} bytes exceeds {self.config.max_body_bytes}")
            if request.headers.get("Content-Encoding", "identity").lower() not in ("identity", ""):
                raise InvalidField("compressed bodies are not accepted", field="Content-Encoding")
            try:
                raw = await asyncio.wait_for(request.read(), self.config.body_timeout_s)
            except asyncio.TimeoutError:
                raise InvalidField(f"body not received within {self.config.body_timeout_s:g} s") from None
            except web.HTTPRequestEntityTooLarge:
                raise PayloadTooLarge(f"body exceeds {self.config.max_body_bytes} bytes") from None
            except (RequestPayloadError, HttpProcessingError) as err:
                raise InvalidField(f"unreadable body: {err.message}") from None
            try:
                body = decode(raw)
            except msgspec.ValidationError as err:
                raise s.invalid_from(err) from None
            except msgspec.DecodeError as err:
                raise InvalidField(f"malformed JSON: {err}") from None
            except UnicodeDecodeError as err:
                raise InvalidField(f"body is not UTF-8: {err}") from None
            result = (await fn(body)) if is_async else fn(body)
            return await self._answer(request, _encode(result))

        self.app.router.add_post(path, handler)

    async def _answer(self, request: web.Request, payload: bytes) -> web.StreamResponse:
        """An answer past the socket's buffers must be taken within ``body_timeout_s``, or the connection is
        closed: aiohttp waits for a client that stops reading (a stopped process, a lookup of thousands of
        ids) without a deadline, holding the connection, a ``max_connections`` slot and the answer. Small
        answers go as they are (they fit the kernel's buffers; no task per answer on the hot path)."""
        if len(payload) <= SMALL_ANSWER:
            return web.Response(body=payload, content_type=_JSON)
        resp = web.StreamResponse(headers={"Content-Type": _JSON})
        resp.content_length = len(payload)

        async def send() -> None:
            await resp.prepare(request)
            await resp.write(payload)
            await resp.write_eof()

        try:
            await asyncio.wait_for(send(), self.config.body_timeout_s)
        except ConnectionError:  # the client went away mid-answer (as aiohttp's own Response, quietly)
            self.counters.errors["answer_not_taken"] += 1
        except asyncio.TimeoutError:
            self.counters.errors["answer_not_taken"] += 1
            log.info("bootstrap: %s %s: the client took no answer of %d bytes within %g s; closing it", request.method,
                     request.path, len(payload), self.config.body_timeout_s)
            if request.transport is not None:
                request.transport.abort()
        return resp

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            if self._token is not None and request.path != "/health":
                self._authorize(request)
            return await handler(request)
        except BootstrapError as err:
            return self._error(err)
        except web.HTTPException as err:
            mapped = {404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge}.get(err.status)
            if mapped is not None:
                return self._error(mapped(f"{err.reason}: {request.method} {request.path}"))
            self.counters.errors[str(err.status)] += 1
            return web.json_response({"error": err.reason, "code": str(err.status), "field": None}, status=err.status)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("bootstrap: internal error on %s %s", request.method, request.path)
            return self._error(BootstrapError("internal server error"))

    def _authorize(self, request: web.Request) -> None:
        header = request.headers.get("Authorization")
        if header is None:
            raise Unauthorized("missing bearer token", field="Authorization")
        scheme, _, given = header.partition(" ")
        token = self._token
        assert token is not None
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token)
        if not ok:
            raise Unauthorized("wrong bearer token", field="Authorization")

    def _error(self, err: BootstrapError) -> web.Response:
        self.counters.errors[err.code] += 1
        body = s.ErrorAnswer(error=err.message, code=err.code, field=err.field)
        return web.Response(body=_encode(body), status=err.status, content_type=_JSON)

    # ----- handlers ---------------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        t = self.table
        answer = s.HealthAnswer(status="ok", server_id=t.server_id, engines=t.num_engine_ranks, requests=t.num_requests)
        return web.Response(body=_encode(answer), content_type=_JSON)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _register(self, body: s.RegisterEngineBody) -> s.RegisterAnswer:
        created = self.table.register_engine(body.registration, body.lease_s)
        if created:
            r = body.registration
            log.info("bootstrap: engine %s rank dp%d/tp%d/pp%d registered at %s",
                     r.engine_id, r.dp_rank, r.tp_rank, r.pp_rank, r.transport_addr)
        return s.RegisterAnswer(created=created, lease_s=body.lease_s)

    def _publish(self, body: s.PublishBody) -> s.OkAnswer:
        self.table.publish(body.engine_id, body.request_id, body.block_ids, body.num_tokens, body.lease_s,
                           body.transfer_id, body.epoch, body.prompt_sha, body.launch)
        return s.OkAnswer()

    def _check_ids(self, ids: list[str]) -> None:
        if len(ids) > self.config.max_lookup_ids:
            raise InvalidField(f"at most {self.config.max_lookup_ids} ids per call", field="request_ids")

    def _renew(self, body: s.RenewBody) -> s.RenewAnswer:
        self._check_ids(body.request_ids)
        return self.table.renew(body.engine_id, body.request_ids, body.lease_s, body.reader)

    async def _lookup(self, body: s.LookupBody) -> s.LookupAnswer:
        self._check_ids(body.request_ids)
        answer = self.table.lookup(body.engine_id, body.request_ids)
        if not answer.unknown or body.wait_s <= 0:
            return answer
        deadline = time.monotonic() + min(body.wait_s, self.config.max_wait_s)
        while answer.unknown:
            keys = [("r", body.engine_id, rid) for rid in answer.unknown]
            if not await self._wait(keys, deadline):
                break
            answer = self.table.lookup(body.engine_id, body.request_ids)
        return answer

    async def _lookup_transfer(self, body: s.LookupTransferBody) -> s.RequestRecord:
        if body.engine_id is not None and not self.table.has_engine(body.engine_id):
            raise UnknownEngine(f"engine {body.engine_id!r} is not registered", field="engine_id")
        found = self.table.lookup_transfer(body.transfer_id, body.after, body.layers, body.peek, body.reader)
        if found is s.RequestStatus.UNKNOWN and body.wait_s > 0:
            deadline = time.monotonic() + min(body.wait_s, self.config.max_wait_s)
            while found is s.RequestStatus.UNKNOWN and await self._wait([("t", body.transfer_id)], deadline):
                found = self.table.lookup_transfer(body.transfer_id, body.after, body.layers, body.peek, body.reader)
            if found is s.RequestStatus.UNKNOWN:
                raise LookupTimeout(f"transfer id {body.transfer_id!r} was not published in time", field="transfer_id")
        if isinstance(found, s.RequestRecord):
            return found
        if found is s.RequestStatus.EXPIRED:
            raise RequestExpired(f"transfer id {body.transfer_id!r} expired", field="transfer_id")
        if found is s.RequestStatus.RELEASED:
            raise RequestReleased(f"transfer id {body.transfer_id!r} was already released", field="transfer_id")
        raise UnknownRequest(f"transfer id {body.transfer_id!r} is unknown", field="transfer_id")

    # ----- long polls -------------------------------------------------------------------------------------

    async def _wait(self, keys: Iterable[Hashable], deadline: float) -> bool:
        """Wait until one of ``keys`` is published or the deadline passes; False on timeout."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.counters.wait_timeouts += 1
            return False
        keys = list(keys)
        # Bound what all long polls together wait on (a grouped poll waits on each of its unknown ids).
        if self._waited_keys + len(keys) > self.config.max_waiters:
            raise TooManyWaiters(f"the server already waits on {self._waited_keys} ids (max_waiters "
                                 f"{self.config.max_waiters}); retry later")
        # ... and the connections they hold: the rest stay for the calls that end the waits.
        if self.counters.waiting >= self.config.max_long_polls:
            raise TooManyWaiters(f"the server already holds {self.counters.waiting} long polls (3/4 of "
                                 f"max_connections {self.config.max_connections}); retry later")
        event = asyncio.Event()
        self.counters.waits += 1
        self.counters.waiting += 1
        with self._registered(keys, event):
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                self.counters.wait_timeouts += 1
                return False
            finally:
                self.counters.waiting -= 1
        if self._closing:
            raise BootstrapUnavailable("bootstrap server is shutting down")
        return True

    @contextlib.contextmanager
    def _registered(self, keys: Iterable[Hashable], event: asyncio.Event) -> Iterator[None]:
        keys = list(keys)
        for key in keys:
            self._waiters.setdefault(key, set()).add(event)
        self._waited_keys += len(keys)
        try:
            yield
        finally:
            self._waited_keys -= len(keys)
            for key in keys:
                events = self._waiters.get(key)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._waiters[key]

    def _on_publish(self, record: s.RequestRecord) -> None:
        if not self._waiters:
            return
        keys: list[Hashable] = [("r", record.engine_id, record.request_id)]
        if record.transfer_id is not None:
            keys.append(("t", record.transfer_id))
        for key in keys:
            for event in self._waiters.get(key, ()):
                event.set()

    def _on_transfer_end(self, transfer_id: str) -> None:
        for event in self._waiters.get(("t", transfer_id), ()):
            event.set()  # the woken lookup finds the tombstone and answers 410 released

    def close(self) -> None:
        """Wake every long poll; they answer 503 so clients retry elsewhere or later."""
        self._closing = True
        for events in self._waiters.values():
            for event in events:
                event.set()


def listen_url(host: str, port: int) -> str:
    """The URL a client on this host reaches a server listening on ``host``:``port`` at (a wildcard
    address is reached on loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class BootstrapServer:
    """The bootstrap server in a background thread with its own event loop.

    ``start()`` returns once the socket listens (``port=0`` picks a free port; see ``.port`` and ``.url``);
    ``stop()`` wakes long polls, closes connections and joins the thread. Also a context manager.
    """

    def __init__(self, config: BootstrapConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or BootstrapConfig()
        self.table = PairingTable(self.config.table_limits(), clock=clock)
        self._port = self.config.port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.app: BootstrapApp | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def url(self) -> str:
        return listen_url(self.config.host, self._port)

    def start(self) -> BootstrapServer:
        if self._thread is not None:
            raise RuntimeError("bootstrap server already started")
        self._ready.clear()
        self._failure = None
        sock = _listen_socket(self.config.host, self.config.port)
        self._port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, args=(sock,), name="kvlink-bootstrap", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            self._thread = None
            raise self._failure
        log.info("bootstrap: listening on %s", self.url)
        short = check_fd_limit(self.config.max_connections)
        if short is not None:
            log.warning("bootstrap: %s", short)
        return self

    def stop(self) -> None:
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        thread.join()
        self._thread = None

    def publish(self, body: s.PublishBody, timeout_s: float) -> None:
        """``POST /v1/request/publish`` from the process that runs this server: the table call on the loop
        thread (long polls wake as they would), its error raised here. A server not running raises
        BootstrapUnavailable from a ConnectionRefusedError, as a refused HTTP connection would (not applied);
        no answer within ``timeout_s`` raises it alone, as a lost HTTP answer would (it may still apply)."""
        self._on_loop(lambda app: app._publish(body), timeout_s)

    def _on_loop(self, fn: Callable[[BootstrapApp], Any], timeout_s: float) -> Any:
        loop, app = self._loop, self.app
        if self._thread is None or loop is None or app is None or loop.is_closed():
            raise BootstrapUnavailable("the embedded bootstrap server is not running") from ConnectionRefusedError()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(app))
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(err)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop closed meanwhile: never scheduled
            raise BootstrapUnavailable("the embedded bootstrap server is not running") from ConnectionRefusedError()
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if fut.cancel():  # it never ran, and never will: not applied (the caller may free what it held)
                raise BootstrapUnavailable(f"the embedded bootstrap server did not get to it in {timeout_s:g} s; "
                                           "not applied") from ConnectionRefusedError()
            raise BootstrapUnavailable(f"the embedded bootstrap server did not answer in {timeout_s:g} s") from None

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock))
        except BaseException as err:  # reported to start() if it happened before listening
            if not self._ready.is_set():
                self._failure = err
            else:
                log.exception("bootstrap: server loop failed")
        finally:
            self._ready.set()
            sock.close()
            loop.close()

    async def _serve(self, sock: socket.socket) -> None:
        self._stop = asyncio.Event()
        self.app = BootstrapApp(self.config, self.table)
        # handler_cancellation: a long poll whose client went away stops waiting (and frees its waiter slot).
        runner = web.AppRunner(self.app.app, access_log=None, shutdown_timeout=self.config.shutdown_timeout_s,
                               handler_cancellation=True, keepalive_timeout=self.config.idle_timeout_s)
        await runner.setup()
        sweeper = listener = None
        try:
            # Not a web.SockSite: the gate stands between the listener and aiohttp's handlers (gate.py).
            assert runner.server is not None
            gate = ConnectionGate(self.config.max_connections, runner.server, self.app.counters)
            loop = asyncio.get_running_loop()
            listener = await loop.create_server(gate, sock=sock, backlog=BACKLOG)
            sweeper = loop.create_task(self._sweep())
            self._ready.set()
            await self._stop.wait()
        finally:
            if sweeper is not None:
                sweeper.cancel()
            if listener is not None:
                listener.close()  # accept no more; the runner closes the open connections
            self.app.close()
            await runner.cleanup()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.table.expire()


def _listen_socket(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
