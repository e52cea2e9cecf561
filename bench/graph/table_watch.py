"""What ``bench.graph.exact_table`` reads of the daemon's exact table (docs/architecture.md, "The
exact table"): its build (time, bytes, where) at start, its counters over a window (exact requests
from the table or on the fly, rows refreshed), and its freshness while the graph changes.

Every reading tolerates its source's absence (an older daemon, a table that is off): a figure that
cannot be read is None. Sources, in order: ``GET /v1/graph`` (a top-level ``exact_table`` entry,
or each engine core's), the ``quiver_serve_exact_*`` metrics, and the daemon's log line
``exact table: N nodes x [..] in gpu memory (X MiB), built in S s``.

Staleness comes three ways: the ``quiver_serve_exact_table_staleness_seconds`` histogram (per
refresh round: oldest change it covers, acknowledged -> servable from the table) differenced over
the window; the table's version polled against the acknowledged one (version lag, and how long the
table has been behind the first acknowledged version it lacks, to the poll interval); and the
``last_round_staleness_s`` each engine core publishes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest import watch

TABLE_STALENESS = "quiver_serve_exact_table_staleness_seconds"
EXACT_REQUESTS = "quiver_serve_exact_requests_total"
ROWS_REFRESHED = "quiver_serve_exact_table_rows_refreshed_total"
FULL_RECOMPUTES = "quiver_serve_exact_table_full_recomputes_total"
REFRESH_FAILURES = "quiver_serve_exact_table_refresh_failures_total"
BUILD_SECONDS = "quiver_serve_exact_table_build_seconds"
TABLE_BYTES = "quiver_serve_exact_table_bytes"
BUILD_LINE = re.compile(r"exact table: (\d+) nodes x \[([^\]]*)\] in (\w+) memory "
                        r"\(([\d.,]+) MiB\), built in ([\d.]+) s")


def build_from_log(text: str) -> list[dict[str, Any]]:
    """Every engine core's build line in a daemon log."""
    out = []
    for m in BUILD_LINE.finditer(text or ""):
        out.append({"nodes": int(m.group(1)),
                    "dims": [int(d) for d in m.group(2).split(",") if d.strip()],
                    "where": m.group(3), "mib": float(m.group(4).replace(",", "")),
                    "build_s": float(m.group(5))})
    return out


