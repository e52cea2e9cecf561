"""What ``bench.graph.updates`` reads from the daemon beside the load: ``GET /v1/graph`` polled
through a window (acknowledged vs visible versions, staleness per engine core, overlay sizes), the
graph metrics of ``/metrics`` differenced over the window, and a forced compaction.

Staleness comes two ways: the ``quiver_serve_graph_staleness_seconds`` histogram (acknowledged ->
visible in an engine core, observed by the daemon for every version) differenced over the window,
and the polled ``staleness_s`` of each engine core (how long it has been behind, at each poll).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from loadtest import promdiff

GRAPH_PATH = "/v1/graph"
COMPACT_PATH = "/v1/graph/compact"
EMBED_ENDPOINT = "/v1/embed"
EDGES_ENDPOINT = "/v1/graph/edges"
STALENESS = "quiver_serve_graph_staleness_seconds"
UPDATE_DURATION = "quiver_serve_graph_update_duration_seconds"
REQUEST_DURATION = "quiver_serve_request_duration_seconds"
APPLY = "quiver_serve_graph_apply_seconds"
UPDATE_STAGE = "quiver_serve_graph_update_stage_seconds"
#: stages of an engine step's update application (``GraphApplyMetrics``)
APPLY_STAGES = ("read", "drain", "overlay", "device", "degrees", "features", "mark", "total")
#: the engine's per-batch stage histograms
ENGINE_STAGES = ("quiver_serve_sample_duration_seconds", "quiver_serve_gather_duration_seconds",
                 "quiver_serve_compute_duration_seconds", "quiver_serve_queue_duration_seconds")
COUNTERS = ("quiver_serve_graph_updates_total", "quiver_serve_graph_compactions_total",
            "quiver_serve_exact_table_turns_total", "quiver_serve_exact_table_rows_refreshed_total")


def http_json(url: str, method: str = "GET", body: Any = None, timeout_s: float = 10.0,
              headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
    """(status, decoded JSON answer or None); an HTTP error is a status, not an exception."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - loopback
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def quantiles(values: list[float] | np.ndarray, scale: float = 1e3) -> dict[str, float | None]:
    a = np.asarray(values, np.float64)
    if a.size == 0:
        return {"p50": None, "p99": None, "max": None}
    p50, p99, top = np.percentile(a, [50, 99, 100]) * scale
    return {"p50": float(p50), "p99": float(p99), "max": float(top)}


def hist_window(before: str, after: str, name: str,
                labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One histogram (every series whose labels include ``labels``, summed) over the window:
    count, mean / p50 / p99 in ms from the buckets."""
    d = promdiff.diff(promdiff.parse_histograms(before), promdiff.parse_histograms(after))
    want = set((labels or {}).items())
    series = [h for (n, lab), h in d.items() if n == name and want <= set(lab) and h["count"] > 0]
    h = promdiff.merge(series)
    n = h["count"]

    def ms(q: float) -> float | None:
        v = promdiff.bucket_quantile(h["buckets"], q) if n else None
        return None if v is None else 1e3 * v

    return {"count": int(n), "mean_ms": 1e3 * h["sum"] / n if n else None, "p50_ms": ms(0.5),
            "p99_ms": ms(0.99)}


def counters(text: str) -> dict[str, float]:
    """Counter samples named in ``COUNTERS`` (the graph's, the exact table's background work)
    and every ``quiver_serve_graph_*`` gauge, as ``name{label=value,...}`` -> value."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type not in ("counter", "gauge") or not (
                fam.name.startswith("quiver_serve_graph") or fam.type == "counter"):
            continue
        for s in fam.samples:
            if fam.type == "counter" and s.name not in COUNTERS:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def embed_statuses(before: str, after: str) -> dict[str, int]:
    """Answers of ``/v1/embed`` by status over the window (from the request histogram's counts)."""
    d = promdiff.diff(promdiff.parse_histograms(before), promdiff.parse_histograms(after))
    out: dict[str, int] = {}
    for (name, lab), h in d.items():
        lab_d = dict(lab)
        if name == REQUEST_DURATION and lab_d.get("endpoint") == EMBED_ENDPOINT and h["count"]:
            out[lab_d.get("status", "?")] = out.get(lab_d.get("status", "?"), 0) + int(h["count"])
    return out


