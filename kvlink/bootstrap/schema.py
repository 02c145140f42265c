"""Wire schema of the bootstrap server: strict msgspec Structs, JSON encoded.

Every Struct forbids unknown fields, bounds its strings and lists, and checks the relations between its
fields in ``__post_init__`` (which runs both when a caller builds one and when the server decodes one), so a
bad value fails at the edge with the field named. The public records (:class:`EngineRegistration`,
:class:`KVLayerSpec`, :class:`RequestRecord`) are frozen and hashable-free plain data.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated

import msgspec
from msgspec import Meta

from kvlink.bootstrap.errors import InvalidField

# Bounds that hold whatever the server configuration says; the configuration tightens some of them.
MAX_ID_LEN = 512
MAX_RANK = 1 << 16
MAX_LAYERS = 4096
MAX_KV_GROUPS = 64
MAX_HEAD_SCALES = 512  # per-head K/V scales of one layer on one rank (its KV heads)
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_LEASE_S = 86_400.0
MAX_IDS_PER_CALL = 65_536
# Prefill frees a held request it has not heard about from the server for a lease once this many of its
# leases have passed since it published it (kvlink.vllm.held); the server never promises decode a lease
# beyond that, nor beyond a lease after prefill's last poll (table.py, ``renew``).
PREFILL_HOLD_LEASES = 1.5

EngineId = Annotated[str, Meta(min_length=1, max_length=256)]
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)]
Name = Annotated[str, Meta(min_length=1, max_length=128)]
Instance = Annotated[str, Meta(min_length=1, max_length=64)]
Scale = Annotated[float, Meta(gt=0.0, lt=1e30)]  # a quantized KV cache's scale: its bytes mean value / scale
# A decode engine reading a request: its engine id and start (table.py, ``release``)
MAX_READER = 320
Reader = Annotated[str, Meta(min_length=1, max_length=MAX_READER)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_RANK)]
Size = Annotated[int, Meta(ge=1, le=MAX_RANK)]
LeaseS = Annotated[float, Meta(gt=0.0, le=MAX_LEASE_S)]
WaitS = Annotated[float, Meta(ge=0.0, le=MAX_LEASE_S)]
BlockId = Annotated[int, Meta(ge=0, lt=1 << 62)]
BlockGroup = Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS_PER_GROUP)]
BlockIds = Annotated[list[BlockGroup], Meta(max_length=MAX_KV_GROUPS)]
RequestIds = Annotated[list[RequestId], Meta(min_length=1, max_length=MAX_IDS_PER_CALL)]
PromptSha = Annotated[str, Meta(pattern="^[0-9a-f]{32}\\Z")]  # (\Z: "$" would pass a trailing newline)

_ADDR = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})\Z")


def is_token(token: str) -> bool:
    """A bearer token as it may travel: printable ASCII (the header's bytes are the same on both ends: the
    client sends latin-1, the server compares UTF-8), no surrounding spaces (the server strips them)."""
    return bool(token) and token == token.strip() and all(0x20 <= ord(c) <= 0x7E for c in token)


def is_address(addr: str) -> bool:
    """host:port as a registration's ``transport_addr`` must be (an IPv6 host in brackets), port 1..65535."""
    match = _ADDR.match(addr)
    return match is not None and 0 < int(match.group(1)) < 65536


class RequestStatus(str, enum.Enum):
    """What a lookup knows about a request id that it cannot answer with a record."""

    UNKNOWN = "unknown"
    """Never published (or forgotten: the tombstone memory is bounded, or the server restarted)."""
    EXPIRED = "expired"
    """Its lease ran out: do not pull."""
    RELEASED = "released"
    """Already reported pulled or abandoned: its blocks are freed, do not pull."""


class Outcome(str, enum.Enum):
    """How a published request ended, as reported to its prefill engine."""

    PULLED = "pulled"
    ABANDONED = "abandoned"
    EXPIRED = "expired"