def table_metrics(text: str | None) -> dict[str, float]:
    """The exact table's samples (every engine core summed; build time and bytes: the largest),
    by short name: table, on_the_fly, rows_refreshed, full_recomputes, failures, build_s, bytes."""
    if not text:
        return {}
    out: dict[str, float] = {}
    names = {ROWS_REFRESHED: "rows_refreshed", FULL_RECOMPUTES: "full_recomputes",
             REFRESH_FAILURES: "failures"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == EXACT_REQUESTS:
                key = s.labels.get("source", "?")
                out[key] = out.get(key, 0.0) + s.value
            elif s.name in names:
                out[names[s.name]] = out.get(names[s.name], 0.0) + s.value
            elif s.name in (BUILD_SECONDS, TABLE_BYTES):
                key = "build_s" if s.name == BUILD_SECONDS else "bytes"
                out[key] = max(out.get(key, 0.0), s.value)
    return out


def counters_window(before: str | None, after: str | None, seconds: float) -> dict[str, Any]:
    """Exact requests by source and rows refreshed over a window (None: not readable)."""
    if not before or not after:
        return {"from_table": None, "on_the_fly": None, "rows_refreshed": None,
                "rows_refreshed_per_s": None, "full_recomputes": None, "failures": None}
    b, a = table_metrics(before), table_metrics(after)

    def delta(key: str) -> float | None:
        return a[key] - b.get(key, 0.0) if key in a else None

    rows = delta("rows_refreshed")
    return {"from_table": delta("table"), "on_the_fly": delta("on_the_fly"),
            "rows_refreshed": rows,
            "rows_refreshed_per_s": None if rows is None or seconds <= 0 else rows / seconds,
            "full_recomputes": delta("full_recomputes"), "failures": delta("failures")}


def table_entries(graph: Any) -> list[dict[str, Any]]:
    """The exact table's entries of a ``GET /v1/graph`` answer: each engine core's, else the
    top-level ``exact_table`` (one dict or a list); [] without a table."""
    if not isinstance(graph, dict):
        return []
    engines = [e["exact_table"] for e in graph.get("engines") or []
               if isinstance(e, dict) and isinstance(e.get("exact_table"), dict)]
    if engines:
        return engines
    top = graph.get("exact_table")
    if isinstance(top, dict):
        return [top]
    return [t for t in top if isinstance(t, dict)] if isinstance(top, list) else []


def build_info(graph: Any, metrics_text: str | None, log_text: str) -> dict[str, Any]:
    """The table's build as the daemon reports it: build time (the slowest engine core), bytes,
    where, nodes, layer widths, and which source said so."""
    top = graph.get("exact_table") if isinstance(graph, dict) else None
    entries = [t for t in ([top] if isinstance(top, dict) else top or []) if isinstance(t, dict)]
    entries += [t for t in table_entries(graph) if t not in entries]
    gauges = table_metrics(metrics_text)
    logs = build_from_log(log_text)
    out: dict[str, Any] = {"build_s": None, "bytes": None, "where": None, "nodes": None,
                           "dims": None, "source": None, "engines": len(logs) or None}
    with_build = [e for e in entries if e.get("build_s") is not None]
    if with_build:
        out.update(build_s=max(float(e["build_s"]) for e in with_build), source="GET /v1/graph",
                   bytes=max((e.get("bytes") or 0 for e in with_build), default=None) or None,
                   where=with_build[0].get("where"))
    elif gauges.get("build_s"):
        out.update(build_s=gauges["build_s"], bytes=gauges.get("bytes"), source="/metrics")
    elif logs:
        out.update(build_s=max(g["build_s"] for g in logs), source="log")
    if logs:
        first = logs[0]
        out["where"] = out["where"] or first["where"]
        out["nodes"], out["dims"] = first["nodes"], first["dims"]
        out["bytes"] = out["bytes"] or first["mib"] * 2**20
    return out


def polled_freshness(polls: list[dict[str, Any]]) -> dict[str, Any]:
    """From ``GET /v1/graph`` polls: the table's version lag behind the acknowledged version,
    how long it had been behind (since the first poll that saw an acknowledged version it
    lacks), its stale rows, and the last refresh round's staleness each engine core published."""
    times, acked, lag, behind_s, stale, rounds = [], [], [], [], [], []
    for p in polls:
        entries = table_entries(p)
        if not entries or "version" not in p:
            continue
        t, v = float(p["t"]), int(p["version"])
        times.append(t)
        acked.append(v)
        table_v = min(int(e.get("version", 0)) for e in entries)
        lag.append(v - table_v)
        first = next((times[j] for j in range(len(acked)) if acked[j] > table_v), t)
        behind_s.append(t - first)
        stale.append(sum(int(e.get("stale_rows") or 0) for e in entries))
        rounds += [float(e["last_round_staleness_s"]) for e in entries
                   if e.get("last_round_staleness_s") is not None]
    return {"polls": len(lag), "version_lag": watch.quantiles(lag, 1.0),
            "behind_ms": watch.quantiles(behind_s), "stale_rows": watch.quantiles(stale, 1.0),
            "last_round_staleness_ms": watch.quantiles(rounds)}


def table_window(w: watch.Watch, seconds: float) -> dict[str, Any]:
    """A finished :class:`~loadtest.watch.Watch`'s table figures: the staleness histogram,
    the counters over the window, and the polled freshness."""
    seen = w.result()
    texts = (w.texts + [None, None])[:2]
    hist = watch.hist_window(texts[0], texts[1], TABLE_STALENESS) if all(texts) else {}
    present = bool(texts[1]) and TABLE_STALENESS in (texts[1] or "")
    return {"staleness_hist": hist if present else None,
            "counters": counters_window(texts[0], texts[1], seconds),
            "polled": polled_freshness(w.polls), "graph_watch": seen}


def fivexx(statuses: Mapping[str, int]) -> int:
    return sum(v for k, v in statuses.items() if str(k).startswith("5"))


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else float(a) / float(b)
