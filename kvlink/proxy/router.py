"""OpenAI-compatible PD router: sends each request to a prefill server and a decode server.

Sequential mode: the prefill server computes the prompt (max_tokens=1) and returns the
``kv_transfer_params`` that the proxy checks and hands to the decode request (malformed ones are a 502
naming the field). What goes into each request's ``kv_transfer_params`` is built by kvlink.vllm.params.
Concurrent mode: both requests leave at once, paired by a fresh transfer id; the decode side finds
the prefill's KV through the prefill's bootstrap server. Prefill's is written first: its compute is the
critical path, and decode only needs its request before prefill's first layer is done.

Every backend failure becomes a JSON error naming the stage, the backend and the reason
(502 unreachable or bad answer, 504 timeout); the proxy never waits longer than its timeout for prefill's
answer, for decode's headers (a decode that stopped reading the body included), nor for decode's next bytes
(a stream lasts as long as its tokens keep coming), nor for a client to take the next bytes. A client that
goes away takes its backend requests with it; one that hangs up mid-stream is not counted as decode's
failure. Decode's answer streams through as it comes (an error answer, 5xx, is read up to 64 KiB to name
it); a stream that stalls or breaks ends with an error event of its own, and counts as not delivered, so
prefill's KV is reported not taken.
Once decode has answered, a concurrent prefill still running (decode recomputed the prompt) does not hold
the answer up: it is cancelled a second later. A concurrent prefill that fails by itself after decode was
given the transfer id has the id abandoned at prefill's bootstrap server, so decode stops waiting for it.

One prompt per request: vLLM gives every prompt of a batch (``"prompt": [p0, p1, ...]``) the same
kv_transfer_params, so their KV would share one pairing. A batch is refused (400 naming the field) before
any backend is asked.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvlink import trace
from kvlink.proxy.config import ProxyConfig
from kvlink.proxy.release import Releaser
from kvlink.vllm.params import BadParams, PrefillRequest, RemoteSource, decode_params, flag, read

logger = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Idle backend connections are dropped before vLLM's own keep-alive limit (5 s) can close them under
# a request.
BACKEND_KEEPALIVE_S = 4.0
# How the app must be served: a client that goes away cancels its handler, which closes the backend
# connections, so vLLM aborts the request and frees its blocks instead of computing it for nobody.
SERVE_OPTIONS: dict[str, Any] = {"handler_cancellation": True}
CONFIG_KEY: web.AppKey[ProxyConfig] = web.AppKey("config", ProxyConfig)
STATE_KEY: web.AppKey["_State"] = web.AppKey("state", object)  # type: ignore[arg-type]


class BackendError(Exception):
    """A backend did not give a usable answer. ``answered``: the HTTP status the backend answered with, None
    when it gave none (unreachable, connection lost, timeout)."""

    def __init__(self, stage: str, backend: str, reason: str, status: int = 502, answered: int | None = None):
        super().__init__(f"{stage} backend {backend}: {reason}")
        self.stage, self.backend, self.reason, self.status = stage, backend, reason, status
        self.answered = answered

    def response(self) -> web.Response:
        return error_response(self.status, "backend_error", self.reason, stage=self.stage,
                              backend=self.backend)


def error_response(status: int, kind: str, message: str, **extra: Any) -> web.Response:
    body = {"error": {"type": kind, "message": message, "code": status, **extra}}
    return web.json_response(body, status=status)


@dataclass
class _State:
    session: aiohttp.ClientSession
    prefill_rr: itertools.cycle  # indices into cfg.prefill
    decode_rr: itertools.cycle
    releaser: Releaser
    served: int = 0
    failed: int = 0
    client_gone: int = 0
    settling: set = field(default_factory=set)  # concurrent prefills still out after decode answered


class ClientGone(Exception):
    """The client hung up while its answer was being streamed to it: nobody's failure. ``out`` is the
    response already started, which the handler must return."""

    def __init__(self, out: web.StreamResponse, why: str):
        super().__init__(why)
        self.out = out


# Prefill's answer is one token and its kv_transfer_params; one larger than this is refused (502) rather
# than read whole and parsed on the event loop.
MAX_PREFILL_ANSWER = 4 << 20
# Fields that make prefill's one-token answer large (logprobs of every prompt token) and that prefill's
# leg does not need; a request asking for prompt logprobs goes to decode alone (_decode_alone).
PREFILL_DROPS = ("prompt_logprobs", "echo", "logprobs", "top_logprobs")

# How long decode's request may wait for prefill's to be on the wire (a prefill that cannot even be
# connected to must not hold decode's request up for the connect timeout).
PREFILL_FIRST_S = 0.05
# How long a concurrent prefill's own answer is waited for once decode answered an error, before it is
# cancelled (and whatever it may have published reported abandoned).
PREFILL_AFTER_ERROR_S = 0.2
# How long a concurrent prefill may still run once decode has answered (then decode did not use it:
# it recomputed the prompt) before the proxy cancels it, so prefill stops computing for nobody.
PREFILL_AFTER_DECODE_S = 1.0


def _timeout(cfg: ProxyConfig) -> aiohttp.ClientTimeout:
    """Prefill's request (one token) must end within ``timeout_s``."""
    return aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=cfg.connect_timeout_s)


