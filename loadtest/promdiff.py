"""The server's per-stage breakdown from ``/metrics``: scrape before and after a window, difference
the histograms, and estimate each stage's mean and quantiles from the bucket counts.

Stages (metric names of docs/operations.md, "Metrics"): queue, sample (per route), gather, compute, and the HTTP request
duration (per endpoint; only answered requests with status 200).
"""

from __future__ import annotations

import urllib.request
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "quiver_serve_"
STAGES = {"queue": "queue_duration_seconds", "sample": "sample_duration_seconds",
          "gather": "gather_duration_seconds", "compute": "compute_duration_seconds",
          "request": "request_duration_seconds"}

#: (histogram name, frozen labels without "le") -> {"buckets": {le: cumulative}, "count", "sum"}
Hists = dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, Any]]


def parse_histograms(text: str) -> Hists:
    """Every histogram series of a Prometheus text exposition."""
    out: Hists = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram":
            continue
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            h = out.setdefault((fam.name, labels), {"buckets": {}, "count": 0.0, "sum": 0.0})
            if s.name.endswith("_bucket"):
                h["buckets"][float(s.labels["le"])] = s.value
            elif s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
    return out


def diff(before: Hists, after: Hists) -> Hists:
    """after - before, series by series (a series absent before counts from zero)."""
    out: Hists = {}
    for key, h in after.items():
        b = before.get(key, {"buckets": {}, "count": 0.0, "sum": 0.0})
        out[key] = {"buckets": {le: v - b["buckets"].get(le, 0.0) for le, v in h["buckets"].items()},
                    "count": h["count"] - b["count"], "sum": h["sum"] - b["sum"]}
    return out


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds the q-th observation."""
    les = sorted(buckets)
    cum = np.array([buckets[le] for le in les])
    if not les or cum[-1] <= 0:
        return None
    rank = q * cum[-1]
    i = int(np.searchsorted(cum, rank, side="left"))
    if les[i] == float("inf"):
        return les[i - 1] if i > 0 else None
    lo_le = les[i - 1] if i > 0 else 0.0
    lo_cum = cum[i - 1] if i > 0 else 0.0
    width = cum[i] - lo_cum
    return lo_le + (les[i] - lo_le) * ((rank - lo_cum) / width if width > 0 else 1.0)


def merge(series: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of several series of one histogram (e.g. every route)."""
    out: dict[str, Any] = {"buckets": {}, "count": 0.0, "sum": 0.0}
    for h in series:
        for le, v in h["buckets"].items():
            out["buckets"][le] = out["buckets"].get(le, 0.0) + v
        out["count"] += h["count"]
        out["sum"] += h["sum"]
    return out


def breakdown(before: str, after: str) -> dict[str, dict[str, Any]]:
    """Per stage over the window: observations, mean / p50 / p99 ms (p from the buckets), and
    sampling per route. Request duration counts status 200 only."""
    d = diff(parse_histograms(before), parse_histograms(after))
    out: dict[str, dict[str, Any]] = {}
    for stage, name in STAGES.items():
        full = PREFIX + name.removesuffix("_seconds") + "_seconds"
        series = {k: v for k, v in d.items() if k[0] == full and v["count"] > 0}
        if stage == "request":
            series = {k: v for k, v in series.items() if dict(k[1]).get("status") in (None, "200")}
        if not series:
            continue
        out[stage] = _summary(merge(list(series.values())))
        if stage == "sample":
            for (_, labels), h in series.items():
                out[f"sample[{dict(labels).get('route', '?')}]"] = _summary(h)
    return out


def _summary(h: dict[str, Any]) -> dict[str, Any]:
    n = h["count"]
    p50, p99 = (bucket_quantile(h["buckets"], q) for q in (0.5, 0.99))
    return {"count": int(n), "mean_ms": 1e3 * h["sum"] / n if n else None,
            "p50_ms": None if p50 is None else 1e3 * p50, "p99_ms": None if p99 is None else 1e3 * p99}


def scrape(url: str, timeout_s: float = 5.0) -> str | None:
    """``GET <url>/metrics``; None when it cannot be read (the breakdown is then left out)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:  # noqa: S310
            return r.read().decode()
    except OSError:
        return None


def local_text() -> str | None:
    """The metrics of a daemon started in this process tree (the queue API path), if any."""
    import os

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path or not os.path.isdir(path):
        return None
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=path)
    return generate_latest(reg).decode()


def stage_rows(stages: dict[str, dict[str, Any]]) -> list[str]:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    return [f"| {k} | {v['count']} | {f(v['mean_ms'])} | {f(v['p50_ms'])} | {f(v['p99_ms'])} |"
            for k, v in stages.items()]
