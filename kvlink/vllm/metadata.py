"""What the scheduler side tells the worker side each step (KVConnectorMetadata) and its records."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvlink.vllm.params import RemoteSource
from kvlink.vllm.plan import NULL_BLOCK


@dataclass(frozen=True)
class GroupTable:
    """Decode's block table of one KV cache group for one pull (see PullSpec)."""

    group: int
    local_block_ids: tuple[int, ...]
    first_block: int
    num_blocks: int | None = None


@dataclass(frozen=True)
class PullSpec:
    """One decode request to pull: decode's block table for the request and where prefill's blocks live.

    ``local_block_ids`` is decode's block table for the request's KV cache group, by position: entry i
    holds the KV of tokens ``[i * block_size, (i + 1) * block_size)``. vLLM puts its null block (id 0)
    at positions it will never read (outside a sliding window); those are never written. Positions
    before ``first_block`` are already in decode's prefix cache. Prefill's block ids are paired with
    these by position, never by index in a filtered list (see plan.pair_blocks).
    """

    request_id: str
    local_block_ids: tuple[int, ...]
    first_block: int
    source: RemoteSource
    group: int = 0  # the KV cache group these ids belong to (named in errors)
    num_blocks: int | None = None  # positions the loaded tokens cover; local_block_ids must have as many
    others: tuple[GroupTable, ...] = ()  # the other KV cache groups' tables (hybrid models)
    num_tokens: int | None = None  # set with Mamba groups: prefill must have computed exactly these tokens
    # Decode's params.prompt_digest of the tokens it loads and of its whole prompt (both pairings), and how
    # many tokens each covers. Prefill's digest (pieces, record) must equal one of them at the same count.
    prompt_sha: str | None = None
    prompt_tokens: int = 0
    whole_sha: str | None = None
    whole_tokens: int = 0

    @property
    def tables(self) -> tuple[GroupTable, ...]:
        """Decode's table of every KV cache group this pull fills, the first group's first."""
        return (GroupTable(self.group, self.local_block_ids, self.first_block, self.num_blocks), *self.others)

    @cached_property
    def blocks_to_fill(self) -> tuple[int, ...]:
        """The local blocks this pull writes, every group: not null, not in the prefix cache (with several
        groups an id names a block within its group only: the worker then reports failures per request)."""
        return tuple(b for t in self.tables for b in t.local_block_ids[t.first_block:] if b != NULL_BLOCK)


@dataclass
class KVLinkMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    pulls: list[PullSpec] = field(default_factory=list)  # decode: start these pulls
    cancels: list[str] = field(default_factory=list)  # decode: aborted while pulling
    frees: list[str] = field(default_factory=list)  # prefill: report as finished_sending
    # prefill with host staging: (request id, device blocks, pool slots) to copy, then report as finished_sending
    stages: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    # prefill with host staging and streamed KV: requests whose streamed slots went back to the pool (before
    # ``stages``: a restaged request's slots may be its old ones again, holding another request's KV by then)
    unstreamed: list[str] = field(default_factory=list)
    bootstrap_url: str | None = None  # prefill: where workers register
    streams: list = field(default_factory=list)  # prefill: stream.StreamSpec pieces to send after this step
    # decode, lock-step (lockstep.py): armed requests this step runs (its layers wait for their KV, its end
    # for their outcome); armed requests vLLM finished (report them in finished_sending once settled)
    lockstep: list[str] = field(default_factory=list)
    lockstep_frees: list[str] = field(default_factory=list)
    # decode, lock-step with prefix caching: armed requests this step does not run whose pull may still be
    # under way; another request of the step may read their blocks from vLLM's prefix cache, so its layers
    # wait for their KV too, and its end for their outcome
    lockstep_shared: list[str] = field(default_factory=list)


@dataclass
class KVLinkWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step (lock-step): requests just armed (in this step's
    finished_recving, their KV still landing), armed requests whose pull ended (confirmed or not), and the
    blocks of those that ended unconfirmed (out of vLLM's prefix cache with them)."""

    armed: set[str] = field(default_factory=set)
    settled: dict[str, bool] = field(default_factory=dict)
    evict: set[int] = field(default_factory=set)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if isinstance(other, KVLinkWorkerMeta):
            return KVLinkWorkerMeta(self.armed | other.armed, {**self.settled, **other.settled},
                                    self.evict | other.evict)
        return self
