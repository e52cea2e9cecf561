"""The figures of ``bench.graph.change`` from what each window recorded, the issue's targets,
and the printed table.

A window's embed figures come from every request the load processes scheduled in it
(``loadtest/recorder.py``: latency from the scheduled send, open loop); its staleness and
update-call figures from the daemon's ``/metrics`` and the updater processes
(``loadtest/watch.py``, ``loadtest/updater.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loadtest.stats import fmt

#: /metrics histogram families kept per window (where time goes): the living graph, the exact
#: table, the engine core's per-batch stages, the front door's request durations
STAGE_PREFIXES = ("quiver_serve_graph_", "quiver_serve_exact_", "quiver_serve_queue_",
                  "quiver_serve_sample_", "quiver_serve_gather_", "quiver_serve_compute_",
                  "quiver_serve_request_")
TABLE_HEADER = (
    "| window | embed req/s | embed p50 / p99 / p99.9 ms | p99 / steady | failed (5xx) "
    "| edge updates/s target / acked | update call p50 / p99 / max ms | staleness p50 / p99 ms "
    "| event |\n|---|---|---|---|---|---|---|---|---|")


def fivexx(statuses: dict[str, int]) -> int:
    return sum(v for k, v in statuses.items() if k.startswith("5"))


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``; None when either is missing or the base is not positive."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def answers_again_after_s(sched: np.ndarray, done: np.ndarray, ok: np.ndarray,
                          t_event: float) -> float | None:
    """Seconds from ``t_event`` until the first successful answer of a request sent at or after
    it (None: none answered). ``sched`` / ``done``: wall-clock send and answer times."""
    sel = ok & (sched >= t_event) & np.isfinite(done)
    if not sel.any():
        return None
    return float(done[sel].min() - t_event)


def longest_gap_s(done: np.ndarray, ok: np.ndarray, t0: float, t1: float) -> float:
    """The longest stretch of [t0, t1) without a successful answer (the window's ends count)."""
    times = np.sort(done[ok & np.isfinite(done) & (done >= t0) & (done < t1)])
    edges = np.concatenate([[t0], times, [t1]])
    return float(np.diff(edges).max())


def window_row(name: str, embed: dict[str, Any], upd: dict[str, Any] | None,
               seen: dict[str, Any], steady_p99_ms: float | None) -> dict[str, Any]:
    """One window's flat figures: ``embed`` is ``Records.window``, ``upd`` the updaters' merge
    (None: no updates), ``seen`` the daemon watch's result."""
    m = seen.get("metrics") or {}
    stale = m.get("staleness") or {}
    upd = upd or {}
    upd_errors = {k: v for k, v in upd.get("status", {}).items() if k != "200"}
    return {
        "window": name, "embed_req_per_s": embed["req_per_s"], "embed_requests": embed["requests"],
        "embed_p50_ms": embed["p50_ms"], "embed_p99_ms": embed["p99_ms"],
        "embed_p999_ms": embed["p999_ms"], "embed_failed": embed["failed"],
        "embed_statuses": embed["statuses"], "embed_5xx": fivexx(embed["statuses"]),
        "p99_over_steady": ratio(embed["p99_ms"], steady_p99_ms),
        "target_edges_per_s": upd.get("target_edges_per_s", 0.0),
        "acked_edges_per_s": upd.get("acked_edges_per_s", 0.0),
        "update_p50_ms": upd.get("call_p50_ms"), "update_p99_ms": upd.get("call_p99_ms"),
        "update_max_ms": upd.get("call_max_ms"), "update_errors": upd_errors,
        "staleness_p50_ms": stale.get("p50_ms"), "staleness_p99_ms": stale.get("p99_ms"),
        "staleness_count": stale.get("count", 0),
        "staleness_polled_ms": seen.get("staleness_polled_ms"),
        "graph_after": seen.get("graph"), "updater": upd or None, "metrics": m,
    }


def targets(rows: list[dict[str, Any]], ratio_max: float = 1.5, embed_p99_max_ms: float = 10.0,
            staleness_p99_max_ms: float = 100.0, update_p99_max_ms: float = 100.0,
            first_answer_max_s: float = 1.0) -> dict[str, Any]:
    """The issue's targets per window (None: not measured there): the highest update rate's
    p99 ratio, absolute p99, staleness p99 and update call p99; the compaction's ratio and
    update waits (p99 and the longest); the model load's ratio, failures and first new-version answer."""
    out: dict[str, Any] = {}
    updates = [r for r in rows if r["window"].startswith("updates")]
    if updates:
        top = max(updates, key=lambda r: r["target_edges_per_s"])
        out[top["window"]] = {
            "p99_ratio_met": le(top["p99_over_steady"], ratio_max),
            "embed_p99_met": le(top["embed_p99_ms"], embed_p99_max_ms),
            "staleness_p99_met": le(top["staleness_p99_ms"], staleness_p99_max_ms),
            "update_p99_met": le(top["update_p99_ms"], update_p99_max_ms)}
    for r in rows:
        if r["window"] == "compaction":
            out["compaction"] = {"p99_ratio_met": le(r["p99_over_steady"], ratio_max),
                                 "update_p99_met": le(r["update_p99_ms"], update_p99_max_ms),
                                 "update_max_met": le(r["update_max_ms"], update_p99_max_ms)}
        if r["window"] == "model load":
            load = r.get("model_load") or {}
            out["model load"] = {
                "p99_ratio_met": le(r["p99_over_steady"], ratio_max),
                "no_failures": r["embed_failed"] == 0,
                "first_answer_met": le(load.get("first_new_answer_s"), first_answer_max_s)}
    return out


def le(value: float | None, bound: float) -> bool | None:
    return None if value is None else bool(value <= bound)


def targets_line(t: dict[str, dict[str, bool | None]]) -> str:
    """``window: check met|MISSED|not measured; ...``."""
    def word(v: bool | None) -> str:
        return "not measured" if v is None else "met" if v else "MISSED"

    return "targets: " + ("; ".join(f"{w}: " + ", ".join(f"{k.removesuffix('_met')} {word(v)}"
                                                          for k, v in checks.items())
                                    for w, checks in t.items()) or "none measured")


def event_text(r: dict[str, Any]) -> str:
    """The window's event in a few words (model load, compaction, kill)."""
    if "model_load" in r:
        ld = r["model_load"]
        return (f"load call {fmt(ld['load_call']['wall_s'], '.3f')} s (status "
                f"{ld['load_call']['status']}), first new answer "
                f"{fmt(ld['first_new_answer_s'], '.3f')} s, swap p99 "
                f"{fmt((ld['windows'].get('swap') or {}).get('p99_ms'))} ms")
    if "compaction" in r:
        c = r["compaction"]
        return f"compaction {fmt(c.get('duration_s'))} s (status {c.get('status')})"
    if "kill" in r:
        k = r["kill"]
        return (f"engine alive again {fmt(k.get('restarted_after_s'))} s, ready "
                f"{fmt(k.get('ready_after_s'))} s, answers again "
                f"{fmt(k.get('answers_again_after_s'))} s, longest gap "
                f"{fmt(k.get('longest_gap_s'))} s")
    return "-"


def row_line(r: dict[str, Any]) -> str:
    return (f"| {r['window']} | {r['embed_req_per_s']:,.0f} | {fmt(r['embed_p50_ms'])} / "
            f"{fmt(r['embed_p99_ms'])} / {fmt(r['embed_p999_ms'])} | "
            f"{fmt(r['p99_over_steady'])}x | {r['embed_failed']} ({r['embed_5xx']}) | "
            f"{r['target_edges_per_s']:,.0f} / {r['acked_edges_per_s']:,.0f} | "
            f"{fmt(r['update_p50_ms'])} / {fmt(r['update_p99_ms'])} / {fmt(r['update_max_ms'])} | "
            f"{fmt(r['staleness_p50_ms'])} / {fmt(r['staleness_p99_ms'])} | {event_text(r)} |")


def stage_histograms(before: str | None, after: str | None,
                     prefixes: tuple[str, ...] = STAGE_PREFIXES) -> dict[str, dict[str, Any]]:
    """Every histogram series whose name starts with one of ``prefixes`` and that observed
    anything between two ``/metrics`` texts: ``name{labels}`` -> count, mean / p50 / p99 ms."""
    from loadtest import promdiff

    if not before or not after:
        return {}
    d = promdiff.diff(promdiff.parse_histograms(before), promdiff.parse_histograms(after))
    out: dict[str, dict[str, Any]] = {}
    for (name, labels), h in sorted(d.items()):
        if not name.startswith(prefixes) or h["count"] <= 0:
            continue
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
        qs = [promdiff.bucket_quantile(h["buckets"], q) for q in (0.5, 0.99)]
        out[key] = {"count": int(h["count"]), "mean_ms": 1e3 * h["sum"] / h["count"],
                    "p50_ms": None if qs[0] is None else 1e3 * qs[0],
                    "p99_ms": None if qs[1] is None else 1e3 * qs[1]}
    return out
