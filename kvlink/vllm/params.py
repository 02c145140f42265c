"""``kv_transfer_params``: the one place that parses and builds them.

What travels, and who builds it here::

    router  -> prefill   {"do_remote_decode": true[, "transfer_id": T]}              PrefillRequest
    prefill -> router    where decode finds the KV (engine, request, blocks, ...)      RemoteSource.to_params
                         or {"do_remote_prefill": false, "kvlink_error": why}         refusal
    router  -> decode    sequential: prefill's answer, checked and rebuilt            decode_params
                         concurrent: {"do_remote_prefill": true, "transfer_id": T,
                                      "remote_bootstrap_addr": U[, "remote_engine_id": E]}  RemoteSource.to_params
    decode  -> client    {"do_remote_prefill": false, "kvlink_error": why} when refused  refusal

Every field has one rule (``RULES``), applied wherever the field is read and whenever a ``RemoteSource`` is
built; a value that breaks it raises :class:`BadParams` naming the field. The fields prefill publishes to the
bootstrap server take their bounds from the bootstrap's publish body, and the bootstrap address is checked by
the bootstrap client's own rule, so a value accepted here is never refused there. Keys this module does
not know are ignored: vLLM and proxies may add their own.

No vLLM import: the proxy uses this module too.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from kvlink.bootstrap.client import canonical_url
from kvlink.bootstrap.schema import MAX_ID_LEN, PublishBody

if TYPE_CHECKING:
    from vllm.v1.request import Request


class BadParams(ValueError):
    """A request's kv_transfer_params are malformed; ``field`` (also in the message) names the culprit."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


class _Broken(Exception):
    """A value broke its field's rule (``detail`` says how); ``read`` names the field."""

    def __init__(self, what: str, detail: str):
        super().__init__(detail)
        self.what, self.detail = what, detail


Rule = Callable[[Any], Any]  # the value as sent -> the value as used; raises _Broken


def _typed(tp: Any, what: str, before: Rule = lambda v: v, after: Rule = lambda v: v) -> Rule:
    def rule(value: Any) -> Any:
        try:
            value = msgspec.convert(before(value), tp, strict=True)
            if isinstance(value, str):
                value.encode()  # a lone surrogate (a client's JSON escape) travels nowhere
        except msgspec.ValidationError as e:
            raise _Broken(what, str(e)) from None
        except UnicodeError as e:  # msgspec raises it for a lone surrogate where it expects another type
            raise _Broken(what, f"not valid Unicode: {e.reason}") from None
        return after(value)

    return rule


_PUBLISHED = {f.name: f.type for f in msgspec.structs.fields(PublishBody)}
MAX_ERROR_LEN = 4096


def as_groups(value: Any) -> Any:
    # vLLM's block ids come flat (one KV cache group) or as one list per group; a flat list is one group.
    if isinstance(value, list) and value and all(isinstance(g, list) for g in value):
        return value
    return [value] if isinstance(value, list) else value