def _silence(cfg: ProxyConfig) -> aiohttp.ClientTimeout:
    """Decode's answer may be silent for at most ``timeout_s`` at a time: a stream lives as long as its
    tokens keep coming (a long generation is not cut at ``timeout_s``), an answer that never starts or a
    stream that stalls ends at ``timeout_s``."""
    return aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.timeout_s)


@dataclass
class _Sending:
    """A backend request's ``trace_request_ctx``: ``sent`` is set when its body is written."""
    stage: str
    sent: asyncio.Event | None = None


async def _on_chunk_sent(session, ctx, params) -> None:
    """aiohttp calls this as it writes each chunk of a request (a JSON body is one chunk)."""
    sending = ctx.trace_request_ctx
    if isinstance(sending, _Sending):
        trace.event(f"proxy_{sending.stage}_sent")
        if sending.sent is not None:
            sending.sent.set()


def _trace_config() -> aiohttp.TraceConfig:
    tc = aiohttp.TraceConfig()
    tc.on_request_chunk_sent.append(_on_chunk_sent)
    return tc


def _passed(request: web.Request) -> dict[str, str] | None:
    """The client's headers the backends need: its API key, for vLLM servers started with ``--api-key`` (the
    proxy checks none itself: it fronts them as they are)."""
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth is not None else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # (the encoder below would send it on as null)


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:40]} is out of range")  # (1e400: inf, sent on as null)
    return value


def _parse(data: bytes) -> Any:
    """A client's body: only JSON's own numbers (no NaN or Infinity, nothing beyond a float's range), which
    the backends are then sent as the client wrote them."""
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite)


def _encode(obj: Any) -> str:
    """A backend request's body: msgspec (several times json.dumps' speed: a body of token ids is encoded on the
    event loop, where every other client's stream waits for it); json.dumps for what msgspec will not write
    (a lone surrogate from a client's escape, an integer beyond 64 bits)."""
    try:
        return msgspec.json.encode(obj).decode()
    except (UnicodeEncodeError, OverflowError, TypeError, ValueError):
        return json.dumps(obj)


def _prefill_body(body: dict, kv_params: dict) -> dict:
    pre = dict(body)  # top-level keys change; the prompt and messages are shared, never written
    pre["kv_transfer_params"] = kv_params
    pre["stream"] = False
    pre.pop("stream_options", None)
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    pre["n"] = 1
    for key in PREFILL_DROPS:
        pre.pop(key, None)
    return pre