def metrics_window(before: str | None, after: str | None) -> dict[str, Any]:
    """The graph figures of the daemon over a window, from two ``/metrics`` texts."""
    if not before or not after:
        return {}
    c0, c1 = counters(before), counters(after)
    changed = {k: v - c0.get(k, 0.0) for k, v in c1.items() if k in c0 or v}
    gauges = {k: v for k, v in c1.items() if not k.split("{")[0].endswith("_total")}
    return {
        "staleness": hist_window(before, after, STALENESS),
        "update_duration": hist_window(before, after, UPDATE_DURATION),
        "embed_server": hist_window(before, after, REQUEST_DURATION,
                                    {"endpoint": EMBED_ENDPOINT, "status": "200"}),
        "edges_server": hist_window(before, after, REQUEST_DURATION,
                                    {"endpoint": EDGES_ENDPOINT, "status": "200"}),
        "embed_statuses": embed_statuses(before, after),
        "apply": {st: hist_window(before, after, APPLY, {"stage": st}) for st in APPLY_STAGES},
        "update_stages": {st: hist_window(before, after, UPDATE_STAGE, {"stage": st})
                          for st in ("lock", "plan", "log", "durable")},
        "engine": {n.removeprefix("quiver_serve_"): hist_window(before, after, n)
                   for n in ENGINE_STAGES},
        "counters": {k: v for k, v in changed.items() if k.split("{")[0].endswith("_total")},
        "gauges": gauges,
    }


class Watch:
    """Polls ``GET /v1/graph`` and scrapes ``/metrics`` at both ends of a window, in a thread."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None,
                 interval_s: float = 0.1) -> None:
        self.url, self.headers, self.interval_s = url.rstrip("/"), dict(headers or {}), interval_s
        self.polls: list[dict[str, Any]] = []
        self.texts: list[str | None] = []
        self.thread: threading.Thread | None = None

    def start(self, win0: float, win1: float) -> None:
        self.thread = threading.Thread(target=self._run, args=(win0, win1), daemon=True)
        self.thread.start()

    def _run(self, win0: float, win1: float) -> None:
        time.sleep(max(0.0, win0 - time.time()))
        self.texts.append(promdiff.scrape(self.url))
        while time.time() < win1:
            t = time.time()
            status, body = http_json(self.url + GRAPH_PATH, headers=self.headers, timeout_s=2.0)
            if status == 200 and isinstance(body, dict):
                self.polls.append({"t": t, **body})
            time.sleep(max(0.0, self.interval_s - (time.time() - t)))
        self.texts.append(promdiff.scrape(self.url))

    def result(self) -> dict[str, Any]:
        """Polled staleness and version lag, the last graph state, and the metrics window."""
        if self.thread is not None:
            self.thread.join(timeout=30)
        stale, lag = [], []
        for p in self.polls:
            engines = p.get("engines") or []
            if engines:
                stale.append(max(float(e.get("staleness_s", 0.0)) for e in engines))
                lag.append(int(p.get("version", 0)) - min(int(e.get("version", 0))
                                                            for e in engines))
        last = self.polls[-1] if self.polls else {}
        texts = self.texts + [None] * (2 - len(self.texts))
        return {"polls": len(self.polls), "staleness_polled_ms": quantiles(stale),
                "version_lag": quantiles(lag, 1.0),
                "graph": {k: last.get(k) for k in ("version", "num_nodes", "num_edges", "overlay",
                                                   "last_compaction")},
                "metrics": metrics_window(texts[0], texts[1])}


def force_compaction(url: str, headers: Mapping[str, str] | None = None,
                     timeout_s: float = 300.0, poll_s: float = 0.2) -> dict[str, Any]:
    """``POST /v1/graph/compact``, then ``GET /v1/graph`` until ``last_compaction`` changes: when
    it was asked, when it ended (seconds, wall clock), and the daemon's own record of it. A 404 or
    405: the daemon does not offer it."""
    url = url.rstrip("/")
    _, before = http_json(url + GRAPH_PATH, headers=headers)
    first = (before or {}).get("last_compaction")
    t0 = time.time()
    status, answer = http_json(url + COMPACT_PATH, "POST", {}, timeout_s=timeout_s,
                               headers=headers)
    out: dict[str, Any] = {"offered": status not in (404, 405), "status": status,
                           "answer": answer, "asked_at": t0}
    if not 200 <= status < 300:
        return out
    while time.time() - t0 < timeout_s:
        _, now = http_json(url + GRAPH_PATH, headers=headers)
        last = (now or {}).get("last_compaction")
        if last is not None and last != first:
            out.update(ended_at=time.time(), duration_s=time.time() - t0, last_compaction=last)
            return out
        time.sleep(poll_s)
    out["timed_out_s"] = timeout_s
    return out
