"""Connector statistics: what moved, how long it took, what failed, what prefill still holds.

Worker and scheduler sides both emit KVLinkStats; vLLM aggregates them and hands them to the log line
("KV Transfer metrics: ...") and to KVLinkPromMetrics (``kvlink_*`` series on /metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = (
    "bytes_pulled", "blocks_pulled", "batches", "descriptors", "pulls_ok", "pulls_failed",
    "pulls_cancelled", "published", "publish_failures", "released_pulled", "released_abandoned",
    "released_unreported",  # freed because the server said released twice, its outcome lost
    "leases_expired", "bad_params", "aborted_transfers", "lease_renewals",
    "lease_proof_waits",  # READs that finished before the renewal proving the lease held
    "bytes_local",  # of bytes_pulled, copied same-host by the transport (process_vm_readv)
    "window_refusals",  # decode computed a prompt itself: its last token's window lies in freed blocks
    "prompt_mismatch",  # decode: prefill computed other prompt tokens than decode's (params.prompt_digest); not used
    "pull_waits_nudged",  # decode: step waits (pull_step_wait_ms) a worker's nudge ended (nudge.py)
    "pull_after_release",  # decode: params of a prefill request decode already released (a late n > 1 sample,
    # the same params sent again): computed here, never pulled
    "remote_refreshed",  # decode: a prefill engine's ranks asked for again, its kept peers stale (a restart)
    # decode, streamed KV: pieces read, or dropped (not waited for); block reads before the record (a block
    # read in several layer ranges counts once per range)
    "pieces", "pieces_dropped", "blocks_streamed",
    # decode, lock-step (lockstep.py): pulls handed to vLLM before their KV landed; of those, confirmed at the
    # end of their step, failed there (their blocks reported as load errors), or stopped (vLLM aborted them);
    # steps that, with prefix caching, waited for armed pulls of requests they did not run
    "lockstep_armed", "lockstep_ok", "lockstep_failed", "lockstep_cancelled", "lockstep_shared_steps",
    # prefill, streamed KV: pieces reported; streams the server said were over; pieces a send failed for
    "pieces_sent", "pieces_ended", "pieces_failed",
    "stream_pool_full",  # prefill, streamed KV with host staging: not streamed, no room in the pool when it started
    # Host staging (staging.py): bytes copied device -> pool (prefill) and pool -> device (decode); requests
    # staged; a request (prefill) or pull (decode) that found the pool full and waited; requests larger than
    # the pool (computed by decode); requests that waited a whole lease for room and were given up.
    "bytes_staged", "bytes_landed", "staged", "staging_pool_full", "staging_refused", "staging_expired",
)
GAUGES = ("held_requests", "held_blocks",  # prefill: blocks kept for decode right now
          "pulls_in_progress",  # decode: requests waiting for their KV right now
          "staging_used_blocks")  # host staging: slots of the pool in use (prefill: staged copies; decode: landing)
# transfer_s: one sample per batched READ, post to completion; pull_s: one per request, from the worker
# receiving the pull (start_load_kv) to its KV in place and trusted (lookup, connect, queueing and any
# wait for the lease proof included); handoff_s: one per pulled request, from its KV in place and trusted to
# vLLM collecting it (get_transfer_results): the wait for vLLM's next engine step, which kvlink does not control.
# staging_s: one per staged request, from its copy handed to the worker to the copy seen done (device to
# pool); landing_s: one per batch, the copy of its landing slots into the KV cache (pool to device).
# compat_refused.<reason>: pulls failed because decode refused the prefill engine at first contact, by the
# first compat field that differs (model, kv_dtype, layout, kv_heads, groups, protocol_version, ...), or
# "mapping" (TP/PP/layers cannot be mapped), "layout" (a head range of an NHD block), "block_bytes",
# "engine_changed" (another process answers at the registration's address: contact.expected_name).
REFUSED = "compat_refused."
SERIES = ("transfer_s", "pull_s", "handoff_s", "staging_s", "landing_s", "tail_s", "lockstep_wait_s")
_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]


@dataclass
class KVLinkStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS} | {k: [] for k in SERIES}

    def add(self, key: str, n: int | float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def sample(self, key: str, v: float) -> None:
        self.data.setdefault(key, []).append(v)

    def set_gauge(self, key: str, v: int) -> None:
        self.data[key] = v

    def aggregate(self, other: KVConnectorStats) -> "KVLinkStats":
        for k, v in other.data.items():
            if k in GAUGES:
                self.data[k] = v
            elif isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in GAUGES) and not any(
            k in self.data for k in GAUGES)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if not isinstance(v, list) and v}
        ts = sorted(self.data.get("transfer_s", []))
        if ts:
            out["transfer_ms_avg"] = round(1e3 * sum(ts) / len(ts), 3)
            out["transfer_ms_p90"] = round(1e3 * ts[int(0.9 * (len(ts) - 1))], 3)
        for k in ("pull_s", "handoff_s"):
            ps = self.data.get(k, [])
            if ps:
                out[k.replace("_s", "_ms_avg")] = round(1e3 * sum(ps) / len(ps), 3)
        return out


class KVLinkPromMetrics(KVConnectorPromMetrics):
    """kvlink_* Prometheus series, per engine label, fed from KVLinkStats data."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for k in COUNTERS:
            c = self._counter_cls(name=f"kvlink_{k}", documentation=f"kvlink connector: {k}",
                                  labelnames=labelnames)
            self._counters[k] = {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}
        self._labels = per_engine_labelvalues
        self._refused = self._counter_cls(name="kvlink_compat_refused", labelnames=[*labelnames, "reason"],
                                          documentation="kvlink connector: pulls refused at first contact with a "
                                                        "prefill engine, by reason")
        self._gauges = {}
        for k in GAUGES:
            g = self._gauge_cls(name=f"kvlink_{k}", documentation=f"kvlink connector: {k}",
                                labelnames=labelnames, multiprocess_mode="mostrecent")
            self._gauges[k] = {i: g.labels(*v) for i, v in per_engine_labelvalues.items()}
        docs = {"transfer_s": ("kvlink_transfer_seconds", "kvlink: duration of one batched KV read", _BUCKETS),
                "pull_s": ("kvlink_pull_seconds", "kvlink: one request's pull, from the decode worker receiving "
                                                  "it to its KV in place", _BUCKETS + [30, 60]),
                "handoff_s": ("kvlink_handoff_seconds", "kvlink: from a request's KV in place to vLLM's engine "
                                                        "step collecting it (get_transfer_results)", _BUCKETS),
                "staging_s": ("kvlink_staging_seconds", "kvlink: one request's copy from device blocks into the "
                                                        "host staging pool", _BUCKETS),
                "tail_s": ("kvlink_tail_seconds", "kvlink: concurrent pairing, from decode seeing prefill's published "
                                                  "record to the request's KV in place (the transfer time not hidden "
                                                  "behind prefill's compute)", _BUCKETS),
                "lockstep_wait_s": ("kvlink_lockstep_wait_seconds", "kvlink: lock-step, how long one wait of a decode "
                                                                    "step for an armed request's layer or outcome took",
                                    _BUCKETS),
                "landing_s": ("kvlink_landing_seconds", "kvlink: one batch's copy from the host staging pool "
                                                        "into the KV cache", _BUCKETS)}
        self._hists = {}
        for k, (name, doc, buckets) in docs.items():
            h = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            self._hists[k] = {i: h.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self._counters and v:
                self._counters[k][engine_idx].inc(v)
            elif k in self._gauges:
                self._gauges[k][engine_idx].set(v)
            elif k.startswith(REFUSED) and v:
                self._refused.labels(*self._labels[engine_idx], k[len(REFUSED):]).inc(v)
        for k, hists in self._hists.items():
            for t in transfer_stats_data.get(k, ()):
                hists[engine_idx].observe(t)