def _decode_alone(path: str, body: dict) -> bool:
    """Whether vLLM will compute the request's prompt logprobs: ``prompt_logprobs`` given (0 included); a
    completion's ``echo`` with ``logprobs``; a chat's ``echo`` (its ``top_logprobs``, 0 by default, become
    the prompt's). vLLM computes those only over a prompt it computes itself (it neither reads its prefix
    cache nor loads external KV for such a request), so prefill's work would be for nobody."""
    if body.get("prompt_logprobs") is not None or body.get("use_beam_search"):
        return True  # (beam search: vLLM's BeamSearchParams carry no kv_transfer_params)
    if not body.get("echo"):
        return False
    if path == "/v1/chat/completions":
        return "top_logprobs" not in body or body["top_logprobs"] is not None
    return body.get("logprobs") is not None


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The answer's body, or None once it exceeds ``cap`` bytes (the rest is not read)."""
    out = bytearray()
    async for chunk in resp.content.iter_any():
        out += chunk
        if len(out) > cap:
            return None
    return bytes(out)


def _failure(stage: str, url: str, cfg: ProxyConfig, e: BaseException) -> BackendError:
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return BackendError(stage, url, f"could not connect within {cfg.connect_timeout_s:g} s",
                            status=504)
    if isinstance(e, asyncio.TimeoutError):
        return BackendError(stage, url, f"no answer within {cfg.timeout_s:g} s", status=504)
    return BackendError(stage, url, f"unreachable: {type(e).__name__}: {e}")


async def _post_json(st: _State, cfg: ProxyConfig, stage: str, url: str, path: str, body: dict,
                     sent: asyncio.Event | None = None, headers: dict | None = None) -> dict:
    """POST and return the decoded JSON answer, or raise BackendError. ``sent`` is set once the body
    is written."""
    try:
        async with st.session.post(url + path, json=body, timeout=_timeout(cfg), headers=headers,
                                   trace_request_ctx=_Sending(stage, sent)) as resp:
            trace.event("proxy_prefill_answer")
            data = await _read_capped(resp, MAX_PREFILL_ANSWER)
            if data is None:
                raise BackendError(stage, url, f"answer larger than {MAX_PREFILL_ANSWER} bytes",
                                   answered=resp.status)
            if resp.status != 200:
                raise BackendError(stage, url, f"HTTP {resp.status}: {data[:500]!r}",
                                   status=resp.status if 400 <= resp.status < 500 else 502, answered=resp.status)
            try:
                return json.loads(data)
            except (ValueError, RecursionError):
                raise BackendError(stage, url, f"answer is not JSON: {data[:200]!r}", answered=200) from None
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        raise _failure(stage, url, cfg, e) from None


# A decode error answer (5xx) is read up to this much, to name the failure; other answers stream through.
MAX_ERROR_BODY = 64 << 10


async def _relay(request: web.Request, st: _State, cfg: ProxyConfig, url: str, path: str,
                 body: dict) -> tuple[web.StreamResponse, bool]:
    """Send the decode request and pass its answer (JSON or SSE stream) through to the client, as it comes.
    Returns the response and whether decode's whole answer went through as a success (not an error status,
    not a stream that stalled or broke): where it did not, the caller reports prefill's KV not taken.
    Decode must answer (its headers) within ``timeout_s``, body written or not (a decode that stopped
    reading it); after that each silence is bounded by ``timeout_s``, and so is each write to a client that
    stopped reading (then it counts as gone)."""
    try:
        async with asyncio.timeout(cfg.timeout_s) as answer_by:
            async with st.session.post(url + path, json=body, timeout=_silence(cfg), headers=_passed(request),
                                       trace_request_ctx=_Sending("decode")) as resp:
                answer_by.reschedule(None)
                trace.event("proxy_decode_answer")
                ctype = resp.headers.get("Content-Type", "application/json")
                if resp.status >= 500:
                    data = await _read_capped(resp, MAX_ERROR_BODY)
                    data = b"(a larger body)" if data is None else data
                    raise BackendError("decode", url, f"HTTP {resp.status}: {data[:500]!r}", answered=resp.status)
                sse = resp.status == 200 and ctype.startswith("text/event-stream")
                headers = {"Content-Type": ctype, "Cache-Control": "no-cache"} if sse else {"Content-Type": ctype}
                out = web.StreamResponse(status=resp.status, headers=headers)
                if not sse and resp.content_length is not None and "Content-Encoding" not in resp.headers:
                    out.content_length = resp.content_length  # (a compressed one: aiohttp hands it decoded)
                try:
                    await out.prepare(request)  # writes the headers: the client may be gone already
                except ConnectionError as e:
                    raise ClientGone(out, str(e) or type(e).__name__) from None
                broke = await _pass_on(resp, out, sse, cfg)
                if broke is not None:
                    st.failed += 1
                    if not sse:  # a JSON body cut short: close, so the client sees an incomplete answer
                        if request.transport is not None:
                            request.transport.close()
                        return out, False
                    # headers are gone already: tell the client inside the stream, then end it
                    err = {"error": {"type": "backend_error", "stage": "decode", "backend": url, "message": broke}}
                    await _to_client(out, f"data: {json.dumps(err)}\n\n".encode(), cfg)
                    await _to_client(out, None, cfg)
                    return out, False
                await _to_client(out, None, cfg)
                st.served += 1
                # (No header names the backend: the client is not told the deployment's internal addresses.)
                return out, resp.status < 400
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        raise _failure("decode", url, cfg, e) from None


