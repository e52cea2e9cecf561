"""Prometheus metrics from every process, in prometheus_client's multiprocess mode.

Each process of one daemon writes its own samples to memory-mapped files in one directory
(``PROMETHEUS_MULTIPROC_DIR``, created by the supervisor before any child starts and inherited by
every child); ``/metrics`` merges them with ``MultiProcessCollector``. Engine cores record the
per-batch metrics (route, batch size, sample/gather/compute time, cache hits) where the batch runs;
front-ends record per-request ones (latency, rejections, pending); the supervisor records restarts.
Counters of a process that died keep counting in the total (their files stay).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

from quiver_serve import envs
from quiver_serve.messages import BatchStats
from quiver_serve.metrics.observer import PipelineObserver

PREFIX = "quiver_serve_"
#: the variable (``envs.py``) that tells prometheus_client, and every child, where the files are
ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_NODE_BUCKETS = tuple(float(2**i) for i in range(0, 21, 2))
_RELATIVE_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_TRANSPORT_BUCKETS_S = (5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.05, 0.5)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
GC_PAUSE_BUCKETS_S = (1e-5, 1e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


_value_class_for: tuple[str, int] | None = None


def multiprocess_dir() -> str:
    """The metrics directory of this process tree; created (and removed at exit) on first use.

    prometheus_client picks its value class when it is imported, so it is picked again here once
    the directory is known; metrics created before this call would stay process-local.
    """
    path = envs.PROMETHEUS_MULTIPROC_DIR
    if not path:
        path = tempfile.mkdtemp(prefix="quiver-metrics-")
        os.environ[ENV] = path  # a write: children spawned later inherit the directory
        atexit.register(shutil.rmtree, path, True)
    os.makedirs(path, exist_ok=True)
    global _value_class_for
    if _value_class_for != (path, os.getpid()):
        # Once per process and directory: a second value class would open the same .db files
        # again, and two writers of one file overwrite each other's samples.
        values.ValueClass = values.get_value_class()
        _value_class_for = (path, os.getpid())
    return path


#: label values that exist from the start (see :class:`Metrics`)
REJECT_REASONS = ("pending_full", "client_disconnected", "engine_lost", "deadline")
WORKER_ROLES = ("engine", "sampler", "frontend")
#: why the gRPC port ended a connection (``frontend/grpc/limits.py``'s REASONS)
GRPC_CUT_OFF_REASONS = ("rapid_reset", "settings_flood", "ping_flood", "window_update_flood",
                        "priority_flood", "empty_frame_flood", "continuation_flood",
                        "control_frames_unread")


def gc_pause_sink(role: str) -> Callable[[int, float], None]:
    """Where :class:`quiver_serve.engine.procs.heap.GcPauses` puts this process's collection pauses."""
    multiprocess_dir()
    hist = Histogram(PREFIX + "gc_pause_seconds", "garbage-collector pauses, by process role and "
                     "generation (2: full collection)", ["role", "generation"],
                     buckets=GC_PAUSE_BUCKETS_S, registry=None)
    by_generation = [hist.labels(role, str(g)) for g in range(3)]
    return lambda generation, pause_s: by_generation[min(max(generation, 0), 2)].observe(pause_s)


