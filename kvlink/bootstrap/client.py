"""Synchronous, thread-safe client of the bootstrap server (called from vLLM's scheduler process).

Built on ``http.client`` with a small pool of keep-alive connections shared by threads. Each call has one
deadline (``timeout_s``, plus the wait of a long poll): connection errors and 5xx answers are retried with
exponential backoff until the retries or the deadline run out, then :class:`BootstrapUnavailable` is raised;
4xx answers are never retried and raise the matching :mod:`kvlink.bootstrap.errors` class. Every call is
idempotent on the server, so a retry after a lost answer is safe (a publish retried after its request ended
is refused 410 and stores nothing: docs/bootstrap.md, "what a repeat answers").
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import threading
import time
import urllib.parse
from typing import Any, TypeVar

import msgspec

from kvlink.bootstrap import schema as s
from kvlink.bootstrap.errors import (
    BootstrapError,
    BootstrapUnavailable,
    Conflict,
    InvalidField,
    LookupTimeout,
    RequestExpired,
    UnknownEngine,
    UnreadableAnswer,
    error_from_body,
)
from kvlink.bootstrap.schema import EngineRegistration, Outcome, RequestRecord, RequestStatus

log = logging.getLogger(__name__)

T = TypeVar("T")
_encode = msgspec.json.Encoder().encode
_error_decoder = msgspec.json.Decoder(s.ErrorAnswer)
# A reused keep-alive connection the server closed while idle fails like this on first use.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
MAX_URL_LEN = 512


def canonical_url(url: str) -> str:
    """The one rule for a bootstrap server's address, wherever one is given (client, kv_transfer_params).

    ``http(s)://host[:port]`` or ``host:port`` (http assumed), at most MAX_URL_LEN characters, no whitespace.
    A path, query, fragment or user part is refused: the client would ignore it, and talk to another server
    than the one meant. Returns ``scheme://host[:port]``; ValueError says what is wrong.
    """
    if not isinstance(url, str):
        raise ValueError(f"bootstrap url must be a string, not {type(url).__name__}")
    if not 0 < len(url) <= MAX_URL_LEN:
        raise ValueError(f"bootstrap url must have 1 to {MAX_URL_LEN} characters, not {len(url)}")
    if any(c.isspace() for c in url):
        raise ValueError(f"bootstrap url must have no whitespace: {url[:80]!r}")
    if not all(0x21 <= ord(c) <= 0x7E for c in url):  # (control characters: the client would refuse it)
        raise ValueError(f"bootstrap url must be printable ASCII: {url[:80]!r}")
    try:
        parsed = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        parsed.port  # noqa: B018 - raises when the port is not a number from 0 to 65535
    except ValueError as e:  # also a malformed IPv6 literal
        raise ValueError(f"bootstrap url {url[:80]!r} is malformed: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"bootstrap url must be http(s)://host[:port] or host:port, not {url[:80]!r}")
    if parsed.port == 0:
        raise ValueError(f"bootstrap url {url[:80]!r} names port 0, which no server listens on")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment or "@" in parsed.netloc:
        raise ValueError(f"bootstrap url must be only scheme://host[:port] (no path, query or user), not {url[:80]!r}")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, "", "", ""))


class _OneWriteMixin:
    """Send each request in one write, with Nagle off.

    ``http.client`` writes the headers and the body separately; with Nagle on, the body then waits for the
    server's delayed ACK (tens of milliseconds on loopback), and even with it off the server wakes twice.
    """

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]

    def _send_output(self, message_body: Any = None, encode_chunked: bool = False) -> None:
        buffer = getattr(self, "_buffer", None)  # http.client's pending header lines
        if isinstance(message_body, bytes) and not encode_chunked and isinstance(buffer, list):
            buffer.extend((b"", b""))
            message = b"\r\n".join(buffer) + message_body
            del buffer[:]
            self.send(message)  # type: ignore[attr-defined]
            return
        super()._send_output(message_body, encode_chunked)  # type: ignore[misc]


class _HTTPConnection(_OneWriteMixin, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_OneWriteMixin, http.client.HTTPSConnection):
    pass


class _Pool:
    """Idle keep-alive connections to one server, shared by threads (a connection is used by one at a time)."""

    def __init__(self, scheme: str, host: str, port: int, max_idle: int) -> None:
        self._cls = _HTTPSConnection if scheme == "https" else _HTTPConnection
        self._host, self._port, self._max_idle = host, port, max_idle
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()  # guards _idle and _closed
        self._closed = False

    def get(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._closed:
                raise BootstrapError("bootstrap client is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            return self._cls(self._host, self._port, timeout=timeout), False
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True

    def put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class BootstrapClient:
    """Typed client of every bootstrap route. See ``docs/bootstrap.md``."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 5.0,
        *,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        max_idle_connections: int = 16,
    ) -> None:
        try:
            self.url = canonical_url(url)
        except ValueError as e:
            raise InvalidField(str(e), field="url") from None
        if timeout_s <= 0:
            raise InvalidField("timeout_s must be positive", field="timeout_s")
        parsed = urllib.parse.urlsplit(self.url)
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._pool = _Pool(parsed.scheme, parsed.hostname or "", port, max_idle_connections)
        self._headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._decoders: dict[type, msgspec.json.Decoder] = {}
        self._poll_lock = threading.Lock()  # serializes poll_released; guards _acks
        # engine_id -> (server_id, last seq handed out, the server's now in the last answer)
        self._acks: dict[str, tuple[str | None, int, float]] = {}
        # The server refused ``after`` (a bootstrap from before streamed KV): ask it without from then on.
        self._no_progress = False
        self._no_layers = False
        self._no_peek = False  # a server of before the router's deferred release: it knows no "peek"
        self._no_reader = False  # a server of before readers were told apart (PairingTable.release)
        self._no_poll_launch = False  # a server of before polls named their launch (PairingTable.poll_released)
        self._no_poll_seen = False  # ... or said which answer they last got

    # ----- engines ----------------------------------------------------------------------------------------

    def register_engine(self, reg: EngineRegistration, lease_s: float) -> bool:
        """Register (or renew) one rank; True if it was new. Conflict if the rank is live with another layout."""
        reg = _validated(reg)
        answer = self._call("/v1/engine/register", s.checked(s.RegisterEngineBody, registration=reg, lease_s=lease_s),
                            s.RegisterAnswer)
        return answer.created

    def heartbeat(self, engine_id: str, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0,
                  instance: str | None = None) -> None:
        """Renew a rank's lease; UnknownEngine if the server forgot it (restart or lease ran out); Conflict
        (field ``instance``) if another process (``instance``: the sender's) registered the rank since."""
        body = s.checked(s.EngineKeyBody, engine_id=engine_id, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank,
                         instance=instance)
        self._call("/v1/engine/heartbeat", body, s.LeaseAnswer)

    def unregister_engine(self, engine_id: str, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> bool:
        return self._call("/v1/engine/unregister", _key(engine_id, tp_rank, dp_rank, pp_rank), s.OkAnswer).ok

    def get_engine(self, engine_id: str, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> EngineRegistration:
        return self._call("/v1/engine/get", _key(engine_id, tp_rank, dp_rank, pp_rank), EngineRegistration)

    def engine_ranks(self, engine_id: str) -> list[EngineRegistration]:
        """Every live rank of an engine, ordered by (dp, tp, pp) rank."""
        body = s.checked(s.EngineRanksBody, engine_id=engine_id)
        return self._call("/v1/engine/ranks", body, s.EngineRanksAnswer).ranks

    # ----- requests ---------------------------------------------------------------------------------------

    def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: list[list[int]],
        num_tokens: int,
        lease_s: float,
        transfer_id: str | None = None,
        epoch: int = 0,
        prompt_sha: str | None = None,
        launch: str | None = None,
    ) -> None:
        """Publish a finished prefill request (the same publish again renews it while it is live; other content
        conflicts). RequestReleased / RequestExpired when its request id or transfer id already ended
        (released, abandoned, expired): nothing stored, the blocks are nobody's any more.
        ``prompt_sha``: the digest of the prompt tokens it computed, which decode compares with its own.
        ``launch``: the engine's start (EngineRegistration.launch); Conflict if its ranks are another's."""
        body = s.checked(s.PublishBody, engine_id=engine_id, request_id=request_id, transfer_id=transfer_id,
                         block_ids=block_ids, num_tokens=num_tokens, lease_s=lease_s, epoch=epoch,
                         prompt_sha=prompt_sha, launch=launch)
        self._call("/v1/request/publish", body, s.OkAnswer)

    def lookup(
        self, engine_id: str, request_ids: list[str], wait_s: float = 0.0
    ) -> dict[str, RequestRecord | RequestStatus]:
        """Grouped lookup: each id maps to its :class:`RequestRecord`, or to ``RequestStatus.UNKNOWN``,
        ``EXPIRED`` or ``RELEASED``. With ``wait_s`` the server holds the call until no id is unknown or the
        wait ends (unknown ids then stay UNKNOWN). UnknownEngine if the engine is not registered."""
        body = s.checked(s.LookupBody, engine_id=engine_id, request_ids=request_ids, wait_s=wait_s)
        answer = self._call("/v1/request/lookup", body, s.LookupAnswer, wait_s=wait_s)
        out: dict[str, RequestRecord | RequestStatus] = {r.request_id: r for r in answer.ready}
        for ids, status in ((answer.expired, RequestStatus.EXPIRED), (answer.released, RequestStatus.RELEASED),
                            (answer.unknown, RequestStatus.UNKNOWN)):
            for rid in ids:
                out[rid] = status
        return out

    def lookup_transfer(self, transfer_id: str, wait_s: float = 0.0, engine_id: str | None = None,
                        after: int | None = None, layers: bool = False, peek: bool = False,
                        reader: str | None = None) -> RequestRecord:
        """The request published under a router-chosen transfer id, waiting up to ``wait_s`` for it. With
        ``after`` (streamed KV) prefill's progress also answers, as a record with ``partial`` set, once its
        ``version`` is above ``after``; with ``layers`` too, that progress is layer-wise (``step_block_ids``,
        ``layers``: streams.py). ``peek``: the caller looks without reading (the router before it releases,
        decode before it reports): the record is not handed to a reader, and one the router released while a
        reader's lease runs is still answered (PairingTable.release). ``reader``: the decode engine reading
        (its id and start: PairingTable.release).

        Raises LookupTimeout (an UnknownRequest and a TimeoutError) when the wait ends first, UnknownRequest
        when not waiting, RequestExpired / RequestReleased when it can no longer be pulled, and, given
        ``engine_id``, UnknownEngine at once when that engine is not registered.
        """
        deadline = time.monotonic() + wait_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            body = s.checked(s.LookupTransferBody, transfer_id=transfer_id, wait_s=remaining, engine_id=engine_id,
                             after=None if self._no_progress else after,
                             layers=layers and after is not None and not (self._no_progress or self._no_layers),
                             peek=peek and not self._no_peek, reader=None if self._no_reader else reader)
            try:
                return self._call("/v1/request/lookup_transfer", body, RequestRecord, wait_s=remaining)
            except InvalidField as e:
                if body.reader is not None and e.field == "reader":
                    self._old_reader()
                    continue
                if body.peek and e.field == "peek":
                    self._old_server("peek")
                    continue
                if body.layers and e.field == "layers":
                    # A server of before layer-wise progress: whole blocks only.
                    log.warning("kvlink: bootstrap server %s does not know layer-wise progress; decode streams "
                                "whole blocks only (upgrade it for layer-wise streaming)", self.url)
                    self._no_layers = True
                    continue
                if body.after is None or e.field != "after":
                    raise
                # An older server: no progress reports, only the published record (nothing is streamed).
                log.warning("kvlink: bootstrap server %s does not know streamed KV ('after'); decode waits "
                    "for published records only (upgrade it to stream)", self.url)
                self._no_progress = True
            except LookupTimeout:
                # The server bounds each wait (max_wait_s); go on until our own deadline.
                if deadline - time.monotonic() <= 0.01:
                    raise

    def renew(self, engine_id: str, request_ids: list[str], lease_s: float,
              reader: str | None = None) -> tuple[dict[str, RequestStatus], float]:
        """Extend leases of requests decode is still pulling. Returns (the ids that could not be renewed, the
        lease the others got: ``lease_s``, or less where prefill published a request with a shorter one).
        ``reader``: the decode engine renewing (PairingTable.release)."""
        while True:
            body = s.checked(s.RenewBody, engine_id=engine_id, request_ids=request_ids, lease_s=lease_s,
                             reader=None if self._no_reader else reader)
            try:
                answer = self._call("/v1/request/renew", body, s.RenewAnswer)
                break
            except InvalidField as e:
                if body.reader is None or e.field != "reader":
                    raise
                self._old_reader()
        failed: dict[str, RequestStatus] = {rid: RequestStatus.EXPIRED for rid in answer.expired}
        failed.update((rid, RequestStatus.RELEASED) for rid in answer.released)
        failed.update((rid, RequestStatus.UNKNOWN) for rid in answer.unknown)
        return failed, min(lease_s, answer.lease_s) if answer.lease_s is not None else lease_s

    def release(self, engine_id: str, request_id: str, outcome: Outcome, router: bool = False,
                reader: str | None = None) -> bool:
        """Report a request ``Outcome.PULLED`` or ``Outcome.ABANDONED``. Idempotent (returns True if it already
        was; the first outcome wins). RequestExpired if its lease ran out first: blocks read after that may be
        garbage. ``router``: the caller is the router, not the reader: once a reader was handed the request,
        prefill frees it only when the lease the reader was given runs out (PairingTable.release). ``reader``:
        the decode engine releasing: while another was handed the request, prefill frees it only once that one
        released it too, or at its lease's end."""
        if not isinstance(outcome, Outcome):
            # Strings are the wire's business (the server decodes them into Outcome); in Python it is the enum.
            raise InvalidField(f"outcome must be an Outcome, got {outcome!r}", field="outcome")
        while True:
            body = s.checked(s.ReleaseBody, engine_id=engine_id, request_id=request_id, outcome=outcome,
                             router=router, reader=None if self._no_reader else reader)
            try:
                return self._call("/v1/request/release", body, s.ReleaseAnswer).already_released
            except InvalidField as e:
                if body.reader is not None and e.field == "reader":
                    self._old_reader()
                    continue
                if router and e.field == "router":  # it would free the blocks under a decode still reading them
                    self._old_server("router")
                raise

    def _old_reader(self) -> None:
        """A server of before readers were told apart refused ``reader``: calls go without it from now on."""
        if not self._no_reader:
            log.warning("kvlink: bootstrap server %s does not tell decode engines apart ('reader'): one engine's "
                        "release frees a request another may still read (upgrade the server)", self.url)
        self._no_reader = True

    def _old_server(self, field: str) -> None:
        """A server of before the router's deferred release refused ``peek`` or ``router``. Its lookups need no
        such word (they go without it from now on); a router's release is not made there (it would free the
        blocks at once, also under a decode still reading them): the lease frees them."""
        if field == "router" or not self._no_peek:
            log.warning("kvlink: bootstrap server %s does not know %r: requests the proxy gives up are left to "
                        "their lease there (upgrade the server)", self.url, field)
        self._no_peek = True

    def abandon_transfer(self, engine_id: str | None, transfer_id: str, request_id: str | None = None) -> bool:
        """Give up a transfer id: waiting and later lookups of it answer RequestReleased at once. Idempotent
        (True if it had already ended).

        Prefill (its request was aborted, or its publish refused) names its ``engine_id`` and its own
        ``request_id``: a live request of the engine bound to the id is released as abandoned, unless it is
        another request (Conflict, field ``request_id``, nothing released). Without ``engine_id`` (a proxy
        that does not know prefill's engine) it succeeds only while nothing is bound to or streamed under
        the id (else Conflict, field ``engine_id``, naming the engine that owns it)."""
        body = s.checked(s.AbandonTransferBody, engine_id=engine_id, transfer_id=transfer_id, request_id=request_id)
        return self._call("/v1/transfer/abandon", body, s.ReleaseAnswer).already_released

    def stream_pieces(self, engine_id: str, rank: int, ranks: int, pieces: list[s.StreamPiece],
                      launch: str | None = None) -> list[str]:
        """Report one prefill rank's streamed pieces; returns the transfer ids whose stream is over (decode
        stopped waiting, or the request was published or abandoned): send no more for them. Conflict if the
        engine's ranks are registered by another ``launch``."""
        body = s.checked(s.StreamPiecesBody, engine_id=engine_id, rank=rank, ranks=ranks,
                         pieces=[msgspec.to_builtins(p) for p in pieces], launch=launch)
        return self._call("/v1/stream/pieces", body, s.StreamPiecesAnswer).ended

    def stop_stream(self, transfer_id: str) -> bool:
        """Decode no longer waits for this transfer: prefill is told to stop streaming it."""
        body = s.checked(s.StreamStopBody, transfer_id=transfer_id)
        return self._call("/v1/stream/stop", body, s.ReleaseAnswer).already_released

    def poll_released(self, engine_id: str, launch: str | None = None) -> list[tuple[str, Outcome]]:
        """Outcomes (request id, pulled/abandoned/expired) of the engine's requests since the last poll.

        Each is returned once: the server keeps an outcome until the next poll acknowledges it, so an answer
        lost on the way is sent again and filtered here. ``Outcome`` is a ``str`` enum (== "pulled" etc.).
        ``launch``: the polling process's start (EngineRegistration.launch); Conflict, nothing acknowledged,
        if the engine's ranks are another's (the caller was replaced).
        """
        with self._poll_lock:
            server_id, last, seen = self._acks.get(engine_id, (None, 0, 0.0))
            while True:
                body = s.checked(s.PollReleasedBody, engine_id=engine_id, server_id=server_id, ack=last,
                                 launch=None if self._no_poll_launch else launch,
                                 seen=None if self._no_poll_seen else seen)
                try:
                    answer = self._call("/v1/request/poll_released", body, s.PollReleasedAnswer)
                    break
                except InvalidField as e:
                    if body.launch is not None and e.field == "launch":
                        self._no_poll_launch = True
                    elif body.seen is not None and e.field == "seen":
                        self._no_poll_seen = True
                    else:
                        raise
                    log.warning("kvlink: bootstrap server %s does not know a poll's %r: %s (upgrade the server)",
                                self.url, e.field, "a replaced process polling under the engine id takes the "
                                "new one's outcomes" if e.field == "launch" else "a poll whose answer was lost "
                                "counts as prefill in touch")
            if answer.server_id != server_id:
                last = 0  # a new server: sequence numbers started again
            fresh = [r for r in answer.released if r.seq > last]
            if fresh:
                last = fresh[-1].seq
            self._acks[engine_id] = (answer.server_id, last, answer.now or 0.0)
            return [(r.request_id, r.outcome) for r in fresh]

    # ----- misc -------------------------------------------------------------------------------------------

    def health(self) -> s.HealthAnswer:
        return self._call("/health", None, s.HealthAnswer)

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- transport --------------------------------------------------------------------------------------

    def _call(self, path: str, body: msgspec.Struct | None, answer_type: type[T], *, wait_s: float = 0.0) -> T:
        payload = _encode(body) if body is not None else None
        method = "GET" if body is None else "POST"
        deadline = time.monotonic() + self.timeout_s + wait_s
        attempt = 0
        stale_retried = False
        unanswered = False  # an attempt may have reached the server and got no answer
        while True:
            remaining = deadline - time.monotonic()
            conn, reused = self._pool.get(max(remaining, 0.001))
            try:
                conn.request(method, path, body=payload, headers=self._headers)
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException) as err:
                conn.close()
                if reused and not stale_retried and isinstance(err, _STALE):
                    stale_retried = True  # the server closed an idle connection: not an outage
                    continue
                unanswered = unanswered or not isinstance(err, ConnectionRefusedError)
                failure: BaseException = err
            else:
                if response.will_close:
                    conn.close()
                else:
                    self._pool.put(conn)
                if response.status == 200:
                    return self._answer(path, answer_type, data)
                error = _error(response.status, data)
                if response.status < 500:
                    # (a call the server applied and answers again answers alike; one that forgot the engine
                    # meanwhile, a restart, or dropped its requests, a lapse or another launch registered
                    # under it, may have handed the first attempt's effect out before it did)
                    error.maybe_applied = unanswered and (
                        isinstance(error, (UnknownEngine, RequestExpired))
                        or isinstance(error, Conflict) and error.field == "launch")
                    raise error
                failure = error
            attempt += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            if attempt > self.retries or time.monotonic() + delay >= deadline:
                gave_up = BootstrapUnavailable(
                    f"bootstrap server {self.url} unavailable for {path} after {attempt} attempt(s): {failure}")
                gave_up.maybe_applied = unanswered
                raise gave_up from failure
            log.debug("bootstrap: %s failed (%s), retry %d in %.3fs", path, failure, attempt, delay)
            time.sleep(delay)

    def _answer(self, path: str, answer_type: type[T], data: bytes) -> T:
        """A 200 answer, decoded; one this client cannot read (a field it does not know: a server of another
        protocol version) is a BootstrapError that says so, not a bare msgspec error."""
        try:
            return self._decoder(answer_type).decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise UnreadableAnswer(f"bootstrap server {self.url} answered {path} with what this client cannot "
                                   f"read ({err}): is it another kvlink version?") from None

    def _decoder(self, answer_type: type) -> msgspec.json.Decoder:
        decoder = self._decoders.get(answer_type)
        if decoder is None:
            decoder = self._decoders[answer_type] = msgspec.json.Decoder(answer_type)
        return decoder


def _error(status: int, data: bytes) -> BootstrapError:
    try:
        body = _error_decoder.decode(data)
    except msgspec.DecodeError:
        return error_from_body(status, None, f"HTTP {status}: {data[:200]!r}", None)
    return error_from_body(status, body.code, body.error, body.field)


def _key(engine_id: str, tp_rank: int, dp_rank: int, pp_rank: int) -> s.EngineKeyBody:
    return s.checked(s.EngineKeyBody, engine_id=engine_id, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank)


def _validated(reg: EngineRegistration) -> EngineRegistration:
    """Apply the schema's bounds to a registration built in Python (constructors check relations only)."""
    try:
        return msgspec.convert(msgspec.to_builtins(reg), EngineRegistration)
    except msgspec.ValidationError as err:
        bad = s.invalid_from(err)
        raise InvalidField(bad.message, field=f"registration.{bad.field}" if bad.field else "registration") from None