# An SSE event is passed on once whole (a stream cut mid-event then ends on a whole one, before the error
# event); one larger than this is passed on in parts.
MAX_EVENT = 1 << 20


async def _pass_on(resp: aiohttp.ClientResponse, out: web.StreamResponse, sse: bool, cfg: ProxyConfig) -> str | None:
    """Copy decode's body to the client as it comes (SSE: whole events). None when it ended; else why it broke
    (what was left of a cut event is dropped: a client's SSE parser would take it for a whole one)."""
    chunks, held = resp.content.iter_any(), b""
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            if held:
                await _to_client(out, held, cfg)
            return None
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            return (f"nothing for {cfg.timeout_s:g} s" if isinstance(e, asyncio.TimeoutError)
                    else f"stream broke: {type(e).__name__}: {e}")
        if sse:
            data = held + chunk
            cut = data.rfind(b"\n\n")  # -1: no whole event yet, nothing to pass on
            end = len(data) if len(data) > MAX_EVENT else cut + 2 if cut >= 0 else 0
            chunk, held = data[:end], data[end:]
        if chunk:
            await _to_client(out, chunk, cfg)


async def _to_client(out: web.StreamResponse, chunk: bytes | None, cfg: ProxyConfig) -> None:
    """Write ``chunk`` to the client (None: end the stream); a client that hung up, or read nothing for
    ``timeout_s`` (decode's stream would wait on it), is ClientGone, so leaving the ``async with`` of decode's
    request closes it and decode aborts the request."""
    try:
        async with asyncio.timeout(cfg.timeout_s):
            await (out.write(chunk) if chunk is not None else out.write_eof())
    except ConnectionError as e:  # aiohttp's ClientConnectionResetError is one
        raise ClientGone(out, str(e) or type(e).__name__) from None
    except TimeoutError:
        raise ClientGone(out, f"the client read nothing for {cfg.timeout_s:g} s") from None


async def _sequential(request, st, cfg, path, body) -> web.StreamResponse:
    prefill = cfg.prefill[next(st.prefill_rr)]
    decode = next(st.decode_rr)
    answer = await _post_json(st, cfg, "prefill", prefill, path,
                              _prefill_body(body, PrefillRequest().to_params()), headers=_passed(request))
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if params is None:
        raise BackendError("prefill", prefill, "answer has no kv_transfer_params: is the server "
                           "running with KVLinkConnector as kv_producer?")
    try:
        dec_params = decode_params(params)
        kept = flag(dec_params, "do_remote_prefill")
        why = None if kept else read(params, "kvlink_error")
    except BadParams as e:
        raise BackendError("prefill", prefill, f"answer has bad kv_transfer_params: {e}") from None
    if not kept:
        logger.warning("prefill %s kept no KV for this request (%.300s); decode computes the prompt", prefill,
                       why or "no reason given")
    dec = dict(body)
    dec["kv_transfer_params"] = dec_params
    src = RemoteSource.from_params(dec_params) if kept else None
    try:
        out, whole = await _relay(request, st, cfg, decode, path, dec)
    except (BackendError, ClientGone, asyncio.CancelledError):
        # decode's request ended without its answer going through (the server defers it while decode reads; as
        # concurrent pairing does for a client gone)
        _not_taken(st, src)
        raise
    if not whole:
        _not_taken(st, src)
    return out