class EngineMetrics:
    """Per-batch metrics, recorded in the engine core process that ran the batch."""

    def __init__(self) -> None:
        multiprocess_dir()
        self.queue_duration = Histogram(
            PREFIX + "queue_duration_seconds", "time a batch's oldest request waited before work",
            buckets=LATENCY_BUCKETS_S, registry=None)
        self.batch_nodes = Histogram(
            PREFIX + "batch_nodes", "seed nodes per batch, by engine core (one per GPU)",
            ["engine"], buckets=_NODE_BUCKETS, registry=None)
        self.sampled_nodes = Histogram(
            PREFIX + "sampled_nodes", "measured unique nodes per sampled batch",
            buckets=_NODE_BUCKETS, registry=None)
        self.route_total = Counter(PREFIX + "route", "batches per route", ["route"], registry=None)
        self.sample_duration = Histogram(
            PREFIX + "sample_duration_seconds", "sampling time per batch", ["route"],
            buckets=LATENCY_BUCKETS_S, registry=None)
        self.gather_duration = Histogram(
            PREFIX + "gather_duration_seconds", "feature gather time per batch",
            buckets=LATENCY_BUCKETS_S, registry=None)
        self.compute_duration = Histogram(
            PREFIX + "compute_duration_seconds", "gather + model time per batch (GPU: device time)",
            buckets=LATENCY_BUCKETS_S, registry=None)
        self.cache_hits = Counter(
            PREFIX + "feature_cache_hits", "feature rows read from GPU memory", registry=None)
        self.cache_misses = Counter(
            PREFIX + "feature_cache_misses", "feature rows read from host memory", registry=None)
        self.psgs = Histogram(
            PREFIX + "psgs", "predicted sampled-graph size (unique nodes) per batch",
            buckets=_NODE_BUCKETS, registry=None)
        self.psgs_error = Histogram(
            PREFIX + "psgs_relative_error", "|predicted - measured| / measured sampled nodes",
            buckets=_RELATIVE_ERROR_BUCKETS, registry=None)
        self.latency_ratio = Histogram(
            PREFIX + "batch_latency_ratio", "measured / predicted batch latency (sample + "
            "gather + model), by route", ["route"], buckets=_RATIO_BUCKETS, registry=None)

    def observe(self, stats: BatchStats) -> None:
        self.route_total.labels(stats.route).inc()
        self.batch_nodes.labels(str(stats.worker)).observe(stats.num_seeds)
        if stats.route != "table":  # exact answers gathered from the table sample nothing
            self.sampled_nodes.observe(stats.num_sampled_nodes)
        self.queue_duration.observe(stats.queue_s)
        self.sample_duration.labels(stats.route).observe(stats.sample_s)
        self.gather_duration.observe(stats.gather_s)
        self.compute_duration.observe(stats.compute_s)
        if stats.cache_hits:
            self.cache_hits.inc(stats.cache_hits)
        if stats.cache_misses:
            self.cache_misses.inc(stats.cache_misses)
        if stats.psgs > 0:
            self.psgs.observe(stats.psgs)
            if stats.num_sampled_nodes:
                self.psgs_error.observe(abs(stats.psgs - stats.num_sampled_nodes)
                                        / stats.num_sampled_nodes)
        if stats.predicted_s > 0:
            measured_s = stats.sample_s + stats.compute_s
            self.latency_ratio.labels(stats.route).observe(measured_s / stats.predicted_s)


class Metrics(PipelineObserver):
    """Front-end and supervisor metrics, and the merged view of every process (``registry``)."""

    def __init__(self) -> None:
        path = multiprocess_dir()
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=path)
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds", "HTTP request latency", ["endpoint", "status"],
            buckets=LATENCY_BUCKETS_S, registry=None)
        self.pending = Gauge(PREFIX + "pending_requests", "admitted requests not yet answered",
                             registry=None, multiprocess_mode="livesum")
        self.rejected = Counter(
            PREFIX + "requests_rejected", "requests refused or abandoned", ["reason"], registry=None)
        self.restarts = Counter(
            PREFIX + "worker_restarts", "worker processes restarted", ["role"], registry=None)
        self.late_results = Counter(
            PREFIX + "late_results", "results that arrived after their request was answered",
            registry=None)
        self.transport = Histogram(
            PREFIX + "transport_seconds", "a micro-batch's trip between a front-end client and "
            "an engine core, by direction (to_engine: sent to taken in; to_client: reply built "
            "to read)", ["direction"], buckets=_TRANSPORT_BUCKETS_S, registry=None)
        self._to_engine = self.transport.labels("to_engine")
        self._to_client = self.transport.labels("to_client")
        self.model_requests = Counter(
            PREFIX + "model_requests", "requests answered, by the model and version that served "
            "them (as asked for, when none did) and outcome (ok, error)",
            ["model", "version", "outcome"], registry=None)
        self.model_latency = Histogram(
            PREFIX + "model_batch_round_trip_seconds", "micro-batch round trip (front-end "
            "client -> engine core -> client), by model and version", ["model", "version"],
            buckets=LATENCY_BUCKETS_S, registry=None)
        self.grpc_cut_off = Counter(
            PREFIX + "grpc_connections_closed", "gRPC port connections ended for passing an "
            "abuse limit (server.grpc_limits, decision 0036), by reason", ["reason"],
            registry=None)
        # Known label values start at 0, so rates and alerts work before the first event.
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for reason in GRPC_CUT_OFF_REASONS:
            self.grpc_cut_off.labels(reason)
        for role in WORKER_ROLES:
            self.restarts.labels(role)

    def on_pending(self, count: int) -> None:
        self.pending.set(count)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def on_late_result(self) -> None:
        self.late_results.inc()

    def on_restart(self, role: str) -> None:
        self.restarts.labels(role).inc()

    def on_grpc_cut_off(self, reason: str) -> None:
        self.grpc_cut_off.labels(reason).inc()

    def on_model_answers(self, model: str, version: str, ok: int, failed: int,
                         round_trip_s: float) -> None:
        if ok:
            self.model_requests.labels(model, version, "ok").inc(ok)
        if failed:
            self.model_requests.labels(model, version, "error").inc(failed)
        self.model_latency.labels(model, version).observe(round_trip_s)

    def on_transport(self, sent_s: float, engine_received_s: float, engine_replied_s: float,
                     received_s: float) -> None:
        self._to_engine.observe(max(engine_received_s - sent_s, 0.0))
        self._to_client.observe(max(received_s - engine_replied_s, 0.0))


