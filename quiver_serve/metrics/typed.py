"""Metrics of a typed graph's batches, labelled by node type (docs/architecture.md, "Typed
graphs"; decision 0050): what a batch of each seed type costs, where it sampled, and where its
feature rows came from, per node type. Recorded in the engine core process that ran the batch
(prometheus_client multiprocess mode, as ``metrics/prometheus.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from quiver_serve.metrics.prometheus import LATENCY_BUCKETS_S, PREFIX, multiprocess_dir

NODE_BUCKETS = tuple(float(4**i) for i in range(0, 11))


@dataclass
class TypedBatchStats:
    """One typed batch: its seed type, path and sizes, and feature rows read per node type."""

    node_type: str
    route: str
    num_seeds: int
    sampled_nodes: int
    sampled_edges: int
    sample_s: float
    compute_s: float
    #: node type -> (rows from GPU memory, rows from host memory) in this batch
    feature_rows: dict[str, tuple[int, int]] = field(default_factory=dict)


class TypedMetrics:
    """Counters and histograms of ``TypedBatchStats`` (``observe``)."""

    def __init__(self) -> None:
        multiprocess_dir()
        self.batches = Counter(PREFIX + "typed_batches", "typed batches by seed node type and "
                               "route", ["node_type", "route"], registry=None)
        self.seeds = Counter(PREFIX + "typed_seeds", "seed ids of typed batches by node type",
                             ["node_type"], registry=None)
        self.sampled_nodes = Histogram(
            PREFIX + "typed_sampled_nodes", "unique sampled nodes per typed batch, by seed node "
            "type", ["node_type"], buckets=NODE_BUCKETS, registry=None)
        self.sample_duration = Histogram(
            PREFIX + "typed_sample_duration_seconds", "sampling time per typed batch, by seed "
            "node type and route", ["node_type", "route"], buckets=LATENCY_BUCKETS_S,
            registry=None)
        self.compute_duration = Histogram(
            PREFIX + "typed_compute_duration_seconds", "gather + model time per typed batch, by "
            "seed node type", ["node_type"], buckets=LATENCY_BUCKETS_S, registry=None)
        self.feature_rows = Counter(
            PREFIX + "typed_feature_rows", "feature rows read, by node type and tier (gpu: "
            "GPU memory, host: pinned host memory)", ["node_type", "tier"], registry=None)

    def observe(self, stats: TypedBatchStats) -> None:
        t = stats.node_type
        self.batches.labels(t, stats.route).inc()
        self.seeds.labels(t).inc(stats.num_seeds)
        self.sampled_nodes.labels(t).observe(stats.sampled_nodes)
        self.sample_duration.labels(t, stats.route).observe(stats.sample_s)
        self.compute_duration.labels(t).observe(stats.compute_s)
        for row_type, (hits, misses) in stats.feature_rows.items():
            if hits:
                self.feature_rows.labels(row_type, "gpu").inc(hits)
            if misses:
                self.feature_rows.labels(row_type, "host").inc(misses)