def _not_taken(st: _State, src: RemoteSource | None) -> None:
    if src is not None and None not in (src.bootstrap_url, src.engine_id, src.request_id):
        st.releaser.request(src.bootstrap_url, src.engine_id, src.request_id)


async def _concurrent(request, st, cfg, path, body) -> web.StreamResponse:
    trace.event("proxy_request")
    i = next(st.prefill_rr)  # (an index: a URL listed twice has a bootstrap and engine id per listing)
    prefill = cfg.prefill[i]
    decode = next(st.decode_rr)
    transfer_id = uuid.uuid4().hex
    sent = asyncio.Event()
    pre_task = asyncio.create_task(_post_json(
        st, cfg, "prefill", prefill, path, _prefill_body(body, PrefillRequest(transfer_id).to_params()), sent,
        _passed(request)))
    delivered = answered = False
    try:
        await _first_on_the_wire(sent, pre_task)
        dec = dict(body)
        dec.pop("kv_transfer_params", None)  # the client's own never reach decode
        if pre_task.done() and (pre_task.cancelled() or pre_task.exception() is not None):
            # Prefill failed already (refused the connection, answered an error): decode computes the
            # prompt itself at once instead of waiting for a transfer nobody will publish.
            logger.warning("concurrent transfer %s: %s; decode computes the prompt", transfer_id,
                           "prefill cancelled" if pre_task.cancelled() else pre_task.exception())
        else:
            source = RemoteSource(bootstrap_url=cfg.bootstrap_for(i), engine_id=cfg.engine_id_for(i),
                                  transfer_id=transfer_id)
            dec["kv_transfer_params"] = source.to_params()
            pre_task.add_done_callback(lambda task: _prefill_ended(st, cfg, i, transfer_id, task))
        try:
            out, delivered = await _relay(request, st, cfg, decode, path, dec)
        except BackendError as e:
            answered = e.answered is not None  # an error answer (5xx): prefill's own answer gets its moment too
            raise
        answered = True
        return out
    finally:
        if not delivered:
            # The client went away or decode failed: prefill's work is for nobody (_give_up_prefill), in the
            # background (the handler, and the client's connection, are not held up by it).
            _background(st, _give_up_prefill(st, cfg, i, pre_task, transfer_id, PREFILL_AFTER_ERROR_S if answered
                                              else 0.0))
        elif not pre_task.done():
            # Decode answered without waiting for it (it recomputed the prompt): the client does not wait
            # for prefill either; prefill gets a moment to end by itself, then is cancelled.
            _background(st, _settle_prefill(pre_task, transfer_id, PREFILL_AFTER_DECODE_S))
        else:
            await _settle_prefill(pre_task, transfer_id, 0.0)


def _background(st: _State, work) -> None:
    """Run ``work`` (a coroutine) beside the answer; the app's cleanup cancels what is left."""
    task = asyncio.create_task(work)
    st.settling.add(task)
    task.add_done_callback(st.settling.discard)


async def _give_up_prefill(st: _State, cfg: ProxyConfig, i: int, pre_task: asyncio.Task, transfer_id: str,
                           wait_s: float) -> None:
    """A concurrent request decode's answer did not go through for. Cancelling prefill's leg closes its
    connection, so prefill aborts the request and keeps no blocks for it; one it had finished (published)
    is reported abandoned. ``wait_s``: decode answered (an error, or a stream that broke): prefill's own
    answer (a refusal of the same request) is likely under way and heard first, as then nothing was
    published and there is nothing to report (each report waits for a record)."""
    if wait_s and not pre_task.done():
        await asyncio.wait((pre_task,), timeout=wait_s)
    pre_task.cancel()
    await _settle_prefill(pre_task, transfer_id, cfg.timeout_s)
    if not _answered_error(pre_task):  # (one that answered an error published nothing)
        st.releaser.transfer(cfg.bootstrap_for(i), transfer_id, cfg.engine_id_for(i))