#: kinds of graph update (``graph_updates_total{kind}``)
UPDATE_KINDS = ("edges", "nodes", "features")
_STALENESS_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                        5.0, 10.0)


#: buckets of one step's update application (the per-step budget is a few ms)
APPLY_BUCKETS_S = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                   1.0)


class GraphApplyMetrics:
    """The living graph in an engine core: staleness of each applied update (acknowledged ->
    visible here) and the version it serves."""

    def __init__(self, engine: int) -> None:
        multiprocess_dir()
        label = str(engine)
        self.staleness = Histogram(
            PREFIX + "graph_staleness_seconds", "acknowledged -> visible in an engine core, per "
            "applied update", ["engine"], buckets=_STALENESS_BUCKETS_S, registry=None).labels(label)
        self.visible = Gauge(PREFIX + "graph_visible_version", "graph version an engine core "
                             "serves", ["engine"], multiprocess_mode="max", registry=None).labels(label)

        self.apply_s = Histogram(
            PREFIX + "graph_apply_seconds", "engine-loop time of one step's update application, "
            "by stage (read: the log; drain: batches in flight finished; overlay, device, "
            "degrees, features, mark: what the updates touch; total)", ["engine", "stage"],
            buckets=APPLY_BUCKETS_S, registry=None)
        self._label = label
        self.applied = Counter(PREFIX + "graph_applied_records_total", "update records an "
                               "engine core applied", ["engine"], registry=None).labels(label)

    def on_applied(self, kind: str, staleness_s: float, version: int) -> None:
        self.staleness.observe(staleness_s)
        self.visible.set(version)

    def on_poll(self, seconds: dict[str, float], records: int) -> None:
        for stage, s in seconds.items():
            self.apply_s.labels(self._label, stage).observe(s)
        self.applied.inc(records)


class TableMetrics:
    """The exact table of one engine core (docs/architecture.md, "The exact table"): its version,
    refresh work and staleness, and where exact requests were answered. ``sync`` turns the table's
    counters into metric increments (the engine loop calls it after its replies); ``on_round`` is
    called by the refresh thread after each round."""

    def __init__(self, engine: int) -> None:
        multiprocess_dir()
        label = str(engine)
        requests = Counter(PREFIX + "exact_requests_total", "exact requests answered, by source: "
                           "a gather from the table, or the on-the-fly path (a stale row)",
                           ["engine", "source"], registry=None)
        self.from_table = requests.labels(label, "table")
        self.on_the_fly = requests.labels(label, "on_the_fly")
        self.version = Gauge(PREFIX + "exact_table_version", "graph version every non-stale row "
                             "of the table is exact for", ["engine"], multiprocess_mode="max",
                             registry=None).labels(label)
        self.rows = Counter(PREFIX + "exact_table_rows_refreshed_total", "table rows recomputed "
                            "by refresh rounds (every layer)", ["engine"], registry=None).labels(label)
        self.backlog = Gauge(PREFIX + "exact_table_backlog_rows", "rows of the running refresh "
                             "round not recomputed yet", ["engine"], multiprocess_mode="max",
                             registry=None).labels(label)
        self.staleness = Histogram(
            PREFIX + "exact_table_staleness_seconds", "per refresh round: oldest change it covers, "
            "acknowledged -> servable from the table", ["engine"],
            buckets=_STALENESS_BUCKETS_S, registry=None).labels(label)
        self.full = Counter(PREFIX + "exact_table_full_recomputes_total", "refresh rounds that "
                            "recomputed a layer whole", ["engine"], registry=None).labels(label)
        self.failures = Counter(PREFIX + "exact_table_refresh_failures_total", "refresh rounds "
                                "that failed (retried as a full recompute)", ["engine"],
                                registry=None).labels(label)
        self.build_s = Gauge(PREFIX + "exact_table_build_seconds", "time to materialise the "
                             "table at start-up", ["engine"], multiprocess_mode="max",
                             registry=None).labels(label)
        self.bytes = Gauge(PREFIX + "exact_table_bytes", "bytes of the table (every layer)",
                           ["engine"], multiprocess_mode="max", registry=None).labels(label)
        self.build_chunk_s = Histogram(
            PREFIX + "exact_table_build_chunk_seconds", "a new model version's table, built by "
            "the engine loop between steps: seconds of each chunk (models.table_build_step_ms "
            "bounds a step's chunks)", ["engine"], buckets=APPLY_BUCKETS_S,
            registry=None).labels(label)
        self.build_progress = Gauge(
            PREFIX + "exact_table_build_progress", "share of a new model version's table built "
            "(1: none building)", ["engine"], multiprocess_mode="max", registry=None).labels(label)
        self.build_progress.set(1.0)
        turns = Counter(PREFIX + "exact_table_turns_total", "chunks of background table work "
                        "(refresh rounds, new versions' builds) by when they ran: at a quiet "
                        "engine loop, or after exact.quiet_wait_ms without one", ["engine", "when"],
                        registry=None)
        self.turns = (turns.labels(label, "quiet"), turns.labels(label, "waited"))
        self._turns_seen = (0, 0)
        self._seen = (0, 0, 0, 0)

    def follow(self, build_s: float, num_bytes: int, version: int) -> None:
        """A new table serves (a model load swapped it in): its counters start from 0."""
        self._seen = (0, 0, 0, 0)
        self.started(build_s, num_bytes, version)

    def on_build_step(self, chunk_s: list[float], progress: float) -> None:
        for s in chunk_s:
            self.build_chunk_s.observe(s)
        self.build_progress.set(progress)

    def started(self, build_s: float, num_bytes: int, version: int) -> None:
        self.build_s.set(build_s)
        self.bytes.set(num_bytes)
        self.version.set(version)

    def on_round(self, rows: int, staleness_s: float, version: int) -> None:
        self.staleness.observe(staleness_s)
        self.version.set(version)
        self.backlog.set(0)

    def sync_turns(self, quiet: int, waited: int) -> None:
        """The quiet gate's counts (``engine/core/quiet.py``), as they are now."""
        for metric, new, old in zip(self.turns, (quiet, waited), self._turns_seen, strict=True):
            if new > old:
                metric.inc(new - old)
        self._turns_seen = (quiet, waited)

    def sync(self, counters: object, backlog_rows: int) -> None:
        now = (counters.from_table, counters.on_the_fly,  # type: ignore[attr-defined]
               counters.rows_refreshed, counters.full_recomputes)  # type: ignore[attr-defined]
        if now == self._seen:
            return
        for metric, new, old in zip((self.from_table, self.on_the_fly, self.rows, self.full),
                                    now, self._seen, strict=True):
            if new > old:
                metric.inc(new - old)
        self._seen = now
        self.backlog.set(backlog_rows)

    def failed(self) -> None:
        self.failures.inc()


