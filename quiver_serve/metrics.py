"""Prometheus metrics, owned by the front-end process only (workers send plain BatchStats)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quiver_serve.engine.pipeline import PipelineObserver
from quiver_serve.messages import BatchStats

PREFIX = "quiver_serve_"
_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_NODE_BUCKETS = tuple(float(2**i) for i in range(0, 21, 2))


class Metrics(PipelineObserver):
    """Every metric of DESIGN §5 that exists at this stage, in one private registry."""

    def __init__(self, pending: Callable[[], float] = lambda: 0.0) -> None:
        r = self.registry = CollectorRegistry()
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds", "HTTP request latency", ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_duration = Histogram(
            PREFIX + "queue_duration_seconds", "time a batch waited in queues before work",
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.batch_nodes = Histogram(
            PREFIX + "batch_nodes", "seed nodes per batch", buckets=_NODE_BUCKETS, registry=r)
        self.sampled_nodes = Histogram(
            PREFIX + "sampled_nodes", "measured unique nodes per sampled batch", buckets=_NODE_BUCKETS,
            registry=r)
        self.route_total = Counter(PREFIX + "route_total", "batches per route", ["route"], registry=r)
        self.sample_duration = Histogram(
            PREFIX + "sample_duration_seconds", "sampling time per batch", ["route"],
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.gather_duration = Histogram(
            PREFIX + "gather_duration_seconds", "feature gather time per batch",
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.compute_duration = Histogram(
            PREFIX + "compute_duration_seconds", "model time per batch", buckets=_LATENCY_BUCKETS_S,
            registry=r)
        self.cache_hits = Counter(
            PREFIX + "feature_cache_hits", "feature rows read from GPU cache", registry=r)
        self.cache_misses = Counter(
            PREFIX + "feature_cache_misses", "feature rows read from host memory", registry=r)
        self.pending = Gauge(PREFIX + "pending_requests", "admitted requests not yet answered",
                             registry=r)
        self.pending.set_function(pending)
        self.rejected = Counter(
            PREFIX + "requests_rejected", "requests refused or abandoned", ["reason"], registry=r)
        self.restarts = Counter(
            PREFIX + "worker_restarts", "worker processes restarted", ["role"], registry=r)
        self.late_results = Counter(
            PREFIX + "late_results", "results that arrived after their request was answered",
            registry=r)

    def on_batch(self, stats: BatchStats) -> None:
        self.route_total.labels(stats.route).inc()
        self.batch_nodes.observe(stats.num_seeds)
        self.sampled_nodes.observe(stats.num_sampled_nodes)
        self.queue_duration.observe(stats.queue_s)
        self.sample_duration.labels(stats.route).observe(stats.sample_s)
        self.gather_duration.observe(stats.gather_s)
        self.compute_duration.observe(stats.compute_s)
        self.cache_hits.inc(stats.cache_hits)
        self.cache_misses.inc(stats.cache_misses)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def on_late_result(self) -> None:
        self.late_results.inc()

    def on_restart(self, role: str) -> None:
        self.restarts.labels(role).inc()
