#!/usr/bin/env python
"""Write deploy/grafana/dashboards/quiver-serve.json (Grafana's dashboard JSON) from the panel
list below: edit here, run ``python deploy/grafana/build_dashboard.py``, commit both files.
tests/tools/test_deploy.py checks that every metric the JSON names is one the daemon exports."""

from __future__ import annotations

import json
from pathlib import Path

RATE = "[1m]"
P = "quiver_serve_"


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    label = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({P}{metric}_bucket{RATE})))",
             f"{label}p{int(q * 100)}") for q in (0.5, 0.99)]


#: (title, unit, [(PromQL, legend)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests per second by endpoint and status", "reqps",
     [(f"sum by (endpoint, status) (rate({P}request_duration_seconds_count{RATE}))",
       "{{endpoint}} {{status}}")]),
    ("Request latency p50 / p99 by endpoint", "s", quantiles("request_duration_seconds", "endpoint")),
    ("Queue wait p50 / p99 (oldest request of a batch)", "s", quantiles("queue_duration_seconds")),
    ("Sampling p50 / p99 by route", "s", quantiles("sample_duration_seconds", "route")),
    ("Feature gather p50 / p99", "s", quantiles("gather_duration_seconds")),
    ("Gather + model p50 / p99", "s", quantiles("compute_duration_seconds")),
    ("Batches per second by route (CPU / GPU / in the engine)", "ops",
     [(f"sum by (route) (rate({P}route_total{RATE}))", "{{route}}")]),
    ("Mean batch size per engine core (one per GPU)", "short",
     [(f"sum by (engine) (rate({P}batch_nodes_sum{RATE})) / "
       f"sum by (engine) (rate({P}batch_nodes_count{RATE}))", "engine {{engine}}")]),
    ("Sampled nodes per batch (mean)", "short",
     [(f"sum(rate({P}sampled_nodes_sum{RATE})) / sum(rate({P}sampled_nodes_count{RATE}))",
       "sampled nodes")]),
    ("Feature cache hit rate", "percentunit",
     [(f"sum(rate({P}feature_cache_hits_total{RATE})) / (sum(rate({P}feature_cache_hits_total"
       f"{RATE})) + sum(rate({P}feature_cache_misses_total{RATE})))", "hit rate")]),
    ("Requests in flight (queue depth)", "short", [(f"sum({P}pending_requests)", "pending")]),
    ("Rejected or abandoned requests per second by reason", "reqps",
     [(f"sum by (reason) (rate({P}requests_rejected_total{RATE}))", "{{reason}}")]),
    ("Worker restarts (5 min)", "short",
     [(f"sum by (role) (increase({P}worker_restarts_total[5m]))", "{{role}}")]),
    ("Late results per second", "ops", [(f"sum(rate({P}late_results_total{RATE}))", "late")]),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": i + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "prometheus"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(65 + k), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "prometheus"}}
                    for k, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    return {
        "uid": "quiver-serve", "title": "quiver-serve", "schemaVersion": 39, "version": 1,
        "tags": ["quiver-serve", "gnn"], "timezone": "utc", "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "dashboards" / "quiver-serve.json"
    out.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print(f"wrote {out.name} ({len(PANELS)} panels)")