class GraphWriterMetrics:
    """The living graph at the writer: versions, updates, their durations, overlay, compactions."""

    def __init__(self) -> None:
        multiprocess_dir()
        self.version = Gauge(PREFIX + "graph_version", "last acknowledged graph version",
                             multiprocess_mode="max", registry=None)
        updates = Counter(PREFIX + "graph_updates_total", "acknowledged graph updates (calls), "
                          "by kind", ["kind"], registry=None)
        self.updates = {k: updates.labels(k) for k in UPDATE_KINDS}
        self.duration = Histogram(PREFIX + "graph_update_duration_seconds", "validate + log + "
                                  "sync + apply of one update call at the writer",
                                  buckets=LATENCY_BUCKETS_S, registry=None)
        self.stage_s = Histogram(PREFIX + "graph_update_stage_seconds", "one edge update call "
                                 "at the writer, by stage: lock (waiting for it), plan, log "
                                 "(the write), durable (the sync, shared by a group)",
                                 ["stage"], buckets=LATENCY_BUCKETS_S, registry=None)
        self.overlay_entries = Gauge(PREFIX + "graph_overlay_entries", "overlay entries in use "
                                     "(8 bytes each per sampling process)",
                                     multiprocess_mode="max", registry=None)
        self.overlay_capacity = Gauge(PREFIX + "graph_overlay_capacity_entries", "overlay "
                                      "entries before updates wait for compaction",
                                      multiprocess_mode="max", registry=None)
        self.nodes = Gauge(PREFIX + "graph_nodes", "nodes of the acknowledged graph",
                           multiprocess_mode="max", registry=None)
        self.edges = Gauge(PREFIX + "graph_edges", "edges of the acknowledged graph",
                           multiprocess_mode="max", registry=None)
        self.compactions = Counter(PREFIX + "graph_compactions_total", "compactions finished",
                                   registry=None)
        self.compaction_s = Histogram(PREFIX + "graph_compaction_duration_seconds", "one "
                                      "compaction: fold, write, sync, switch",
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
                                      registry=None)

    def on_stages(self, seconds: dict[str, float]) -> None:
        for stage, s in seconds.items():
            self.stage_s.labels(stage).observe(s)

    def on_update(self, kind: str, seconds: float, version: int) -> None:
        self.updates[kind].inc()
        self.duration.observe(seconds)
        self.version.set(version)

    def on_state(self, nodes: int, edges: int, entries: int, capacity: int) -> None:
        self.nodes.set(nodes)
        self.edges.set(edges)
        self.overlay_entries.set(entries)
        self.overlay_capacity.set(capacity)

    def on_compaction(self, seconds: float) -> None:
        self.compactions.inc()
        self.compaction_s.observe(seconds)