def _answered_error(task: asyncio.Task) -> bool:
    """Prefill's leg ended with an error answer (not 200): prefill is done with the request, unpublished."""
    if not task.done() or task.cancelled() or (e := task.exception()) is None:
        return False
    return getattr(e, "answered", None) not in (None, 200)


def _prefill_ended(st: _State, cfg: ProxyConfig, i: int, transfer_id: str, task: asyncio.Task) -> None:
    """Prefill's leg ended after decode was given the transfer id. If prefill failed by itself (the proxy did
    not cancel it), its connector may never have seen the request, so nobody would give the id up and decode
    would wait ``lookup_wait_s`` for it: the proxy abandons it now (release.py), and decode computes the
    prompt. A failure with an answer (an error status) means prefill is done with the request, so its engine
    id is named; without an answer the request may still finish and publish in the engine, so no engine id
    is named and the bootstrap server gives the id up only if nothing is published or streamed under it."""
    if task.cancelled() or (e := task.exception()) is None:
        return
    answered = getattr(e, "answered", None)
    if answered == 200:  # prefill computed the request (its answer was unreadable): decode may pull it
        return
    engine_id = cfg.engine_id_for(i) if answered is not None else None
    logger.info("concurrent transfer %s: prefill failed after decode got the transfer id (%s); abandoning the "
                "id so decode computes the prompt", transfer_id, e)
    st.releaser.abandon(cfg.bootstrap_for(i), transfer_id, engine_id)


