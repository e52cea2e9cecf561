"""The report tables of a sweep bench (``bench/frontdoor/wrk_bench.py``) and its result file.

Best point of a series: the most seed nodes/s among its points with p99 <= the bound and at most
1% failed (``loadtest.stats.best_under``). Its ratio: its seeds/s over the queue API's best in
the same run and workload. CPU per request by role: at each series' best point (else its first).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loadtest.cpu import ROLE_CLASSES
from loadtest.results import run_meta, write_result
from loadtest.stats import best_under, fmt

P999_OVER_P99_MAX = 2.0  # the contract: p99.9 within 2x p99
NOTES = [
    "closed loop: every connection (caller) sends its next request when the last is answered",
    "wrk errors: answers with a status > 399 (wrk's own count; --lua-statuses: every status), "
    "socket errors (connect, read, write) and timeouts (10 s)",
    "gRPC unary through h2load: one request body per workload, repeated (h2load posts one "
    "file); checked once with a gRPC client (grpc-status 0), and per point by the bytes "
    "received per request (h2load does not read trailers)",
    "roles: main is the daemon's main process (with one HTTP worker also the front-end, HTTP "
    "and gRPC); frontend i, engine core i, sampler i from GET /v1/workers; standby: warm spare "
    "processes (not in the daemon's total: no request's work); other: anything else in the tree",
    "CPU-ms per request: utime + stime of each process over the point's window (/proc), over the "
    "requests answered in it; 'client': the load client's own (wrk / h2load: the whole run, "
    "loadtest.gen: its load processes over the window); the load client shares the machine",
]


def point_line(p: dict) -> str:
    errs = ", ".join(f"{k}:{v}" for k, v in sorted(p["errors"].items())) or "0"
    cpu = p.get("cpu_ms_per_request") or {}
    return (f"| {p['workload']} | {p['path']} | {p['level']} | {p['seed_nodes_per_s']:,.0f} | "
            f"{p['req_per_s']:,.0f} | {fmt(p['p50_ms'])} / {fmt(p['p99_ms'])} / "
            f"{fmt(p['p999_ms'])} / {fmt(p.get('max_ms'))} | {errs} | "
            f"{fmt(cpu.get('daemon'), '.3f')} / {fmt(cpu.get('client'), '.3f')} |")


def banner(run: Any) -> str:
    a = run.args
    tools = ", ".join(f"{k}: " + (("" if run.tools[k] else "does not run: ") + v["found"]
                                  if v["found"] else "not found")
                      for k, v in run.tool_info.items())
    return (f"{os.cpu_count()} CPUs; {tools}; loadtest.gen {a.procs} process(es); budget "
            f"{a.budget_s:.0f} s\n| workload | path | connections | seeds/s | req/s | "
            "p50 / p99 / p99.9 / max ms | errors | CPU-ms per request: daemon / client |")


def queue_best(run: Any, workload: str, bound_ms: float) -> float | None:
    s = run.series.get(f"{workload}/queue")
    best = best_under(s["points"], bound_ms) if s else None
    return best["seed_nodes_per_s"] if best else None


def best_rows(run: Any) -> list[dict[str, Any]]:
    """One row per series: its best point at p99 <= the bound, the ratio to the queue API."""
    bound = run.args.bound_ms
    rows = []
    for name, s in run.series.items():
        best = best_under(s["points"], bound)
        ref = queue_best(run, s["workload"], bound)
        row: dict[str, Any] = {"series": name, "label": s["label"], "workload": s["workload"],
                               "best": None, "lowest_p99_ms": min(
                                   (p["p99_ms"] for p in s["points"] if p["p99_ms"] is not None),
                                   default=None)}
        if best is not None:
            ratio = best["p999_ms"] / best["p99_ms"] if best["p99_ms"] else None
            row["best"] = {k: best.get(k) for k in (
                "level", "seed_nodes_per_s", "req_per_s", "p50_ms", "p99_ms", "p999_ms", "max_ms",
                "errors", "error_fraction", "daemon_cores", "client_cores")}
            row["p999_over_p99"] = ratio
            row["p999_within_2x_p99"] = ratio is not None and ratio <= P999_OVER_P99_MAX
            row["over_queue_api"] = best["seed_nodes_per_s"] / ref if ref else None
        rows.append(row)
    return rows


def best_table(run: Any, rows: list[dict]) -> list[str]:
    b = run.args.bound_ms
    out = [f"Best point per path at p99 <= {b:g} ms (closed loop; ratio: / the queue API's "
           "seeds/s, same workload):",
           "| workload | path | seeds/s | req/s | connections | p50 / p99 / p99.9 ms | "
           "p99.9 / p99 | errors | / queue API |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = r["best"]
        if x is None:
            out.append(f"| {r['workload']} | {r['label']} | none (lowest p99 "
                       f"{fmt(r['lowest_p99_ms'], '.1f')} ms) | | | | | | |")
            continue
        errs = sum(x["errors"].values())
        within = "" if r["p999_within_2x_p99"] else " (> 2x)"
        out.append(f"| {r['workload']} | {r['label']} | {x['seed_nodes_per_s']:,.0f} | "
                   f"{x['req_per_s']:,.0f} | {x['level']} | {fmt(x['p50_ms'])} / "
                   f"{fmt(x['p99_ms'])} / {fmt(x['p999_ms'])} | "
                   f"{fmt(r['p999_over_p99'])}{within} | {errs} | "
                   f"{fmt(r['over_queue_api'])} |")
    return out


def single_table(run: Any) -> list[str]:
    if not run.single:
        return []
    out = ["", "Single id (workload c), 1 connection:",
           "| path | p50 / p99 / p99.9 / max ms | req/s | errors | CPU-ms per request: daemon "
           "/ client |", "|---|---|---|---|---|"]
    for p in run.single.values():
        cpu = p.get("cpu_ms_per_request") or {}
        out.append(f"| {p['label']} | {fmt(p['p50_ms'])} / {fmt(p['p99_ms'])} / "
                   f"{fmt(p['p999_ms'])} / {fmt(p.get('max_ms'))} | {p['req_per_s']:,.0f} | "
                   f"{sum(p['errors'].values())} | {fmt(cpu.get('daemon'), '.3f')} / "
                   f"{fmt(cpu.get('client'), '.3f')} |")
    return out


def cpu_points(run: Any) -> list[tuple[str, dict]]:
    """(row name, point) of the CPU table: the single-id points, then each series' best point
    (else its first)."""
    out = [(f"c/{p['path']} 1 conn", p) for p in run.single.values()]
    for name, s in run.series.items():
        best = best_under(s["points"], run.args.bound_ms) or (s["points"] or [None])[0]
        if best is not None:
            out.append((f"{name} @{best['level']}", best))
    return out


def cpu_rows(run: Any) -> list[dict[str, Any]]:
    return [{"row": name, "level": p["level"], "requests": p["ok"],
             "cpu_ms_per_request": p.get("cpu_ms_per_request"),
             "daemon_cores": p.get("daemon_cores"), "client_cores": p.get("client_cores")}
            for name, p in cpu_points(run)]


def cpu_table(rows: list[dict]) -> list[str]:
    cols = [*ROLE_CLASSES, "daemon", "client"]
    out = ["", "Where a request's CPU goes: CPU-ms per request by role (at each best point; the "
           "daemon's and the client's cores busy):",
           "| workload/path @connections | " + " | ".join(cols[:-2])
           + " | daemon (no standby) | client | daemon / client cores |",
           "|---|" + "---|" * (len(cols) + 1)]
    for r in rows:
        per = r["cpu_ms_per_request"] or {}
        cells = [fmt(per.get(c), ".3f") for c in cols]
        out.append(f"| {r['row']} | " + " | ".join(cells) + f" | {fmt(r['daemon_cores'])} / "
                   f"{fmt(r['client_cores'])} |")
    return out


def meta(run: Any, cfg: Any, graph: Any) -> dict[str, Any]:
    a = run.args
    return run_meta(a, cfg, graph=graph.describe(), route=cfg.sampling.route,
                    tools=run.tool_info, gen_procs=a.procs, seconds=a.seconds,
                    warmup_s=a.warmup_s, bound_ms=a.bound_ms, client_threads=a.client_threads
                    or "CPUs / 4, 1 to 4, at most the connections")


def finish(run: Any, cfg: Any, graph: Any, out: Path) -> None:
    """The JSON (``out``) and the tables, printed last."""
    rows, cpu = best_rows(run), cpu_rows(run)
    result = {"meta": meta(run, cfg, graph), "notes": NOTES + run.notes, "starts_s": run.starts_s,
              "daemon": run.idle, "rows": rows, "cpu_rows": cpu, "single_id": run.single,
              "series": run.series, "skipped": run.skipped,
              "wall_s": run.elapsed_s()}
    write_result(out, result, run.folder)
    lines = best_table(run, rows) + single_table(run) + cpu_table(cpu)
    print(f"wall {result['wall_s']:.0f} s; daemon: "
          f"{run.idle.get('http_workers', '-')} HTTP front-end(s), idle cores "
          f"{run.idle.get('cores', {})}")
    if run.skipped:
        print("skipped: " + "; ".join(run.skipped))
    print("\n" + "\n".join(lines), flush=True)