def _groups(groups: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    # Block id 0 is vLLM's null block (sliding-window groups hold it by position): it is a valid id here.
    if not groups:
        raise _Broken("the block ids of at least one KV cache group", "no group")
    return tuple(tuple(g) for g in groups)


def _listed(value: Any) -> Any:
    """Block ids as they travel (lists) from the checked form (a tuple per group, or one flat tuple)."""
    if isinstance(value, tuple):
        return [list(g) if isinstance(g, tuple) else g for g in value]
    return value


def _bootstrap_url(url: Any) -> str:
    # The bootstrap client's own rule, so an address accepted here is one the client can use.
    try:
        out = canonical_url(url)
        out.encode()
        return out
    except (ValueError, UnicodeError) as e:  # (UnicodeEncodeError is a ValueError too)
        raise _Broken("an http(s) URL or host:port", str(e)) from None


RULES: dict[str, Rule] = {
    "do_remote_decode": _typed(bool, "true or false"),
    "do_remote_prefill": _typed(bool, "true or false"),
    "transfer_id": _typed(_PUBLISHED["transfer_id"], "a non-empty string"),
    "remote_engine_id": _typed(_PUBLISHED["engine_id"], "a non-empty string"),
    "remote_request_id": _typed(_PUBLISHED["request_id"], "a non-empty string"),
    "remote_block_ids": _typed(_PUBLISHED["block_ids"], "a list of block ids (non-negative integers), flat or "
                               "one list per KV cache group", before=as_groups, after=_groups),
    "remote_num_tokens": _typed(_PUBLISHED["num_tokens"], "a non-negative integer"),
    "remote_lease_s": _typed(_PUBLISHED["lease_s"], "a positive number of seconds"),
    "remote_bootstrap_addr": _bootstrap_url,
    "remote_prompt_sha": _typed(_PUBLISHED["prompt_sha"], "32 lowercase hex digits (kvlink's prompt digest)"),
    "remote_launch": _typed(_PUBLISHED["launch"], "a non-empty string of at most 64 characters"),
    "kvlink_error": _typed(Annotated[str, Meta(max_length=MAX_ERROR_LEN)], "a string"),
}


def check(name: str, value: Any) -> Any:
    """``value`` checked by field ``name``'s rule, as used (a URL with its scheme, block ids as a tuple).
    BadParams, naming the field, when it breaks the rule."""
    try:
        return RULES[name](value)
    except _Broken as e:
        raise BadParams(name, f"kv_transfer_params[{name!r}] must be {e.what} ({e.detail}), "
                              f"got {reprlib.repr(value):.80}") from None


def read(params: Mapping[str, Any], name: str) -> Any:
    """Field ``name`` of ``params`` checked by its rule; None when absent (or null)."""
    value = params.get(name)
    return None if value is None else check(name, value)


def flag(params: Mapping[str, Any], name: str) -> bool:
    """A do_remote_* flag: False when absent; BadParams unless true or false."""
    return read(params, name) is True


def _mapping(params: Any) -> Mapping[str, Any]:
    if not isinstance(params, Mapping):
        raise BadParams(None, f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    return params


@dataclass(frozen=True)
class PrefillRequest:
    """What the router asks of prefill: compute the prompt and keep its KV for a decode engine.

    ``transfer_id`` (concurrent pairing) is the name decode will look the KV up by.
    """

    transfer_id: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PrefillRequest:
        return cls(read(_mapping(params), "transfer_id"))

    def to_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"do_remote_decode": True}
        if self.transfer_id is not None:
            out["transfer_id"] = self.transfer_id
        return out


# RemoteSource attribute -> its kv_transfer_params name.
_SOURCE_FIELDS = (("bootstrap_url", "remote_bootstrap_addr"), ("engine_id", "remote_engine_id"),
                  ("request_id", "remote_request_id"), ("block_ids", "remote_block_ids"),
                  ("num_tokens", "remote_num_tokens"), ("transfer_id", "transfer_id"),
                  ("lease_s", "remote_lease_s"), ("prompt_sha", "remote_prompt_sha"), ("launch", "remote_launch"))
_SEQUENTIAL = ("remote_engine_id", "remote_request_id", "remote_block_ids")


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode request's KV lives: prefill's answer, and what decode parses.

    Sequential pairing gives engine id, request id and block ids; concurrent pairing gives a transfer
    id that the bootstrap server resolves once prefill publishes. Every field given is checked by its rule
    however the source is built (parsed here, or built by prefill or the router): BadParams names the field.
    """

    bootstrap_url: str
    engine_id: str | None = None
    request_id: str | None = None
    block_ids: tuple[tuple[int, ...], ...] | None = None  # per KV cache group; 0 is vLLM's null block
    num_tokens: int | None = None
    transfer_id: str | None = None
    lease_s: float | None = None  # prefill's lease; decode renews it while pulling
    prompt_sha: str | None = None  # prompt_digest of the tokens prefill computed: decode checks its own
    launch: str | None = None  # prefill's start (RequestRecord.launch): decode reads only its ranks

    def __post_init__(self) -> None:
        for attr, name in _SOURCE_FIELDS:
            value = getattr(self, attr)
            if value is not None:
                # A tuple of block ids is the checked form; its rule reads the list that travels.
                object.__setattr__(self, attr, check(name, _listed(value)))
        if self.bootstrap_url is None:
            raise BadParams("remote_bootstrap_addr",
                            "kv_transfer_params['remote_bootstrap_addr'] is required with do_remote_prefill")
        missing = [name for attr, name in _SOURCE_FIELDS if name in _SEQUENTIAL and getattr(self, attr) is None]
        if missing and (self.transfer_id is None or self.block_ids is not None):
            # (block ids name blocks of one prefill request: without its engine and id nobody can renew, check
            # or release them, and a renewal naming none fails for every pull renewed with it)
            raise BadParams(missing[0], f"kv_transfer_params need either transfer_id (concurrent pairing) or "
                                        f"{', '.join(_SEQUENTIAL)} (sequential); missing {', '.join(missing)}")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteSource:
        params = _mapping(params)
        return cls(**{attr: params.get(name) for attr, name in _SOURCE_FIELDS})

    def to_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"do_remote_prefill": True}
        for attr, name in _SOURCE_FIELDS:
            value = getattr(self, attr)
            if value is not None:
                # one group travels flat (vLLM's own form), several as one list per group
                out[name] = (list(value[0]) if len(value) == 1 else [list(g) for g in value]) \
                    if attr == "block_ids" else value
        return out

    @property
    def key(self) -> str:
        return self.transfer_id or f"{self.engine_id}/{self.request_id}"


def prompt_digest(token_ids: Any, extras: tuple[str, ...] = ()) -> str | None:
    """A digest of a prompt's token ids and of ``extras``, what else decides the KV of those tokens (the
    LoRA adapter, each image's identifier and place; None for no ids: a prompt of embeddings). Prefill
    publishes the one of the tokens it computed; decode computes its own over as many of its prompt's tokens
    and pulls only where they agree: another prompt, or the same text tokenized otherwise (another chat
    template or tokenizer revision on one side), would hand decode KV of other tokens, and its answer would
    be fluent and wrong."""
    import array
    import hashlib
    import sys

    if token_ids is None:
        return None
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.sha256(ids.tobytes())
    for e in extras:
        h.update(b"\0" + e.encode())
    return h.hexdigest()[:32]


def wire_id(request_id: str) -> bool:
    """Whether the bootstrap server can take ``request_id`` (1 to MAX_ID_LEN characters of valid Unicode). vLLM
    builds request ids from the client's (``X-Request-Id``, a body's ``request_id``): one that cannot travel
    is never streamed, its publish is refused, and its transfer id is abandoned without naming it."""
    if not 0 < len(request_id) <= MAX_ID_LEN:
        return False
    try:
        request_id.encode()
    except UnicodeEncodeError:
        return False
    return True


def refusal(why: str) -> dict[str, Any]:
    """An answer that hands over no KV: a decode given it computes the prompt; ``kvlink_error`` says why."""
    return {"do_remote_prefill": False, "kvlink_error": why[:MAX_ERROR_LEN]}


def decode_params(prefill_answer: Any) -> dict[str, Any]:
    """The router's decode params from prefill's answer (sequential pairing): the same source, checked and
    rebuilt, or ``{"do_remote_prefill": False}`` when prefill kept nothing (decode computes the prompt).
    BadParams, naming the field, when the answer is malformed."""
    answer = _mapping(prefill_answer)
    if not flag(answer, "do_remote_prefill"):
        return {"do_remote_prefill": False}
    return RemoteSource.from_params(answer).to_params()


def request_digest(request: "Request", n: int) -> str | None:
    """params.prompt_digest of a request's first ``n`` prompt tokens, with what else decides their KV: the
    LoRA adapter and the multimodal inputs placed among them (identifier, offset, length). None where vLLM
    feeds embeddings (prompt_embeds, also mixed with ids): their bytes are not hashed, nothing is compared."""
    ids = request.prompt_token_ids
    if ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    extras = [f"lora:{lora.lora_name}"] if lora is not None else []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        if pos.offset < n:
            extras.append(f"{f.modality}:{f.identifier}@{pos.offset}+{pos.length}")
    return prompt_digest(ids[:n], tuple(extras))  # fewer than n ids: another prompt, another digest