async def _first_on_the_wire(sent: asyncio.Event, task: asyncio.Task) -> None:
    """Until prefill's body is written, its leg has ended, or PREFILL_FIRST_S has passed."""
    waiter = asyncio.ensure_future(sent.wait())
    try:
        await asyncio.wait((waiter, task), timeout=PREFILL_FIRST_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def _settle_prefill(task: asyncio.Task, transfer_id: str, wait_s: float) -> None:
    """Wait up to ``wait_s`` for a concurrent prefill so its failure is logged, then cancel it if it is
    still running. The decode answer is what the client gets: a prefill failure only costs decode a
    bounded wait and a local recompute."""
    try:
        if not task.done():
            await asyncio.wait((task,), timeout=wait_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        logger.info("concurrent transfer %s: prefill still running %g s after decode answered; cancelled",
                    transfer_id, wait_s)
        task.cancel()
    elif not task.cancelled() and task.exception() is not None:
        logger.warning("concurrent transfer %s: %s", transfer_id, task.exception())


def _prompts(value: Any) -> int:
    """How many prompts vLLM makes of a completion's ``prompt`` (or ``prompt_embeds``): none, one (a string,
    base64 embeddings, a list of token ids), or one per item of any other list (vLLM's ``prompt_to_seq``)."""
    if value is None:
        return 0
    if not isinstance(value, list) or (value and set(map(type, value)) <= {int, float, bool}):  # (C speed)
        return 1
    return len(value)


def _batch_refusal(path: str, body: dict) -> web.Response | None:
    """A 400 naming the field when a completion request holds several prompts. vLLM runs each as its own
    request with the same kv_transfer_params: in concurrent pairing they would share one transfer id, and in
    sequential pairing prefill answers the first one's only, so the others' KV would be held for nobody.
    /v1/chat/completions takes one conversation (vLLM refuses a list of them; its batch endpoint is not
    routed), and ``n`` samples one prompt (decode pulls it once for all of them)."""
    if path != "/v1/completions":
        return None
    texts, embeds = _prompts(body.get("prompt")), _prompts(body.get("prompt_embeds"))
    if texts + embeds <= 1:
        return None
    field = "prompt" if texts else "prompt_embeds"
    what = (f"prompt and prompt_embeds hold {texts + embeds} prompts together" if texts and embeds
            else f"{field} holds {texts + embeds} prompts")
    return error_response(400, "invalid_request", f"{what}: the PD proxy pairs one prompt per request; send "
                          "each prompt as a request of its own", param=field)


# How deep a request body may nest: an OpenAI request nests a few levels (a JSON schema for structured
# output some more); one that only just parsed fails again when it is encoded for the backends.
MAX_NESTING = 256


def _nesting(value: Any) -> int:
    """How many levels of lists and objects ``value`` nests (iteratively: no recursion to run out of)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, depth)
            if not set(map(type, v)).isdisjoint((dict, list)):  # (a flat list, of token ids, at C speed)
                todo.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


async def handle_completion(request: web.Request) -> web.StreamResponse:
    cfg, st = request.app[CONFIG_KEY], request.app[STATE_KEY]
    try:
        body = _parse(await request.read())  # bytes: the encoding is JSON's, whatever the header says
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        return error_response(400, "invalid_request", f"request body is not valid JSON: {why}")
    if not isinstance(body, dict):
        return error_response(400, "invalid_request", "request body must be a JSON object")
    if (depth := _nesting(body)) > MAX_NESTING:  # (encoded again for the backends, deeper in the stack)
        return error_response(400, "invalid_request", f"request body nests {depth} levels deep (at most "
                              f"{MAX_NESTING})")
    if (refused := _batch_refusal(request.path, body)) is not None:
        return refused
    t0 = time.monotonic()
    try:
        if _decode_alone(request.path, body):
            dec = dict(body)
            dec.pop("kv_transfer_params", None)  # the client's own never reach decode
            resp, _ = await _relay(request, st, cfg, next(st.decode_rr), request.path, dec)
        elif cfg.mode == "sequential":
            resp = await _sequential(request, st, cfg, request.path, body)
        else:
            resp = await _concurrent(request, st, cfg, request.path, body)
    except BackendError as e:
        st.failed += 1
        logger.warning("%s %s failed after %.2f s: %s", request.method, request.path,
                       time.monotonic() - t0, e)
        return e.response()
    except ClientGone as e:
        st.client_gone += 1
        logger.info("%s %s: the client hung up mid-answer after %.2f s (%s)", request.method, request.path,
                    time.monotonic() - t0, e)
        return e.out
    return resp  # served (or failed mid-stream) is counted in _relay


async def handle_health(request: web.Request) -> web.Response:
    """200 when every backend answers its /health, else 503 naming the ones that do not."""
    cfg, st = request.app[CONFIG_KEY], request.app[STATE_KEY]
    urls = [*cfg.prefill, *cfg.decode]

    async def probe(url: str) -> str | None:
        try:
            async with st.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return None if r.status == 200 else f"HTTP {r.status}"
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            return f"{type(e).__name__}: {e}" or "unreachable"

    results = await asyncio.gather(*(probe(u) for u in urls))
    bad = {u: r for u, r in zip(urls, results) if r is not None}
    body = {"status": "ok" if not bad else "degraded", "mode": cfg.mode, "unhealthy": bad,
            "served": st.served, "failed": st.failed, "client_gone": st.client_gone,
            "prefill_abandoned": st.releaser.reported, "transfers_abandoned": st.releaser.transfers_abandoned,
            "reports_dropped": st.releaser.dropped}
    return web.json_response(body, status=200 if not bad else 503)


async def handle_models(request: web.Request) -> web.StreamResponse:
    cfg, st = request.app[CONFIG_KEY], request.app[STATE_KEY]
    url = cfg.decode[0]
    try:
        async with st.session.get(url + "/v1/models", timeout=_timeout(cfg), headers=_passed(request)) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        return BackendError("decode", url, f"unreachable: {type(e).__name__}: {e}").response()


def build_app(cfg: ProxyConfig) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[CONFIG_KEY] = cfg

    async def on_startup(app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=BACKEND_KEEPALIVE_S)
        app[STATE_KEY] = _State(aiohttp.ClientSession(connector=conn, trace_configs=[_trace_config()],
                                                      json_serialize=_encode),
                                itertools.cycle(range(len(cfg.prefill))), itertools.cycle(cfg.decode),
                                Releaser(cfg.bootstrap_token, timeout_s=cfg.connect_timeout_s))

    async def on_cleanup(app: web.Application) -> None:
        for task in list(app[STATE_KEY].settling):
            task.cancel()
        await app[STATE_KEY].releaser.close()
        await app[STATE_KEY].session.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for p in COMPLETION_PATHS:
        app.router.add_post(p, handle_completion)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/models", handle_models)
    return app