# What decode may report; EXPIRED is the server's own verdict.
RELEASE_OUTCOMES = frozenset({Outcome.PULLED, Outcome.ABANDONED})


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class KVLayerSpec(_Strict, kw_only=True, omit_defaults=True):  # unset fields stay off the wire (older servers)
    """One KV cache layer as the prefill engine registered it."""

    name: Name
    region_id: Annotated[int, Meta(ge=0, lt=1 << 32)]
    block_bytes: Annotated[int, Meta(gt=0, lt=1 << 40)]
    num_blocks: Annotated[int, Meta(ge=0, lt=1 << 40)]
    tokens_per_block: Annotated[int, Meta(gt=0, le=1 << 20)]
    dtype: Name
    layout: Name
    # Where block b, segment s of this layer lives in the region: offset + s * segment_stride + b * block_stride
    # (block_stride 0: blocks of block_bytes back to back, one segment). Prefill's strides, which need not
    # be decode's (another num_blocks moves a V plane; a staging pool packs every layer of a block together).
    offset: Annotated[int, Meta(ge=0, lt=1 << 48)] = 0
    block_stride: Annotated[int, Meta(ge=0, lt=1 << 48)] = 0
    segment_stride: Annotated[int, Meta(ge=0, lt=1 << 48)] = 0
    group: Annotated[int, Meta(ge=0, lt=MAX_KV_GROUPS)] = 0  # the layer's KV cache group (hybrid models)
    # fp8 KV caches: the layer's K and V scales (the bytes mean value / scale); None where the cache is not fp8
    k_scale: Scale | None = None
    v_scale: Scale | None = None
    # per-head scales (compressed-tensors' attention-head strategy): this rank's KV heads' K and V scales, in
    # its head order (k_scale / v_scale are their maximum, which some kernels use instead)
    k_head_scales: Annotated[list[Scale], Meta(max_length=MAX_HEAD_SCALES)] | None = None
    v_head_scales: Annotated[list[Scale], Meta(max_length=MAX_HEAD_SCALES)] | None = None


