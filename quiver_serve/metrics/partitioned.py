"""Prometheus metrics of a partitioned deployment (docs/architecture.md, "Partitioned serving").

The partition servers run on other hosts, so their numbers do not go through the daemon's
multiprocess files: each server keeps plain counts (``scaleout/partitioned/server.py: info``) and
the ingress's ``/metrics`` asks every server for them and writes them out here, one labelled
sample per (partition, peer, hop), next to the ingress's own request counts. A server that does
not answer is shown with ``quiver_serve_partition_up 0`` and no other samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from quiver_serve.metrics.prometheus import LATENCY_BUCKETS_S, PREFIX

P = PREFIX + "partition_"


@dataclass
class IngressCounts:
    """The ingress's own answers: by status, and their latency histogram."""

    by_status: dict[int, int] = field(default_factory=dict)
    latency_sum_s: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def observe(self, status: int, latency_s: float) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1
        self.latency_sum_s += latency_s
        i = next((i for i, b in enumerate(LATENCY_BUCKETS_S) if latency_s <= b),
                 len(LATENCY_BUCKETS_S))
        self.latency_buckets[i] += 1


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _cumulative(bounds: Iterable[float], counts: list[int]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*bounds, float("inf")], counts, strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
    return out


class _Collector:
    def __init__(self, servers: list[dict[str, Any]], ingress: IngressCounts,
                 call_buckets_s: tuple[float, ...]) -> None:
        self.servers, self.ingress, self.call_buckets_s = servers, ingress, call_buckets_s

    def collect(self) -> Iterator[Metric]:
        yield from self._servers()
        yield from self._calls()
        yield from self._ingress()

    def _servers(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(P + "up", "1: the partition server answered the metrics call",
                               labels=["partition", "replica"])
        rows = CounterMetricFamily(P + "rows", "feature rows gathered, by where they came from "
                                   "(local: owned; hot: a replicated row; remote: a call)",
                                   labels=["partition", "source"])
        hit = GaugeMetricFamily(P + "hot_hit_ratio", "of the rows owned elsewhere, the share a "
                                "replicated hot row answered", labels=["partition"])
        reqs = CounterMetricFamily(P + "requests", "embed calls taken, and refused overloaded",
                                   labels=["partition", "outcome"])
        living = self._living()
        for s in self.servers:
            part, rep = str(s["partition"]), str(s["replica"])
            up.add_metric([part, rep], 0.0 if s.get("down") else 1.0)
            if s.get("down"):
                continue
            for source, n in s["rows"].items():
                rows.add_metric([part, source], float(n))
            hit.add_metric([part], float(s["hot_hit_rate"]))
            reqs.add_metric([part, "taken"], float(s["requests"]))
            reqs.add_metric([part, "refused"], float(s["refused"]))
            living.add(s)
        yield from (up, rows, hit, reqs, *living.families())

    def _living(self) -> _Living:
        newest: dict[str, int] = {}
        for s in self.servers:
            if not s.get("down") and "version" in s:
                part = str(s["partition"])
                newest[part] = max(newest.get(part, 0), int(s["version"]))
        return _Living(newest)

    def _calls(self) -> Iterator[Metric]:
        labels = ["partition", "peer", "hop"]
        calls = CounterMetricFamily(P + "remote_calls", "calls to other partition servers, by "
                                    "hop (a number: sampling; features: rows)", labels=labels)
        failed = CounterMetricFamily(P + "remote_call_failures", "calls that failed or timed "
                                     "out (each replica tried counts)", labels=labels)
        sent = CounterMetricFamily(P + "remote_sent_bytes", "bytes of ids sent", labels=labels)
        got = CounterMetricFamily(P + "remote_received_bytes", "bytes of answers received",
                                  labels=labels)
        latency = _histogram(P + "remote_call_seconds", "latency of a remote call, from the "
                             "caller (queueing, transport, the peer's work)", labels)
        for s in self.servers:
            for c in s.get("calls", []):
                key = [str(s["partition"]), str(c["peer"]), str(c["hop"])]
                calls.add_metric(key, float(c["calls"]))
                failed.add_metric(key, float(c["failures"]))
                sent.add_metric(key, float(c["sent_bytes"]))
                got.add_metric(key, float(c["received_bytes"]))
                latency.add_metric(key, _cumulative(self.call_buckets_s, c["latency_buckets"]),
                                   float(c["latency_sum_s"]))
        yield from (calls, failed, sent, got, latency)

    def _ingress(self) -> Iterator[Metric]:
        answered = CounterMetricFamily(PREFIX + "partitioned_requests", "requests the ingress "
                                       "answered, by HTTP status", labels=["status"])
        for status, n in sorted(self.ingress.by_status.items()):
            answered.add_metric([str(status)], float(n))
        latency = _histogram(PREFIX + "partitioned_request_seconds", "ingress request latency",
                             [])
        latency.add_metric([], _cumulative(LATENCY_BUCKETS_S, self.ingress.latency_buckets),
                           self.ingress.latency_sum_s)
        yield from (answered, latency)


def exposition(servers: list[dict[str, Any]], ingress: IngressCounts,
               call_buckets_s: tuple[float, ...]) -> bytes:
    """The Prometheus text of the servers' ``info()`` answers (``{"partition", "replica",
    "down": True}`` for one that did not answer) and the ingress's counts."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(servers, ingress, call_buckets_s))
    return generate_latest(registry)


class _Living:
    """Each partition server's living graph: versions, the lag of a replica behind the newest
    replica of its partition, the overlay's fill and the compactions (decision 0063)."""

    def __init__(self, newest: dict[str, int]) -> None:
        labels = ["partition", "replica"]
        self.newest = newest
        self.version = GaugeMetricFamily(P + "graph_version", "the partition's log version this "
                                         "server has applied", labels=labels)
        self.lag = GaugeMetricFamily(P + "version_lag", "versions this server is behind the "
                                     "newest replica of its partition (a follower catches up "
                                     "before each read it answers)", labels=labels)
        self.base = GaugeMetricFamily(P + "base_version", "the version of the base its overlay "
                                      "is over (0: the partition's snapshot)", labels=labels)
        self.fill = GaugeMetricFamily(P + "overlay_fill_ratio", "overlay entries used over its "
                                      "capacity (compaction at graph.compact_at_fill)",
                                      labels=labels)
        self.compactions = CounterMetricFamily(P + "compactions", "compactions of the "
                                               "partition's log by this server", labels=labels)
        self.stale = GaugeMetricFamily(P + "exact_table_stale_rows", "own rows of the exact "
                                       "table not fresh at the last layer (answered on the fly)",
                                       labels=labels)
        self.computed = CounterMetricFamily(P + "exact_table_rows_computed", "layer rows the "
                                            "exact table computed (build and refresh)",
                                            labels=labels)
        self.served = CounterMetricFamily(P + "exact_table_rows_served", "exact rows answered "
                                          "from the table", labels=labels)
        self.restarts = CounterMetricFamily(P + "exact_table_restarts", "servers this primary "
                                            "restarted because their table could not be marked "
                                            "for its update (decision 0065)", labels=labels)

    def add(self, s: dict[str, Any]) -> None:
        if "version" not in s:
            return
        key, version = [str(s["partition"]), str(s["replica"])], int(s["version"])
        self.version.add_metric(key, float(version))
        self.lag.add_metric(key, float(self.newest.get(key[0], version) - version))
        self.base.add_metric(key, float(s.get("base_version", 0)))
        overlay = s.get("overlay") or {}
        if overlay.get("entries_capacity"):
            self.fill.add_metric(key, overlay["entries_used"] / overlay["entries_capacity"])
        self.compactions.add_metric(key, float((s.get("compaction") or {}).get("compactions",
                                                                                0)))
        table = s.get("table")
        if table:
            self.stale.add_metric(key, float(table["stale_rows"]))
            self.computed.add_metric(key, float(table["computed_rows"]))
            self.served.add_metric(key, float(table["rows_from_table"]))
            self.restarts.add_metric(key, float(table.get("restarted", 0)))

    def families(self) -> tuple[Metric, ...]:
        return (self.version, self.lag, self.base, self.fill, self.compactions, self.stale,
                self.computed, self.served, self.restarts)
