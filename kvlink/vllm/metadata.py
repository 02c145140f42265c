"""What the scheduler side tells the worker side each step (KVConnectorMetadata) and its records."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


class BadParams(ValueError):
    """A request's kv_transfer_params are malformed; the message names the field."""


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode request's KV lives, parsed from its kv_transfer_params.

    Sequential pairing gives engine id, request id and block ids; concurrent pairing gives a transfer
    id that the bootstrap server resolves once prefill publishes.
    """

    bootstrap_url: str
    engine_id: str | None = None
    request_id: str | None = None
    block_ids: tuple[int, ...] | None = None
    num_tokens: int | None = None
    transfer_id: str | None = None
    lease_s: float | None = None  # prefill's lease; decode renews it while pulling

    @classmethod
    def from_params(cls, p: dict) -> "RemoteSource":
        def opt_str(key):
            v = p.get(key)
            if v is not None and (not isinstance(v, str) or not v or len(v) > 512):
                raise BadParams(f"kv_transfer_params[{key!r}] must be a non-empty string, got {v!r:.80}")
            return v

        url = opt_str("remote_bootstrap_addr")
        if url is None:
            raise BadParams("kv_transfer_params['remote_bootstrap_addr'] is required with do_remote_prefill")
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        engine_id, request_id, transfer_id = (opt_str("remote_engine_id"), opt_str("remote_request_id"),
                                              opt_str("transfer_id"))
        blocks = p.get("remote_block_ids")
        if blocks is not None:
            if blocks and isinstance(blocks[0], list):  # one list per KV cache group
                if len(blocks) != 1:
                    raise BadParams("kv_transfer_params['remote_block_ids'] has several KV cache groups; "
                                    "kvlink supports one")
                blocks = blocks[0]
            if (not isinstance(blocks, list) or len(blocks) > 1 << 20
                    or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 1 << 40
                               for b in blocks)):
                raise BadParams("kv_transfer_params['remote_block_ids'] must be a list of block ids "
                                "(non-negative integers)")
            blocks = tuple(blocks)
        num_tokens = p.get("remote_num_tokens")
        if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)
                                       or num_tokens < 0):
            raise BadParams(f"kv_transfer_params['remote_num_tokens'] must be a non-negative integer, "
                            f"got {num_tokens!r:.40}")
        lease_s = p.get("remote_lease_s")
        if lease_s is not None and (not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool)
                                    or not 0 < lease_s <= 3600):
            raise BadParams(f"kv_transfer_params['remote_lease_s'] must be a number of seconds in (0, 3600], "
                            f"got {lease_s!r:.40}")
        if transfer_id is None and (engine_id is None or request_id is None or blocks is None):
            raise BadParams("kv_transfer_params need either transfer_id (concurrent pairing) or "
                            "remote_engine_id, remote_request_id and remote_block_ids (sequential)")
        return cls(url, engine_id, request_id, blocks, num_tokens, transfer_id,
                   float(lease_s) if lease_s is not None else None)

    @property
    def key(self) -> str:
        return self.transfer_id or f"{self.engine_id}/{self.request_id}"


@dataclass(frozen=True)
class PullSpec:
    """One decode request to pull: its local blocks and where the matching remote blocks live.

    The first ``skip_remote_blocks`` remote blocks are already present locally (prefix cache hit).
    """

    request_id: str
    local_block_ids: tuple[int, ...]
    skip_remote_blocks: int
    source: RemoteSource


@dataclass
class KVLinkMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    pulls: list[PullSpec] = field(default_factory=list)  # decode: start these pulls
    cancels: list[str] = field(default_factory=list)  # decode: aborted while pulling
    frees: list[str] = field(default_factory=list)  # prefill: report as finished_sending
    bootstrap_url: str | None = None  # prefill: where workers register
