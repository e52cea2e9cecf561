"""The refresh step of ``bench.graph.exact_table``: on the table daemon, updater processes
(``loadtest/updater.py``) posting edge batches at --update-rate while the load generator serves
sampled requests at --load-fraction of the sampled HTTP capacity measured before, and a trickle of
exact requests at --exact-rate (a second pool of load processes); the table watched
(``bench/graph/table_watch.py``): acknowledged edge updates/s, table staleness, rows refreshed/s,
exact requests from the table vs on the fly, embed latency, 5xx."""

from __future__ import annotations

import argparse
import threading
from typing import Any

from bench.graph import table_watch as tw
from bench.graph.exact_report import refresh_line
from loadtest import watch
from loadtest.gen import Generator
from loadtest.harness import Daemon
from loadtest.updater import UpdaterPool


def add_refresh_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--update-rate", type=float, default=50_000.0, help="edge updates/s")
    ap.add_argument("--load-fraction", type=float, default=0.8,
                    help="sampled load of the refresh step, a fraction of the sampled capacity")
    ap.add_argument("--sampled-rate", type=float,
                    help="sampled req/s of the refresh step (default: --load-fraction of capacity)")
    ap.add_argument("--exact-rates", type=float, nargs="+", default=[0.0, 1.0],
                    help="exact requests/s (open loop) of each refresh window, one window each "
                         "(0: none; one that names a stale row is computed on the fly)")
    ap.add_argument("--refresh-seconds", type=float, default=10.0)
    ap.add_argument("--edges-per-call", type=int, default=2000)
    ap.add_argument("--remove-fraction", type=float, default=0.1)
    ap.add_argument("--degree-bias", type=float, default=0.5)
    ap.add_argument("--update-procs", type=int, default=2)
    ap.add_argument("--update-inflight", type=int, default=4)
    ap.add_argument("--no-refresh", action="store_true", help="no refresh-under-updates step")


def capacity_req_per_s(run: Any) -> float | None:
    """Sampled HTTP capacity of step 1: most req/s at p99 <= --bound-ms, else of any point."""
    for s in run.series:
        if s["mode"] == "table" and s["request"] == "sampled" and s["protocol"] != "queue":
            best = s["under_bound"] or s["most"]
            return best["req_per_s"] if best else None
    return None


def refresh_step(run: Any, d: Daemon) -> None:
    """One window per --exact-rates: updaters at --update-rate, sampled load at --load-fraction
    of capacity, exact requests at that rate (a second pool of load processes; 0: none); the
    table watched. Rows in ``run.refresh``."""
    a = run.args
    capacity = capacity_req_per_s(run)
    if not capacity and not a.sampled_rate:
        run.skipped.append("refresh step (no sampled capacity measured)")
        return
    rate = a.sampled_rate or a.load_fraction * capacity
    updaters = UpdaterPool(a.update_procs)
    trickle = Generator(1, a.warmup, a.refresh_seconds) if max(a.exact_rates) > 0 else None
    try:
        for i, exact_rate in enumerate(a.exact_rates):
            if not run.afford(f"refresh step, exact {exact_rate:g} req/s",
                              a.refresh_seconds + a.warmup + 10):
                break
            print(f"\n== refresh under updates: sampled {rate:,.0f} req/s + exact "
                  f"{exact_rate:g} req/s open loop, edge updates {a.update_rate:,.0f}/s ==",
                  flush=True)
            row = refresh_window(run, d, updaters, trickle if exact_rate > 0 else None, rate,
                                 exact_rate, seed=i + 1)
            run.refresh.append(row)
            print(refresh_line(row), flush=True)
    finally:
        updaters.close()
        if trickle is not None:
            trickle.close()


