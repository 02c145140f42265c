"""Prometheus metrics of one bootstrap server, read from the table's counters at scrape time.

A per-server ``CollectorRegistry`` (never the global one), so several servers in one process (tests, embedded
use) do not collide. Nothing is incremented on the request path except plain integers.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvlink.bootstrap.table import PairingTable


class ServerCounters:
    """What the HTTP adapter counts itself (the table counts the rest)."""

    def __init__(self) -> None:
        self.errors: collections.Counter[str] = collections.Counter()
        self.waits = 0
        self.wait_timeouts = 0
        self.waiting = 0
        self.connections = 0  # client connections open now (gate.py)
        self.connections_refused = 0  # connections refused at max_connections (gate.py)


class _Collector:
    def __init__(self, table: PairingTable, counters: ServerCounters) -> None:
        self._table = table
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        table, stats, c = self._table, self._table.stats, self._counters

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvlink_bootstrap_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvlink_bootstrap_{name}", doc, value=value)

        yield gauge("engine_ranks", "Live registered engine ranks.", table.num_engine_ranks)
        yield gauge("requests", "Live published requests.", table.num_requests)
        yield gauge("tombstones", "Remembered expired/released ids.", table.num_tombstones)
        yield gauge("pending_outcomes", "Outcomes not yet acknowledged by prefill.", table.num_pending_outcomes)
        yield gauge("waiting", "Long polls in progress.", c.waiting)
        yield gauge("connections", "Client connections open.", c.connections)
        yield counter("engine_registrations", "New engine rank registrations.", stats.engines_registered)
        yield counter("engines_expired", "Engines dropped because every rank's lease ran out.", stats.engines_expired)
        yield counter("published", "Requests published.", stats.published)
        yield counter("looked_up", "Request ids looked up.", stats.looked_up)
        yield counter("expired", "Requests whose lease ran out.", stats.expired)
        yield counter("transfers_abandoned", "Transfer ids abandoned by prefill (aborted requests).",
                      stats.transfers_abandoned)
        yield counter("releases_deferred", "Router releases held until the lease a reader was given ran out.",
                      stats.releases_deferred)
        yield counter("renewals_capped", "Renewals refused: prefill, out of touch, would not hold the blocks "
                      "that long.", stats.renewals_capped)
        yield counter("conflicts", "Refused conflicting registrations, publishes, abandons and streamed pieces.",
                      stats.conflicts)
        yield counter("refused_full", "Registrations and publishes refused: max_engines, max_ranks_per_engine or "
                      "max_requests_per_engine reached.", stats.refused_full)
        yield counter("outcomes_dropped", "Outcomes dropped because prefill never acknowledged.",
                      stats.outcomes_dropped)
        st = table.streams.stats
        yield gauge("streams", "Requests prefill is still computing and streaming pieces of.", len(table.streams))
        yield counter("stream_pieces", "Streamed pieces applied.", st.pieces)
        yield counter("stream_duplicates", "Streamed pieces that arrived again (first arrival won).", st.duplicates)
        yield counter("stream_stale", "Streamed pieces of an earlier epoch (the request restarted).", st.stale)
        yield counter("stream_dropped", "Streamed pieces for a stream that had ended (published, abandoned, "
                      "stopped by decode).", st.dropped)
        yield counter("streams_stopped", "Streams decode stopped waiting for.", st.stopped)
        yield counter("waits", "Long polls started.", c.waits)
        yield counter("wait_timeouts", "Long polls that ended without an answer.", c.wait_timeouts)
        yield counter("connections_refused", "Connections refused (503, closed unread) at max_connections.",
                      c.connections_refused)
        released = CounterMetricFamily(
            "kvlink_bootstrap_released", "Requests reported done by decode.", labels=["outcome"]
        )
        released.add_metric(["pulled"], stats.released_pulled)
        released.add_metric(["abandoned"], stats.released_abandoned)
        yield released
        errors = CounterMetricFamily("kvlink_bootstrap_errors", "Error answers by code.", labels=["code"])
        for code, n in sorted(c.errors.items()):
            errors.add_metric([code], n)
        yield errors


class ServerMetrics:
    def __init__(self, table: PairingTable, counters: ServerCounters) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(table, counters))

    def render(self) -> bytes:
        return generate_latest(self.registry)
