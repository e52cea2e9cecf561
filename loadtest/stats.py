"""Merging the load processes' reports into one point, percentiles, and the sweep summary."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from loadtest.protocols import OK

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
MAX_ERROR_FRACTION = 0.01  # a point with more failed requests than this does not count as served


def percentiles_ms(lat_s: np.ndarray) -> dict[str, float | None]:
    """p50 / p90 / p99 / p99.9 in ms (numpy's linear interpolation); None for no samples."""
    names = ("p50_ms", "p90_ms", "p99_ms", "p999_ms")
    lat = np.asarray(lat_s, np.float64)
    if lat.size == 0:
        return dict.fromkeys(names)
    return {k: float(v) for k, v in zip(names, np.percentile(lat, PERCENTILES) * 1e3, strict=True)}


def pooled(parts: list[dict]) -> tuple[np.ndarray, np.ndarray, Counter[str]]:
    """Latencies, schedule lags and status counts of several load processes' reports, pooled."""
    lat = np.concatenate([p["lat_s"] for p in parts]) if parts else np.zeros(0)
    lag = np.concatenate([p["lag_s"] for p in parts]) if parts else np.zeros(0)
    status: Counter[str] = Counter()
    for p in parts:
        status.update(p["status"])
    return lat, lag, status


def merge_point(parts: list[dict], cmd: dict) -> dict[str, Any]:
    """One point from its processes' reports: rates over the window, percentiles of all latencies,
    statuses, and each process's CPU use (cores)."""
    seconds = cmd["seconds"]
    lat, lag, status = pooled(parts)
    ok = status.get(OK, 0)
    total = sum(status.values())
    errors = {k: v for k, v in status.items() if k != OK}
    point = {
        "protocol": cmd["target"]["protocol"], "mode": cmd["mode"],
        "level": cmd["rate"] if cmd["mode"] == "open" else cmd["callers"],
        "offered_req_per_s": cmd["rate"] if cmd["mode"] == "open" else None,
        "seconds": seconds, "requests": total, "sent_per_s": total / seconds, "ok": ok,
        "req_per_s": ok / seconds, "seed_nodes_per_s": sum(p["seeds"] for p in parts) / seconds,
        **percentiles_ms(lat),
        "mean_ms": float(lat.mean() * 1e3) if lat.size else None,
        "errors": errors, "error_fraction": (total - ok) / total if total else 1.0,
        "send_lag_p99_ms": float(np.percentile(lag, 99) * 1e3) if lag.size else None,
        "load_cpu_cores": [round(p["cpu_frac"], 3) for p in sorted(parts, key=lambda p: p["index"])],
        "retried": sum(p.get("retried", 0) for p in parts),  # HTTP sends again after a cut
        "latencies_ms": np.sort(lat) * 1e3,  # dropped from the JSON; kept for the CDF plot
    }
    return point


def served(point: dict, bound_ms: float) -> bool:
    """The point counts at ``bound_ms``: p99 within it and few enough errors."""
    return (point["p99_ms"] is not None and point["p99_ms"] <= bound_ms
            and point["error_fraction"] <= MAX_ERROR_FRACTION)


def best_under(points: list[dict], bound_ms: float) -> dict | None:
    """The point with the most seed nodes/s among those served at ``bound_ms``."""
    ok = [p for p in points if served(p, bound_ms)]
    return max(ok, key=lambda p: p["seed_nodes_per_s"]) if ok else None


def summary(points: list[dict], bounds_ms: list[float]) -> dict[str, Any]:
    """Max seed nodes/s (and the point's level and p99) at each p99 bound."""
    out: dict[str, Any] = {}
    for b in bounds_ms:
        best = best_under(points, b)
        out[f"p99<={b:g}ms"] = None if best is None else {
            "seed_nodes_per_s": best["seed_nodes_per_s"], "req_per_s": best["req_per_s"],
            "level": best["level"], "p50_ms": best["p50_ms"], "p99_ms": best["p99_ms"]}
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def capacity_text(capacity: dict) -> str:
    """``capacity R req/s (S seeds/s, p99 P ms)`` of a measured capacity point."""
    return (f"capacity {capacity['req_per_s']:,.0f} req/s "
            f"({capacity['seed_nodes_per_s']:,.0f} seeds/s, p99 {fmt(capacity['p99_ms'])} ms)")


def point_row(p: dict) -> str:
    errs = ", ".join(f"{k}:{v}" for k, v in sorted(p["errors"].items())) or "0"
    return (f"| {p['protocol']} | {p['mode']} {fmt(p['level'], 'g')} | {p['seed_nodes_per_s']:,.0f} | "
            f"{p['req_per_s']:,.0f} | {fmt(p['p50_ms'])} / {fmt(p['p90_ms'])} / {fmt(p['p99_ms'])} / "
            f"{fmt(p['p999_ms'])} | {errs} | {max(p['load_cpu_cores'], default=0):.2f} |")


POINT_HEADER = ("| protocol | load | seed nodes/s | req/s | p50 / p90 / p99 / p99.9 ms | errors "
                "| load CPU (max process, cores) |\n|---|---|---|---|---|---|---|")


LOST_PREFIXES = ("timeout", "conn:")  # no HTTP answer at all (after any retries of a cut)


def answered_summary(point: dict) -> dict[str, Any]:
    """A drill's view of one point: sent, answered by status, lost (no answer: client timeout
    or a connection error), unsent (the client was over its in-flight limit), p50 / p99."""
    errors = point["errors"]
    lost = {k: v for k, v in errors.items() if k.startswith(LOST_PREFIXES)}
    unsent = errors.get("client_overload", 0)
    answered = {k: v for k, v in errors.items() if k not in lost and k != "client_overload"}
    if point["ok"]:
        answered[OK] = point["ok"]
    return {"sent": point["requests"] - unsent, "answered": dict(sorted(answered.items())),
            "lost": sum(lost.values()), "lost_by_kind": lost, "unsent": unsent,
            "retried_after_cut": point.get("retried", 0),
            "p50_ms": point["p50_ms"], "p99_ms": point["p99_ms"]}