class EngineRegistration(_Strict, kw_only=True, omit_defaults=True):  # unset fields stay off the wire
    """One rank of a prefill engine: where to reach it and how its KV cache is laid out.

    ``instance`` names the process (random per start): a rank registered again by another instance is a
    new process, whose block ids mean nothing of the old one's (the table drops what the old one published).
    ``launch`` names the engine's start (vLLM's ``instance_id``: the same in its scheduler and in every rank):
    a publish or streamed piece from another launch than the live ranks' comes from a process that was
    replaced, and is refused (its block ids would be read in the new process's memory).
    """

    engine_id: EngineId
    dp_rank: Rank = 0
    dp_size: Size = 1
    tp_rank: Rank = 0
    tp_size: Size = 1
    pp_rank: Rank = 0
    pp_size: Size = 1
    transport_addr: Annotated[str, Meta(min_length=3, max_length=300)]
    layers: Annotated[list[KVLayerSpec], Meta(max_length=MAX_LAYERS)]
    protocol_version: Annotated[int, Meta(ge=0, lt=1 << 31)]
    compat_hash: Annotated[str, Meta(min_length=1, max_length=256)]
    # What compat_hash digests, so a decode that refuses the engine can name both sides' values.
    compat: Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)] | int],
                      Meta(max_length=32)] = {}
    instance: Instance | None = None
    launch: Instance | None = None

    def __post_init__(self) -> None:
        for rank, size in (("dp_rank", "dp_size"), ("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            if getattr(self, rank) >= getattr(self, size):
                raise ValueError(f"invalid `{rank}`: {getattr(self, rank)} is not below {size} {getattr(self, size)}")
        if not is_address(self.transport_addr):
            raise ValueError(f"invalid `transport_addr`: {self.transport_addr!r} is not host:port")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("invalid `layers`: layer names repeat")

    def same_layout(self, other: EngineRegistration) -> bool:
        """True when only the transport address or instance may differ (what a re-registration may change)."""
        return (
            self.dp_size == other.dp_size
            and self.tp_size == other.tp_size
            and self.pp_size == other.pp_size
            and self.layers == other.layers
            and self.protocol_version == other.protocol_version
            and self.compat_hash == other.compat_hash
        )


class RequestRecord(_Strict, kw_only=True, omit_defaults=True):  # an older client never sees the new fields
    """A finished prefill request, as decode sees it.

    ``lease_remaining_s`` is relative (seconds left when the server answered), so clocks need not agree.
    """

    engine_id: EngineId
    request_id: RequestId
    transfer_id: RequestId | None = None
    block_ids: BlockIds
    num_tokens: Annotated[int, Meta(ge=0, lt=1 << 40)]
    lease_remaining_s: float
    # Streamed KV (lookup_transfer with ``after``): ``partial`` is a progress report of a request prefill is
    # still computing (no lease: its blocks belong to the running request), ``version`` orders them;
    # ``epoch`` counts the request's (re)starts on prefill (a preempted request may get other blocks).
    partial: bool = False
    version: Annotated[int, Meta(ge=0)] = 0
    epoch: Annotated[int, Meta(ge=0, lt=1 << 31)] = 0
    # Layer-wise progress (asked for with ``layers``): the running step's further full blocks, by position
    # after ``block_ids``, hold their KV in every layer whose index is below ``layers``.
    step_block_ids: BlockIds = []
    layers: Annotated[int, Meta(ge=0, lt=1 << 20)] = 0
    # A digest of the first ``num_tokens`` prompt token ids prefill computed (kvlink.vllm.params.prompt_digest):
    # decode compares its own before it trusts the KV (the same prompt, the same tokenization). In a partial
    # record, of the whole prompt being computed, ``prompt_tokens`` tokens.
    prompt_sha: PromptSha | None = None
    prompt_tokens: Annotated[int, Meta(ge=0, lt=1 << 40)] = 0
    # The launch (EngineRegistration.launch) that published it, or whose ranks stream it: its block ids name
    # memory of that launch's processes only. Decode reads them only through ranks registered by it (a
    # rolling restart keeps the old process serving while the new one is registered under the same id).
    launch: Instance | None = None


class ReleasedRequest(_Strict, kw_only=True):
    """One outcome in a poll answer; ``seq`` increases (one count for the whole server, so an engine that
    registers again never sees a number again) and acknowledges it on the next poll."""

    seq: int
    request_id: RequestId
    outcome: Outcome


# ----- request bodies ---------------------------------------------------------------------------------------


class RegisterEngineBody(_Strict, kw_only=True):
    registration: EngineRegistration
    lease_s: LeaseS


class EngineKeyBody(_Strict, kw_only=True, omit_defaults=True):
    engine_id: EngineId
    dp_rank: Rank = 0
    tp_rank: Rank = 0
    pp_rank: Rank = 0
    instance: Instance | None = None  # a heartbeat: the process that sends it (EngineRegistration.instance)


class EngineRanksBody(_Strict, kw_only=True):
    engine_id: EngineId


class PublishBody(_Strict, kw_only=True, omit_defaults=True):  # unset fields stay off the wire (older servers)
    engine_id: EngineId
    request_id: RequestId
    transfer_id: RequestId | None = None
    block_ids: BlockIds
    num_tokens: Annotated[int, Meta(ge=0, lt=1 << 40)]
    lease_s: LeaseS | None = None
    epoch: Annotated[int, Meta(ge=0, lt=1 << 31)] = 0
    prompt_sha: PromptSha | None = None
    launch: Instance | None = None  # EngineRegistration.launch of the publishing engine


class StreamPiece(_Strict, kw_only=True, omit_defaults=True):
    """Prefill has the KV of the first ``num_tokens`` tokens of a request it is still computing in place, in
    the full blocks ``block_ids`` (by position, one list per KV cache group). Cumulative: each piece
    repeats what the earlier ones said. ``index`` only grows for a request (across chunks and restarts).

    Layer-wise: the running step's further blocks ``step_block_ids`` (positions after ``block_ids``; full
    ones, and the prompt's last, partial one in the step that completes it) hold their KV in the model's
    layers whose index is below ``layers`` (0: none yet)."""

    transfer_id: RequestId
    request_id: RequestId
    index: Annotated[int, Meta(ge=1, lt=1 << 62)]
    epoch: Annotated[int, Meta(ge=0, lt=1 << 31)] = 0
    num_tokens: Annotated[int, Meta(ge=0, lt=1 << 40)]
    block_ids: BlockIds
    step_block_ids: BlockIds = []
    layers: Annotated[int, Meta(ge=0, lt=1 << 20)] = 0
    # The digest of the request's whole prompt (``prompt_tokens`` tokens): decode compares it before it reads
    prompt_sha: PromptSha | None = None
    prompt_tokens: Annotated[int, Meta(ge=0, lt=1 << 40)] = 0

    def __post_init__(self) -> None:
        if self.step_block_ids and len(self.step_block_ids) != len(self.block_ids):
            raise ValueError(f"invalid `step_block_ids`: {len(self.step_block_ids)} KV cache group(s), "
                             f"`block_ids` has {len(self.block_ids)}")


class StreamPiecesBody(_Strict, kw_only=True, omit_defaults=True):
    """One prefill rank's pieces of one step; ``rank`` is its (PP stage, TP rank) index among ``ranks``."""

    engine_id: EngineId
    rank: Rank = 0
    ranks: Size = 1
    pieces: Annotated[list[StreamPiece], Meta(max_length=4096)]
    launch: Instance | None = None  # EngineRegistration.launch of the sending engine

    def __post_init__(self) -> None:
        if self.rank >= self.ranks:
            raise ValueError(f"invalid `rank`: {self.rank} is not below ranks {self.ranks}")


class StreamPiecesAnswer(_Strict, kw_only=True):
    ended: list[str] = []  # transfer ids whose stream is over (decode gone, published, abandoned): stop sending


class StreamStopBody(_Strict, kw_only=True):
    transfer_id: RequestId


class LookupBody(_Strict, kw_only=True):
    engine_id: EngineId
    request_ids: RequestIds
    wait_s: WaitS = 0.0


class LookupTransferBody(_Strict, kw_only=True, omit_defaults=True):  # no "after" sent unless set
    transfer_id: RequestId
    wait_s: WaitS = 0.0
    engine_id: EngineId | None = None
    # Streamed KV: also answer with prefill's progress once its version is above ``after`` (a partial record)
    after: Annotated[int, Meta(ge=0)] | None = None
    # ... including layer-wise progress (``step_block_ids``, ``layers``); without it, whole blocks only
    layers: bool = False
    # Looking without reading (the router before it releases, decode before it reports): nothing is handed
    # to a reader (table.py, ``release``)
    peek: bool = False
    reader: Reader | None = None  # the decode engine handed the record (table.py, ``release``)


class RenewBody(_Strict, kw_only=True, omit_defaults=True):  # no "reader" sent unless set (older servers)
    engine_id: EngineId
    request_ids: RequestIds
    lease_s: LeaseS
    reader: Reader | None = None  # the decode engine renewing (table.py, ``release``)


class ReleaseBody(_Strict, kw_only=True, omit_defaults=True):  # no "router" sent unless set (older servers)
    engine_id: EngineId
    request_id: RequestId
    outcome: Outcome  # on the wire its value: "pulled" or "abandoned"
    # The router (the proxy) gives the request up, not the reader: deferred while a reader may read
    # (table.py, ``release``)
    router: bool = False
    reader: Reader | None = None  # the decode engine releasing: deferred while another may read

    def __post_init__(self) -> None:
        if self.outcome not in RELEASE_OUTCOMES:
            raise ValueError(f"invalid `outcome`: {self.outcome.value!r} is not pulled or abandoned")


class AbandonTransferBody(_Strict, kw_only=True, omit_defaults=True):  # unset fields stay off the wire
    """Give up a transfer id. ``engine_id`` None: by one that does not know the prefill engine (the proxy),
    only while nothing is bound to or streamed under the id. ``request_id``: prefill's own request, so the
    call never releases another request bound to the id."""

    engine_id: EngineId | None = None
    transfer_id: RequestId
    request_id: RequestId | None = None


class PollReleasedBody(_Strict, kw_only=True, omit_defaults=True):  # unset fields stay off the wire (older servers)
    engine_id: EngineId
    server_id: Annotated[str, Meta(max_length=64)] | None = None
    ack: Annotated[int, Meta(ge=0)] = 0
    # EngineRegistration.launch of the polling process: a process replaced under the engine id neither
    # acknowledges the new one's outcomes nor counts as the engine being in touch (PairingTable.poll_released)
    launch: Instance | None = None
    # the server's ``now`` in the last answer the poller got (0: none yet), so the server counts the engine in
    # touch as of a poll it knows was answered, not one whose answer may have been lost; unset: an older
    # client, counted as of this poll
    seen: Annotated[float, Meta(ge=0.0, lt=1e12)] | None = None


# ----- answers ----------------------------------------------------------------------------------------------


class RegisterAnswer(_Strict, kw_only=True):
    created: bool
    lease_s: float


class LeaseAnswer(_Strict, kw_only=True):
    lease_s: float


class OkAnswer(_Strict, kw_only=True):
    ok: bool = True


class EngineRanksAnswer(_Strict, kw_only=True):
    ranks: list[EngineRegistration]


class LookupAnswer(_Strict, kw_only=True):
    """Grouped lookup: every asked id appears in exactly one of the four lists."""

    ready: list[RequestRecord] = []
    expired: list[str] = []
    released: list[str] = []
    unknown: list[str] = []


class RenewAnswer(_Strict, kw_only=True, omit_defaults=True):  # unset fields stay off the wire
    renewed: list[str] = []
    expired: list[str] = []
    released: list[str] = []
    unknown: list[str] = []
    # set only when some renewed request got less than asked (prefill published it with a shorter lease):
    # the least any got
    lease_s: float | None = None


class ReleaseAnswer(_Strict, kw_only=True):
    already_released: bool


class PollReleasedAnswer(_Strict, kw_only=True, omit_defaults=True):  # "now" only to a poll that sent "seen"
    server_id: str
    released: list[ReleasedRequest]
    now: float | None = None  # the server's clock as it answered (PollReleasedBody.seen of the next poll)


class ErrorAnswer(msgspec.Struct, frozen=True, kw_only=True):
    error: str
    code: str
    field: str | None = None


class HealthAnswer(msgspec.Struct, frozen=True, kw_only=True):
    status: str
    server_id: str
    engines: int
    requests: int


# ----- validation errors ------------------------------------------------------------------------------------

_PATH = re.compile(r" - at `\$\.?(.*)`$")
_NAMED = re.compile(r"(?:unknown field|missing required field|invalid) `([^`]+)`")


def field_of(err: msgspec.ValidationError) -> str | None:
    """The dotted path of the field a msgspec validation error is about (``None``: the whole body)."""
    text = str(err)
    match = _PATH.search(text)
    path = match.group(1) if match else ""
    named = _NAMED.search(text)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


def invalid_from(err: msgspec.ValidationError) -> InvalidField:
    text = _PATH.sub("", str(err))
    return InvalidField(text, field=field_of(err))


def checked(struct_type: type, **fields: object):
    """Build a Struct from caller arguments with the same validation the server applies to a body, and one
    more the wire gives for free: every string must be encodable (a Python str may hold a lone UTF-16
    surrogate, e.g. a request id from a client's JSON escape; the embedded server's table would keep it, and
    every answer naming it would fail to encode)."""
    try:
        body = msgspec.convert(fields, struct_type)
    except msgspec.ValidationError as err:
        raise invalid_from(err) from None
    try:
        msgspec.json.encode(body)
    except UnicodeEncodeError as err:
        raise InvalidField(f"a string is not valid Unicode ({err.reason} at {err.start}: "
                           f"{err.object[max(0, err.start - 20):err.start]!r}...)") from None
    return body