def refresh_window(run: Any, d: Daemon, updaters: UpdaterPool, trickle: Generator | None,
                   rate: float, exact_rate: float, seed: int) -> dict[str, Any]:
    a, gen = run.args, run.gen
    gen.warm_s, gen.seconds = a.warmup, a.refresh_seconds
    w = watch.Watch(d.url, run.headers, a.poll_interval_s)
    exact: dict[str, Any] = {}
    threads: list[threading.Thread] = []
    target = run.target("http-npy", False, d.url)

    def on_start(t_start: float) -> None:
        win0 = t_start + a.warmup
        updaters.start(update_cmd(run, d.url, t_start, seed))
        w.start(win0, win0 + a.refresh_seconds)
        if trickle is not None:
            threads.append(threading.Thread(target=exact_trickle, daemon=True, args=(
                trickle, run.target("http-npy", True, d.url), run.spec(True), exact_rate,
                exact)))
            threads[0].start()

    point = gen.point(target, run.spec(False), "open", rate, None, on_start)
    upd = updaters.collect()
    for t in threads:
        t.join(timeout=a.refresh_seconds + a.baseline_timeout_s + 90)
    seen = tw.table_window(w, a.refresh_seconds)
    return {"exact_offered_req_per_s": exact_rate, **refresh_row(rate, point, exact, upd, seen)}


def exact_trickle(trickle: Generator, target: dict, spec: dict, rate: float,
                  out: dict[str, Any]) -> None:
    """Exact requests, open loop, from their own load process (a failure is reported)."""
    try:
        out.update(trickle.point(target, spec, "open", rate))
    except RuntimeError as exc:
        out["failed"] = str(exc)


def update_cmd(run: Any, url: str, t_start: float, seed: int) -> dict[str, Any]:
    a = run.args
    return {"url": url, "headers": run.headers, "rate": a.update_rate,
            "edges_per_call": a.edges_per_call, "remove_fraction": a.remove_fraction,
            "degree_bias": a.degree_bias, "num_nodes": run.facts["num_nodes"],
            "indptr": run.facts["indptr"], "seed": seed, "t_start": t_start, "warm_s": a.warmup,
            "seconds": a.refresh_seconds, "inflight": a.update_inflight,
            "timeout_s": a.timeout_s}


def refresh_row(rate: float, point: dict, exact: dict, upd: dict, seen: dict) -> dict[str, Any]:
    upd_errors = {k: v for k, v in upd.get("status", {}).items() if k != "200"}
    polled, hist, c = seen["polled"], seen["staleness_hist"] or {}, seen["counters"]
    graph_m = seen["graph_watch"].get("metrics") or {}
    return {
        "target_edges_per_s": upd["target_edges_per_s"],
        "acked_edges_per_s": upd["acked_edges_per_s"], "update_p50_ms": upd["call_p50_ms"],
        "update_p99_ms": upd["call_p99_ms"], "update_5xx": tw.fivexx(upd_errors),
        "update_errors": upd_errors, "update_skipped": upd["skipped"],
        "sampled_offered_req_per_s": rate, "sampled_req_per_s": point["req_per_s"],
        "sampled_p50_ms": point["p50_ms"], "sampled_p99_ms": point["p99_ms"],
        "sampled_p999_ms": point["p999_ms"], "sampled_5xx": tw.fivexx(point["errors"]),
        "sampled_errors": point["errors"], "exact_req_per_s": exact.get("req_per_s"),
        "exact_p50_ms": exact.get("p50_ms"), "exact_p99_ms": exact.get("p99_ms"),
        "exact_5xx": tw.fivexx(exact.get("errors") or {}), "exact_errors": exact.get("errors"),
        "exact_failed": exact.get("failed"),
        "table_staleness_p50_ms": hist.get("p50_ms"), "table_staleness_p99_ms": hist.get("p99_ms"),
        "table_staleness_count": hist.get("count"), "table_polled": polled,
        "exact_from_table": c["from_table"], "exact_on_the_fly": c["on_the_fly"],
        "rows_refreshed": c["rows_refreshed"], "rows_refreshed_per_s": c["rows_refreshed_per_s"],
        "full_recomputes": c["full_recomputes"], "refresh_failures": c["failures"],
        "graph_staleness_p99_ms": (graph_m.get("staleness") or {}).get("p99_ms"),
        "graph_after": seen["graph_watch"]["graph"], "updater": upd,
        "load_cpu_cores": point["load_cpu_cores"], "send_lag_p99_ms": point["send_lag_p99_ms"],
    }
